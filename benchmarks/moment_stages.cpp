// Where the cycles of the compressed-moment kernels go: each stage of the SIMD body timed
// alone on cache-resident data (one thread), then the whole kernels. Built and run by
// `benchmarks/adam_step.py --stages` (one binary per instruction set the processor has):
//
//   c++ -O3 -std=c++17 -ffp-contract=off -fno-math-errno -Icsrc -DSTAGES_AVX2
//       benchmarks/moment_stages.cpp -o /tmp/stages -lpthread && /tmp/stages 4096 60 1
//
// It includes the ISA file itself (csrc/adam/adam_avx2.cpp or adam_avx512.cpp), so the stages
// are the kernel's own building blocks (VecAdam, VecHash, VecBf16, VecF8, SimdMoments),
// compiled with the extension's flags. Prints one line per stage: name, ns per element.
// Arguments: elements per array (4096), rounds (60), threads (1: with T, T threads run each
// stage at once, each on arrays of its own, and the figure is the machine's ns per element),
// seconds (3: rounds go on at least that long, to outlast the host's slow spells), elements a
// round and thread (200000: whole calls of the arrays).
// No torch; timing only, nothing is checked here (the tests check the bits).
#if defined(STAGES_AVX512)
#include "adam/adam_avx512.cpp"
#define STAGES_OPS Avx512Ops
#define STAGES_KERNELS avx512_kernels
#else
#include "adam/adam_avx2.cpp"
#define STAGES_OPS Avx2Ops
#define STAGES_KERNELS avx2_kernels
#endif

#include "bench_common.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>


using namespace statestore;
using namespace statestore::cpu;

