// Argument checks of the `statestore` Adam ops (adam_step_, adam_step_moments_), shared by the
// CPU implementations (csrc/adam/adam_ops.cpp) and the CUDA ones (csrc/cuda/fused_adam_binding.cpp).
// ATen only, no CUDA header: the CPU build includes it. `op` is the name that opens each message
// ("adam_step_" or "adam_step_moments_").
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>

#include "adam_math.h"

namespace statestore {
namespace checks {

// The storage type of a param or grad dtype; DType::kNone for any other dtype.
inline DType storage_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kF32;
    case at::kHalf: return DType::kF16;
    case at::kBFloat16: return DType::kBF16;
    default: return DType::kNone;
  }
}

// `name[i]` is defined, on `dev` (nullptr: on the CPU), contiguous, with `numel` elements.
inline void check_tensor(const at::Tensor& t, const char* name, size_t i, int64_t numel,
                         const at::Device* dev = nullptr) {
  TORCH_CHECK(t.defined(), "adam_step_: ", name, "[", i, "] is undefined");
  if (dev == nullptr) {
    TORCH_CHECK(t.device().is_cpu(), "adam_step_: ", name, "[", i, "] is on ", t.device(),
                ", expected cpu");
  } else {
    TORCH_CHECK(t.device() == *dev, "adam_step_: ", name, "[", i, "] is on ", t.device(),
                ", params[0] is on ", *dev);
  }
  TORCH_CHECK(t.is_contiguous(), "adam_step_: ", name, "[", i,
              "] is not contiguous; call .contiguous() or use the reference path");
  TORCH_CHECK(t.numel() == numel, "adam_step_: ", name, "[", i, "] has ", t.numel(),
              " elements, params[", i, "] has ", numel);
}

inline void check_f32(const at::Tensor& t, const char* name, size_t i) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "adam_step_: ", name, "[", i,
              "] must be float32, got ", t.scalar_type());
}

// check_tensor then check_f32: an fp32 tensor of one element per param element
// (max_exp_avg_sqs, masters).
inline void check_f32_tensor(const at::Tensor& t, const char* name, size_t i, int64_t numel,
                             const at::Device* dev = nullptr) {
  check_tensor(t, name, i, numel, dev);
  check_f32(t, name, i);
}

// The int8 moments' block scales of param i: `nb` fp32 values each.
inline void check_scales(const at::Tensor& exp_avg_scale, const at::Tensor& exp_avg_sq_scale,
                         size_t i, int64_t nb, const at::Device* dev = nullptr) {
  check_tensor(exp_avg_scale, "exp_avg_scales", i, nb, dev);
  check_tensor(exp_avg_sq_scale, "exp_avg_sq_scales", i, nb, dev);
  check_f32(exp_avg_scale, "exp_avg_scales", i);
  check_f32(exp_avg_sq_scale, "exp_avg_sq_scales", i);
}

inline void check_grad_scale(const char* op, double grad_scale) {
  TORCH_CHECK(std::isfinite(grad_scale) && grad_scale > 0, op,
              ": grad_scale must be a positive finite number, got ", grad_scale);
}

// The storage type of grads[i], which must be fp32, fp16 or bf16.
inline DType grad_dtype(const char* op, const at::Tensor& g, size_t i) {
  const DType d = storage_of(g.scalar_type());
  TORCH_CHECK(d != DType::kNone, op, ": grads[", i,
              "] must be float32, float16 or bfloat16, got ", g.scalar_type());
  return d;
}

// The storage type of params[i] written from an fp32 master: fp32, fp16 or bf16.
inline DType param_dtype_with_master(const char* op, const at::Tensor& p, size_t i) {
  const DType d = storage_of(p.scalar_type());
  TORCH_CHECK(d != DType::kNone, op, ": params[", i,
              "] (with an fp32 master) must be float32, float16 or bfloat16, got ",
              p.scalar_type());
  return d;
}

// params[i] without a master is updated in place, so must be fp32.
inline void check_param_without_master(const char* op, const at::Tensor& p, size_t i) {
  TORCH_CHECK(p.scalar_type() == at::kFloat, op, ": params[", i, "] is ", p.scalar_type(),
              " without an fp32 master; pass masters[", i, "]");
}

// The four tensors every op reads per param: params[i], grads[i], exp_avgs[i] and
// exp_avg_sqs[i], each defined, on `dev` (nullptr: the CPU), contiguous, `numel` elements.
inline void check_param_tensors(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m,
                                const at::Tensor& v, size_t i, int64_t numel,
                                const at::Device* dev = nullptr) {
  check_tensor(p, "params", i, numel, dev);
  check_tensor(g, "grads", i, numel, dev);
  check_tensor(m, "exp_avgs", i, numel, dev);
  check_tensor(v, "exp_avg_sqs", i, numel, dev);
}

// masters[i] where one is given (masters not empty and entry i defined), else nullopt.
inline std::optional<at::Tensor> master_of(const c10::List<std::optional<at::Tensor>>& masters,
                                           size_t i) {
  if (masters.empty()) return std::nullopt;
  std::optional<at::Tensor> m = masters.get(i);
  if (m.has_value() && !m->defined()) return std::nullopt;
  return m;
}

