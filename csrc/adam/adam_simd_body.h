// The SIMD body of the CPU Adam kernel, written once over a vector-traits class V
// (Avx2Ops in adam_avx2.cpp, Avx512Ops in adam_avx512.cpp).
//
// Include only from an ISA translation unit, AFTER its `#pragma GCC target(...)` and INSIDE an
// anonymous namespace: every function here is then compiled for that instruction set and
// stays local to the file (no inline symbol compiled for AVX-512 can be picked by the linker
// for code that runs on a processor without it).
//
// The body mirrors statestore::adam_update (csrc/adam_math.h) operation by operation; the
// tail of each range calls adam_element itself, so both give the same bits.

using statestore::AdamScalars;
using statestore::DType;
using statestore::AdamTensorArgs;

template <class V, DType D> struct VecIO;
template <class V> struct VecIO<V, DType::kF32> {
  static typename V::F load(const void* p, int64_t i) { return V::load(static_cast<const float*>(p) + i); }
  static void store(void* p, int64_t i, typename V::F x) { V::store(static_cast<float*>(p) + i, x); }
};
template <class V> struct VecIO<V, DType::kBF16> {
  static typename V::F load(const void* p, int64_t i) { return V::load_bf16(static_cast<const uint16_t*>(p) + i); }
  static void store(void* p, int64_t i, typename V::F x) { V::store_bf16(static_cast<uint16_t*>(p) + i, x); }
};
template <class V> struct VecIO<V, DType::kF16> {
  static typename V::F load(const void* p, int64_t i) { return V::load_f16(static_cast<const uint16_t*>(p) + i); }
  static void store(void* p, int64_t i, typename V::F x) { V::store_f16(static_cast<uint16_t*>(p) + i, x); }
};

// The vector form of statestore::adam_update: the same operations in the same order.
template <class V>
struct VecAdam {
  using F = typename V::F;
  F grad_mul, l2_decay, decay_mul, beta1_c, beta2, beta2_c, neg_step, inv_bc2_sqrt, eps;
  bool use_l2;
  explicit VecAdam(const AdamScalars& s)
      : grad_mul(V::set1(s.grad_mul)), l2_decay(V::set1(s.l2_decay)),
        decay_mul(V::set1(s.decay_mul)), beta1_c(V::set1(s.beta1_c)), beta2(V::set1(s.beta2)),
        beta2_c(V::set1(s.beta2_c)), neg_step(V::set1(s.neg_step_size)),
        inv_bc2_sqrt(V::set1(s.inv_bc2_sqrt)), eps(V::set1(s.eps)),
        use_l2(s.l2_decay != 0.0f) {}
  // w, m, v in: current values; out: updated. vmax_at: amsgrad's max_exp_avg_sq (W floats).
  // sqrt_v (optional): sqrt of the new v (the root of the denominator without amsgrad).
  template <bool kAmsgrad>
  inline void update(F& w, F g, F& m, F& v, float* vmax_at, F* sqrt_v = nullptr) const {
    g = V::mul(g, grad_mul);
    if (use_l2) g = V::fma(l2_decay, w, g);
    F wd = V::mul(w, decay_mul);
    F mn = V::fma(beta1_c, V::sub(g, m), m);
    F vn = V::fma(V::mul(beta2_c, g), g, V::mul(beta2, v));
    F vm = vn;
    if constexpr (kAmsgrad) {
      vm = V::max(V::load(vmax_at), vn);
      V::store(vmax_at, vm);
    }
    const F root = V::sqrt(vm);
    F d = V::fma(root, inv_bc2_sqrt, eps);
    w = V::fma(neg_step, V::div(mn, d), wd);
    m = mn;
    v = vn;
    if (sqrt_v != nullptr) *sqrt_v = kAmsgrad ? V::sqrt(vn) : root;
  }
};

template <class V>
struct SimdAdam {
  template <DType GD, DType PD, bool kAmsgrad>
  static void run(const AdamTensorArgs& a, int64_t begin, int64_t end) {
    using F = typename V::F;
    constexpr int64_t W = V::kWidth;
    const AdamScalars& s = a.s;
    const VecAdam<V> c(s);
    float* const wp = a.w;
    float* const mp = static_cast<float*>(a.m);
    float* const vp = static_cast<float*>(a.v);
    float* const vmaxp = a.vmax;
    constexpr int kGradBytes = GD == DType::kF32 ? 4 : 2;
    int64_t i = begin;
    for (; i + W <= end; i += W) {
      if (((i - begin) & 15) == 0 && i + statestore::cpu::kPrefetchElems < end) {
        statestore::cpu::prefetch_ahead<4>(wp, i);
        statestore::cpu::prefetch_ahead<kGradBytes>(a.g, i);
        statestore::cpu::prefetch_ahead<4>(mp, i);
        statestore::cpu::prefetch_ahead<4>(vp, i);
      }
      F w = V::load(wp + i);
      F g = VecIO<V, GD>::load(a.g, i);
      F m = V::load(mp + i);
      F v = V::load(vp + i);
      c.template update<kAmsgrad>(w, g, m, v, kAmsgrad ? vmaxp + i : nullptr);
      V::store(wp + i, w);
      V::store(mp + i, m);
      V::store(vp + i, v);
      if constexpr (PD != DType::kNone) VecIO<V, PD>::store(a.p_out, i, w);
    }
    for (; i < end; ++i) {
      statestore::adam_element<GD, PD, kAmsgrad>(i, a.w, a.g, mp, vp, a.vmax, a.p_out, s);
    }
  }
};

template <class U, U kExpMask>
bool simd_finite_bits(const U* p, int64_t begin, int64_t end) {
  constexpr int64_t kBlock = 4096;
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t e = b + kBlock < end ? b + kBlock : end;
    U bad = 0;
    for (int64_t i = b; i < e; ++i) bad |= static_cast<U>((p[i] & kExpMask) == kExpMask);
    if (bad) return false;
  }
  return true;
}

bool simd_finite(const void* data, DType dtype, int64_t begin, int64_t end) {
  switch (dtype) {
    case DType::kF32:
      return simd_finite_bits<uint32_t, 0x7f800000u>(static_cast<const uint32_t*>(data), begin, end);
    case DType::kF16:
      return simd_finite_bits<uint16_t, 0x7c00u>(static_cast<const uint16_t*>(data), begin, end);
    case DType::kBF16:
      return simd_finite_bits<uint16_t, 0x7f80u>(static_cast<const uint16_t*>(data), begin, end);
    case DType::kNone:
      break;
  }
  return true;
}
