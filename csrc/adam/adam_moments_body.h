// The SIMD body of the compressed-moment Adam kernel (moment_dtype "bf16" / "int8"), written
// once over a vector-traits class V (Avx2Ops, Avx512Ops). Include only from an ISA
// translation unit, after adam_simd_body.h, inside its anonymous namespace (see there).
//
// Every vector operation gives the bits of the scalar functions of csrc/adam_math.h
// (decode_m8, decode_v8 (f8_val), adam_update, make_qscale_m/_v, encode_m8, encode_v8
// (f8_code), float_to_bf16(_sr), ss_hash32); the elements that do not fill a vector call
// those functions, so an element gets the same bits on every path. Where the vector form
// computes a value another way, the comment says why the bits are the same.
//
// int8 works block by block: pass 1 decodes with the block's old scales, updates, writes w
// and keeps the new fp32 moments of the block (256 floats each, on the stack: never a
// temporary of a whole tensor); pass 2 takes the block's new scales from their largest
// magnitudes and writes the codes (exp_avg_sq from the square root of its new value, which
// the update computed for its denominator: one root saved).
//
// Where the cycles go (benchmarks/adam_step.py --stages; benchmarks/RESULTS.md): the update's
// square root and division, the random bits (three 32-bit multiplies per hash) and, for int8,
// the codes. So the loops keep everything else off the vector units: rounding mode and amsgrad
// are template parameters, a block's largest magnitude is an unsigned integer max of the float
// bits (which also flags inf and NaN), the codes stay integers (no int -> float -> int round
// trips), the hash's first line (a Weyl step plus the seed) is carried from vector to vector,
// both moments' codes leave in one pack, and bf16 goes a chunk at a time in three loops
// (run_bf16).

using statestore::MomentKind;
using statestore::QScale;

template <class V>
struct VecHash {
  using I = typename V::I;
  static constexpr uint32_t kWeyl = 0x9E3779B1u;
  // ss_hash32's first line, i * kWeyl + seed (mod 2^32), for the W consecutive indices from
  // `first`; the next W indices' sums are these plus step(): the product distributes modulo
  // 2^32, so the running sum (seed included) gives the same bits as computing each index's.
  static I start(uint32_t first, uint32_t seed) {
    return V::addi(V::mullo(V::addi(V::seti(first), V::iota()), V::seti(kWeyl)), V::seti(seed));
  }
  static I step() { return V::seti(static_cast<uint32_t>(V::kWidth) * kWeyl); }
  // statestore::ss_hash32(seed, i) from x = i * kWeyl + seed
  static I mix(I x) {
    x = V::xori(x, V::template srli<16>(x));
    x = V::mullo(x, V::seti(0x7FEB352Du));
    x = V::xori(x, V::template srli<15>(x));
    x = V::mullo(x, V::seti(0x846CA68Bu));
    return V::xori(x, V::template srli<16>(x));
  }
  // mix(x) >> 16, the 16 random bits of bf16's stochastic rounding: mix without its last line
  // (x ^= x >> 16), which leaves the top 16 bits as they are
  static I bits16(I x) {
    x = V::xori(x, V::template srli<16>(x));
    x = V::mullo(x, V::seti(0x7FEB352Du));
    x = V::xori(x, V::template srli<15>(x));
    return V::template srli<16>(V::mullo(x, V::seti(0x846CA68Bu)));
  }
  // statestore::ss_uniform
  static typename V::F uniform(I h) {
    return V::mul(V::cvt_i2f(V::template srli<8>(h)), V::set1(statestore::k2m24));
  }
};

// bf16 codes of W floats (statestore::float_to_bf16 / float_to_bf16_sr), in the HIGH halves of
// the lanes: the sum before float_to_bf16's final `>> 16`, whose high half store_hi16_pair
// stores (by a byte shuffle: no shift, and no pack of values it would have to saturate); hs:
// the random bits (VecHash::bits16), read when stochastic.
template <class V, bool kStoch>
struct VecBf16 {
  using F = typename V::F;
  using I = typename V::I;
  static I round(F x, I hs) {
    const I u = V::castf(x);
    if constexpr (kStoch) {
      return V::addi(u, hs);
    } else {
      const I lsb = V::andi(V::template srli<16>(u), V::seti(1u));
      return V::addi(V::addi(u, V::seti(0x7fffu)), lsb);
    }
  }
  // m, v: new moments; hm, hv: their random bits (read when stochastic)
  static void store(uint16_t* pm, uint16_t* pv, F m, F v, I hm, I hv) {
    I rm = round(m, hm), rv = round(v, hv);
    if (V::any_nan2(m, v)) {       // rare: one compare for both in the common case
      rm = V::nan_to_bf16_nan_hi(rm, m);
      rv = V::nan_to_bf16_nan_hi(rv, v);
    }
    V::store_hi16_pair(pm, pv, rm, rv);
  }
};

