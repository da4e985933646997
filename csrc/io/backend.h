// statestore I/O engines: the small pure-virtual interface every engine implements.
//
// A Backend moves *blocks*: one syscall-sized read or write of (fd, buffer, nbytes, offset).
// It knows nothing of requests, splitting, retries or errors beyond reporting each block's
// raw result; the Queue (queue.h) owns all of that, so the three engines stay small.
//
// Order of calls, all made by the Queue:
//   0) construction (throws std::system_error when the engine cannot work here: io_uring
//      blocked by seccomp, io_setup refused, ...);
//   1) submit(blocks, n): called with the Queue's lock held, by any thread; returns how many
//      blocks were accepted (the Queue never has more than depth() blocks in flight);
//   2) reap(out, max, timeout_ms): called by ONE thread (the Queue's reaper) without the lock;
//      waits up to timeout_ms for at least one completion and returns how many were written;
//   3) flush(): called with the lock held after each reap, so a backend that could only queue
//      some blocks (EAGAIN from the kernel) hands them over without racing a submitter;
//   4) destruction, after every submitted block was reaped.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace statestore {
namespace io {

enum class Op : uint8_t { Read = 0, Write = 1 };

struct Block {
  uint64_t tag;    // opaque to the backend, echoed in the BlockResult (a slot index < depth)
  int fd;
  Op op;
  char* buf;
  size_t nbytes;
  int64_t offset;
};

struct BlockResult {
  uint64_t tag;
  int64_t res;     // bytes transferred (>= 0) or -errno
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  virtual int submit(const Block* blocks, int n) = 0;
  virtual int reap(BlockResult* out, int max, int timeout_ms) = 0;
  virtual void flush() {}
};

// Factories; each throws std::system_error (with errno) when the engine is unusable here, and
// std::runtime_error when it was not compiled in.
std::unique_ptr<Backend> make_uring_backend(int depth);
std::unique_ptr<Backend> make_aio_backend(int depth);
std::unique_ptr<Backend> make_threads_backend(int depth, int nthreads);

bool uring_compiled();
bool aio_compiled();

}  // namespace io
}  // namespace statestore
