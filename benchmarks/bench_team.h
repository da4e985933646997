// A team of T threads running one job together, for the C++ benchmark drivers
// (benchmarks/moment_stages.cpp, benchmarks/kernel_ab.cpp): the caller is thread 0, the
// others wait spinning between jobs (a job is about a millisecond: waking a sleeping thread
// would be part of the time). run() returns when every thread has finished the job.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

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