// The 8-bit floats of int8 moments on W lanes (statestore::f8_val, statestore::f8_code).
template <class V>
struct VecF8 {
  using F = typename V::F;
  using I = typename V::I;
  // val(k) of integer codes k (0 .. 2^(MB+4) - 1)
  template <int MB>
  static F val(I k) {
    const F normal = V::casti(V::template slli<23 - MB>(V::addi(k, V::seti((127u - 15u) << MB))));
    const F sub = V::mul(V::cvt_i2f(k), V::set1(1.0f / static_cast<float>(1u << (14 + MB))));
    return V::casti(V::selecti(V::lti(k, V::seti(1u << MB)), V::castf(sub), V::castf(normal)));
  }
  // val(k) * 2^-112, for every code k = e 2^MB + f: the float whose bits are k << (23 - MB),
  // i.e. exponent field e and mantissa f: 2^(e-127) (1 + f/2^MB) for e >= 1 and, for e = 0,
  // the subnormal f 2^(-126-MB) = f 2^-(14+MB) 2^-112. Exact, with no compare and blend; but
  // the codes below 2^MB become subnormal floats, so this is used only where subnormal
  // operands are not flushed (the DAZ bit: fast_decode_ok) and, as measured on the AMD hosts
  // (benchmarks/adam_step.py --stages), cost no more than normal ones.
  template <int MB>
  static F val_2m112(I k) { return V::casti(V::template slli<23 - MB>(k)); }
  // exp_avg from codes c (sign-extended int8) and the block's scale: sign(c) val(|c|) scale,
  // computed as val(|c|) (sign(c) scale): a product's sign is the xor of its factors' signs
  // and its magnitude does not depend on them, so the bits are the same (NaN scales too:
  // the product is that NaN, with the sign flipped where c < 0, as negating after). The
  // lane picks scale or -scale by c's sign bit: one blend instead of an and and an xor.
  // kFast: `scale` is scale * 2^112 (exact: fast_decode_ok) and val(|c|) * 2^-112 is
  // multiplied: the same real product, so the same rounding.
  template <bool kFast>
  static F decode_m(I c, F scale, F neg_scale) {
    const I k = V::absi(c);
    return V::mul(kFast ? val_2m112<statestore::kMBitsM>(k) : val<statestore::kMBitsM>(k),
                  V::select_sign(c, neg_scale, scale));
  }
  // exp_avg_sq from codes c (zero-extended uint8): (val(c) scale)^2; kFast as decode_m
  template <bool kFast>
  static F decode_v(I c, F scale) {
    const F t = V::mul(kFast ? val_2m112<statestore::kMBitsV>(c) : val<statestore::kMBitsV>(c), scale);
    return V::mul(t, t);
  }
  // codes of ratios r >= 0 (finite, at most the largest code's value to a rounding); h: the
  // lanes' hashes (read when stochastic):
  //   r >= 2^-14 (normal_code): ((bits + R) >> D) - (B << MB), computed as
  //     (bits + R - (B << MB << D)) >> D: the same for every r >= 2^-14 (bits >= 113 << 23
  //     exceed the subtrahend, nothing wraps); other lanes take sub_code
  //   r < 2^-14 (sub_code): floor(r 2^(14+MB) + u) as trunc(fma(r, 2^(14+MB), u)): the
  //     product by a power of two is exact, so the fma rounds the same sum once, and the sum
  //     is >= 0, so truncation is floor
  template <int MB, bool kStoch>
  static I normal_code(F r, I h) {
    constexpr int kDrop = 23 - MB;
    constexpr uint32_t kBiasBits = ((127u - 15u) << MB) << kDrop;
    const I bits = V::castf(r);
    if constexpr (kStoch) {
      const I t = V::addi(bits, V::template srli<32 - kDrop>(h));
      return V::template srli<kDrop>(V::addi(t, V::seti(0u - kBiasBits)));
    } else {
      const I lsb = V::andi(V::template srli<kDrop>(bits), V::seti(1u));
      const I t = V::addi(bits, V::seti((1u << (kDrop - 1)) - 1u - kBiasBits));
      return V::template srli<kDrop>(V::addi(t, lsb));
    }
  }
  template <int MB, bool kStoch>
  static I sub_code(F r, I h) {
    const F u = kStoch ? VecHash<V>::uniform(h) : V::set1(0.5f);
    return V::cvtt_f2i(V::fma(r, V::set1(static_cast<float>(1u << (14 + MB))), u));
  }
  // The clamp to the largest code, with stochastic rounding only. With nearest rounding no
  // code can exceed it: the codes are taken against the scale of the block's own largest
  // value, so every ratio is at most largest * (1 / (largest * kInvTop)), which is 1/kInvTop
  // (1.8750001, 1.9375001) to two float roundings (a subnormal 1/scale, for blocks near
  // FLT_MAX, still within 3e-7): below the midpoint to the next code (1.9375, 1.96875), so
  // nearest rounding gives at most the largest code and f8_code's clamp never acts.
  template <int MB, bool kStoch>
  static I clamp(I k) {
    if constexpr (kStoch) return V::minu(k, V::seti((1u << (MB + 4)) - 1u));
    return k;
  }
  template <int MB, bool kStoch>
  static I code(F r, I h) {
    return clamp<MB, kStoch>(V::selecti(V::ltf(r, V::set1(statestore::k2m14)), sub_code<MB, kStoch>(r, h),
                                normal_code<MB, kStoch>(r, h)));
  }
  // code() for ratios known to be >= 2^-14
  template <int MB, bool kStoch>
  static I code_normal(F r, I h) { return clamp<MB, kStoch>(normal_code<MB, kStoch>(r, h)); }
};