// adam_step_'s lists: one entry per param each (max_exp_avg_sqs and masters where not empty),
// and grad_scale.
inline void check_adam_lists(size_t n, at::TensorList grads, at::TensorList exp_avgs,
                             at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
                             const c10::List<std::optional<at::Tensor>>& masters,
                             at::ArrayRef<double> step_sizes, at::ArrayRef<double> bc2_sqrts,
                             double grad_scale) {
  TORCH_CHECK(grads.size() == n, "adam_step_: grads has ", grads.size(), " tensors, params has ", n);
  TORCH_CHECK(exp_avgs.size() == n, "adam_step_: exp_avgs has ", exp_avgs.size(),
              " tensors, params has ", n);
  TORCH_CHECK(exp_avg_sqs.size() == n, "adam_step_: exp_avg_sqs has ", exp_avg_sqs.size(),
              " tensors, params has ", n);
  TORCH_CHECK(max_exp_avg_sqs.empty() || max_exp_avg_sqs.size() == n,
              "adam_step_: max_exp_avg_sqs must be empty (no amsgrad) or have one tensor per "
              "param, got ", max_exp_avg_sqs.size(), " for ", n, " params");
  TORCH_CHECK(masters.empty() || masters.size() == n,
              "adam_step_: masters must be empty or have one entry per param, got ",
              masters.size(), " for ", n, " params");
  TORCH_CHECK(step_sizes.size() == n && bc2_sqrts.size() == n,
              "adam_step_: step_sizes and bc2_sqrts need one value per param (", n, "), got ",
              step_sizes.size(), " and ", bc2_sqrts.size());
  check_grad_scale("adam_step_", grad_scale);
}

// adam_step_moments_'s codes of param i: bfloat16 / bfloat16, or int8 / uint8.
inline void check_moment_codes(const at::Tensor& m, const at::Tensor& v, bool int8, size_t i) {
  const at::ScalarType want_m = int8 ? at::kChar : at::kBFloat16;
  const at::ScalarType want_v = int8 ? at::kByte : at::kBFloat16;
  TORCH_CHECK(m.scalar_type() == want_m, "adam_step_moments_: exp_avgs[", i, "] must be ",
              want_m, ", got ", m.scalar_type());
  TORCH_CHECK(v.scalar_type() == want_v, "adam_step_moments_: exp_avg_sqs[", i, "] must be ",
              want_v, ", got ", v.scalar_type());
}

// adam_step_moments_'s int8 blocks of param i: `nb` fp32 scales each, and an offset in the
// parameter that is a multiple of kQBlock (blocks never straddle two calls).
inline void check_int8_blocks(const at::Tensor& exp_avg_scale, const at::Tensor& exp_avg_sq_scale,
                              int64_t offset, size_t i, int64_t nb,
                              const at::Device* dev = nullptr) {
  check_scales(exp_avg_scale, exp_avg_sq_scale, i, nb, dev);
  TORCH_CHECK(offset % kQBlock == 0, "adam_step_moments_: offsets[", i, "] = ", offset,
              " is not a multiple of ", kQBlock);
}

// adam_step_moments_'s kind: 1 (bf16) or 2 (int8).
inline MomentKind moment_kind(int64_t kind) {
  TORCH_CHECK(kind == static_cast<int64_t>(MomentKind::kBF16) ||
                  kind == static_cast<int64_t>(MomentKind::kInt8),
              "adam_step_moments_: kind must be 1 (bf16) or 2 (int8), got ", kind);
  return static_cast<MomentKind>(kind);
}

// adam_step_moments_'s lists: one entry per param each (the scales only for int8,
// max_exp_avg_sqs and masters where not empty), and grad_scale.
inline void check_moment_lists(size_t n, bool int8, at::TensorList grads,
                               at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                               at::TensorList exp_avg_scales,
                               at::TensorList exp_avg_sq_scales, at::TensorList max_exp_avg_sqs,
                               const c10::List<std::optional<at::Tensor>>& masters,
                               at::ArrayRef<double> step_sizes, at::ArrayRef<double> bc2_sqrts,
                               at::ArrayRef<int64_t> seeds_m, at::ArrayRef<int64_t> seeds_v,
                               at::ArrayRef<int64_t> offsets, double grad_scale) {
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
              "adam_step_moments_: grads, exp_avgs and exp_avg_sqs need one tensor per param (",
              n, "), got ", grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size());
  TORCH_CHECK(!int8 || (exp_avg_scales.size() == n && exp_avg_sq_scales.size() == n),
              "adam_step_moments_: int8 needs exp_avg_scales and exp_avg_sq_scales, one per param");
  TORCH_CHECK(max_exp_avg_sqs.empty() || max_exp_avg_sqs.size() == n,
              "adam_step_moments_: max_exp_avg_sqs must be empty or have one tensor per param");
  TORCH_CHECK(masters.empty() || masters.size() == n,
              "adam_step_moments_: masters must be empty or have one entry per param");
  TORCH_CHECK(step_sizes.size() == n && bc2_sqrts.size() == n && seeds_m.size() == n &&
                  seeds_v.size() == n && offsets.size() == n,
              "adam_step_moments_: step_sizes, bc2_sqrts, seeds and offsets need one value per param");
  check_grad_scale("adam_step_moments_", grad_scale);
}

}  // namespace checks
}  // namespace statestore
