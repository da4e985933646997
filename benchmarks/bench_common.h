// What the C++ benchmark drivers (benchmarks/moment_stages.cpp, benchmarks/kernel_ab.cpp)
// share: the arena their arrays are carved from, a thread's Adam states in one, and the team
// of threads that runs a job.
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "adam/adam_kernels.h"

// One thread's arrays in one buffer: array k starts `align`-aligned plus k * 1088 bytes
// (modulo `align`, a multiple of 4 KiB), so no two streams of a loop share an offset modulo
// 4 KiB ("4K aliasing": a load waits on a store to another array at the same page offset) and
// none sits 2^k bytes from another. Separate heap arrays of 16 KiB lie 16 KiB + 16 bytes
// apart, 16 bytes from each other modulo 4 KiB: fp32 moments timed 0.39 against 0.34 ns an
// element on the AVX2 host.
class BenchArena {
 public:
  BenchArena(size_t bytes, size_t align) : align_(align), mem_(bytes + align) {}
  BenchArena(const BenchArena&) = delete;
  template <class T>
  T* take(int64_t n) {
    char* base = mem_.data() + (align_ - reinterpret_cast<uintptr_t>(mem_.data()) % align_) % align_;
    used_ = (used_ + align_ - 1) / align_ * align_ + static_cast<size_t>(k_++) * 1088 % align_;
    T* p = reinterpret_cast<T*>(base + used_);
    used_ += static_cast<size_t>(n) * sizeof(T);
    if (used_ + align_ > mem_.size()) std::abort();
    return p;
  }
  // bytes `take` may need for arrays of these many bytes in all, `count` of them
  static size_t bytes_for(size_t total, int count, size_t align) { return total + static_cast<size_t>(2 * count + 1) * align; }

 private:
  size_t align_;
  std::vector<char> mem_;
  size_t used_ = 0;
  int k_ = 0;
};

