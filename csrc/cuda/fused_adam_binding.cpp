// Torch binding of the fused CUDA Adam (fused_adam.cu): the CUDA implementations of the
// `statestore` ops declared in csrc/adam/adam_ops.cpp. Compiled only when torch has CUDA
// (setup.py); the kernel source itself has no torch header.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "adam/adam_checks.h"
#include "cuda/fused_adam.h"
#include "cuda/fused_adam_moments.h"

namespace statestore {
namespace cuda {
namespace {

using checks::check_f32;

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

void adam_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                    const c10::List<std::optional<at::Tensor>>& masters,
                    at::ArrayRef<double> step_sizes, at::ArrayRef<double> bc2_sqrts, double lr,
                    double beta1, double beta2, double eps, double weight_decay,
                    bool adamw_mode, bool maximize, double grad_scale) {
  const size_t n = params.size();
  if (n == 0) return;
  checks::check_adam_lists(n, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, step_sizes,
                           bc2_sqrts, grad_scale);
  const at::Device dev = params[0].device();
  TORCH_CHECK(dev.is_cuda(), "adam_step_: params[0] is on ", dev, ", expected a CUDA device");
  const bool amsgrad = !max_exp_avg_sqs.empty();
  const c10::cuda::CUDAGuard guard(dev);

  std::vector<CudaAdamTensor> meta;
  std::vector<int64_t> prefix(1, 0);
  meta.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    const int64_t numel = p.numel();
    checks::check_param_tensors(p, grads[i], exp_avgs[i], exp_avg_sqs[i], i, numel, &dev);
    check_f32(exp_avgs[i], "exp_avgs", i);
    check_f32(exp_avg_sqs[i], "exp_avg_sqs", i);
    CudaAdamTensor t{};
    t.g_dtype = static_cast<int32_t>(checks::grad_dtype("adam_step_", grads[i], i));
    if (amsgrad) {
      checks::check_f32_tensor(max_exp_avg_sqs[i], "max_exp_avg_sqs", i, numel, &dev);
      t.vmax = max_exp_avg_sqs[i].data_ptr<float>();
    }
    const std::optional<at::Tensor> master = checks::master_of(masters, i);
    if (master.has_value()) {
      checks::check_f32_tensor(*master, "masters", i, numel, &dev);
      t.p_dtype = static_cast<int32_t>(checks::param_dtype_with_master("adam_step_", p, i));
      t.w = master->data_ptr<float>();
      t.p_out = p.data_ptr();
    } else {
      checks::check_param_without_master("adam_step_", p, i);
      t.p_dtype = static_cast<int32_t>(DType::kNone);
      t.w = p.data_ptr<float>();
      t.p_out = nullptr;
    }
    t.g = grads[i].data_ptr();
    t.m = exp_avgs[i].data_ptr<float>();
    t.v = exp_avg_sqs[i].data_ptr<float>();
    t.n = numel;
    t.s = make_adam_scalars(lr, beta1, beta2, eps, weight_decay, adamw_mode, maximize,
                            grad_scale, step_sizes[i], bc2_sqrts[i]);
    if (numel == 0) continue;
    meta.push_back(t);
    prefix.push_back(prefix.back() + (numel + kCudaChunk - 1) / kCudaChunk);
  }
  if (meta.empty()) return;

