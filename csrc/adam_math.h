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

// Scalars of one Adam step for one tensor, built once per tensor and step by
// make_adam_scalars() below from the call's AdamHyper and the tensor's step count.
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

// The hyperparameters of one Adam op call. The op's `float[] hyper` argument is exactly these
// nine doubles in this order, and Python's statestore.kernels.AdamHyper is the same tuple
// (statestore/kernels/_dispatch.py), passed to the op as it is: one form on both sides of the
// call. The flags are 0.0 or 1.0; amsgrad must agree with the op's max_exp_avg_sqs.
struct AdamHyper {
  double lr, beta1, beta2, eps, weight_decay, adamw_mode, maximize, grad_scale, amsgrad;
};
constexpr int kAdamHyperLen = 9;
static_assert(sizeof(AdamHyper) == kAdamHyperLen * sizeof(double),
              "AdamHyper is the op's float[] hyper, nine doubles");

// Builds AdamScalars the way torch.optim.adam does for a tensor whose step count after this
// update is `step` (>= 1): the bias corrections in double with libm's pow, as Python's
// `beta ** step` computes them, the step size lr / (1 - beta1^step), then each value rounded
// to float once. Returns false where the bias correction is degenerate (1 - beta1^step == 0,
// or 1 - beta2^step negative or NaN). Host code (libm): the kernels receive the result.
inline bool make_adam_scalars(const AdamHyper& h, int64_t step, AdamScalars* out) {
  const double s = static_cast<double>(step);
  const double bc1 = 1.0 - std::pow(h.beta1, s);
  const double bc2 = 1.0 - std::pow(h.beta2, s);
  if (step < 1 || bc1 == 0.0 || !(bc2 >= 0.0)) return false;
  const bool adamw = h.adamw_mode != 0.0;
  AdamScalars& r = *out;
  r.grad_mul = static_cast<float>((h.maximize != 0.0 ? -1.0 : 1.0) / h.grad_scale);
  r.l2_decay = adamw ? 0.0f : static_cast<float>(h.weight_decay);
  r.decay_mul = adamw ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  r.beta1_c = static_cast<float>(1.0 - h.beta1);
  r.beta2 = static_cast<float>(h.beta2);
  r.beta2_c = static_cast<float>(1.0 - h.beta2);
  r.neg_step_size = static_cast<float>(-(h.lr / bc1));
  r.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  r.eps = static_cast<float>(h.eps);
  return true;
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


// ---- compressed moments (moment_dtype "bf16" / "int8"), written once ----------------------
//
// The encodings of statestore/kernels/_quant.py (its docstring and docs/moments.md specify
// them); every function below performs the same float32 operations in the same order as that
// torch reference, so both give the same codes. The SIMD bodies (adam_moments_body.h) and the
// CUDA kernel (fused_adam.cu) call these functions or mirror them operation by operation.

// The encoding of exp_avg / exp_avg_sq (the op's `moments` argument: "fp32", "bf16-..." or
// "int8-...").
enum class MomentKind : int32_t { kF32 = 0, kBF16 = 1, kInt8 = 2 };

constexpr int kQBlock = 256;                    // elements per int8 block (one fp32 scale)
// int8 codes are 8-bit floats relative to the block's scale (no inf/nan, exponent bias 15):
// exp_avg E4M3 (kMBitsM mantissa bits; |c| <= 127), sqrt(exp_avg_sq) E4M4 (kMBitsV; 0..255).
constexpr int kMBitsM = 3;
constexpr int kMBitsV = 4;
constexpr float kScaleFloor = 2.35098870164457501594e-38f;  // 2^-125: smaller blocks -> zeros
// 1 / val(127) and 1 / val(255) rounded down (so that top * (1/top) <= 1 - 2^-24: the
// block's largest value decodes to at most itself, and FLT_MAX stays finite)
constexpr float kInvTopM = 0x1.111110p-1f;   // 0.53333330 < 1 / 1.875
constexpr float kInvTopV = 0x1.08420ep-1f;   // 0.51612896 < 1 / 1.9375
constexpr float k2m14 = 6.103515625e-05f;                 // 2^-14: the smallest normal code
constexpr float kFltMax = 3.40282346638528859812e+38f;
constexpr float k2m24 = 5.9604644775390625e-08f;         // 2^-24

// Counter-based hash of element i (its index in the parameter, low 32 bits) under a
// per-tensor, per-step seed: the random bits of stochastic rounding. Two multiply-xorshift
// rounds (constants from Wellons' hash search), after a Weyl step over the index.
SS_HD uint32_t ss_mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}
SS_HD uint32_t ss_hash32(uint32_t seed, uint32_t i) { return ss_mix32(i * 0x9E3779B1u + seed); }