// One thread's Adam states of n elements in one arena, as the kernels take them: fp32 w, g, m,
// v; bf16 g, m, v and a bf16 parameter copy p; int8 moment codes and their block scales. The
// values: w ~ N(0, 1), g ~ 1e-2 N, exp_avg ~ 1e-3 N, exp_avg_sq ~ 1e-5 |N|, the bf16 arrays
// their encodings (p zeros), uniform codes, the scales sm0 and sv0; `rng` goes on from there
// for what a driver draws next. A driver may take `extra_count` more arrays of `extra` bytes in
// all from `arena` afterwards (their offsets stay distinct from these modulo 4 KiB).
struct BenchStates {
  int64_t n;
  BenchArena arena;
  std::mt19937 rng;
  float *w, *g, *m, *v, *sm, *sv;
  uint16_t *gb, *mb, *vb, *pb;
  int8_t* mi;
  uint8_t* vi;
  BenchStates(int64_t n_, unsigned seed, size_t align, float sm0, float sv0, size_t extra = 0, int extra_count = 0)
      : n(n_),
        arena(BenchArena::bytes_for(static_cast<size_t>(n_) * 26 + 8 * static_cast<size_t>(n_ / statestore::kQBlock + 1) + extra,
                                    12 + extra_count, align),
              align),
        rng(seed) {
    w = arena.take<float>(n), g = arena.take<float>(n), m = arena.take<float>(n), v = arena.take<float>(n);
    sm = arena.take<float>(n / statestore::kQBlock + 1), sv = arena.take<float>(n / statestore::kQBlock + 1);
    gb = arena.take<uint16_t>(n), mb = arena.take<uint16_t>(n), vb = arena.take<uint16_t>(n);
    pb = arena.take<uint16_t>(n);
    mi = arena.take<int8_t>(n), vi = arena.take<uint8_t>(n);
    std::normal_distribution<float> nd;
    for (int64_t i = 0; i < n; ++i) {
      w[i] = nd(rng);
      g[i] = nd(rng) * 1e-2f;
      gb[i] = statestore::float_to_bf16(g[i]);
      m[i] = nd(rng) * 1e-3f;
      v[i] = std::fabs(nd(rng)) * 1e-5f;
      mb[i] = statestore::float_to_bf16(m[i]);
      vb[i] = statestore::float_to_bf16(v[i]);
      pb[i] = 0;
      mi[i] = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
      vi[i] = static_cast<uint8_t>(rng() % 256);
    }
    for (int64_t b = 0; b <= n / statestore::kQBlock; ++b) sm[b] = sm0, sv[b] = sv0;
  }
  BenchStates(const BenchStates&) = delete;
  // the whole kernel's arguments for moments of kind `kind`, gradients of dtype `grads` (fp32
  // g or bf16 gb) and parameters of dtype `params` written to p besides w (kNone: w only)
  statestore::AdamTensorArgs args(const statestore::AdamScalars& s, statestore::MomentKind kind, bool stochastic,
                                       statestore::DType params = statestore::DType::kNone,
                                       statestore::DType grads = statestore::DType::kF32, uint32_t seed_m = 1,
                                       uint32_t seed_v = 2) const {
    using statestore::DType;
    using statestore::MomentKind;
    statestore::AdamTensorArgs a{};
    a.w = w;
    a.g = grads == DType::kF32 ? static_cast<const void*>(g) : static_cast<const void*>(gb);
    a.g_dtype = grads;
    a.p_dtype = params;
    a.p_out = params == DType::kNone ? nullptr : pb;
    a.kind = kind;
    a.stochastic = stochastic;
    a.seed_m = seed_m;
    a.seed_v = seed_v;
    a.n = n;
    a.s = s;
    if (kind == MomentKind::kF32) {
      a.m = m, a.v = v;
    } else if (kind == MomentKind::kBF16) {
      a.m = mb, a.v = vb;
    } else {
      a.m = mi, a.v = vi, a.m_scale = sm, a.v_scale = sv;
    }
    return a;
  }
};

// The hyperparameters the drivers time the kernels with: AdamW, lr 1e-3, betas (0.9, 0.999),
// eps 1e-8, weight decay 0.01, at step 5
inline statestore::AdamScalars bench_scalars() {
  // lr, beta1, beta2, eps, weight_decay, adamw_mode, maximize, grad_scale, amsgrad
  const statestore::AdamHyper hyper{1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0, 0.0, 1.0, 0.0};
  statestore::AdamScalars s;
  statestore::make_adam_scalars(hyper, 5, &s);
  return s;
}

// A team of T threads running one job together: the caller is thread 0, the others wait
// spinning between jobs (a job is about a millisecond: waking a sleeping thread would be part
// of the time). run() returns when every thread has finished the job.
class BenchTeam {
 public:
  explicit BenchTeam(int t) : t_(t) {
    for (int k = 1; k < t; ++k) th_.emplace_back([this, k] { loop(k); });
  }
  ~BenchTeam() {
    quit_ = true;
    gen_.fetch_add(1, std::memory_order_release);
    for (auto& x : th_) x.join();
  }
  BenchTeam(const BenchTeam&) = delete;
  void run(const std::function<void(int)>& job) {
    job_ = &job;
    done_.store(0, std::memory_order_relaxed);
    gen_.fetch_add(1, std::memory_order_release);
    job(0);
    while (done_.load(std::memory_order_acquire) < t_ - 1) {
    }
  }

 private:
  void loop(int k) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t g;
      while ((g = gen_.load(std::memory_order_acquire)) == seen) {
      }
      seen = g;
      if (quit_) return;
      (*job_)(k);
      done_.fetch_add(1, std::memory_order_release);
    }
  }
  int t_;
  std::vector<std::thread> th_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> done_{0};
  std::atomic<bool> quit_{false};
  const std::function<void(int)>* job_ = nullptr;
};