  size_t prefix_off = 0;
  at::Tensor dmeta = upload_meta(meta, prefix, dev, &prefix_off);
  const char* base = static_cast<const char*>(dmeta.data_ptr());
  const int num_sms = sm_count(dev);
  const int err = launch_fused_adam(reinterpret_cast<const CudaAdamTensor*>(base),
                                    reinterpret_cast<const int64_t*>(base + prefix_off),
                                    static_cast<int>(meta.size()), prefix.back(), amsgrad,
                                    num_sms, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "adam_step_: CUDA kernel launch failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(err)));
}

// Adam over compressed moments on CUDA (the CPU op's contract: csrc/adam/adam_ops.cpp).
void adam_step_moments_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                            at::TensorList exp_avg_sqs, at::TensorList exp_avg_scales,
                            at::TensorList exp_avg_sq_scales, at::TensorList max_exp_avg_sqs,
                            const c10::List<std::optional<at::Tensor>>& masters,
                            at::ArrayRef<double> step_sizes, at::ArrayRef<double> bc2_sqrts,
                            at::ArrayRef<int64_t> seeds_m, at::ArrayRef<int64_t> seeds_v,
                            at::ArrayRef<int64_t> offsets, int64_t kind, bool stochastic,
                            double lr, double beta1, double beta2, double eps,
                            double weight_decay, bool adamw_mode, bool maximize,
                            double grad_scale) {
  const size_t n = params.size();
  if (n == 0) return;
  const bool int8 = checks::moment_kind(kind) == MomentKind::kInt8;
  checks::check_moment_lists(n, int8, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales, max_exp_avg_sqs,
                             masters, step_sizes, bc2_sqrts, seeds_m, seeds_v, offsets,
                             grad_scale);
  const at::Device dev = params[0].device();
  TORCH_CHECK(dev.is_cuda(), "adam_step_moments_: params[0] is on ", dev, ", expected CUDA");
  const bool amsgrad = !max_exp_avg_sqs.empty();
  const c10::cuda::CUDAGuard guard(dev);
  std::vector<MomentTensorArgs> meta;
  std::vector<int64_t> prefix(1, 0);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    const int64_t numel = p.numel();
    checks::check_param_tensors(p, grads[i], exp_avgs[i], exp_avg_sqs[i], i, numel, &dev);
    checks::check_moment_codes(exp_avgs[i], exp_avg_sqs[i], int8, i);
    MomentTensorArgs t{};
    if (int8) {
      const int64_t nb = (numel + kQBlock - 1) / kQBlock;
      checks::check_int8_blocks(exp_avg_scales[i], exp_avg_sq_scales[i], offsets[i], i, nb,
                                &dev);
      t.m_scale = exp_avg_scales[i].data_ptr<float>();
      t.v_scale = exp_avg_sq_scales[i].data_ptr<float>();
    }
    t.g_dtype = checks::grad_dtype("adam_step_moments_", grads[i], i);
    if (amsgrad) {
      checks::check_f32_tensor(max_exp_avg_sqs[i], "max_exp_avg_sqs", i, numel, &dev);
      t.vmax = max_exp_avg_sqs[i].data_ptr<float>();
    }
    const std::optional<at::Tensor> master = checks::master_of(masters, i);
    if (master.has_value()) {
      checks::check_f32_tensor(*master, "masters", i, numel, &dev);
      t.p_dtype = checks::param_dtype_with_master("adam_step_moments_", p, i);
      t.w = master->data_ptr<float>();
      t.p_out = p.data_ptr();
    } else {
      checks::check_param_without_master("adam_step_moments_", p, i);
      t.p_dtype = DType::kNone;
      t.w = p.data_ptr<float>();
    }
    t.g = grads[i].data_ptr();
    t.m = exp_avgs[i].data_ptr();
    t.v = exp_avg_sqs[i].data_ptr();
    t.kind = int8 ? MomentKind::kInt8 : MomentKind::kBF16;
    t.stochastic = stochastic;
    t.seed_m = static_cast<uint32_t>(seeds_m[i]);
    t.seed_v = static_cast<uint32_t>(seeds_v[i]);
    t.offset = offsets[i];
    t.n = numel;
    t.s = make_adam_scalars(lr, beta1, beta2, eps, weight_decay, adamw_mode, maximize,
                            grad_scale, step_sizes[i], bc2_sqrts[i]);
    if (numel == 0) continue;
    meta.push_back(t);
    prefix.push_back(prefix.back() + (numel + kQBlock - 1) / kQBlock);
  }
  if (meta.empty()) return;
  size_t prefix_off = 0;
  at::Tensor dmeta = upload_meta(meta, prefix, dev, &prefix_off);
  const char* base = static_cast<const char*>(dmeta.data_ptr());
  const int num_sms = sm_count(dev);
  const int err = launch_fused_adam_moments(
      reinterpret_cast<const MomentTensorArgs*>(base),
      reinterpret_cast<const int64_t*>(base + prefix_off), static_cast<int>(meta.size()),
      prefix.back(), amsgrad, int8, num_sms, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "adam_step_moments_: CUDA kernel launch failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(err)));
}

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
  m.impl("adam_step_", &statestore::cuda::adam_step_cuda);
  m.impl("grads_finite", &statestore::cuda::grads_finite_cuda);
  m.impl("adam_step_moments_", &statestore::cuda::adam_step_moments_cuda);
}