template <class V>
struct SimdMoments {
  using F = typename V::F;
  using I = typename V::I;
  static constexpr int64_t W = V::kWidth;

  template <DType GD, DType PD, bool kAmsgrad, MomentKind MK, bool kStoch>
  static void run(const AdamTensorArgs& a, int64_t begin, int64_t end) {
    if constexpr (MK == MomentKind::kBF16) {
      run_bf16<GD, PD, kAmsgrad, kStoch>(a, begin, end);
    } else {
      alignas(64) float mt[statestore::kQBlock];
      alignas(64) float vt[statestore::kQBlock];
      for (int64_t b = begin; b < end; b += statestore::kQBlock) {
        const int64_t e = b + statestore::kQBlock < end ? b + statestore::kQBlock : end;
        block_int8<GD, PD, kAmsgrad, kStoch>(a, b, e, end, mt, vt);
      }
    }
  }

  // Software prefetch of the streams, as the fp32 loop does (adam_kernels.h, prefetch_ahead):
  // the fp32 and gradient lines every 16 elements, the parameter's and the codes' lines as
  // often as their size needs. i: the element about to be read; `end`: the range's end.
  template <DType GD, DType PD, int kCodeBytes>
  static void prefetch(const AdamTensorArgs& a, int64_t i, int64_t end) {
    using statestore::cpu::kPrefetchElems;
    using statestore::cpu::prefetch_ahead;
    if ((i & 15) != 0 || i + kPrefetchElems >= end) return;
    prefetch_ahead<4>(a.w, i);
    prefetch_ahead<GD == DType::kF32 ? 4 : 2>(a.g, i);
    if constexpr (PD != DType::kNone) {
      if (PD == DType::kF32 || (i & 31) == 0) prefetch_ahead<PD == DType::kF32 ? 4 : 2>(a.p_out, i);
    }
    if ((i & (64 / kCodeBytes - 1)) == 0) {
      prefetch_ahead<kCodeBytes>(a.m, i);
      prefetch_ahead<kCodeBytes>(a.v, i);
    }
  }

  // bf16 moments, a chunk of kBf16Chunk elements at a time in three loops: the random bits
  // (stochastic rounding), the update (the new moments kept in L1), the encoding. The same
  // operations on the same values (the same bits) as one loop, but short dependency chains
  // the out-of-order core overlaps better: cache-resident on the AVX2 host, bf16 stochastic
  // 0.76 -> 0.68 ns an element with the other changes of 2026-11-26, nearest 0.59 -> 0.55
  // (benchmarks/RESULTS.md).
  static constexpr int64_t kBf16Chunk = 256;