// Uniform in [0, 1) from 24 hash bits (exact in float).
SS_HD float ss_uniform(uint32_t h) { return static_cast<float>(h >> 8) * k2m24; }

// bf16 with stochastic rounding: add 16 random bits below the kept ones, truncate.
SS_HD uint16_t float_to_bf16_sr(float f, uint32_t h) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + (h >> 16)) >> 16);
}

SS_HD float ss_absf(float x) { return bits_to_float(float_to_bits(x) & 0x7fffffffu); }

// The 8-bit float with MB mantissa bits: val(k), k = e * 2^MB + f, is 2^(e-15) (1 + f/2^MB)
// for e >= 1 and f * 2^-(14+MB) for e = 0 (continuous at k = 2^MB: 2^-14). Exact in float.
template <int MB>
SS_HD float f8_val(uint32_t k) {
  constexpr float kSubStep = 1.0f / static_cast<float>(1u << (14 + MB));
  return k < (1u << MB) ? static_cast<float>(k) * kSubStep
                        : bits_to_float((k + ((127u - 15u) << MB)) << (23 - MB));
}

// Code of a ratio r >= 0 (finite): nearest (round half to even on r's mantissa; below 2^-14,
// floor(r 2^(14+MB) + 0.5)) or stochastic (the top 23-MB bits of h added below the kept
// mantissa bits, then truncated; below 2^-14, floor(r 2^(14+MB) + ss_uniform(h))); clamped
// to the largest code.
template <int MB>
SS_HD uint32_t f8_code(float r, uint32_t h, bool stochastic) {
  constexpr int kDrop = 23 - MB;
  constexpr uint32_t kKMax = (1u << (MB + 4)) - 1u;
  constexpr float kSubMul = static_cast<float>(1u << (14 + MB));
  uint32_t k;
  if (r < k2m14) {
    const float u = stochastic ? ss_uniform(h) : 0.5f;
    k = static_cast<uint32_t>(static_cast<int>(floorf(r * kSubMul + u)));
  } else {
    const uint32_t bits = float_to_bits(r);
    const uint32_t add = stochastic ? (h >> (32 - kDrop))
                                    : ((1u << (kDrop - 1)) - 1u + ((bits >> kDrop) & 1u));
    k = ((bits + add) >> kDrop) - ((127u - 15u) << MB);
  }
  return k > kKMax ? kKMax : k;
}

// Decoding: exp_avg = sign(c) val_E4M3(|c|) scale; exp_avg_sq = (val_E4M4(c) scale)^2.
SS_HD float decode_m8(int8_t c, float scale) {
  const int ci = static_cast<int>(c);
  const float v = f8_val<kMBitsM>(static_cast<uint32_t>(ci < 0 ? -ci : ci)) * scale;
  return ci < 0 ? -v : v;
}
SS_HD float decode_v8(uint8_t c, float scale) {
  const float t = f8_val<kMBitsV>(c) * scale;
  return t * t;
}

// A block's stored scale and its reciprocal the codes are computed with, from the largest
// finite magnitude of its new values (exp_avg; for exp_avg_sq, of their square roots) and
// whether all were finite: a non-finite block gets scale NaN, a block below 2^-125 scale 0;
// both then get codes 0 (encode_block_ok false).
struct QScale {
  float scale;
  float inv;
};
SS_HD QScale make_qscale(float absmax, bool finite, float inv_top) {
  QScale q;
  if (!finite) {
    q.scale = bits_to_float(0x7fc00000u);
  } else {
    q.scale = absmax < kScaleFloor ? 0.0f : absmax * inv_top;
  }
  q.inv = q.scale > 0.0f ? 1.0f / q.scale : 0.0f;
  return q;
}
SS_HD QScale make_qscale_m(float absmax, bool finite) {
  return make_qscale(absmax, finite, kInvTopM);
}
// absmax_v: the block's largest exp_avg_sq (its square root is the largest sqrt: sqrt is
// monotonic and correctly rounded)
SS_HD QScale make_qscale_v(float absmax_v, bool finite) {
  return make_qscale(sqrtf(absmax_v), finite, kInvTopV);
}
SS_HD bool encode_block_ok(const QScale& q) { return q.scale > 0.0f; }