#pragma GCC push_options
#if defined(STAGES_AVX512)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#else
#pragma GCC target("avx2,fma,f16c")
#endif
namespace statestore {
namespace cpu {
namespace {
using V = STAGES_OPS;
using F = V::F;
using I = V::I;
constexpr int64_t W = V::kWidth;

__attribute__((noinline)) void st_ldst(float* w, const float* g, float* m, float* v, int64_t n) {
  for (int64_t i = 0; i + W <= n; i += W) {
    const F gi = V::load(g + i);
    V::store(w + i, V::add(V::load(w + i), gi));
    V::store(m + i, V::add(V::load(m + i), gi));
    V::store(v + i, V::add(V::load(v + i), gi));
  }
}
__attribute__((noinline)) void st_sqrtdiv(float* w, const float* m, const float* v, int64_t n) {
  for (int64_t i = 0; i + W <= n; i += W) V::store(w + i, V::div(V::load(m + i), V::sqrt(V::load(v + i))));
}
__attribute__((noinline)) void st_update(const AdamScalars& s, float* w, const float* g, float* m,
                                         float* v, int64_t n) {
  const VecAdam<V> c(s);
  for (int64_t i = 0; i + W <= n; i += W) {
    F wi = V::load(w + i), gi = V::load(g + i), mi = V::load(m + i), vi = V::load(v + i);
    c.update<false>(wi, gi, mi, vi, nullptr);
    V::store(w + i, wi);
    V::store(m + i, mi);
    V::store(v + i, vi);
  }
}
__attribute__((noinline)) void st_bf16_decode(const uint16_t* m, const uint16_t* v, float* mo,
                                              float* vo, int64_t n) {
  for (int64_t i = 0; i + W <= n; i += W) {
    V::store(mo + i, V::load_bf16(m + i));
    V::store(vo + i, V::load_bf16(v + i));
  }
}
template <bool kStoch>
__attribute__((noinline)) void st_bf16_encode(const float* mi, const float* vi, uint16_t* m,
                                              uint16_t* v, int64_t n) {
  I wm = VecHash<V>::start(0, 1u), wv = VecHash<V>::start(0, 2u);
  const I step = VecHash<V>::step();
  for (int64_t i = 0; i + W <= n; i += W) {
    if constexpr (kStoch) {
      VecBf16<V, true>::store(m + i, v + i, V::load(mi + i), V::load(vi + i), VecHash<V>::bits16(wm),
                              VecHash<V>::bits16(wv));
      wm = V::addi(wm, step);
      wv = V::addi(wv, step);
    } else {
      VecBf16<V, false>::store(m + i, v + i, V::load(mi + i), V::load(vi + i), wm, wv);
    }
  }
}
__attribute__((noinline)) void st_hash(float* o, int64_t n) {
  I wm = VecHash<V>::start(0, 1u), wv = VecHash<V>::start(0, 2u);
  const I step = VecHash<V>::step();
  for (int64_t i = 0; i + W <= n; i += W) {
    const I a = VecHash<V>::mix(wm), b = VecHash<V>::mix(wv);
    wm = V::addi(wm, step);
    wv = V::addi(wv, step);
    V::store(o + i, V::casti(V::xori(a, b)));
  }
}
__attribute__((noinline)) void st_int8_decode(const int8_t* mc, const uint8_t* vc, float sm, float sv,
                                              float* mo, float* vo, int64_t n) {
  const F smv = V::set1(sm * 0x1p112f), smn = V::set1(-sm * 0x1p112f), svv = V::set1(sv * 0x1p112f);
  for (int64_t i = 0; i + W <= n; i += W) {
    V::store(mo + i, VecF8<V>::decode_m<true>(V::load_i8_i(mc + i), smv, smn));
    V::store(vo + i, VecF8<V>::decode_v<true>(V::load_u8_i(vc + i), svv));
  }
}
__attribute__((noinline)) void st_block_max(const float* m, const float* v, float* out, int64_t n) {
  for (int64_t b = 0; b + kQBlock <= n; b += kQBlock) {
    I am = V::seti(0u), av = V::seti(0u), smin = V::seti(0x7fffffffu);
    for (int64_t i = b; i < b + kQBlock; i += W) {
      const F mi = V::load(m + i), vi = V::load(v + i);
      am = V::maxu(am, V::castf(V::abs(mi)));
      av = V::maxu(av, V::castf(V::abs(vi)));
      smin = V::mini(smin, V::castf(vi));
    }
    out[b / kQBlock] = bits_to_float(V::hmaxu(am) ^ V::hmaxu(av) ^ static_cast<uint32_t>(V::hmini(smin)));
  }
}
template <bool kStoch>
__attribute__((noinline)) void st_int8_encode(const AdamTensorArgs& a, const float* mt,
                                              const float* vt, int64_t n) {
  const QScale qm = make_qscale_m(0.2f, true), qv = make_qscale_v(0.04f, true);
  for (int64_t b = 0; b + kQBlock <= n; b += kQBlock)
    SimdMoments<V>::encode_int8<kStoch, true, false>(a, b, b + kQBlock, mt + b, vt + b, qm, qv);
}
}  // namespace
}  // namespace cpu
}  // namespace statestore
#pragma GCC pop_options

// An array carved from a thread's arena (below); data(), size() and [] as std::vector's.
template <class T>
struct Span {
  T* p = nullptr;
  int64_t n = 0;
  T* data() const { return p; }
  int64_t size() const { return n; }
  T& operator[](int64_t i) const { return p[i]; }
};

