// The Adam/AdamW update of one element, written once.
//
// Every kernel of statestore computes Adam with the functions of this header:
//   * the CPU scalar path (csrc/adam/adam_scalar.cpp) and the SIMD tails call adam_update();
//   * the SIMD bodies (csrc/adam/adam_simd_body.h) perform the same operations in the same
//     order, lane by lane, so an element gets the same bits whether it falls in a SIMD body
//     or in a tail, on any thread split;
//   * the CUDA kernel (csrc/cuda/fused_adam.cu) calls adam_update() from device code.
//
// The header is plain C++17 when no CUDA compiler is involved: it includes no CUDA header.
// Under nvcc, SS_HD expands to __host__ __device__.
//
// Every multiply-add that should be fused is written as an explicit fma (one rounding, on
// every ISA and on the GPU); nothing else is left for the compiler to contract (the CPU
// sources are also compiled with -ffp-contract=off).
#pragma once

#include <cstdint>
#include <cstring>
#include <cmath>

#if defined(__CUDACC__)
#define SS_HD __host__ __device__ __forceinline__
#else
#define SS_HD inline
#endif

namespace statestore {

// Scalars of one Adam step for one tensor; built once per tensor by the caller from the
// hyperparameters and the tensor's step count (bias correction is computed by the caller,
// in Python, never cached here).
struct AdamScalars {
  float grad_mul;      // (maximize ? -1 : 1) / grad_scale
  float l2_decay;      // weight_decay in L2 mode (torch.optim.Adam), else 0
  float decay_mul;     // 1 - lr * weight_decay in decoupled mode (AdamW), else 1
  float beta1_c;       // 1 - beta1 (weight of the lerp m -> g)
  float beta2;         // beta2
  float beta2_c;       // 1 - beta2
  float neg_step_size; // -lr / (1 - beta1^step)
  float inv_bc2_sqrt;  // 1 / sqrt(1 - beta2^step)
  float eps;
};

// Builds AdamScalars the way torch.optim.adam does (double math, then float).
SS_HD AdamScalars make_adam_scalars(double lr, double beta1, double beta2, double eps,
                                    double weight_decay, bool adamw_mode, bool maximize,
                                    double grad_scale, double step_size, double bc2_sqrt) {
  AdamScalars s;
  s.grad_mul = static_cast<float>((maximize ? -1.0 : 1.0) / grad_scale);
  s.l2_decay = adamw_mode ? 0.0f : static_cast<float>(weight_decay);
  s.decay_mul = adamw_mode ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  s.beta1_c = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.beta2_c = static_cast<float>(1.0 - beta2);
  s.neg_step_size = static_cast<float>(-step_size);
  s.inv_bc2_sqrt = static_cast<float>(1.0 / bc2_sqrt);
  s.eps = static_cast<float>(eps);
  return s;
}

SS_HD float ss_fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// max as x86's maxps computes it: a > b ? a : b (b when either is NaN).
SS_HD float ss_max(float a, float b) { return a > b ? a : b; }

// One element. w: the fp32 weight (the parameter itself or its fp32 master); g: the raw
// gradient, already converted to float; m, v: exp_avg, exp_avg_sq; vmax: max_exp_avg_sq, or
// nullptr without amsgrad.
//
// Operation order (each line one IEEE rounding, as the SIMD bodies do it):
//   g  = g * grad_mul                       unscale, negate for maximize
//   g  = fma(l2_decay, w, g)                L2 weight decay (skipped when 0, as in AdamW mode)
//   w  = w * decay_mul                      decoupled weight decay (1 in L2 mode: exact no-op)
//   m  = fma(1 - beta1, g - m, m)           m.lerp_(g, 1 - beta1)
//   v  = fma((1 - beta2) * g, g, beta2 * v) v.mul_(beta2).addcmul_(g, g, 1 - beta2)
//   vm = amsgrad ? max(vmax, v) : v         (vmax stored back)
//   d  = fma(sqrt(vm), 1 / bc2_sqrt, eps)   torch: sqrt(vm) / bc2_sqrt + eps
//   w  = fma(-step_size, m / d, w)          w.addcdiv_(m, d, -step_size)
//
// One square root and one division an element: they share the divider, the slowest unit of
// the step, and a second division made the AVX2 kernel compute-bound on one core. The
// multiply by the reciprocal changes d by at most an ulp or so against torch's division.
template <bool kAmsgrad>
SS_HD void adam_update(float& w, float g, float& m, float& v, float* vmax,
                       const AdamScalars& s) {
  g = g * s.grad_mul;
  if (s.l2_decay != 0.0f) g = ss_fma(s.l2_decay, w, g);  // skipped at 0: keeps inf weights inf
  float wd = w * s.decay_mul;
  float mn = ss_fma(s.beta1_c, g - m, m);
  float vn = ss_fma(s.beta2_c * g, g, s.beta2 * v);
  float vm = vn;
  if (kAmsgrad) {
    vm = ss_max(*vmax, vn);
    *vmax = vm;
  }
  float d = ss_fma(sqrtf(vm), s.inv_bc2_sqrt, s.eps);
  w = ss_fma(s.neg_step_size, mn / d, wd);
  m = mn;
  v = vn;
}

// ---- low-precision conversions, bit exact, round-to-nearest-even (as torch's .to()) ----

SS_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

SS_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

SS_HD float bf16_to_float(uint16_t b) { return bits_to_float(static_cast<uint32_t>(b) << 16); }

// c10::BFloat16's round_to_nearest_even: NaN -> 0x7FC0, else add 0x7FFF + lsb and truncate.
SS_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

SS_HD float fp16_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (e == 0x1f) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  if (e == 0) {
    // zero or subnormal: mant * 2^-24, exact in float
    float val = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -val : val;
  }
  return bits_to_float(sign | ((e + 112u) << 23) | (mant << 13));
}

