// Thread-pool engine: `nthreads` workers doing pread/pwrite. Needs nothing but POSIX; with
// O_DIRECT files and enough threads it keeps a disk's queue as full as the async engines.
#include "io/backend.h"

#include <pthread.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace statestore {
namespace io {
namespace {

class ThreadsBackend final : public Backend {
 public:
  ThreadsBackend(int depth, int nthreads) {
    (void)depth;
    if (nthreads < 1) nthreads = 1;
    try {
      for (int i = 0; i < nthreads; ++i) {
        workers_.emplace_back([this] { work(); });
        ::pthread_setname_np(workers_.back().native_handle(), "ss-io-worker");  // see Queue()
      }
    } catch (const std::system_error&) {
      stop_workers();
      throw;
    }
  }
  ~ThreadsBackend() override { stop_workers(); }
  const char* name() const override { return "threads"; }

  int submit(const Block* blocks, int n) override {
    {
      std::lock_guard<std::mutex> g(mu_);
      for (int i = 0; i < n; ++i) todo_.push_back(blocks[i]);
    }
    if (n == 1) todo_cv_.notify_one(); else todo_cv_.notify_all();
    return n;
  }

  int reap(BlockResult* out, int max, int timeout_ms) override {
    std::unique_lock<std::mutex> g(mu_);
    done_cv_.wait_for(g, std::chrono::milliseconds(timeout_ms), [this] { return !done_.empty(); });
    int n = 0;
    while (n < max && !done_.empty()) {
      out[n++] = done_.front();
      done_.pop_front();
    }
    return n;
  }

 private:
  void work() {
    for (;;) {
      Block b;
      {
        std::unique_lock<std::mutex> g(mu_);
        todo_cv_.wait(g, [this] { return stop_ || !todo_.empty(); });
        if (todo_.empty()) return;  // stop_ and nothing left
        b = todo_.front();
        todo_.pop_front();
      }
      ssize_t r;
      do {
        r = b.op == Op::Read ? ::pread(b.fd, b.buf, b.nbytes, static_cast<off_t>(b.offset))
                             : ::pwrite(b.fd, b.buf, b.nbytes, static_cast<off_t>(b.offset));
      } while (r < 0 && errno == EINTR);
      BlockResult res{b.tag, r < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(r)};
      {
        std::lock_guard<std::mutex> g(mu_);
        done_.push_back(res);
      }
      done_cv_.notify_one();
    }
  }
  void stop_workers() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    todo_cv_.notify_all();
    for (auto& t : workers_)
      if (t.joinable()) t.join();
    workers_.clear();
  }

  std::mutex mu_;
  std::condition_variable todo_cv_, done_cv_;
  std::deque<Block> todo_;
  std::deque<BlockResult> done_;
  std::vector<std::thread> workers_;
  bool stop_ = false;
};

}  // namespace

std::unique_ptr<Backend> make_threads_backend(int depth, int nthreads) {
  return std::unique_ptr<Backend>(new ThreadsBackend(depth, nthreads));
}

}  // namespace io
}  // namespace statestore
