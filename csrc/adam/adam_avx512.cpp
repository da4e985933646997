// AVX-512 CPU Adam (16 floats a vector). Same scheme as adam_avx2.cpp: the instruction set is
// enabled for this file's functions only; adam_ops.cpp calls them only where the processor
// (and the OS) supports AVX-512F/BW/VL/DQ.
#include <immintrin.h>

#include <cstdint>

#include "adam/adam_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
// GCC 12 reports its own _mm512_undefined_* placeholders as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace statestore {
namespace cpu {
namespace {

struct Avx512Ops {
  using F = __m512;
  static constexpr int64_t kWidth = 16;
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  // vmaxps: a > b ? a : b, as statestore::ss_max
  static F max(F a, F b) { return _mm512_max_ps(a, b); }

  static F load_bf16(const uint16_t* p) {
    __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  }
  // statestore::float_to_bf16 on 16 lanes: add 0x7FFF + lsb, truncate; NaN -> 0x7FC0.
  // (vcvtneps2bf16 is not used: it flushes subnormals, torch's conversion does not.)
  static void store_bf16(uint16_t* p, F x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  // ---- compressed moments (adam_moments_body.h)
  using I = __m512i;
  static I seti(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static I addi(I a, I b) { return _mm512_add_epi32(a, b); }
  static I load_i(const uint32_t* p) { return _mm512_load_si512(p); }         // 64-byte aligned
  static void store_i(uint32_t* p, I x) { _mm512_store_si512(p, x); }
  static I xori(I a, I b) { return _mm512_xor_si512(a, b); }
  template <int N> static I srli(I a) { return _mm512_srli_epi32(a, N); }
  static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static F cvt_i2f(I a) { return _mm512_cvtepi32_ps(a); }
  static I cvtt_f2i(F a) { return _mm512_cvttps_epi32(a); }
  static I castf(F a) { return _mm512_castps_si512(a); }
  static F casti(I a) { return _mm512_castsi512_ps(a); }
  template <int N> static I slli(I a) { return _mm512_slli_epi32(a, N); }
  static I subi(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I andi(I a, I b) { return _mm512_and_si512(a, b); }
  static I minu(I a, I b) { return _mm512_min_epu32(a, b); }
  static F abs(F a) {
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7fffffff)));
  }

  // ---- the moment kernels' integer-domain helpers (adam_moments_body.h)
  static I load_i8_i(const int8_t* p) {      // 16 int8 codes, sign-extended
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static I load_u8_i(const uint8_t* p) {     // 16 uint8 codes, zero-extended
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static I absi(I a) { return _mm512_abs_epi32(a); }
  static I maxu(I a, I b) { return _mm512_max_epu32(a, b); }
  using M = __mmask16;                        // a lane mask (lti, ltf -> selecti)
  static M lti(I a, I b) { return _mm512_cmplt_epi32_mask(a, b); }
  static M ltf(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static I selecti(M mask, I x, I y) { return _mm512_mask_blend_epi32(mask, y, x); }
  // k negated in the lanes where x's sign bit is set
  static I neg_where_sign(I k, F x) {
    return _mm512_mask_sub_epi32(k, _mm512_movepi32_mask(_mm512_castps_si512(x)), _mm512_setzero_si512(), k);
  }
  static uint32_t hmaxu(I a) { return _mm512_reduce_max_epu32(a); }
  static uint32_t hminu(I a) { return _mm512_reduce_min_epu32(a); }
  // per lane: c's sign bit set ? neg : pos
  static F select_sign(I c, F neg, F pos) { return _mm512_mask_blend_ps(_mm512_movepi32_mask(c), pos, neg); }
  static I mini(I a, I b) { return _mm512_min_epi32(a, b); }
  static int32_t hmini(I a) { return _mm512_reduce_min_epi32(a); }
  static bool any_nan2(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q) != 0; }
  // NaN lanes of x -> 0x7FC0 in the high half of r (the bf16 encoders' NaN rule; VecBf16)
  static I nan_to_bf16_nan_hi(I r, F x) {
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc00000));
  }
  // the high halves of tm's 16 lanes to pm, of tv's to pv
  static void store_hi16_pair(uint16_t* pm, uint16_t* pv, I tm, I tv) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pm), _mm512_cvtepi32_epi16(_mm512_srli_epi32(tm, 16)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pv), _mm512_cvtepi32_epi16(_mm512_srli_epi32(tv, 16)));
  }
  static void store_codes(int8_t* pm, uint8_t* pv, I km, I kv) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(pm), _mm512_cvtepi32_epi8(km));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(pv), _mm512_cvtepi32_epi8(kv));
  }

  static F load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store_f16(uint16_t* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

#include "adam/adam_simd_body.h"
#include "adam/adam_moments_body.h"

STATESTORE_DEFINE_PROBE(avx512_probe)

inline __m512i load512(const char* p) { return _mm512_loadu_si512(p); }
inline void stream512(char* p, __m512i x) { _mm512_stream_si512(reinterpret_cast<__m512i*>(p), x); }
STATESTORE_DEFINE_STREAM_COPY(avx512_stream_copy, __m512i, 64, load512, stream512)

void avx512_adam(const AdamTensorArgs& a, int64_t begin, int64_t end) {
  dispatch_range<SimdAdam<Avx512Ops>, SimdMoments<Avx512Ops>>(a, begin, end);
}

}  // namespace
}  // namespace cpu
}  // namespace statestore

#pragma GCC pop_options

namespace statestore {
namespace cpu {
const SimdKernels& avx512_kernels() {
  static const SimdKernels k{"avx512", 512, &avx512_adam, &simd_finite, &avx512_probe, &avx512_stream_copy};
  return k;
}
}  // namespace cpu
}  // namespace statestore
