// AVX2 + FMA + F16C CPU Adam (8 floats a vector). setup.py compiles every csrc/adam/*.cpp
// with the same flags and no -m options: the instruction set is enabled below for this
// file's own functions only, and adam_ops.cpp calls them only where the processor has it.
#include <immintrin.h>

#include <cstdint>

#include "adam/adam_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace statestore {
namespace cpu {
namespace {

struct Avx2Ops {
  using F = __m256;
  static constexpr int64_t kWidth = 8;
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  // maxps: a > b ? a : b, as statestore::ss_max
  static F max(F a, F b) { return _mm256_max_ps(a, b); }

  // 8 bf16 -> their floats (bits << 16): the 16 bytes in both 128-bit lanes, then one
  // in-lane byte shuffle puts elements 0-3 (low lane) and 4-7 (high lane) in the high
  // halves of the 32-bit lanes and zeros below (one shuffle instead of a widening and a shift)
  static F load_bf16(const uint16_t* p) {
    const __m256i x = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i idx = _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7,
                                         -1, -1, 8, 9, -1, -1, 10, 11, -1, -1, 12, 13, -1, -1, 14, 15);
    return _mm256_castsi256_ps(_mm256_shuffle_epi8(x, idx));
  }
  // statestore::float_to_bf16 on 8 lanes: add 0x7FFF + lsb, keep the high halves (one byte
  // shuffle to the low 8 bytes of each 128-bit lane, then qwords 0 and 2); NaN -> 0x7FC0.
  static void store_bf16(uint16_t* p, F x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), nan);
    const __m256i hi = _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                                        2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(r, hi), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  // ---- compressed moments (adam_moments_body.h)
  using I = __m256i;
  static I seti(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static I addi(I a, I b) { return _mm256_add_epi32(a, b); }
  static I load_i(const uint32_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }  // aligned
  static void store_i(uint32_t* p, I x) { _mm256_store_si256(reinterpret_cast<__m256i*>(p), x); }
  static I xori(I a, I b) { return _mm256_xor_si256(a, b); }
  template <int N> static I srli(I a) { return _mm256_srli_epi32(a, N); }
  static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static F cvt_i2f(I a) { return _mm256_cvtepi32_ps(a); }
  static I cvtt_f2i(F a) { return _mm256_cvttps_epi32(a); }
  static I castf(F a) { return _mm256_castps_si256(a); }
  static F casti(I a) { return _mm256_castsi256_ps(a); }
  template <int N> static I slli(I a) { return _mm256_slli_epi32(a, N); }
  static I subi(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I minu(I a, I b) { return _mm256_min_epu32(a, b); }
  static I andi(I a, I b) { return _mm256_and_si256(a, b); }
  static F abs(F a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }

  // ---- the moment kernels' integer-domain helpers (adam_moments_body.h)
  static I load_i8_i(const int8_t* p) {      // 8 int8 codes, sign-extended
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static I load_u8_i(const uint8_t* p) {     // 8 uint8 codes, zero-extended
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static I absi(I a) { return _mm256_abs_epi32(a); }
  static I maxu(I a, I b) { return _mm256_max_epu32(a, b); }
  using M = __m256i;                          // a lane mask (lti, ltf -> selecti): all ones or 0
  static M lti(I a, I b) { return _mm256_cmpgt_epi32(b, a); }           // a < b (signed)
  static M ltf(F a, F b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
  static I selecti(M mask, I x, I y) { return _mm256_blendv_epi8(y, x, mask); }
  // k negated in the lanes where x's sign bit is set (k is 0 where x is +-0: vpsignd's zeroing
  // changes nothing)
  static I neg_where_sign(I k, F x) { return _mm256_sign_epi32(k, _mm256_castps_si256(x)); }
  static uint32_t hmaxu(I a) {
    __m128i x = _mm_max_epu32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    x = _mm_max_epu32(x, _mm_shuffle_epi32(x, 0x4e));
    x = _mm_max_epu32(x, _mm_shuffle_epi32(x, 0xb1));
    return static_cast<uint32_t>(_mm_cvtsi128_si32(x));
  }
  static uint32_t hminu(I a) {
    __m128i x = _mm_min_epu32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    x = _mm_min_epu32(x, _mm_shuffle_epi32(x, 0x4e));
    x = _mm_min_epu32(x, _mm_shuffle_epi32(x, 0xb1));
    return static_cast<uint32_t>(_mm_cvtsi128_si32(x));
  }
  // per lane: c's sign bit set ? neg : pos
  static F select_sign(I c, F neg, F pos) { return _mm256_blendv_ps(pos, neg, _mm256_castsi256_ps(c)); }
  static I mini(I a, I b) { return _mm256_min_epi32(a, b); }
  static int32_t hmini(I a) {
    __m128i x = _mm_min_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    x = _mm_min_epi32(x, _mm_shuffle_epi32(x, 0x4e));
    x = _mm_min_epi32(x, _mm_shuffle_epi32(x, 0xb1));
    return _mm_cvtsi128_si32(x);
  }
  // true when a lane of a or of b is NaN
  static bool any_nan2(F a, F b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q)) != 0; }
  // NaN lanes of x -> 0x7FC0 in the high half of r (the bf16 encoders' NaN rule; VecBf16)
  static I nan_to_bf16_nan_hi(I r, F x) {
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  }
  // the high halves of tm's 8 lanes to pm, of tv's to pv: one byte shuffle each puts them in
  // the low (tm) or high (tv) 8 bytes of each 128-bit lane, a blend joins them, [m0-3 v0-3 |
  // m4-7 v4-7], and qwords 0 2 1 3 give [m0-7 | v0-7]
  static void store_hi16_pair(uint16_t* pm, uint16_t* pv, I tm, I tv) {
    const __m256i im = _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                                        2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i iv = _mm256_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, 2, 3, 6, 7, 10, 11, 14, 15,
                                        -1, -1, -1, -1, -1, -1, -1, -1, 2, 3, 6, 7, 10, 11, 14, 15);
    const __m256i b = _mm256_blend_epi32(_mm256_shuffle_epi8(tm, im), _mm256_shuffle_epi8(tv, iv), 0xcc);
    const __m256i x = _mm256_permute4x64_epi64(b, 0xd8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(pm), _mm256_castsi256_si128(x));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(pv), _mm256_extracti128_si256(x, 1));
  }
  // the low bytes of km to 8 int8 at pm (km within int16: -127..127, or the code minus a
  // multiple of 256, adam_moments_body.h), kv (0..255) to 8 uint8 at pv
  static void store_codes(int8_t* pm, uint8_t* pv, I km, I kv) {
    const __m256i w = _mm256_packs_epi32(km, kv);               // [m0-3 v0-3 | m4-7 v4-7] int16
    const __m256i lo = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 2, 4, 6, 8, 10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i b = _mm256_shuffle_epi8(w, lo);                // low bytes: dwords m0-3 v0-3 . . | m4-7 v4-7 . .
    const __m128i x = _mm256_castsi256_si128(
        _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 3, 6, 7)));  // m0-7 v0-7
    _mm_storel_epi64(reinterpret_cast<__m128i*>(pm), x);
    _mm_storeh_pd(reinterpret_cast<double*>(pv), _mm_castsi128_pd(x));
  }

  static F load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_f16(uint16_t* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
};

#include "adam/adam_simd_body.h"
#include "adam/adam_moments_body.h"

STATESTORE_DEFINE_PROBE(avx2_probe)

inline __m256i load256(const char* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void stream256(char* p, __m256i x) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), x); }
STATESTORE_DEFINE_STREAM_COPY(avx2_stream_copy, __m256i, 32, load256, stream256)

void avx2_adam(const AdamTensorArgs& a, int64_t begin, int64_t end) {
  dispatch_range<SimdAdam<Avx2Ops>, SimdMoments<Avx2Ops>>(a, begin, end);
}

}  // namespace
}  // namespace cpu
}  // namespace statestore

#pragma GCC pop_options

namespace statestore {
namespace cpu {
const SimdKernels& avx2_kernels() {
  static const SimdKernels k{"avx2", 256, &avx2_adam, &simd_finite, &avx2_probe, &avx2_stream_copy};
  return k;
}
}  // namespace cpu
}  // namespace statestore