  template <DType GD, DType PD, bool kAmsgrad, bool kStoch>
  static void run_bf16(const AdamTensorArgs& a, int64_t begin, int64_t end) {
    const VecAdam<V> c(a.s);
    uint16_t* const mp = static_cast<uint16_t*>(a.m);
    uint16_t* const vp = static_cast<uint16_t*>(a.v);
    const uint32_t first = static_cast<uint32_t>(a.offset + begin);
    I wm = VecHash<V>::start(first, a.seed_m), wv = VecHash<V>::start(first, a.seed_v);
    const I step = VecHash<V>::step();
    alignas(64) uint32_t hb[2 * kBf16Chunk];   // per vector: W random bits of m, then W of v
    alignas(64) float nb[2 * kBf16Chunk];      // per vector: W new exp_avg, then W exp_avg_sq
    int64_t i = begin;
    while (end - i >= W) {
      const int64_t c0 = i;
      const int64_t ce = c0 + (end - c0 < kBf16Chunk ? (end - c0) / W * W : kBf16Chunk);
      if constexpr (kStoch) {
        for (int64_t j = c0; j < ce; j += W) {
          V::store_i(hb + 2 * (j - c0), VecHash<V>::bits16(wm));
          V::store_i(hb + 2 * (j - c0) + W, VecHash<V>::bits16(wv));
          wm = V::addi(wm, step);
          wv = V::addi(wv, step);
        }
      }
      for (; i < ce; i += W) {
        prefetch<GD, PD, 2>(a, i, end);
        F w = V::load(a.w + i);
        F g = VecIO<V, GD>::load(a.g, i);
        F m = V::load_bf16(mp + i);
        F v = V::load_bf16(vp + i);
        c.template update<kAmsgrad>(w, g, m, v, kAmsgrad ? a.vmax + i : nullptr);
        V::store(a.w + i, w);
        V::store(nb + 2 * (i - c0), m);
        V::store(nb + 2 * (i - c0) + W, v);
        if constexpr (PD != DType::kNone) VecIO<V, PD>::store(a.p_out, i, w);
      }
      for (int64_t j = c0; j < ce; j += W) {
        const F m = V::load(nb + 2 * (j - c0)), v = V::load(nb + 2 * (j - c0) + W);
        if constexpr (kStoch) {
          const uint32_t* const h = hb + 2 * (j - c0);
          VecBf16<V, true>::store(mp + j, vp + j, m, v, V::load_i(h), V::load_i(h + W));
        } else {
          VecBf16<V, false>::store(mp + j, vp + j, m, v, wm, wv);   // (not read)
        }
      }
    }
    for (; i < end; ++i) statestore::adam_element_bf16m<GD, PD, kAmsgrad>(i, a);
  }

  // Pass 2 of an int8 block: the codes of [b, e) from the new moments mt and the square roots
  // of the new exp_avg_sq vt (vector part; the caller does the tail). kOk: both scales are
  // positive (the common case, no test in the loop); else okm/okv say which moment is coded
  // and which is zeros. kNormal (with kOk): every |m| and every sqrt(v) of the block is at
  // least 2^-14 of its scale, so neither code needs the subnormal step (f8_code's other
  // branch); kVNormal: the same for sqrt(v) alone. sqrt(v) >= +0 (v >= +0, above), so its
  // ratio needs no abs.
  template <bool kStoch, bool kOk, bool kVNormal, bool kMNormal = false>
  static int64_t encode_int8(const AdamTensorArgs& a, int64_t b, int64_t e, const float* mt,
                             const float* vt, const QScale& qm, const QScale& qv) {
    int8_t* const mo = static_cast<int8_t*>(a.m);
    uint8_t* const vo = static_cast<uint8_t*>(a.v);
    const bool okm = statestore::encode_block_ok(qm), okv = statestore::encode_block_ok(qv);
    const F invm = V::set1(qm.inv), invv = V::set1(qv.inv);
    const I zero = V::seti(0u);
    const uint32_t first = static_cast<uint32_t>(a.offset + b);
    I wm = kStoch ? VecHash<V>::start(first, a.seed_m) : zero;
    I wv = kStoch ? VecHash<V>::start(first, a.seed_v) : zero;
    const I step = VecHash<V>::step();
    int64_t i = b;
    for (; i + W <= e; i += W) {
      const F m = V::load(mt + (i - b));
      const F s = V::load(vt + (i - b));     // sqrt of the new exp_avg_sq
      const I hm = kStoch ? VecHash<V>::mix(wm) : zero;
      const I hv = kStoch ? VecHash<V>::mix(wv) : zero;
      if constexpr (kStoch) {
        wm = V::addi(wm, step);
        wv = V::addi(wv, step);
      }
      const F rv = V::mul(s, invv);
      I km;
      if constexpr (kMNormal && !kStoch) {
        // the code of m * inv from its bits with the sign bit left in: the rounding reads
        // only the bits below it, and the sign bit adds 2^(31 - kDrop) = 2048 to the code,
        // a multiple of 256: the low byte, all that is stored, is the same once negated
        // (no abs; no clamp: nearest rounding, see VecF8::clamp)
        km = V::neg_where_sign(
            VecF8<V>::template normal_code<statestore::kMBitsM, false>(V::mul(m, invm), zero), m);
      } else {
        const F rm = V::mul(V::abs(m), invm);
        km = V::neg_where_sign(kMNormal ? VecF8<V>::template code_normal<statestore::kMBitsM, kStoch>(rm, hm)
                                        : VecF8<V>::template code<statestore::kMBitsM, kStoch>(rm, hm),
                               m);
      }
      I kv = kVNormal ? VecF8<V>::template code_normal<statestore::kMBitsV, kStoch>(rv, hv)
                      : VecF8<V>::template code<statestore::kMBitsV, kStoch>(rv, hv);
      if constexpr (!kOk) {
        if (!okm) km = zero;
        if (!okv) kv = zero;
      }
      V::store_codes(mo + i, vo + i, km, kv);
    }
    return i;
  }

