// Torch binding of the fused CUDA Adam (fused_adam.cu, fused_adam_moments.cu): the CUDA
// implementations of the `statestore` ops declared in csrc/adam/adam_ops.cpp. Compiled only when torch has CUDA
// (setup.py); the kernel source itself has no torch header.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "adam/adam_checks.h"
#include "cuda/fused_adam.h"
#include "cuda/fused_adam_moments.h"

namespace statestore {
namespace cuda {
namespace {

// Copies meta and prefix into one pinned buffer (prefix at *prefix_off, 16-byte aligned), then
// asynchronously to `dev` on the current stream; the caching host allocator keeps the buffer
// alive until that copy has completed. Returns the device buffer.
template <typename Meta>
at::Tensor upload_meta(const std::vector<Meta>& meta, const std::vector<int64_t>& prefix,
                       const at::Device& dev, size_t* prefix_off) {
  const size_t meta_bytes = meta.size() * sizeof(Meta);
  *prefix_off = (meta_bytes + 15) / 16 * 16;
  const size_t total = *prefix_off + prefix.size() * sizeof(int64_t);
  at::Tensor host = at::empty({static_cast<int64_t>(total)},
                              at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), meta.data(), meta_bytes);
  std::memcpy(static_cast<char*>(host.data_ptr()) + *prefix_off, prefix.data(),
              prefix.size() * sizeof(int64_t));
  return host.to(dev, /*non_blocking=*/true);
}

// The multiprocessor count of `dev`, or 32 where CUDA cannot tell (it only sizes the grid).
int sm_count(const at::Device& dev) {
  int num_sms = 0;
  if (cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev.index()) != cudaSuccess) {
    (void)cudaGetLastError();
    num_sms = 32;
  }
  return num_sms;
}

// The compressed-moment kernel's layout: -1 until the first use reads the environment.
std::atomic<int> g_moments_layout{-1};

MomentsKernel parse_layout(const std::string& name, const char* what) {
  if (name == "block") return MomentsKernel::kBlock;
  if (name == "wide") return MomentsKernel::kWide;
  TORCH_CHECK(false, what, " must be 'block' or 'wide', got '", name, "'");
  return MomentsKernel::kBlock;
}

MomentsKernel moments_layout() {
  int v = g_moments_layout.load();
  if (v < 0) {
    const char* env = std::getenv("STATESTORE_CUDA_MOMENTS");
    v = static_cast<int>(env == nullptr || *env == '\0'
                             ? MomentsKernel::kBlock
                             : parse_layout(env, "STATESTORE_CUDA_MOMENTS"));
    g_moments_layout.store(v);
  }
  return static_cast<MomentsKernel>(v);
}

// One launch over `meta` (every tensor of one moment encoding, all with or all without
// amsgrad's max): its chunk prefix and the table uploaded to `dev`, the fp32 or the
// compressed-moment kernel on the current stream.
void launch_jobs(const std::vector<AdamTensorArgs>& meta, const at::Device& dev, bool amsgrad,
                 int num_sms) {
  const bool fp32 = meta[0].kind == MomentKind::kF32;
  const MomentsKernel layout = fp32 ? MomentsKernel::kBlock : moments_layout();
  const int64_t chunk = fp32 ? kCudaChunk : moments_chunk(layout);
  std::vector<int64_t> prefix(1, 0);
  for (const AdamTensorArgs& t : meta) prefix.push_back(prefix.back() + (t.n + chunk - 1) / chunk);
  size_t prefix_off = 0;
  at::Tensor dmeta = upload_meta(meta, prefix, dev, &prefix_off);
  const char* base = static_cast<const char*>(dmeta.data_ptr());
  const auto* dm = reinterpret_cast<const AdamTensorArgs*>(base);
  const auto* dp = reinterpret_cast<const int64_t*>(base + prefix_off);
  const int n = static_cast<int>(meta.size());
  void* stream = c10::cuda::getCurrentCUDAStream().stream();
  const int err = fp32 ? launch_fused_adam(dm, dp, n, prefix.back(), amsgrad, num_sms, stream)
                       : launch_fused_adam_moments(layout, dm, dp, n, prefix.back(), amsgrad,
                                                   meta[0].kind == MomentKind::kInt8, num_sms,
                                                   stream);
  TORCH_CHECK(err == 0, "adam_: CUDA kernel launch failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(err)));
}

// The `statestore::adam_` op on CUDA, every encoding of the moments: the arguments are
// checked once (checks::adam_jobs, shared with the CPU op), then one launch updates every
// tensor: fp32 moments in chunks of kCudaChunk elements, compressed ones as the process's
// layout says (fused_adam_moments.h, MomentsKernel).
void adam_cuda(STATESTORE_ADAM_OP_PARAMS) {
  if (params.size() == 0) return;
  const at::Device dev = params[0].device();
  TORCH_CHECK(dev.is_cuda(), "adam_: params[0] is on ", dev, ", expected a CUDA device");
  const c10::cuda::CUDAGuard guard(dev);
  const std::vector<AdamTensorArgs> meta = checks::adam_jobs(STATESTORE_ADAM_OP_ARGS, &dev);
  if (meta.empty()) return;
  launch_jobs(meta, dev, !max_exp_avg_sqs.empty(), sm_count(dev));
}

}  // namespace

std::string moments_kernel() {
  return moments_layout() == MomentsKernel::kWide ? "wide" : "block";
}

std::string set_moments_kernel(const std::string& name) {
  g_moments_layout.store(static_cast<int>(parse_layout(name, "set_cuda_moments: the layout")));
  return moments_kernel();
}

void run_adam_jobs(const AdamTensorArgs* jobs, size_t n, int device_index) {
  if (n == 0) return;
  const at::Device dev(at::kCUDA, static_cast<c10::DeviceIndex>(device_index));
  const c10::cuda::CUDAGuard guard(dev);
  const int num_sms = sm_count(dev);
  for (const bool amsgrad : {false, true}) {
    std::vector<AdamTensorArgs> meta;
    for (size_t i = 0; i < n; ++i) {
      TORCH_CHECK(jobs[i].kind == jobs[0].kind, "run_adam_jobs: one moment encoding per call");
      if ((jobs[i].vmax != nullptr) == amsgrad && jobs[i].n > 0) meta.push_back(jobs[i]);
    }
    if (!meta.empty()) launch_jobs(meta, dev, amsgrad, num_sms);
  }
}

namespace {

bool grads_finite_cuda(at::TensorList grads) {
  if (grads.empty()) return true;
  std::vector<at::Tensor> flags;
  flags.reserve(grads.size());
  for (const at::Tensor& g : grads) flags.push_back(at::isfinite(g).all());
  return at::stack(flags).all().item<bool>();  // one synchronization
}

}  // namespace
}  // namespace cuda
}  // namespace statestore

TORCH_LIBRARY_IMPL(statestore, CUDA, m) {
  m.impl("adam_", &statestore::cuda::adam_cuda);
  m.impl("grads_finite", &statestore::cuda::grads_finite_cuda);
}
