// Interface between the torch binding (adam_ops.cpp) and the per-ISA CPU kernels
// (adam_scalar.cpp, adam_avx2.cpp, adam_avx512.cpp). No torch header here: the ISA files are
// compiled for their instruction set and must not instantiate torch's inline functions.
#pragma once

#include <cstdint>
#include <cstring>

#include "adam_math.h"

namespace statestore {
namespace cpu {

// Updates elements [begin, end) of one tensor (AdamTensorArgs, adam_math.h), whatever its
// moments' encoding (int8: begin a multiple of kQBlock).
using AdamRangeFn = void (*)(const AdamTensorArgs& a, int64_t begin, int64_t end);
// True when elements [begin, end) of a float buffer of kind `dtype` are all finite.
using FiniteRangeFn = bool (*)(const void* data, DType dtype, int64_t begin, int64_t end);

// Bandwidth probe with an fp32 Adam step's memory traffic and almost no arithmetic:
// reads p, g, m, v and writes p, m, v (28 bytes an element). The benchmark's roofline.
using ProbeRangeFn = void (*)(float* p, const float* g, float* m, float* v, int64_t begin,
                              int64_t end);

// Copies n bytes with non-temporal (streaming) stores: for data headed to a device (a
// store's ring buffer about to be written to disk), which the processor will not read again.
// The destination bypasses the caches, so a copy moves 2n bytes over the memory bus instead
// of 3n (no read-for-ownership), and leaves more of it to the disk's DMA that runs beside it.
using StreamCopyFn = void (*)(void* dst, const void* src, int64_t n);

struct SimdKernels {
  const char* name;   // "avx512", "avx2", "scalar"
  int width_bits;     // 512, 256, 32
  AdamRangeFn adam;
  FiniteRangeFn finite;
  ProbeRangeFn probe;
  StreamCopyFn stream_copy;
};

// Software prefetch for the streaming loops: every 16 elements (one 64-byte line of fp32),
// touch the lines kPrefetchElems elements ahead, into L2 (prefetcht1), not L1. With the
// hardware prefetchers alone one thread cannot keep enough misses in flight. Into L1
// (prefetcht0, as first written) the prefetches held the L1's miss buffers the demand loads
// need, and at 2 threads cost more than they gained. Distances and levels were measured with
// benchmarks/adam_step.py and benchmarks/optimizer_probe.py (benchmarks/RESULTS.md).
// The write hint is not used: without PRFCHW in the target it compiles to the same
// instruction, and a load brings the line in exclusive anyway.
// `static`: each ISA file gets its own copy, compiled for its instruction set (see below).
constexpr int64_t kPrefetchElems = 256;
template <int kBytesPerElem>
static inline void prefetch_ahead(const void* base, int64_t i) {
  const char* q = static_cast<const char*>(base) + (i + kPrefetchElems) * kBytesPerElem;
  __builtin_prefetch(q, 0, 2);  // locality 2: prefetcht1
}

// The streaming copy; instantiated by each SIMD file inside its target region. V is the
// vector type of kVec bytes, LOAD(const char*) an unaligned load and STREAM(char*, V) a
// non-temporal store to a kVec-aligned address. The destination's unaligned head and the tail
// shorter than a vector go through memcpy.
#define STATESTORE_DEFINE_STREAM_COPY(fn, V, kVec, LOAD, STREAM)                              \
  void fn(void* dst, const void* src, int64_t n) {                                            \
    char* d = static_cast<char*>(dst);                                                        \
    const char* s = static_cast<const char*>(src);                                            \
    int64_t head = static_cast<int64_t>((kVec - (reinterpret_cast<uintptr_t>(d) & (kVec - 1))) \
                                        & (kVec - 1));                                        \
    if (head > n) head = n;                                                                   \
    std::memcpy(d, s, static_cast<size_t>(head));                                            \
    d += head;                                                                                \
    s += head;                                                                                \
    n -= head;                                                                                \
    int64_t i = 0;                                                                            \
    for (; i + 4 * kVec <= n; i += 4 * kVec) {                                                \
      const V a = LOAD(s + i), b = LOAD(s + i + kVec), c = LOAD(s + i + 2 * kVec),            \
              e = LOAD(s + i + 3 * kVec);                                                     \
      STREAM(d + i, a);                                                                       \
      STREAM(d + i + kVec, b);                                                                \
      STREAM(d + i + 2 * kVec, c);                                                            \
      STREAM(d + i + 3 * kVec, e);                                                            \
    }                                                                                         \
    for (; i + kVec <= n; i += kVec) STREAM(d + i, LOAD(s + i));                              \
    _mm_sfence(); /* streaming stores are weakly ordered: publish them before returning */    \
    std::memcpy(d + i, s + i, static_cast<size_t>(n - i));                                    \
  }

// The probe loop; instantiated by each ISA file in its own anonymous namespace. It prefetches
// as the Adam loop does, so the roofline is the best this code knows for 28 bytes an element.
#define STATESTORE_DEFINE_PROBE(fn)                                                         \
  void fn(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,         \
          float* __restrict__ v, int64_t begin, int64_t end) {                               \
    int64_t b = begin;                                                                       \
    for (; b + 16 <= end; b += 16) {                                                         \
      if (b + ::statestore::cpu::kPrefetchElems < end) {                                     \
        ::statestore::cpu::prefetch_ahead<4>(p, b);                                          \
        ::statestore::cpu::prefetch_ahead<4>(g, b);                                          \
        ::statestore::cpu::prefetch_ahead<4>(m, b);                                          \
        ::statestore::cpu::prefetch_ahead<4>(v, b);                                          \
      }                                                                                      \
      for (int64_t i = b; i < b + 16; ++i) { /* a fixed trip count: fully vectorized */      \
        const float gi = g[i];                                                               \
        p[i] += gi;                                                                          \
        m[i] += gi;                                                                          \
        v[i] += gi;                                                                          \
      }                                                                                      \
    }                                                                                        \
    for (; b < end; ++b) {                                                                   \
      const float gi = g[b];                                                                 \
      p[b] += gi;                                                                            \
      m[b] += gi;                                                                            \
      v[b] += gi;                                                                            \
    }                                                                                        \
  }

const SimdKernels& scalar_kernels();
const SimdKernels& avx2_kernels();
const SimdKernels& avx512_kernels();

// Calls Impl::template run<GD, PD, kAmsgrad>(a, begin, end) for the tensor's dtypes.
template <class Impl>
void dispatch_adam_range(const AdamTensorArgs& a, int64_t begin, int64_t end) {
  const bool ams = a.vmax != nullptr;
#define SS_ADAM_CASE_P(GD)                                                                   \
  switch (a.p_dtype) {                                                                       \
    case DType::kNone:                                                                       \
      return ams ? Impl::template run<GD, DType::kNone, true>(a, begin, end)                 \
                 : Impl::template run<GD, DType::kNone, false>(a, begin, end);               \
    case DType::kF32:                                                                        \
      return ams ? Impl::template run<GD, DType::kF32, true>(a, begin, end)                  \
                 : Impl::template run<GD, DType::kF32, false>(a, begin, end);                \
    case DType::kF16:                                                                        \
      return ams ? Impl::template run<GD, DType::kF16, true>(a, begin, end)                  \
                 : Impl::template run<GD, DType::kF16, false>(a, begin, end);                \
    case DType::kBF16:                                                                       \
      return ams ? Impl::template run<GD, DType::kBF16, true>(a, begin, end)                 \
                 : Impl::template run<GD, DType::kBF16, false>(a, begin, end);               \
  }
  switch (a.g_dtype) {
    case DType::kF32: SS_ADAM_CASE_P(DType::kF32) break;
    case DType::kF16: SS_ADAM_CASE_P(DType::kF16) break;
    case DType::kBF16: SS_ADAM_CASE_P(DType::kBF16) break;
    case DType::kNone: break;
  }
#undef SS_ADAM_CASE_P
}

// Calls Impl::template run<GD, PD, kAmsgrad, MK, kStochastic>(a, begin, end) for a
// compressed-moment tensor's dtypes, encoding and rounding.
template <class Impl>
void dispatch_moments_range(const AdamTensorArgs& a, int64_t begin, int64_t end) {
  const bool ams = a.vmax != nullptr;
#define SS_MOM_CASE_S(GD, PD, MK)                                                            \
  if (a.stochastic) {                                                                        \
    return ams ? Impl::template run<GD, PD, true, MK, true>(a, begin, end)                   \
               : Impl::template run<GD, PD, false, MK, true>(a, begin, end);                 \
  }                                                                                          \
  return ams ? Impl::template run<GD, PD, true, MK, false>(a, begin, end)                    \
             : Impl::template run<GD, PD, false, MK, false>(a, begin, end);
#define SS_MOM_CASE_K(GD, PD)                                                                \
  if (a.kind == MomentKind::kBF16) {                                                         \
    SS_MOM_CASE_S(GD, PD, MomentKind::kBF16)                                                 \
  }                                                                                          \
  SS_MOM_CASE_S(GD, PD, MomentKind::kInt8)
#define SS_MOM_CASE_P(GD)                                                                    \
  switch (a.p_dtype) {                                                                       \
    case DType::kNone: SS_MOM_CASE_K(GD, DType::kNone)                                       \
    case DType::kF32: SS_MOM_CASE_K(GD, DType::kF32)                                         \
    case DType::kF16: SS_MOM_CASE_K(GD, DType::kF16)                                         \
    case DType::kBF16: SS_MOM_CASE_K(GD, DType::kBF16)                                       \
  }
  switch (a.g_dtype) {
    case DType::kF32: SS_MOM_CASE_P(DType::kF32) break;
    case DType::kF16: SS_MOM_CASE_P(DType::kF16) break;
    case DType::kBF16: SS_MOM_CASE_P(DType::kBF16) break;
    case DType::kNone: break;
  }
#undef SS_MOM_CASE_P
#undef SS_MOM_CASE_K
#undef SS_MOM_CASE_S
}

// Calls Fp32Impl::template run<GD, PD, kAmsgrad>(a, begin, end) for fp32 moments and
// MomentImpl::template run<GD, PD, kAmsgrad, MK, kStochastic>(a, begin, end) for the others.
template <class Fp32Impl, class MomentImpl>
void dispatch_range(const AdamTensorArgs& a, int64_t begin, int64_t end) {
  if (a.kind == MomentKind::kF32) {
    dispatch_adam_range<Fp32Impl>(a, begin, end);
  } else {
    dispatch_moments_range<MomentImpl>(a, begin, end);
  }
}

// Scalar compressed-moment loop over [begin, end): bf16 element by element, int8 block by
// block (the last block may be partial).
template <DType GD, DType PD, bool kAmsgrad, MomentKind MK>
inline void moments_scalar_range(const AdamTensorArgs& a, int64_t begin, int64_t end) {
  if constexpr (MK == MomentKind::kBF16) {
    for (int64_t i = begin; i < end; ++i) adam_element_bf16m<GD, PD, kAmsgrad>(i, a);
  } else {
    float mt[kQBlock], vt[kQBlock];
    for (int64_t b = begin; b < end; b += kQBlock) {
      const int64_t e = b + kQBlock < end ? b + kQBlock : end;
      adam_block_int8<GD, PD, kAmsgrad>(a, b, e, mt, vt);
    }
  }
}

// Scalar loop over [begin, end): the reference every SIMD tail uses.
template <DType GD, DType PD, bool kAmsgrad>
inline void adam_scalar_range(const AdamTensorArgs& a, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    adam_element<GD, PD, kAmsgrad>(i, a.w, a.g, static_cast<float*>(a.m), static_cast<float*>(a.v),
                                   a.vmax, a.p_out, a.s);
  }
}

// Non-finite test by exponent bits, scalar (the SIMD files have their own copy compiled for
// their instruction set, see adam_simd_body.h).
inline bool finite_range_scalar(const void* data, DType dtype, int64_t begin, int64_t end) {
  const int64_t n = end - begin;
  switch (dtype) {
    case DType::kF32: {
      const uint32_t* p = static_cast<const uint32_t*>(data) + begin;
      for (int64_t i = 0; i < n; ++i)
        if ((p[i] & 0x7f800000u) == 0x7f800000u) return false;
      return true;
    }
    case DType::kF16:
    case DType::kBF16: {
      const uint16_t mask = dtype == DType::kF16 ? 0x7c00u : 0x7f80u;
      const uint16_t* p = static_cast<const uint16_t*>(data) + begin;
      for (int64_t i = 0; i < n; ++i)
        if ((p[i] & mask) == mask) return false;
      return true;
    }
    case DType::kNone:
      break;
  }
  return true;
}

}  // namespace cpu
}  // namespace statestore
