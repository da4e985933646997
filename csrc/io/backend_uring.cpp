// io_uring engine (liburing). One ring of `depth` entries; submissions from any thread under
// the Queue's lock, completions reaped by the Queue's reaper thread. Waiting uses the kernel's
// EXT_ARG timeout (no timeout SQE), so the reaper never touches the submission ring.
#include "io/backend.h"

#include <cerrno>
#include <stdexcept>
#include <system_error>

#ifdef STATESTORE_WITH_URING
#include <liburing.h>
#endif

namespace statestore {
namespace io {

#ifdef STATESTORE_WITH_URING
namespace {

class UringBackend final : public Backend {
 public:
  explicit UringBackend(int depth) {
    struct io_uring_params p = {};
    int rc = io_uring_queue_init_params(static_cast<unsigned>(depth), &ring_, &p);
    if (rc < 0) throw std::system_error(-rc, std::generic_category(), "io_uring_queue_init");
    if (!(p.features & IORING_FEAT_EXT_ARG)) {
      io_uring_queue_exit(&ring_);
      // Without EXT_ARG, liburing waits with a timeout SQE, which would race with submitters.
      throw std::system_error(ENOTSUP, std::generic_category(),
                              "io_uring without IORING_FEAT_EXT_ARG (kernel older than 5.11)");
    }
  }
  ~UringBackend() override { io_uring_queue_exit(&ring_); }
  const char* name() const override { return "io_uring"; }

  int submit(const Block* blocks, int n) override {
    int prepared = 0;
    for (; prepared < n; ++prepared) {
      struct io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr) break;
      const Block& b = blocks[prepared];
      if (b.op == Op::Read)
        io_uring_prep_read(sqe, b.fd, b.buf, static_cast<unsigned>(b.nbytes),
                           static_cast<__u64>(b.offset));
      else
        io_uring_prep_write(sqe, b.fd, b.buf, static_cast<unsigned>(b.nbytes),
                            static_cast<__u64>(b.offset));
      io_uring_sqe_set_data64(sqe, b.tag);
    }
    flush();
    // Prepared SQEs stay in the ring until the kernel takes them (flush() retries on EAGAIN),
    // so every prepared block counts as accepted.
    return prepared;
  }

  int reap(BlockResult* out, int max, int timeout_ms) override {
    struct io_uring_cqe* cqe = nullptr;
    struct __kernel_timespec ts;
    ts.tv_sec = timeout_ms / 1000;
    ts.tv_nsec = static_cast<long long>(timeout_ms % 1000) * 1000000LL;
    int rc = io_uring_wait_cqe_timeout(&ring_, &cqe, &ts);
    if (rc == -ETIME || rc == -EINTR || rc == -EAGAIN) return 0;
    if (rc < 0) throw std::system_error(-rc, std::generic_category(), "io_uring_wait_cqe_timeout");
    int n = 0;
    unsigned head;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      if (n == max) break;
      out[n].tag = io_uring_cqe_get_data64(cqe);
      out[n].res = cqe->res;
      ++n;
    }
    io_uring_cq_advance(&ring_, static_cast<unsigned>(n));
    return n;
  }


  void flush() override {
    // Always called with the Queue's lock held: preparing SQEs and io_uring_submit never race.
    if (io_uring_sq_ready(&ring_) == 0) return;
    int rc = io_uring_submit(&ring_);
    if (rc < 0 && rc != -EAGAIN && rc != -EBUSY && rc != -EINTR)
      throw std::system_error(-rc, std::generic_category(), "io_uring_submit");
  }
 private:
  struct io_uring ring_;
};

}  // namespace

std::unique_ptr<Backend> make_uring_backend(int depth) {
  return std::unique_ptr<Backend>(new UringBackend(depth));
}
bool uring_compiled() { return true; }
#else
std::unique_ptr<Backend> make_uring_backend(int) {
  throw std::runtime_error("statestore._C_io was built without liburing (install liburing-dev and rebuild)");
}
bool uring_compiled() { return false; }
#endif

}  // namespace io
}  // namespace statestore