// Codes, for a block with encode_block_ok; h: the element's hash (used when stochastic).
SS_HD int8_t encode_m8(float x, float inv, uint32_t h, bool stochastic) {
  const int k = static_cast<int>(f8_code<kMBitsM>(ss_absf(x) * inv, h, stochastic));
  return static_cast<int8_t>(x < 0.0f ? -k : k);
}
// exp_avg_sq from sv = sqrt(v), the root the update computes anyway.
SS_HD uint8_t encode_v8(float sv, float inv, uint32_t h, bool stochastic) {
  return static_cast<uint8_t>(f8_code<kMBitsV>(ss_absf(sv) * inv, h, stochastic));
}

// Magnitude bookkeeping of a block's new values: the largest finite magnitude (NaN never
// wins a comparison) and whether every value was finite.
SS_HD void absmax_step(float x, float& absmax, bool& finite) {
  const float a = ss_absf(x);
  absmax = a > absmax ? a : absmax;
  finite = finite && (a <= kFltMax);
}

// The overflow rule of int8 moments. A finite gradient whose square overflows float32
// (|g| above about 5.8e20 with beta2 = 0.999) makes exp_avg_sq +inf, in torch's AdamW as here;
// the element's update m / inf is 0 in this step (computed before this rule applies) and, in
// torch, in every later one. int8 codes have no infinity, and a block holding a non-finite
// value is stored as NaN, which would turn a finite input into 256 NaN parameters. So, in a
// block whose new exp_avg are all finite (no non-finite input reached it), each exp_avg_sq
// that is +inf is stored as FLT_MAX and that element's exp_avg as +0: its later updates are
// (new exp_avg) / (sqrt(FLT_MAX) / bc2_sqrt + eps), about 0 as torch's are 0, and the block's
// other elements stay finite. A NaN exp_avg_sq stays NaN (scale NaN), and a block with a
// non-finite exp_avg is unchanged: both come from non-finite inputs. The rule is applied only
// to a block that would otherwise be stored as NaN, so no block stored finite before it
// changes by a bit.
//
// Per element, on the new exp_avg_sq (the CUDA kernel):
SS_HD void int8_saturate_v(float& mn, float& vn) {
  if (vn > kFltMax) {
    vn = kFltMax;
    mn = 0.0f;
  }
}
// Per block, on the square roots of the new exp_avg_sq (the CPU paths keep those): mt, st
// hold the block's n new exp_avg and sqrt(exp_avg_sq) (sqrt is monotonic and correctly
// rounded: sqrt(v) is +inf exactly where v is, and the largest root is the root of the
// largest v, so the scales are those make_qscale_v gives for the saturated values); returns
// the block's scales.
SS_HD void int8_saturate_block(float* mt, float* st, int64_t n, QScale& qm, QScale& qv) {
  const float root_max = sqrtf(kFltMax);
  float am = 0.0f, as = 0.0f;
  bool fm = true, fs = true;
  for (int64_t j = 0; j < n; ++j) {
    if (st[j] > kFltMax) {
      st[j] = root_max;
      mt[j] = 0.0f;
    }
    absmax_step(mt[j], am, fm);
    absmax_step(st[j], as, fs);
  }
  qm = make_qscale_m(am, fm);
  qv = make_qscale(as, fs, kInvTopV);
}

// One tensor of an Adam step, as raw pointers: the unit of work of every kernel (CPU SIMD and
// scalar, CUDA), whatever the moments' encoding. Filled and checked once, for CPU and CUDA,
// by statestore::checks::adam_jobs (csrc/adam/adam_checks.h).
struct AdamTensorArgs {
  float* w;            // fp32 weight (the parameter or its fp32 master)
  const void* g;       // gradient (g_dtype)
  void* m;             // exp_avg: fp32, bf16 (uint16) or int8 codes, as `kind` says
  void* v;             // exp_avg_sq: fp32, bf16 (uint16) or uint8 codes
  float* m_scale;      // int8: one scale per block of kQBlock elements, else nullptr
  float* v_scale;
  float* vmax;         // amsgrad's max_exp_avg_sq (fp32), or nullptr
  void* p_out;         // low-precision parameter written from w, or nullptr
  DType g_dtype;
  DType p_dtype;       // kNone when p_out is nullptr
  MomentKind kind;
  bool stochastic;     // bf16 / int8: stochastic rounding, else nearest
  uint32_t seed_m;     // the random bits' seeds (stochastic rounding)
  uint32_t seed_v;
  int64_t offset;      // index in the parameter of element 0 (int8: a multiple of kQBlock)
  int64_t n;
  AdamScalars s;
};

