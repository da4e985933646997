// The SIMD body of the compressed-moment Adam kernel (moment_dtype "bf16" / "int8"), written
// once over a vector-traits class V (Avx2Ops, Avx512Ops). Include only from an ISA
// translation unit, after adam_simd_body.h, inside its anonymous namespace (see there).
//
// Every vector operation mirrors the scalar functions of csrc/adam_math.h (decode_m8,
// decode_v8 (f8_val), adam_update, make_qscale_m/_v, encode_m8, encode_v8 (f8_code),
// float_to_bf16_sr, ss_hash32)
// operation by operation; the elements that do not fill a vector call those functions, so
// an element gets the same bits on every path. int8 works block by block: pass 1 decodes with
// the block's old scales, updates, writes w and keeps the new fp32 moments of the block (256
// floats each, on the stack: never a temporary of a whole tensor); pass 2 takes the block's
// new scales from their largest magnitudes and writes the codes (exp_avg_sq from the square
// root of its new value, which the update computed for its denominator: one root saved).

using statestore::MomentKind;
using statestore::MomentTensorArgs;
using statestore::QScale;

template <class V>
struct VecHash {
  using I = typename V::I;
  // statestore::ss_hash32 on W lanes of consecutive indices starting at `first`.
  static I lanes(uint32_t seed, uint32_t first) {
    I x = V::addi(V::seti(first), V::iota());
    x = V::addi(V::mullo(x, V::seti(0x9E3779B1u)), V::seti(seed));
    x = V::xori(x, V::template srli<16>(x));
    x = V::mullo(x, V::seti(0x7FEB352Du));
    x = V::xori(x, V::template srli<15>(x));
    x = V::mullo(x, V::seti(0x846CA68Bu));
    x = V::xori(x, V::template srli<16>(x));
    return x;
  }
  // statestore::ss_uniform
  static typename V::F uniform(I h) {
    return V::mul(V::cvt_i2f(V::template srli<8>(h)), V::set1(statestore::k2m24));
  }
};

// The 8-bit floats of int8 moments on W lanes (statestore::f8_val, statestore::f8_code).
template <class V>
struct VecF8 {
  using F = typename V::F;
  using I = typename V::I;
  // val(k) of codes k, given as floats cf (0 .. 2^(MB+4) - 1, exact)
  template <int MB>
  static F val(F cf) {
    const I k = V::cvtt_f2i(cf);
    const F normal = V::casti(V::template slli<23 - MB>(V::addi(k, V::seti((127u - 15u) << MB))));
    const F sub = V::mul(cf, V::set1(1.0f / static_cast<float>(1u << (14 + MB))));
    return V::select_lt(cf, V::set1(static_cast<float>(1u << MB)), sub, normal);
  }
  // codes of ratios r >= 0; h: the lanes' hashes (read when stochastic)
  template <int MB>
  static I code(F r, I h, bool stochastic) {
    constexpr int kDrop = 23 - MB;
    const I bits = V::castf(r);
    const I add = stochastic
        ? V::template srli<32 - kDrop>(h)
        : V::addi(V::seti((1u << (kDrop - 1)) - 1u), V::andi(V::template srli<kDrop>(bits), V::seti(1u)));
    const I kn = V::subi(V::template srli<kDrop>(V::addi(bits, add)), V::seti((127u - 15u) << MB));
    const F u = stochastic ? VecHash<V>::uniform(h) : V::set1(0.5f);
    const F y = V::add(V::mul(r, V::set1(static_cast<float>(1u << (14 + MB)))), u);
    const I ks = V::cvtt_f2i(V::floor(y));
    const I k = V::select_lt_i(r, V::set1(statestore::k2m14), ks, kn);
    return V::minu(k, V::seti((1u << (MB + 4)) - 1u));
  }
};

template <class V>
struct SimdMoments {
  using F = typename V::F;
  using I = typename V::I;
  static constexpr int64_t W = V::kWidth;

  template <DType GD, DType PD, bool kAmsgrad, MomentKind MK>
  static void run(const MomentTensorArgs& a, int64_t begin, int64_t end) {
    if constexpr (MK == MomentKind::kBF16) {
      run_bf16<GD, PD, kAmsgrad>(a, begin, end);
    } else {
      alignas(64) float mt[statestore::kQBlock];
      alignas(64) float vt[statestore::kQBlock];
      for (int64_t b = begin; b < end; b += statestore::kQBlock) {
        const int64_t e = b + statestore::kQBlock < end ? b + statestore::kQBlock : end;
        block_int8<GD, PD, kAmsgrad>(a, b, e, mt, vt);
      }
    }
  }

