// The request queue shared by every engine.
//
// A request is one read or write of (fd, buffer, nbytes, offset) on behalf of a named file.
// The Queue splits it into blocks of at most `block_size` bytes, keeps at most `depth` blocks in
// flight on its Backend, retries short transfers and EINTR/EAGAIN, records the first error of a
// request (errno and a message naming the file, offset and size) and stops submitting the rest
// of a failed request. A request completes once every block it submitted has completed, so a
// caller may reuse the buffer as soon as its completion is returned by wait().
//
// Threads: submit()/wait()/stats() may be called from any thread. One internal reaper thread
// collects block completions.
//
// Error injection (tests only): inject_fault() arms a fault applied to block completions
// (`skip` matching blocks pass, then `count` blocks fail with `err` or come back short). It is
// inert until that explicit call; nothing in production calls it.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "io/backend.h"

namespace statestore {
namespace io {

enum RequestFlags : int {
  kDropCache = 1,   // after the request: write back (sync_file_range) and posix_fadvise(DONTNEED)
  kDataSync = 2,    // after a write request: fdatasync(fd)
};

struct Completion {
  uint64_t id;
  int64_t bytes;      // bytes transferred when err == 0
  int err;            // 0 or an errno value
  std::string message;
};

struct QueueStats {
  uint64_t requests = 0, blocks = 0, retries = 0, errors = 0;
  uint64_t bytes_read = 0, bytes_written = 0;
};

class Queue {
 public:
  // engine: "io_uring", "libaio" or "threads". Throws std::invalid_argument on bad arguments,
  // std::system_error when the engine cannot start here.
  Queue(const std::string& engine, int depth, int64_t block_size, int nthreads);
  ~Queue();
  Queue(const Queue&) = delete;
  Queue& operator=(const Queue&) = delete;

  uint64_t submit(Op op, int fd, char* buf, int64_t nbytes, int64_t offset,
                  const std::string& path, int flags);
  // Waits until at least min_n completions are ready (or timeout_ms passes, or the queue is
  // closed) and returns at most max_n of them.
  std::vector<Completion> wait(int min_n, int max_n, int timeout_ms);
  // Waits for every submitted request, then stops the engine. Idempotent.
  void close();

  void inject_fault(int op, int skip, int count, int kind, int err);
  void clear_faults();

  QueueStats stats() const;
  size_t outstanding() const;
  bool closed() const;
  const std::string& engine() const { return engine_; }
  int depth() const { return depth_; }
  int64_t block_size() const { return block_size_; }

 private:
  struct Request {
    Op op;
    int fd;
    int flags;
    int64_t nbytes, offset;
    std::string path;
    int64_t outstanding_blocks = 0;
    int64_t done_bytes = 0;
    int err = 0;
    std::string message;
  };
  struct Piece {
    uint64_t req;
    char* buf;
    int64_t nbytes, offset;
    int retries;
  };

  void reaper_loop();
  void pump_locked();
  void on_block_locked(const BlockResult& r, std::vector<uint64_t>& finished);
  void fail_locked(Request& rq, int err, const std::string& what);
  void finish(uint64_t id);
  int64_t apply_fault_locked(const Piece& p, Op op, int64_t res);

  std::string engine_;
  int depth_;
  int64_t block_size_;
  std::unique_ptr<Backend> backend_;

  mutable std::mutex mu_;
  std::condition_variable done_cv_, idle_cv_;
  std::unordered_map<uint64_t, Request> reqs_;
  std::deque<Piece> pending_;
  std::vector<Piece> slots_;
  std::vector<int> free_slots_;
  std::deque<Completion> completed_;
  uint64_t next_id_ = 1;
  bool closing_ = false, stop_reaper_ = false, closed_ = false;
  QueueStats stats_;

  struct Fault {
    bool armed = false;
    int op = -1, skip = 0, count = 0, kind = 0, err = 0;
  } fault_;

  std::thread reaper_;
};

}  // namespace io
}  // namespace statestore