// One thread's arrays (every thread has its own, cache-resident in its core's caches), 4 KiB
// apart plus distinct offsets (BenchArena).
struct Bufs {
  BenchArena arena;
  template <class T>
  Span<T> take(int64_t n, T init = T()) {
    Span<T> a{arena.take<T>(n), n};
    for (int64_t i = 0; i < n; ++i) a[i] = init;
    return a;
  }
  Span<float> w, g, m, v, mo, vo, mt, vt, sc, sc2;
  Span<uint16_t> mb, vb, pb;
  Span<int8_t> mi;
  Span<uint8_t> vi;
  Bufs(int64_t n, unsigned seed) : arena(BenchArena::bytes_for(static_cast<size_t>(n) * 48 + 8, 15, 4096), 4096) {
    w = take<float>(n), g = take<float>(n), m = take<float>(n), v = take<float>(n);
    mo = take<float>(n), vo = take<float>(n), mt = take<float>(n), vt = take<float>(n);
    sc = take<float>(n / kQBlock + 1, 0.01f), sc2 = take<float>(n / kQBlock + 1, 0.02f);
    mb = take<uint16_t>(n), vb = take<uint16_t>(n), pb = take<uint16_t>(n);
    mi = take<int8_t>(n), vi = take<uint8_t>(n);
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    std::uniform_real_distribution<float> ud(0.0f, 1.0f);
    for (int64_t i = 0; i < n; ++i) {
      w[i] = nd(rng);
      g[i] = nd(rng) * 1e-2f;
      m[i] = nd(rng) * 1e-3f;
      v[i] = std::fabs(nd(rng)) * 1e-5f;
      mb[i] = float_to_bf16(m[i]);
      vb[i] = float_to_bf16(v[i]);
      mi[i] = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
      vi[i] = static_cast<uint8_t>(rng() % 256);
      mt[i] = m[i] * 100.0f;                 // within the scales of st_int8_encode
      vt[i] = std::sqrt(v[i]) * 5.0f * std::pow(10.0f, -2.0f * ud(rng));
    }
  }
  Bufs(const Bufs&) = delete;
};

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) / kQBlock * kQBlock : 4096;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 60;
  const int nthreads = argc > 3 ? std::max(1, std::atoi(argv[3])) : 1;
  const double min_seconds = argc > 4 ? std::atof(argv[4]) : 3.0;
  const int64_t round_elems = argc > 5 ? std::atoll(argv[5]) : 200000;
  std::vector<std::unique_ptr<Bufs>> bufs;
  for (int t = 0; t < nthreads; ++t) bufs.push_back(std::make_unique<Bufs>(n, 1u + static_cast<unsigned>(t)));
  const AdamHyper hyper{1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0, true, false};
  const AdamScalars s = make_adam_scalars(hyper, 1e-3 / (1 - std::pow(0.9, 5)),
                                          std::sqrt(1 - std::pow(0.999, 5)));
  struct Row {
    std::string name;
    std::function<void(Bufs&)> f;
  };
  std::vector<Row> rows;
  auto row = [&](std::string name, std::function<void(Bufs&)> f) { rows.push_back({std::move(name), std::move(f)}); };
  row("stage: loads and stores of an fp32 step", [&](Bufs& b) { st_ldst(b.w.data(), b.g.data(), b.m.data(), b.v.data(), n); });
  row("stage: sqrt and division", [&](Bufs& b) { st_sqrtdiv(b.mo.data(), b.m.data(), b.v.data(), n); });
  row("stage: update (fp32 m, v in and out)", [&](Bufs& b) { st_update(s, b.w.data(), b.g.data(), b.m.data(), b.v.data(), n); });
  row("stage: bf16 decode m, v", [&](Bufs& b) { st_bf16_decode(b.mb.data(), b.vb.data(), b.mo.data(), b.vo.data(), n); });
  row("stage: bf16 encode m, v, nearest", [&](Bufs& b) { st_bf16_encode<false>(b.m.data(), b.v.data(), b.mb.data(), b.vb.data(), n); });
  row("stage: random bits (two hashes)", [&](Bufs& b) { st_hash(b.mo.data(), n); });
  row("stage: bf16 encode m, v, stochastic", [&](Bufs& b) { st_bf16_encode<true>(b.m.data(), b.v.data(), b.mb.data(), b.vb.data(), n); });
  row("stage: int8 decode m, v", [&](Bufs& b) { st_int8_decode(b.mi.data(), b.vi.data(), 0.01f, 0.02f, b.mo.data(), b.vo.data(), n); });
  row("stage: int8 block max m, v", [&](Bufs& b) { st_block_max(b.mt.data(), b.vt.data(), b.mo.data(), n); });
  auto codes = [](Bufs& b) {
    AdamTensorArgs c{};
    c.m = b.mi.data();
    c.v = b.vi.data();
    c.seed_m = 1;
    c.seed_v = 2;
    return c;
  };
  row("stage: int8 encode m, v, nearest", [&](Bufs& b) { st_int8_encode<false>(codes(b), b.mt.data(), b.vt.data(), n); });
  row("stage: int8 encode m, v, stochastic", [&](Bufs& b) { st_int8_encode<true>(codes(b), b.mt.data(), b.vt.data(), n); });
  const SimdKernels& K = STAGES_KERNELS();
  for (DType pd : {DType::kNone, DType::kBF16}) {
    const char* pn = pd == DType::kNone ? "fp32 params" : "bf16 params + fp32 masters";
    for (MomentKind k : {MomentKind::kF32, MomentKind::kBF16, MomentKind::kInt8}) {
      for (bool st : {false, true}) {
        if (k == MomentKind::kF32 && st) continue;
        auto args = [=, &s](Bufs& b) {
          AdamTensorArgs a{};
          a.w = b.w.data();
          a.g = b.g.data();
          a.g_dtype = DType::kF32;
          a.p_dtype = pd;
          a.p_out = pd == DType::kNone ? nullptr : b.pb.data();
          a.kind = k;
          a.stochastic = st;
          a.seed_m = 1;
          a.seed_v = 2;
          a.n = n;
          a.s = s;
          if (k == MomentKind::kF32) {
            a.m = b.m.data();
            a.v = b.v.data();
          } else if (k == MomentKind::kBF16) {
            a.m = b.mb.data();
            a.v = b.vb.data();
          } else {
            a.m = b.mi.data();
            a.v = b.vi.data();
            a.m_scale = b.sc.data();
            a.v_scale = b.sc2.data();
          }
          return a;
        };
        char name[160];
        if (k == MomentKind::kF32) {
          std::snprintf(name, sizeof name, "kernel: fp32 moments, %s", pn);
        } else {
          std::snprintf(name, sizeof name, "kernel: %s moments %s, %s", k == MomentKind::kBF16 ? "bf16" : "int8",
                        st ? "stochastic" : "nearest", pn);
        }
        row(name, [&K, args](Bufs& b) { K.adam(args(b), 0, b.w.size()); });
      }
    }
  }
  // Best time per element of each row, the rows taken in turn within every round (not one
  // row's rounds back to back), for at least min_seconds: on a host whose speed changes for
  // tenths of a second at a time (the AVX2 development host), each row's best then comes
  // from the same fast spells. With T threads, each runs
  // the row on its own arrays at the same time, and the time per element is the wall time
  // over the elements of all threads (the machine's, not one core's).
  BenchTeam team(nthreads);
  const int64_t calls = std::max<int64_t>(1, round_elems / n);
  std::vector<double> best(rows.size(), 1e30);
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  for (int r = -2; r < rounds || elapsed() < min_seconds; ++r) {       // two rounds of warm-up
    for (size_t k = 0; k < rows.size(); ++k) {
      const std::function<void(int)> job = [&](int t) {
        for (int64_t c = 0; c < calls; ++c) rows[k].f(*bufs[t]);
      };
      const auto t0 = std::chrono::steady_clock::now();
      team.run(job);
      const std::chrono::duration<double, std::nano> dt = std::chrono::steady_clock::now() - t0;
      if (r >= 0) best[k] = std::min(best[k], dt.count() / static_cast<double>(calls * n * nthreads));
    }
  }
  std::printf("isa\t%s\nelements\t%ld\nthreads\t%d\n", STAGES_KERNELS().name, static_cast<long>(n), nthreads);
  for (size_t k = 0; k < rows.size(); ++k) std::printf("%s\t%.4f\n", rows[k].name.c_str(), best[k]);
  return 0;
}
