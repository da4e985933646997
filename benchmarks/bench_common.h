// What the C++ benchmark drivers (benchmarks/moment_stages.cpp, benchmarks/kernel_ab.cpp)
// share: the arena their arrays are carved from, and the team of threads that runs a job.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <thread>
#include <vector>

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