  // True when the block's scales allow the blend-free decoding (VecF8::val_2m112): scale *
  // 2^112 finite (scale < 2^16; false for NaN) and subnormal operands not treated as zero
  // (MXCSR's DAZ bit, set e.g. by torch.set_flush_denormal(True)).
  static bool fast_decode_ok(float sm, float sv) {
    return sm < 65536.0f && sv < 65536.0f && (_mm_getcsr() & 0x0040u) == 0;
  }

  // Pass 1 of an int8 block, vector part: decode with the old scales, update, write w (and
  // the parameter), keep the new moments in mt and sqrt of exp_avg_sq in vt; returns the
  // first element not done. am, av: the largest |m| and v as unsigned integers (for floats
  // of one sign the bits order as the values do, and inf or NaN, sign cleared, is above
  // 0x7F7FFFFF; the new v = beta2 v + (1 - beta2) g^2 has its sign bit clear unless NaN,
  // whose bits exceed every finite float's either way, so it needs no abs); amin: the
  // smallest |m| as unsigned integers; smin: the smallest bits of sqrt(v) as signed integers
  // (below those of any positive float for a NaN with its sign bit set: a conservative test
  // in pass 2).
  template <DType GD, DType PD, bool kAmsgrad, bool kFast>
  static int64_t update_int8(const AdamTensorArgs& a, int64_t b, int64_t e, int64_t end,
                             float* mt, float* vt, float sm, float sv, I& am, I& av, I& amin,
                             I& smin) {
    const VecAdam<V> c(a.s);
    const int8_t* const mc = static_cast<const int8_t*>(a.m);
    const uint8_t* const vc = static_cast<const uint8_t*>(a.v);
    const float smf = kFast ? sm * 0x1p112f : sm;
    const F smv = V::set1(smf), smn = V::set1(-smf);
    const F svv = V::set1(kFast ? sv * 0x1p112f : sv);
    int64_t i = b;
    for (; i + W <= e; i += W) {
      prefetch<GD, PD, 1>(a, i, end);
      F w = V::load(a.w + i);
      F g = VecIO<V, GD>::load(a.g, i);
      F m = VecF8<V>::template decode_m<kFast>(V::load_i8_i(mc + i), smv, smn);
      F v = VecF8<V>::template decode_v<kFast>(V::load_u8_i(vc + i), svv);
      F s;
      c.template update<kAmsgrad>(w, g, m, v, kAmsgrad ? a.vmax + i : nullptr, &s);
      V::store(a.w + i, w);
      if constexpr (PD != DType::kNone) VecIO<V, PD>::store(a.p_out, i, w);
      V::store(mt + (i - b), m);
      V::store(vt + (i - b), s);
      const I mabs = V::castf(V::abs(m));
      am = V::maxu(am, mabs);
      amin = V::minu(amin, mabs);
      av = V::maxu(av, V::castf(v));
      smin = V::mini(smin, V::castf(s));
    }
    return i;
  }

