// Fused multi-tensor CUDA Adam over compressed moments. Element math: csrc/adam_math.h
// (adam_element_bf16m; adam_element_int8_update, make_qscale_m/_v, int8_saturate_v and
// encode_element_int8), the functions the CPU kernels use. Two layouts of the same math
// (fused_adam_moments.h, MomentsKernel), equal bit for bit since a block's largest magnitudes
// are exact maxima whatever the order:
//   * kBlock: a thread block of kQBlock threads per chunk of kQBlock elements (one int8
//     block): each thread decodes and updates its element (keeping the new moments in
//     registers), the block's largest magnitudes come from a warp-shuffle and shared-memory
//     reduction, then each thread writes its codes;
//   * kWide: a thread block per chunk of kCudaChunk elements (the fp32 kernel's chunks: one
//     tensor lookup per 16384 elements, not per 256); bf16 moments are strided over the
//     chunk's elements, and each int8 block is one warp's (kQBlock / 32 elements a lane,
//     reduced by warp shuffles alone: no shared memory, no block barrier).
// No torch header: compiles with nvcc alone (scripts/check_cuda.sh).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/fused_adam.h"
#include "cuda/fused_adam_moments.h"

namespace statestore {
namespace cuda {
namespace {

constexpr int kThreads = kQBlock;
constexpr int kWarps = kThreads / 32;

template <DType GD, DType PD, bool kAmsgrad>
__device__ __forceinline__ void bf16_chunk(const AdamTensorArgs& t, int64_t b, int64_t e) {
  const int64_t i = b + threadIdx.x;
  if (i < e) adam_element_bf16m<GD, PD, kAmsgrad>(i, t);
}

__device__ __forceinline__ float warp_max(float x) {
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

template <DType GD, DType PD, bool kAmsgrad>
__device__ __forceinline__ void int8_chunk(const AdamTensorArgs& t, int64_t b, int64_t e,
                                           float* red_m, float* red_v) {
  const int64_t i = b + threadIdx.x;
  const bool in = i < e;
  const int64_t blk = b / kQBlock;
  float mn = 0.0f, vn = 0.0f, am = 0.0f, av = 0.0f;
  bool fm = true, fv = true;
  if (in) {
    adam_element_int8_update<GD, PD, kAmsgrad>(i, t, t.m_scale[blk], t.v_scale[blk], mn, vn);
    absmax_step(mn, am, fm);          // NaN never wins: am, av are finite or inf
    absmax_step(vn, av, fv);
  }
  am = warp_max(am);
  av = warp_max(av);
  if ((threadIdx.x & 31) == 0) {
    red_m[threadIdx.x >> 5] = am;
    red_v[threadIdx.x >> 5] = av;
  }
  // a barrier: every thread has read the old scales and written its warp's maxima
  const bool all_fm = __syncthreads_and(fm) != 0;
  bool all_fv = __syncthreads_and(fv) != 0;
  float AM = 0.0f, AV = 0.0f;
  for (int w = 0; w < kWarps; ++w) {
    AM = fmaxf(AM, red_m[w]);
    AV = fmaxf(AV, red_v[w]);
  }
  if (all_fm && !all_fv) {
    // rare: an exp_avg_sq overflowed to +inf (int8_saturate_v, the overflow rule). The
    // condition is the same in every thread of the block, so its barriers are reached by all.
    am = 0.0f;
    av = 0.0f;
    fv = true;
    if (in) {
      int8_saturate_v(mn, vn);
      bool fm2 = true;
      absmax_step(mn, am, fm2);
      absmax_step(vn, av, fv);
    }
    am = warp_max(am);
    av = warp_max(av);
    __syncthreads();                  // every thread has read the first maxima
    if ((threadIdx.x & 31) == 0) {
      red_m[threadIdx.x >> 5] = am;
      red_v[threadIdx.x >> 5] = av;
    }
    all_fv = __syncthreads_and(fv) != 0;
    AM = 0.0f;
    AV = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      AM = fmaxf(AM, red_m[w]);
      AV = fmaxf(AV, red_v[w]);
    }
  }
  const QScale qm = make_qscale_m(AM, all_fm), qv = make_qscale_v(AV, all_fv);
  if (threadIdx.x == 0) {
    t.m_scale[blk] = qm.scale;
    t.v_scale[blk] = qv.scale;
  }
  if (in) encode_element_int8(i, t, qm, qv, mn, sqrtf(vn));
  __syncthreads();                    // red_m/red_v are reused by the next chunk
}

template <bool kInt8, DType GD, bool kAmsgrad>
__device__ __forceinline__ void chunk_p(const AdamTensorArgs& t, int64_t b, int64_t e,
                                        float* rm, float* rv) {
#define SS_CHUNK(PD)                                                 \
  if (kInt8) int8_chunk<GD, PD, kAmsgrad>(t, b, e, rm, rv);          \
  else bf16_chunk<GD, PD, kAmsgrad>(t, b, e);
  switch (t.p_dtype) {
    case DType::kNone: SS_CHUNK(DType::kNone) break;
    case DType::kF32: SS_CHUNK(DType::kF32) break;
    case DType::kF16: SS_CHUNK(DType::kF16) break;
    case DType::kBF16: SS_CHUNK(DType::kBF16) break;
  }
#undef SS_CHUNK
}

// Grid-stride over the chunks of all tensors (every thread of a block takes the same chunks,
// so the block-wide barriers of int8 are reached by all of them).
template <bool kInt8, bool kAmsgrad>
__global__ void __launch_bounds__(kThreads)
fused_moments_kernel(const AdamTensorArgs* __restrict__ meta,
                     const int64_t* __restrict__ prefix, int ntensors, int64_t nchunks) {
  __shared__ float red_m[kWarps];
  __shared__ float red_v[kWarps];
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    int64_t begin, end;
    const AdamTensorArgs t = meta[chunk_range(meta, prefix, ntensors, c, kQBlock, &begin, &end)];
    switch (t.g_dtype) {
      case DType::kF32: chunk_p<kInt8, DType::kF32, kAmsgrad>(t, begin, end, red_m, red_v); break;
      case DType::kF16: chunk_p<kInt8, DType::kF16, kAmsgrad>(t, begin, end, red_m, red_v); break;
      case DType::kBF16: chunk_p<kInt8, DType::kBF16, kAmsgrad>(t, begin, end, red_m, red_v); break;
      case DType::kNone: break;
    }
  }
}

// ---- kWide ----

constexpr int kPerLane = kQBlock / 32;
static_assert(kQBlock % 32 == 0 && kCudaChunk % kQBlock == 0,
              "a wide chunk holds whole int8 blocks, a block whole warps' lanes");

// Int8 block [b, e) (b a multiple of kQBlock, e - b <= kQBlock) by one warp: lane l takes
// elements b + l + 32k. The same steps as int8_chunk, the reductions over the warp.
template <DType GD, DType PD, bool kAmsgrad>
__device__ __forceinline__ void int8_block_warp(const AdamTensorArgs& t, int64_t b, int64_t e) {
  const int lane = threadIdx.x & 31;
  const int64_t blk = b / kQBlock;
  const float sm = t.m_scale[blk], sv = t.v_scale[blk];
  float mn[kPerLane], vn[kPerLane];
  float am = 0.0f, av = 0.0f;
  bool fm = true, fv = true;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int64_t i = b + lane + 32 * k;
    mn[k] = 0.0f;
    vn[k] = 0.0f;
    if (i < e) {
      adam_element_int8_update<GD, PD, kAmsgrad>(i, t, sm, sv, mn[k], vn[k]);
      absmax_step(mn[k], am, fm);
      absmax_step(vn[k], av, fv);
    }
  }
  // the shuffles and votes synchronize the warp: every lane has read the old scales
  am = warp_max(am);
  av = warp_max(av);
  const bool all_fm = __all_sync(0xffffffffu, fm) != 0;
  bool all_fv = __all_sync(0xffffffffu, fv) != 0;
  if (all_fm && !all_fv) {  // the overflow rule (rare); the condition is the warp's
    am = 0.0f;
    av = 0.0f;
    fv = true;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      if (b + lane + 32 * k < e) {
        int8_saturate_v(mn[k], vn[k]);
        bool fm2 = true;
        absmax_step(mn[k], am, fm2);
        absmax_step(vn[k], av, fv);
      }
    }
    am = warp_max(am);
    av = warp_max(av);
    all_fv = __all_sync(0xffffffffu, fv) != 0;
  }
  const QScale qm = make_qscale_m(am, all_fm), qv = make_qscale_v(av, all_fv);
  if (lane == 0) {
    t.m_scale[blk] = qm.scale;
    t.v_scale[blk] = qv.scale;
  }
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int64_t i = b + lane + 32 * k;
    if (i < e) encode_element_int8(i, t, qm, qv, mn[k], sqrtf(vn[k]));
  }
}