// One element of a bf16-moment tensor: decode, update, re-encode.
template <DType GD, DType PD, bool kAmsgrad>
SS_HD void adam_element_bf16m(int64_t i, const AdamTensorArgs& a) {
  uint16_t* m = static_cast<uint16_t*>(a.m);
  uint16_t* v = static_cast<uint16_t*>(a.v);
  float wi = a.w[i];
  float mi = bf16_to_float(m[i]);
  float vi = bf16_to_float(v[i]);
  float gi = Storage<GD>::load(static_cast<const typename Storage<GD>::T*>(a.g), i);
  adam_update<kAmsgrad>(wi, gi, mi, vi, kAmsgrad ? a.vmax + i : nullptr, a.s);
  a.w[i] = wi;
  if (a.stochastic) {
    const uint32_t idx = static_cast<uint32_t>(a.offset + i);
    m[i] = float_to_bf16_sr(mi, ss_hash32(a.seed_m, idx));
    v[i] = float_to_bf16_sr(vi, ss_hash32(a.seed_v, idx));
  } else {
    m[i] = float_to_bf16(mi);
    v[i] = float_to_bf16(vi);
  }
  if constexpr (PD != DType::kNone) {
    Storage<PD>::store(static_cast<typename Storage<PD>::T*>(a.p_out), i, wi);
  }
}

// Phase 1 of an int8 element: decode with the block's old scales, update; returns the new
// fp32 moments in mn, vn (kept in a block-sized buffer by the caller).
template <DType GD, DType PD, bool kAmsgrad>
SS_HD void adam_element_int8_update(int64_t i, const AdamTensorArgs& a, float scale_m,
                                    float scale_v, float& mn, float& vn) {
  float wi = a.w[i];
  mn = decode_m8(static_cast<const int8_t*>(a.m)[i], scale_m);
  vn = decode_v8(static_cast<const uint8_t*>(a.v)[i], scale_v);
  float gi = Storage<GD>::load(static_cast<const typename Storage<GD>::T*>(a.g), i);
  adam_update<kAmsgrad>(wi, gi, mn, vn, kAmsgrad ? a.vmax + i : nullptr, a.s);
  a.w[i] = wi;
  if constexpr (PD != DType::kNone) {
    Storage<PD>::store(static_cast<typename Storage<PD>::T*>(a.p_out), i, wi);
  }
}

// Phase 2 of an int8 element: its codes from the block's new scales; sv = sqrt(vn).
SS_HD void encode_element_int8(int64_t i, const AdamTensorArgs& a, const QScale& qm,
                               const QScale& qv, float mn, float sv) {
  const uint32_t idx = static_cast<uint32_t>(a.offset + i);
  const uint32_t hm = a.stochastic ? ss_hash32(a.seed_m, idx) : 0u;
  const uint32_t hv = a.stochastic ? ss_hash32(a.seed_v, idx) : 0u;
  static_cast<int8_t*>(a.m)[i] =
      encode_block_ok(qm) ? encode_m8(mn, qm.inv, hm, a.stochastic) : int8_t(0);
  static_cast<uint8_t*>(a.v)[i] =
      encode_block_ok(qv) ? encode_v8(sv, qv.inv, hv, a.stochastic) : uint8_t(0);
}

// One whole int8 block [b, e) (e - b <= kQBlock, b a multiple of kQBlock), sequentially:
// the CPU scalar path. mt, vt: block-sized buffers (vt keeps sqrt of the new exp_avg_sq).
template <DType GD, DType PD, bool kAmsgrad>
SS_HD void adam_block_int8(const AdamTensorArgs& a, int64_t b, int64_t e, float* mt,
                           float* vt) {
  const int64_t blk = b / kQBlock;
  const float sm = a.m_scale[blk], sv = a.v_scale[blk];
  float am = 0.0f, av = 0.0f;
  bool fm = true, fv = true;
  for (int64_t i = b; i < e; ++i) {
    adam_element_int8_update<GD, PD, kAmsgrad>(i, a, sm, sv, mt[i - b], vt[i - b]);
    absmax_step(mt[i - b], am, fm);
    absmax_step(vt[i - b], av, fv);
    vt[i - b] = sqrtf(vt[i - b]);
  }
  QScale qm, qv;
  if (fm && !fv) {
    int8_saturate_block(mt, vt, e - b, qm, qv);   // the overflow rule (rare)
  } else {
    qm = make_qscale_m(am, fm);
    qv = make_qscale_v(av, fv);
  }
  a.m_scale[blk] = qm.scale;
  a.v_scale[blk] = qv.scale;
  for (int64_t i = b; i < e; ++i) encode_element_int8(i, a, qm, qv, mt[i - b], vt[i - b]);
}

}  // namespace statestore