  template <DType GD, DType PD, bool kAmsgrad, bool kStoch>
  static void block_int8(const AdamTensorArgs& a, int64_t b, int64_t e, int64_t end, float* mt,
                         float* vt) {
    const int64_t blk = b / statestore::kQBlock;
    const float sm = a.m_scale[blk], sv = a.v_scale[blk];
    I am = V::seti(0u), av = V::seti(0u), amin = V::seti(0xffffffffu), smin = V::seti(0x7fffffffu);
    // pass 1: decode, update, keep the new moments
    int64_t i = fast_decode_ok(sm, sv)
                    ? update_int8<GD, PD, kAmsgrad, true>(a, b, e, end, mt, vt, sm, sv, am, av, amin, smin)
                    : update_int8<GD, PD, kAmsgrad, false>(a, b, e, end, mt, vt, sm, sv, am, av, amin, smin);
    const uint32_t hm = V::hmaxu(am), hv = V::hmaxu(av);
    uint32_t mmin = V::hminu(amin);
    int32_t vmin = V::hmini(smin);
    bool fm = hm <= 0x7f7fffffu, fv = hv <= 0x7f7fffffu;
    float amx = fm ? statestore::bits_to_float(hm) : 0.0f;
    float avx = fv ? statestore::bits_to_float(hv) : 0.0f;
    for (; i < e; ++i) {
      statestore::adam_element_int8_update<GD, PD, kAmsgrad>(i, a, sm, sv, mt[i - b], vt[i - b]);
      statestore::absmax_step(mt[i - b], amx, fm);
      statestore::absmax_step(vt[i - b], avx, fv);
      const uint32_t mbits = statestore::float_to_bits(mt[i - b]) & 0x7fffffffu;
      mmin = mbits < mmin ? mbits : mmin;
      vt[i - b] = sqrtf(vt[i - b]);
      const int32_t bits = static_cast<int32_t>(statestore::float_to_bits(vt[i - b]));
      vmin = bits < vmin ? bits : vmin;
    }
    if (fm && !fv) {
      // rare: an exp_avg_sq overflowed to +inf (statestore::int8_saturate_block, the overflow
      // rule): its own scales, and the general encoding (no normal-range shortcut)
      QScale qm, qv;
      statestore::int8_saturate_block(mt, vt, e - b, qm, qv);
      a.m_scale[blk] = qm.scale;
      a.v_scale[blk] = qv.scale;
      i = statestore::encode_block_ok(qm) && statestore::encode_block_ok(qv)
              ? encode_int8<kStoch, true, false>(a, b, e, mt, vt, qm, qv)
              : encode_int8<kStoch, false, false>(a, b, e, mt, vt, qm, qv);
      for (; i < e; ++i) statestore::encode_element_int8(i, a, qm, qv, mt[i - b], vt[i - b]);
      return;
    }
    const QScale qm = statestore::make_qscale_m(amx, fm), qv = statestore::make_qscale_v(avx, fv);
    a.m_scale[blk] = qm.scale;
    a.v_scale[blk] = qv.scale;
    // pass 2: codes. r = sqrt(v) * inv is monotonic in sqrt(v), so the block's smallest r is
    // its smallest sqrt(v) times inv (a negative vmin: -0 or a NaN, take the general path)
    const bool ok = statestore::encode_block_ok(qm) && statestore::encode_block_ok(qv);
    const bool vnormal = vmin >= 0 && statestore::bits_to_float(static_cast<uint32_t>(vmin)) * qv.inv >= statestore::k2m14;
    // |m| * inv rounds monotonically, so the block's smallest ratio is its smallest |m| times
    // inv (a NaN makes the block not ok)
    const bool mnormal = statestore::bits_to_float(mmin) * qm.inv >= statestore::k2m14;
    if (ok && vnormal && mnormal) i = encode_int8<kStoch, true, true, true>(a, b, e, mt, vt, qm, qv);
    else if (ok && vnormal) i = encode_int8<kStoch, true, true>(a, b, e, mt, vt, qm, qv);
    else if (ok) i = encode_int8<kStoch, true, false>(a, b, e, mt, vt, qm, qv);
    else i = encode_int8<kStoch, false, false>(a, b, e, mt, vt, qm, qv);
    for (; i < e; ++i) statestore::encode_element_int8(i, a, qm, qv, mt[i - b], vt[i - b]);
  }
};
