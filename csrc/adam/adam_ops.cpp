// Torch binding of the CPU Adam kernels: the `statestore` op library (schemas with mutation
// annotations, CPU implementations), run-time choice of the SIMD path, multi-threading with
// torch's intra-op threads, and the module `statestore._C_adam`.
//
// Threading: the elements of every tensor of a call are cut into fixed chunks (kChunk
// elements); at::parallel_for hands each thread a contiguous run of chunks. The update is
// elementwise with no reduction, and the SIMD body and the scalar tail compute the same bits,
// so results do not depend on the number of threads.
// torch's headers are most of this file's compile time: only those used (not
// <torch/extension.h>, the whole C++ frontend).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/isfinite.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam/adam_checks.h"
#include "adam/adam_kernels.h"

namespace statestore {
namespace cpu {
namespace {

constexpr int64_t kChunk = 1 << 14;  // elements per work item (64 KiB of fp32)

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq");
}

const SimdKernels* best_kernels() {
  if (cpu_has_avx512()) return &avx512_kernels();
  if (cpu_has_avx2()) return &avx2_kernels();
  return &scalar_kernels();
}

std::atomic<const SimdKernels*>& active() {
  static std::atomic<const SimdKernels*> k{best_kernels()};
  return k;
}

std::vector<std::string> simd_supported() {
  std::vector<std::string> out;
  if (cpu_has_avx512()) out.emplace_back("avx512");
  if (cpu_has_avx2()) out.emplace_back("avx2");
  out.emplace_back("scalar");
  return out;
}

// Selects a path by name ("avx512", "avx2", "scalar", or "auto"/"" for the best the
// processor supports). Never selects a path the processor lacks: that is an error.
std::string set_simd(const std::string& name) {
  const SimdKernels* k = nullptr;
  if (name.empty() || name == "auto") {
    k = best_kernels();
  } else if (name == "avx512") {
    if (!cpu_has_avx512())
      throw std::runtime_error("set_simd: this processor does not support AVX-512 (F/BW/VL/DQ)");
    k = &avx512_kernels();
  } else if (name == "avx2") {
    if (!cpu_has_avx2())
      throw std::runtime_error("set_simd: this processor does not support AVX2+FMA+F16C");
    k = &avx2_kernels();
  } else if (name == "scalar") {
    k = &scalar_kernels();
  } else {
    throw std::invalid_argument("set_simd: unknown SIMD path '" + name +
                                "' (expected avx512, avx2, scalar or auto)");
  }
  active().store(k);
  return k->name;
}

pybind11::tuple simd_in_use() {
  const SimdKernels* k = active().load();
  return pybind11::make_tuple(std::string(k->name), k->width_bits);
}

using checks::storage_of;

// Runs kernel(job, b, e) over every element range [b, e) of every job, in parallel over fixed
// chunks of kChunk elements.
template <typename Job, typename Kernel>
void run_chunked(const std::vector<Job>& jobs, Kernel kernel) {
  std::vector<int64_t> prefix(jobs.size() + 1, 0);
  int64_t total = 0;
  for (size_t t = 0; t < jobs.size(); ++t) {
    prefix[t + 1] = prefix[t] + (jobs[t].n + kChunk - 1) / kChunk;
    total += jobs[t].n;
  }
  if (total <= 2 * kChunk || at::get_num_threads() <= 1 || at::in_parallel_region()) {
    for (const auto& j : jobs) kernel(j, 0, j.n);
    return;
  }
  at::parallel_for(0, prefix.back(), 1, [&](int64_t cb, int64_t ce) {
    size_t t = static_cast<size_t>(std::upper_bound(prefix.begin(), prefix.end(), cb) - prefix.begin()) - 1;
    for (int64_t c = cb; c < ce;) {
      while (prefix[t + 1] <= c) ++t;
      const int64_t cend = std::min(ce, prefix[t + 1]);
      const int64_t b = (c - prefix[t]) * kChunk;
      const int64_t e = std::min(jobs[t].n, (cend - prefix[t]) * kChunk);
      kernel(jobs[t], b, e);
      c = cend;
    }
  });
}

// The `statestore::adam_` op on CPU, every encoding of the moments: the arguments are
// checked once (checks::adam_jobs, shared with the CUDA binding), then every tensor is
// updated in parallel over fixed chunks (kChunk is a multiple of kQBlock, so int8 blocks
// never straddle two threads).
void adam_cpu(STATESTORE_ADAM_OP_PARAMS) {
  static_assert(kChunk % kQBlock == 0, "chunks must hold whole int8 blocks");
  const std::vector<AdamTensorArgs> jobs = checks::adam_jobs(STATESTORE_ADAM_OP_ARGS, nullptr);
  run_chunked(jobs, active().load()->adam);
}

bool grads_finite_cpu(at::TensorList grads) {
  struct Job { const void* data; DType dtype; int64_t n; };
  std::vector<Job> jobs;
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    TORCH_CHECK(g.device().is_cpu(), "grads_finite: grads[", i, "] is on ", g.device(), ", expected cpu");
    const DType d = storage_of(g.scalar_type());
    if (d == DType::kNone || !g.is_contiguous()) {
      if (g.is_floating_point() || g.is_complex()) {
        if (!at::isfinite(g).all().item<bool>()) return false;
      }
      continue;
    }
    if (g.numel() > 0) jobs.push_back({g.data_ptr(), d, g.numel()});
  }
  const SimdKernels& k = *active().load();
  constexpr int64_t kFiniteChunk = 1 << 16;
  std::vector<int64_t> prefix(jobs.size() + 1, 0);
  for (size_t t = 0; t < jobs.size(); ++t) prefix[t + 1] = prefix[t] + (jobs[t].n + kFiniteChunk - 1) / kFiniteChunk;
  std::atomic<bool> ok{true};
  auto body = [&](int64_t cb, int64_t ce) {
    size_t t = static_cast<size_t>(std::upper_bound(prefix.begin(), prefix.end(), cb) - prefix.begin()) - 1;
    for (int64_t c = cb; c < ce && ok.load(std::memory_order_relaxed); ++c) {
      while (prefix[t + 1] <= c) ++t;
      const int64_t b = (c - prefix[t]) * kFiniteChunk;
      const int64_t e = std::min(jobs[t].n, b + kFiniteChunk);
      if (!k.finite(jobs[t].data, jobs[t].dtype, b, e)) ok.store(false, std::memory_order_relaxed);
    }
  };
  if (prefix.back() <= 2 || at::in_parallel_region()) body(0, prefix.back());
  else at::parallel_for(0, prefix.back(), 1, body);
  return ok.load();
}

// Roofline probe (benchmarks only): p += g; m += g; v += g over fp32 tensors, with the
// threading of adam_.
void bandwidth_probe(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m,
                     const at::Tensor& v) {
  for (const at::Tensor* t : {&p, &g, &m, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == at::kFloat &&
                    t->numel() == p.numel(),
                "bandwidth_probe: p, g, m, v must be contiguous float32 CPU tensors of one size");
  }
  const SimdKernels& k = *active().load();
  float* pp = p.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const int64_t nchunks = (p.numel() + kChunk - 1) / kChunk;
  const int64_t n = p.numel();
  pybind11::gil_scoped_release nogil;
  at::parallel_for(0, nchunks, 1, [&](int64_t cb, int64_t ce) {
    k.probe(pp, gp, mp, vp, cb * kChunk, std::min(n, ce * kChunk));
  });
}

// dst <- src, byte for byte, with the active path's streaming stores (stream_copy). For
// buffers headed to a device; one thread, without the GIL: a copy into a store's ring runs
// beside the disk's transfers, and a second thread took CPU from the I/O completions here
// (benchmarks/nvme_io.py, docs/nvme.md "Copies into the ring").
void stream_copy(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu(),
              "stream_copy: dst and src must be CPU tensors, got ", dst.device(), " and ",
              src.device());
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(),
              "stream_copy: dst and src must be contiguous");
  TORCH_CHECK(dst.scalar_type() == src.scalar_type(), "stream_copy: dst is ", dst.scalar_type(),
              ", src is ", src.scalar_type(), "; the copy does not convert");
  TORCH_CHECK(dst.numel() == src.numel(), "stream_copy: dst has ", dst.numel(),
              " elements, src has ", src.numel());
  const int64_t n = src.numel() * static_cast<int64_t>(src.element_size());
  if (n == 0) return;
  void* d = dst.data_ptr();
  const void* s = src.data_ptr();
  const auto db = reinterpret_cast<uintptr_t>(d), sb = reinterpret_cast<uintptr_t>(s);
  TORCH_CHECK(db + static_cast<uintptr_t>(n) <= sb || sb + static_cast<uintptr_t>(n) <= db,
              "stream_copy: dst and src overlap");
  const SimdKernels& k = *active().load();
  pybind11::gil_scoped_release nogil;
  k.stream_copy(d, s, n);
}

}  // namespace
}  // namespace cpu
}  // namespace statestore