  template <DType GD, DType PD, bool kAmsgrad>
  static void run_bf16(const MomentTensorArgs& a, int64_t begin, int64_t end) {
    const VecAdam<V> c(a.s);
    uint16_t* const mp = static_cast<uint16_t*>(a.m);
    uint16_t* const vp = static_cast<uint16_t*>(a.v);
    int64_t i = begin;
    for (; i + W <= end; i += W) {
      F w = V::load(a.w + i);
      F g = VecIO<V, GD>::load(a.g, i);
      F m = V::load_bf16(mp + i);
      F v = V::load_bf16(vp + i);
      c.template update<kAmsgrad>(w, g, m, v, kAmsgrad ? a.vmax + i : nullptr);
      V::store(a.w + i, w);
      if (a.stochastic) {
        const uint32_t first = static_cast<uint32_t>(a.offset + i);
        V::store_bf16_sr(mp + i, m, VecHash<V>::lanes(a.seed_m, first));
        V::store_bf16_sr(vp + i, v, VecHash<V>::lanes(a.seed_v, first));
      } else {
        V::store_bf16(mp + i, m);
        V::store_bf16(vp + i, v);
      }
      if constexpr (PD != DType::kNone) VecIO<V, PD>::store(a.p_out, i, w);
    }
    for (; i < end; ++i) statestore::adam_element_bf16m<GD, PD, kAmsgrad>(i, a);
  }

  static float hmax(F x, float acc) {
    alignas(64) float t[W];
    V::store(t, x);
    for (int64_t j = 0; j < W; ++j) acc = t[j] > acc ? t[j] : acc;
    return acc;
  }

  template <DType GD, DType PD, bool kAmsgrad>
  static void block_int8(const MomentTensorArgs& a, int64_t b, int64_t e, float* mt, float* vt) {
    const VecAdam<V> c(a.s);
    const int64_t blk = b / statestore::kQBlock;
    const float sm = a.m_scale[blk], sv = a.v_scale[blk];
    const int8_t* const mc = static_cast<const int8_t*>(a.m);
    const uint8_t* const vc = static_cast<const uint8_t*>(a.v);
    const F smv = V::set1(sm), svv = V::set1(sv);
    const I sign = V::seti(0x80000000u);
    const F fmax = V::set1(statestore::kFltMax);
    F am = V::set1(0.0f), av = V::set1(0.0f);
    bool fm = true, fv = true;
    // pass 1: decode, update, keep the new moments
    int64_t i = b;
    for (; i + W <= e; i += W) {
      F w = V::load(a.w + i);
      F g = VecIO<V, GD>::load(a.g, i);
      const F cm = V::load_i8(mc + i);
      F m = V::mul(VecF8<V>::template val<statestore::kMBitsM>(V::abs(cm)), smv);
      m = V::casti(V::xori(V::castf(m), V::andi(V::castf(cm), sign)));   // -m where c < 0
      const F cv = V::load_u8(vc + i);
      const F t = V::mul(VecF8<V>::template val<statestore::kMBitsV>(cv), svv);
      F v = V::mul(t, t);
      F sv;
      c.template update<kAmsgrad>(w, g, m, v, kAmsgrad ? a.vmax + i : nullptr, &sv);
      V::store(a.w + i, w);
      if constexpr (PD != DType::kNone) VecIO<V, PD>::store(a.p_out, i, w);
      V::store(mt + (i - b), m);
      V::store(vt + (i - b), sv);
      const F ma = V::abs(m), va = V::abs(v);
      am = V::max(ma, am);
      av = V::max(va, av);
      fm = fm && V::all_le(ma, fmax);
      fv = fv && V::all_le(va, fmax);
    }
    float amx = hmax(am, 0.0f), avx = hmax(av, 0.0f);
    for (; i < e; ++i) {
      statestore::adam_element_int8_update<GD, PD, kAmsgrad>(i, a, sm, sv, mt[i - b], vt[i - b]);
      statestore::absmax_step(mt[i - b], amx, fm);
      statestore::absmax_step(vt[i - b], avx, fv);
      vt[i - b] = sqrtf(vt[i - b]);
    }
    const QScale qm = statestore::make_qscale_m(amx, fm), qv = statestore::make_qscale_v(avx, fv);
    a.m_scale[blk] = qm.scale;
    a.v_scale[blk] = qv.scale;
    // pass 2: codes
    int8_t* const mo = static_cast<int8_t*>(a.m);
    uint8_t* const vo = static_cast<uint8_t*>(a.v);
    const bool okm = statestore::encode_block_ok(qm), okv = statestore::encode_block_ok(qv);
    const F invm = V::set1(qm.inv), invv = V::set1(qv.inv);
    const I zero = V::seti(0u);
    for (i = b; i + W <= e; i += W) {
      const uint32_t first = static_cast<uint32_t>(a.offset + i);
      const F m = V::load(mt + (i - b));
      const F v = V::load(vt + (i - b));     // sqrt of the new exp_avg_sq
      if (okm) {
        const I h = a.stochastic ? VecHash<V>::lanes(a.seed_m, first) : zero;
        const I k = VecF8<V>::template code<statestore::kMBitsM>(V::mul(V::abs(m), invm), h,
                                                                   a.stochastic);
        V::store_i8(mo + i, V::neg_if_neg(k, m));
      } else {
        std::memset(mo + i, 0, static_cast<size_t>(W));
      }
      if (okv) {
        const I h = a.stochastic ? VecHash<V>::lanes(a.seed_v, first) : zero;
        V::store_u8(vo + i, VecF8<V>::template code<statestore::kMBitsV>(V::mul(V::abs(v), invv),
                                                                         h, a.stochastic));
      } else {
        std::memset(vo + i, 0, static_cast<size_t>(W));
      }
    }
    for (; i < e; ++i) statestore::encode_element_int8(i, a, qm, qv, mt[i - b], vt[i - b]);
  }
};