// IEEE binary16, round to nearest even, overflow to inf; NaN keeps its top payload bits and
// is made quiet (as x86's vcvtps2ph does).
SS_HD uint16_t float_to_fp16(float f) {
  uint32_t x = float_to_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) {
    if (ax == 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u);
    return static_cast<uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
  }
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: inf
  if (ax < 0x38800000u) {                                              // < 2^-14: subnormal
    uint32_t e = ax >> 23;
    if (e < 102) return static_cast<uint16_t>(sign);                   // < 2^-25: zero
    uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e;                                         // 14 .. 24
    uint32_t q = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  uint32_t r = ax - 0x38000000u;  // rebias 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return static_cast<uint16_t>(sign | (r >> 13));
}

// Storage kinds a kernel reads or writes.
enum class DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2, kNone = 3 };

template <DType D> struct Storage;
template <> struct Storage<DType::kF32> {
  using T = float;
  static SS_HD float load(const T* p, int64_t i) { return p[i]; }
  static SS_HD void store(T* p, int64_t i, float x) { p[i] = x; }
};
template <> struct Storage<DType::kF16> {
  using T = uint16_t;
  static SS_HD float load(const T* p, int64_t i) { return fp16_to_float(p[i]); }
  static SS_HD void store(T* p, int64_t i, float x) { p[i] = float_to_fp16(x); }
};
template <> struct Storage<DType::kBF16> {
  using T = uint16_t;
  static SS_HD float load(const T* p, int64_t i) { return bf16_to_float(p[i]); }
  static SS_HD void store(T* p, int64_t i, float x) { p[i] = float_to_bf16(x); }
};

// Element i of one tensor: the whole update, reading each input once and writing each
// output once (the low-precision parameter copy in the same pass).
// GD: gradient storage. PD: storage of the low-precision parameter written back from the
// fp32 master, kNone when w is the parameter itself.
template <DType GD, DType PD, bool kAmsgrad>
SS_HD void adam_element(int64_t i, float* w, const void* g, float* m, float* v, float* vmax,
                        void* p_out, const AdamScalars& s) {
  float wi = w[i];
  float mi = m[i];
  float vi = v[i];
  float gi = Storage<GD>::load(static_cast<const typename Storage<GD>::T*>(g), i);
  adam_update<kAmsgrad>(wi, gi, mi, vi, kAmsgrad ? vmax + i : nullptr, s);
  w[i] = wi;
  m[i] = mi;
  v[i] = vi;
  if constexpr (PD != DType::kNone) {
    Storage<PD>::store(static_cast<typename Storage<PD>::T*>(p_out), i, wi);
  }
}

}  // namespace statestore