TORCH_LIBRARY(statestore, m) {
  m.def(statestore::checks::kAdamSchema);
  m.def("grads_finite(Tensor[] grads) -> bool");
}

TORCH_LIBRARY_IMPL(statestore, CPU, m) {
  m.impl("adam_", &statestore::cpu::adam_cpu);
  m.impl("grads_finite", &statestore::cpu::grads_finite_cpu);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "statestore's Adam kernels; the ops are torch.ops.statestore.adam_ / grads_finite";
  m.def("set_simd", &statestore::cpu::set_simd, pybind11::arg("name"),
        "Select the CPU path: 'avx512', 'avx2', 'scalar' or 'auto'. Raises where the processor "
        "lacks it. Returns the name selected.");
  m.def("simd", &statestore::cpu::simd_in_use, "(name, width in bits) of the CPU path in use");
  m.def("bandwidth_probe", &statestore::cpu::bandwidth_probe,
        "Roofline probe for benchmarks: p += g; m += g; v += g (28 bytes an element)");
  m.def("stream_copy", &statestore::cpu::stream_copy, pybind11::arg("dst"), pybind11::arg("src"),
        "dst <- src (contiguous CPU tensors of one dtype and size) with streaming stores");
  m.def("simd_supported", &statestore::cpu::simd_supported,
        "CPU paths this processor supports, widest first");
#ifdef STATESTORE_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
