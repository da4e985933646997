// Linux native AIO engine (libaio). One io_context of `depth` slots; each slot owns the iocb
// the kernel reads until the block completes (the Queue's tag is the slot index).
#include "io/backend.h"

#include <cerrno>
#include <ctime>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <system_error>
#include <vector>

#ifdef STATESTORE_WITH_AIO
#include <libaio.h>
#endif

namespace statestore {
namespace io {

#ifdef STATESTORE_WITH_AIO
namespace {

class AioBackend final : public Backend {
 public:
  explicit AioBackend(int depth) : iocbs_(static_cast<size_t>(depth)), ptrs_(static_cast<size_t>(depth)),
                                   events_(static_cast<size_t>(depth)) {
    int rc = io_setup(depth, &ctx_);
    if (rc < 0) throw std::system_error(-rc, std::generic_category(), "io_setup");
  }
  ~AioBackend() override { io_destroy(ctx_); }
  const char* name() const override { return "libaio"; }

  int submit(const Block* blocks, int n) override {
    for (int i = 0; i < n; ++i) {
      const Block& b = blocks[i];
      if (b.tag >= iocbs_.size())
        throw std::logic_error("libaio backend: block tag out of range");
      struct iocb* cb = &iocbs_[b.tag];
      if (b.op == Op::Read)
        io_prep_pread(cb, b.fd, b.buf, b.nbytes, static_cast<long long>(b.offset));
      else
        io_prep_pwrite(cb, b.fd, b.buf, b.nbytes, static_cast<long long>(b.offset));
      cb->data = reinterpret_cast<void*>(static_cast<uintptr_t>(b.tag));
      ptrs_[static_cast<size_t>(i)] = cb;
    }
    int done = 0;
    while (done < n) {
      int rc = io_submit(ctx_, n - done, ptrs_.data() + done);
      if (rc == -EAGAIN || rc == -EINTR) {
        // The kernel queue is momentarily full; what was not taken is returned as not accepted
        // and the Queue resubmits it after the next completion.
        break;
      }
      if (rc < 0) {
        // The kernel rejected the first iocb (EBADF, EINVAL, ...): that block alone completes
        // with the error; the others are submitted on.
        {
          std::lock_guard<std::mutex> g(mu_);
          rejected_.push_back(BlockResult{blocks[done].tag, static_cast<int64_t>(rc)});
        }
        ++done;
        continue;
      }
      if (rc == 0) break;
      done += rc;
    }
    return done;
  }

  int reap(BlockResult* out, int max, int timeout_ms) override {
    struct timespec ts;
    ts.tv_sec = timeout_ms / 1000;
    ts.tv_nsec = static_cast<long>(timeout_ms % 1000) * 1000000L;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (!rejected_.empty()) {
        int n = 0;
        while (n < max && !rejected_.empty()) {
          out[n++] = rejected_.front();
          rejected_.pop_front();
        }
        return n;
      }
    }
    if (max > static_cast<int>(events_.size())) max = static_cast<int>(events_.size());
    int rc = io_getevents(ctx_, 1, max, events_.data(), &ts);
    if (rc == -EINTR) return 0;
    if (rc < 0) throw std::system_error(-rc, std::generic_category(), "io_getevents");
    for (int i = 0; i < rc; ++i) {
      out[i].tag = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(events_[static_cast<size_t>(i)].data));
      // libaio splits the kernel's signed result into res (low bits) and res2.
      out[i].res = static_cast<int64_t>(static_cast<long>(events_[static_cast<size_t>(i)].res));
    }
    return rc;
  }

 private:
  io_context_t ctx_ = nullptr;
  std::vector<struct iocb> iocbs_;
  std::vector<struct iocb*> ptrs_;
  std::vector<struct io_event> events_;
  std::mutex mu_;                      // guards rejected_ (submit and reap run on different threads)
  std::deque<BlockResult> rejected_;   // blocks io_submit refused, reported as completions
};

}  // namespace

std::unique_ptr<Backend> make_aio_backend(int depth) {
  return std::unique_ptr<Backend>(new AioBackend(depth));
}
bool aio_compiled() { return true; }
#else
std::unique_ptr<Backend> make_aio_backend(int) {
  throw std::runtime_error("statestore._C_io was built without libaio (install libaio-dev and rebuild)");
}
bool aio_compiled() { return false; }
#endif

}  // namespace io
}  // namespace statestore
