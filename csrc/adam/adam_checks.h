// The `statestore::adam_` op's arguments, declared once and checked once for its CPU
// implementation (csrc/adam/adam_ops.cpp) and its CUDA one (csrc/cuda/fused_adam_binding.cpp):
// STATESTORE_ADAM_OP_PARAMS is the C++ parameter list of the schema (kAdamSchema), and
// adam_jobs() checks every argument and turns them into one AdamTensorArgs (adam_math.h) per
// non-empty tensor. ATen only, no CUDA header: the CPU build includes it. Messages open with
// the op's name ("adam_") and name the argument and index at fault.
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "adam_math.h"

namespace statestore {
namespace checks {

// One op for every Adam update: the moments' encoding is an argument (`moments`: "fp32",
// "bf16-nearest", "bf16-stochastic", "int8-nearest", "int8-stochastic"), the scalar
// hyperparameters travel as one struct (`hyper`: AdamHyper's nine doubles, adam_math.h), and
// the per-tensor values in lists of one entry per tensor: steps (each tensor's step count
// after this update, >= 1: the bias corrections are computed here, make_adam_scalars), seeds (two per tensor,
// exp_avg's then exp_avg_sq's: stochastic rounding; empty otherwise) and offsets (the index
// in its parameter of each tensor's first element; empty: all 0). exp_avg_scales /
// exp_avg_sq_scales: int8's block scales (empty otherwise); max_exp_avg_sqs: amsgrad's
// (empty: no amsgrad); masters: fp32 masters of low-precision params (empty, or None entries).
constexpr const char* kAdamSchema =
    "adam_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
    "Tensor(d!)[] exp_avg_scales, Tensor(e!)[] exp_avg_sq_scales, Tensor(f!)[] max_exp_avg_sqs, "
    "Tensor(g!)?[] masters, int[] steps, int[] seeds, int[] offsets, "
    "float[] hyper, str moments) -> ()";

#define STATESTORE_ADAM_OP_PARAMS                                                             \
  at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,                      \
      at::TensorList exp_avg_sqs, at::TensorList exp_avg_scales,                              \
      at::TensorList exp_avg_sq_scales, at::TensorList max_exp_avg_sqs,                       \
      const c10::List<std::optional<at::Tensor>>&masters, at::ArrayRef<int64_t> steps,       \
      at::ArrayRef<int64_t> seeds, at::ArrayRef<int64_t> offsets, at::ArrayRef<double> hyper, \
      c10::string_view moments
#define STATESTORE_ADAM_OP_ARGS                                                               \
  ::statestore::checks::AdamOpArgs {                                                          \
    params, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales, max_exp_avg_sqs, \
        masters, steps, seeds, offsets, hyper, moments                                        \
  }

struct AdamOpArgs {
  at::TensorList params, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales,
      max_exp_avg_sqs;
  const c10::List<std::optional<at::Tensor>>& masters;
  at::ArrayRef<int64_t> steps, seeds, offsets;
  at::ArrayRef<double> hyper;
  c10::string_view moments;
};

struct MomentCoding {
  MomentKind kind;
  bool stochastic;
};

// The encoding named by `moments`.
inline MomentCoding moment_coding(c10::string_view moments) {
  const std::string m(moments.data(), moments.size());
  if (m == "fp32") return {MomentKind::kF32, false};
  if (m == "bf16-nearest") return {MomentKind::kBF16, false};
  if (m == "bf16-stochastic") return {MomentKind::kBF16, true};
  if (m == "int8-nearest") return {MomentKind::kInt8, false};
  if (m == "int8-stochastic") return {MomentKind::kInt8, true};
  TORCH_CHECK(false, "adam_: moments must be fp32, bf16-nearest, bf16-stochastic, int8-nearest or "
              "int8-stochastic, got '", m, "'");
  return {MomentKind::kF32, false};
}

// What is wrong with a `hyper` argument (nullptr: nothing): kAdamHyperLen values, grad_scale
// positive and finite, the flags 0 or 1.
inline const char* hyper_problem(at::ArrayRef<double> h) {
  if (h.size() != static_cast<size_t>(kAdamHyperLen))
    return "hyper must hold 9 values (lr, beta1, beta2, eps, weight_decay, adamw_mode, "
           "maximize, grad_scale, amsgrad)";
  if (!(std::isfinite(h[7]) && h[7] > 0)) return "grad_scale must be a positive finite number";
  for (int k : {5, 6, 8}) {
    if (h[k] != 0.0 && h[k] != 1.0) return "adamw_mode, maximize and amsgrad must be 0 or 1";
  }
  return nullptr;
}

// The `hyper` argument as the struct it is (the same nine doubles), checked.
inline AdamHyper adam_hyper(at::ArrayRef<double> h) {
  const char* bad = hyper_problem(h);
  TORCH_CHECK(bad == nullptr, "adam_: ", bad, "; got ", h);
  AdamHyper hy;
  std::memcpy(&hy, h.data(), sizeof(hy));
  return hy;
}

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
                         const at::Device* dev) {
  TORCH_CHECK(t.defined(), "adam_: ", name, "[", i, "] is undefined");
  if (dev == nullptr) {
    TORCH_CHECK(t.device().is_cpu(), "adam_: ", name, "[", i, "] is on ", t.device(),
                ", expected cpu");
  } else {
    TORCH_CHECK(t.device() == *dev, "adam_: ", name, "[", i, "] is on ", t.device(),
                ", params[0] is on ", *dev);
  }
  TORCH_CHECK(t.is_contiguous(), "adam_: ", name, "[", i,
              "] is not contiguous; call .contiguous() or use the reference path");
  TORCH_CHECK(t.numel() == numel, "adam_: ", name, "[", i, "] has ", t.numel(),
              " elements, params[", i, "] has ", numel);
}

inline void check_dtype(const at::Tensor& t, at::ScalarType want, const char* name, size_t i) {
  TORCH_CHECK(t.scalar_type() == want, "adam_: ", name, "[", i, "] must be ", want, ", got ",
              t.scalar_type());
}

// The lists: one entry per param each (the optional ones empty where allowed).
inline void check_lists(const AdamOpArgs& a, const MomentCoding& mc) {
  const size_t n = a.params.size();
  TORCH_CHECK(a.grads.size() == n && a.exp_avgs.size() == n && a.exp_avg_sqs.size() == n,
              "adam_: grads, exp_avgs and exp_avg_sqs need one tensor per param (", n,
              "), got ", a.grads.size(), ", ", a.exp_avgs.size(), ", ", a.exp_avg_sqs.size());
  const bool int8 = mc.kind == MomentKind::kInt8;
  TORCH_CHECK(int8 ? (a.exp_avg_scales.size() == n && a.exp_avg_sq_scales.size() == n)
                   : (a.exp_avg_scales.empty() && a.exp_avg_sq_scales.empty()),
              "adam_: exp_avg_scales and exp_avg_sq_scales need one tensor per param with int8 "
              "moments and none otherwise, got ", a.exp_avg_scales.size(), " and ",
              a.exp_avg_sq_scales.size(), " for ", n, " params");
  TORCH_CHECK(a.max_exp_avg_sqs.empty() || a.max_exp_avg_sqs.size() == n,
              "adam_: max_exp_avg_sqs must be empty (no amsgrad) or have one tensor per param, "
              "got ", a.max_exp_avg_sqs.size(), " for ", n, " params");
  TORCH_CHECK(a.masters.empty() || a.masters.size() == n,
              "adam_: masters must be empty or have one entry per param, got ", a.masters.size(),
              " for ", n, " params");
  TORCH_CHECK(a.steps.size() == n, "adam_: steps need one value per param (", n, "), got ",
              a.steps.size());
  TORCH_CHECK(a.seeds.size() == 2 * n || (a.seeds.empty() && !mc.stochastic),
              "adam_: seeds need two values per param (", 2 * n, ") with stochastic rounding, "
              "got ", a.seeds.size());
  TORCH_CHECK(a.offsets.empty() || a.offsets.size() == n,
              "adam_: offsets must be empty or have one value per param, got ",
              a.offsets.size(), " for ", n, " params");
}

// Checks every argument and returns one AdamTensorArgs per param with elements, on `dev`
// (nullptr: the CPU; else every tensor must be on *dev).
inline std::vector<AdamTensorArgs> adam_jobs(const AdamOpArgs& a, const at::Device* dev) {
  const MomentCoding mc = moment_coding(a.moments);
  const AdamHyper hy = adam_hyper(a.hyper);
  check_lists(a, mc);
  const size_t n = a.params.size();
  const bool amsgrad = !a.max_exp_avg_sqs.empty();
  TORCH_CHECK(n == 0 || amsgrad == (hy.amsgrad != 0.0), "adam_: hyper's amsgrad is ", hy.amsgrad,
              " but max_exp_avg_sqs ", amsgrad ? "has" : "has no", " tensors");
  std::vector<AdamTensorArgs> jobs;
  jobs.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = a.params[i];
    const int64_t numel = p.numel();
    check_tensor(p, "params", i, numel, dev);
    check_tensor(a.grads[i], "grads", i, numel, dev);
    check_tensor(a.exp_avgs[i], "exp_avgs", i, numel, dev);
    check_tensor(a.exp_avg_sqs[i], "exp_avg_sqs", i, numel, dev);
    AdamTensorArgs t{};
    t.kind = mc.kind;
    t.stochastic = mc.stochastic;
    switch (mc.kind) {
      case MomentKind::kF32:
        check_dtype(a.exp_avgs[i], at::kFloat, "exp_avgs", i);
        check_dtype(a.exp_avg_sqs[i], at::kFloat, "exp_avg_sqs", i);
        break;
      case MomentKind::kBF16:
        check_dtype(a.exp_avgs[i], at::kBFloat16, "exp_avgs", i);
        check_dtype(a.exp_avg_sqs[i], at::kBFloat16, "exp_avg_sqs", i);
        break;
      case MomentKind::kInt8: {
        check_dtype(a.exp_avgs[i], at::kChar, "exp_avgs", i);
        check_dtype(a.exp_avg_sqs[i], at::kByte, "exp_avg_sqs", i);
        const int64_t nb = (numel + kQBlock - 1) / kQBlock;
        check_tensor(a.exp_avg_scales[i], "exp_avg_scales", i, nb, dev);
        check_tensor(a.exp_avg_sq_scales[i], "exp_avg_sq_scales", i, nb, dev);
        check_dtype(a.exp_avg_scales[i], at::kFloat, "exp_avg_scales", i);
        check_dtype(a.exp_avg_sq_scales[i], at::kFloat, "exp_avg_sq_scales", i);
        t.m_scale = a.exp_avg_scales[i].data_ptr<float>();
        t.v_scale = a.exp_avg_sq_scales[i].data_ptr<float>();
        break;
      }
    }
    t.offset = a.offsets.empty() ? 0 : a.offsets[i];
    TORCH_CHECK(mc.kind != MomentKind::kInt8 || t.offset % kQBlock == 0, "adam_: offsets[", i,
                "] = ", t.offset, " is not a multiple of ", kQBlock);
    TORCH_CHECK(t.offset >= 0, "adam_: offsets[", i, "] = ", t.offset, " is negative");
    if (!a.seeds.empty()) {
      t.seed_m = static_cast<uint32_t>(a.seeds[2 * i]);
      t.seed_v = static_cast<uint32_t>(a.seeds[2 * i + 1]);
    }
    t.g_dtype = storage_of(a.grads[i].scalar_type());
    TORCH_CHECK(t.g_dtype != DType::kNone, "adam_: grads[", i,
                "] must be float32, float16 or bfloat16, got ", a.grads[i].scalar_type());
    if (amsgrad) {
      check_tensor(a.max_exp_avg_sqs[i], "max_exp_avg_sqs", i, numel, dev);
      check_dtype(a.max_exp_avg_sqs[i], at::kFloat, "max_exp_avg_sqs", i);
      t.vmax = a.max_exp_avg_sqs[i].data_ptr<float>();
    }
    std::optional<at::Tensor> master;
    if (!a.masters.empty()) {
      master = a.masters.get(i);
      if (master.has_value() && !master->defined()) master.reset();
    }
    if (master.has_value()) {
      check_tensor(*master, "masters", i, numel, dev);
      check_dtype(*master, at::kFloat, "masters", i);
      t.p_dtype = storage_of(p.scalar_type());
      TORCH_CHECK(t.p_dtype != DType::kNone, "adam_: params[", i,
                  "] (with an fp32 master) must be float32, float16 or bfloat16, got ",
                  p.scalar_type());
      t.w = master->data_ptr<float>();
      t.p_out = p.data_ptr();
    } else {
      TORCH_CHECK(p.scalar_type() == at::kFloat, "adam_: params[", i, "] is ", p.scalar_type(),
                  " without an fp32 master; pass masters[", i, "]");
      t.p_dtype = DType::kNone;
      t.w = p.data_ptr<float>();
      t.p_out = nullptr;
    }
    t.g = a.grads[i].data_ptr();
    t.m = a.exp_avgs[i].data_ptr();
    t.v = a.exp_avg_sqs[i].data_ptr();
    t.n = numel;
    TORCH_CHECK(make_adam_scalars(hy, a.steps[i], &t.s), "adam_: steps[", i, "] = ",
                a.steps[i], ": step counts start at 1 (the count after this update), and "
                "1 - beta1^step must not be 0 nor 1 - beta2^step negative (beta1 = ", hy.beta1,
                ", beta2 = ", hy.beta2, ")");
    if (numel > 0) jobs.push_back(t);
  }
  return jobs;
}

}  // namespace checks
}  // namespace statestore