// Chunk [b, e) of one tensor (b a multiple of kCudaChunk) by the whole thread block.
template <bool kInt8, DType GD, DType PD, bool kAmsgrad>
__device__ __forceinline__ void wide_chunk(const AdamTensorArgs& t, int64_t b, int64_t e) {
  if (kInt8) {
    const int64_t warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int64_t q = b + warp * kQBlock; q < e; q += warps * kQBlock)  // warp-uniform
      int8_block_warp<GD, PD, kAmsgrad>(t, q, q + kQBlock < e ? q + kQBlock : e);
  } else {
    for (int64_t i = b + threadIdx.x; i < e; i += blockDim.x)
      adam_element_bf16m<GD, PD, kAmsgrad>(i, t);
  }
}

template <bool kInt8, DType GD, bool kAmsgrad>
__device__ __forceinline__ void wide_chunk_p(const AdamTensorArgs& t, int64_t b, int64_t e) {
  switch (t.p_dtype) {
    case DType::kNone: wide_chunk<kInt8, GD, DType::kNone, kAmsgrad>(t, b, e); break;
    case DType::kF32: wide_chunk<kInt8, GD, DType::kF32, kAmsgrad>(t, b, e); break;
    case DType::kF16: wide_chunk<kInt8, GD, DType::kF16, kAmsgrad>(t, b, e); break;
    case DType::kBF16: wide_chunk<kInt8, GD, DType::kBF16, kAmsgrad>(t, b, e); break;
  }
}

