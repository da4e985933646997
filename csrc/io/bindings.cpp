// Python binding of the I/O queue and the aligned buffer allocator: statestore._C_io.
// Thin by design; statestore/io/ wraps it (futures, errors naming files, engine probing).
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>
#include <system_error>
#include <tuple>

// not <torch/extension.h>: the tensor type, from_blob and the pybind11 casters are all this
// file uses, and the rest of torch's headers tripled its compile time.
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <torch/csrc/utils/pybind.h>

#include "io/queue.h"

namespace py = pybind11;
using statestore::io::Completion;
using statestore::io::Op;
using statestore::io::Queue;

namespace {

// Anonymous memory returned to the OS on free (munmap), optionally mlock'ed. Buffers of 2 MiB
// or more are 2 MiB-aligned, rounded up to 2 MiB and marked MADV_HUGEPAGE (before anything
// touches them): backed by transparent huge pages, each 2 MiB is physically contiguous, so a
// direct-I/O request of several MiB is a handful of segments instead of one per 4 KiB page
// (a virtio disk here takes 254 segments a request; a 1 GiB write from a freshly allocated
// 4 KiB-page buffer ran at about half the speed of the same write from huge pages).
// Returns (uint8 tensor, locked, note): note says why locking was not done.
std::tuple<at::Tensor, bool, std::string> alloc_aligned(int64_t nbytes, bool lock) {
  if (nbytes <= 0) throw std::invalid_argument("nbytes must be > 0, got " + std::to_string(nbytes));
  const int64_t page = 4096, huge = int64_t(2) << 20;
  const bool use_huge = nbytes >= huge;
  const int64_t align = use_huge ? huge : page;
  const int64_t len = (nbytes + align - 1) / align * align;
  const int64_t maplen = use_huge ? len + huge : len;   // room to align the start
  void* raw = ::mmap(nullptr, static_cast<size_t>(maplen), PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    int e = errno;
    throw std::system_error(e, std::generic_category(),
                            "mmap of an aligned buffer of " + std::to_string(len) + " bytes");
  }
  char* p = static_cast<char*>(raw);
  if (use_huge) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(raw);
    char* start = reinterpret_cast<char*>((a + static_cast<uintptr_t>(huge) - 1) & ~static_cast<uintptr_t>(huge - 1));
    const int64_t head = start - p, tail = maplen - head - len;
    if (head > 0) ::munmap(p, static_cast<size_t>(head));
    if (tail > 0) ::munmap(start + len, static_cast<size_t>(tail));
    p = start;
    // Advice only: where THP is off ("never") the buffer keeps 4 KiB pages and works the same.
    (void)::madvise(p, static_cast<size_t>(len), MADV_HUGEPAGE);
  }
  bool locked = false;
  std::string note;
  if (lock) {
    if (::mlock(p, static_cast<size_t>(len)) == 0) {
      locked = true;
    } else {
      note = std::string("mlock failed: ") + std::strerror(errno);
    }
  } else {
    note = "not requested";
  }
  auto deleter = [len, locked](void* q) {
    if (locked) ::munlock(q, static_cast<size_t>(len));  // result irrelevant: munmap unlocks too
    ::munmap(q, static_cast<size_t>(len));
  };
  auto t = at::from_blob(p, {nbytes}, deleter, at::TensorOptions().dtype(at::kByte));
  return {t, locked, note};
}

py::list wait_py(Queue& q, int min_n, int max_n, int timeout_ms) {
  std::vector<Completion> done;
  {
    py::gil_scoped_release nogil;
    done = q.wait(min_n, max_n, timeout_ms);
  }
  py::list out;
  for (auto& c : done) out.append(py::make_tuple(c.id, c.bytes, c.err, c.message));
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "statestore asynchronous I/O engines (io_uring, libaio, thread pool)";
  m.def("uring_compiled", &statestore::io::uring_compiled);
  m.def("aio_compiled", &statestore::io::aio_compiled);
  m.def("alloc_aligned", &alloc_aligned, py::arg("nbytes"), py::arg("lock"));
  m.attr("DROP_CACHE") = static_cast<int>(statestore::io::kDropCache);
  m.attr("DATA_SYNC") = static_cast<int>(statestore::io::kDataSync);

  py::class_<Queue>(m, "Queue")
      .def(py::init<const std::string&, int, int64_t, int>(), py::arg("engine"), py::arg("depth"),
           py::arg("block_size"), py::arg("threads"), py::call_guard<py::gil_scoped_release>())
      .def("submit",
           [](Queue& q, int op, int fd, uintptr_t ptr, int64_t nbytes, int64_t offset,
              const std::string& path, int flags) {
             if (op != 0 && op != 1) throw std::invalid_argument("op must be 0 (read) or 1 (write)");
             py::gil_scoped_release nogil;
             return q.submit(op == 0 ? Op::Read : Op::Write, fd, reinterpret_cast<char*>(ptr),
                             nbytes, offset, path, flags);
           },
           py::arg("op"), py::arg("fd"), py::arg("ptr"), py::arg("nbytes"), py::arg("offset"),
           py::arg("path"), py::arg("flags") = 0)
      .def("wait", &wait_py, py::arg("min_n") = 1, py::arg("max_n") = 1024, py::arg("timeout_ms") = -1)
      .def("close", &Queue::close, py::call_guard<py::gil_scoped_release>())
      .def("_inject_fault_for_testing", &Queue::inject_fault, py::arg("op"), py::arg("skip"),
           py::arg("count"), py::arg("kind"), py::arg("err"))
      .def("_clear_faults_for_testing", &Queue::clear_faults)
      .def("stats",
           [](const Queue& q) {
             auto s = q.stats();
             py::dict d;
             d["requests"] = s.requests;
             d["blocks"] = s.blocks;
             d["retries"] = s.retries;
             d["errors"] = s.errors;
             d["bytes_read"] = s.bytes_read;
             d["bytes_written"] = s.bytes_written;
             return d;
           })
      .def("outstanding", &Queue::outstanding)
      .def_property_readonly("closed", &Queue::closed)
      .def_property_readonly("engine", &Queue::engine)
      .def_property_readonly("depth", &Queue::depth)
      .def_property_readonly("block_size", &Queue::block_size);
}