// Grid-stride over chunks of kCudaChunk elements of all tensors (a chunk's tensor found by
// binary search in the prefix sums of chunk counts, as the fp32 kernel does).
template <bool kInt8, bool kAmsgrad>
__global__ void __launch_bounds__(kThreads)
wide_moments_kernel(const AdamTensorArgs* __restrict__ meta,
                    const int64_t* __restrict__ prefix, int ntensors, int64_t nchunks) {
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    int64_t begin, end;
    const AdamTensorArgs t = meta[chunk_range(meta, prefix, ntensors, c, kCudaChunk, &begin, &end)];
    switch (t.g_dtype) {
      case DType::kF32: wide_chunk_p<kInt8, DType::kF32, kAmsgrad>(t, begin, end); break;
      case DType::kF16: wide_chunk_p<kInt8, DType::kF16, kAmsgrad>(t, begin, end); break;
      case DType::kBF16: wide_chunk_p<kInt8, DType::kBF16, kAmsgrad>(t, begin, end); break;
      case DType::kNone: break;
    }
  }
}

template <bool kInt8, bool kAmsgrad>
void launch_moments(MomentsKernel layout, const AdamTensorArgs* meta, const int64_t* prefix,
                    int ntensors, int64_t nchunks, unsigned blocks, cudaStream_t s) {
  if (layout == MomentsKernel::kWide) {
    wide_moments_kernel<kInt8, kAmsgrad><<<blocks, kThreads, 0, s>>>(meta, prefix, ntensors,
                                                                     nchunks);
  } else {
    fused_moments_kernel<kInt8, kAmsgrad><<<blocks, kThreads, 0, s>>>(meta, prefix, ntensors,
                                                                      nchunks);
  }
}

}  // namespace

int64_t moments_chunk(MomentsKernel layout) {
  return layout == MomentsKernel::kWide ? kCudaChunk : kQBlock;
}

int launch_fused_adam_moments(MomentsKernel layout, const AdamTensorArgs* meta,
                              const int64_t* chunk_prefix, int ntensors, int64_t nchunks,
                              bool amsgrad, bool int8, int num_sms, void* stream) {
  if (ntensors <= 0 || nchunks <= 0) return 0;
  const int per_sm = layout == MomentsKernel::kWide ? 16 : 32;
  const int64_t max_blocks = static_cast<int64_t>(num_sms > 0 ? num_sms : 1) * per_sm;
  const unsigned blocks = static_cast<unsigned>(nchunks < max_blocks ? nchunks : max_blocks);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (int8) {
    if (amsgrad) launch_moments<true, true>(layout, meta, chunk_prefix, ntensors, nchunks, blocks, s);
    else launch_moments<true, false>(layout, meta, chunk_prefix, ntensors, nchunks, blocks, s);
  } else {
    if (amsgrad) launch_moments<false, true>(layout, meta, chunk_prefix, ntensors, nchunks, blocks, s);
    else launch_moments<false, false>(layout, meta, chunk_prefix, ntensors, nchunks, blocks, s);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace cuda
}  // namespace statestore
