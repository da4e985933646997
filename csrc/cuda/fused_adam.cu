// Fused multi-tensor Adam/AdamW for CUDA: one launch updates every tensor of a call. The
// element update is statestore::adam_element / adam_update from csrc/adam_math.h, the same
// code the CPU kernels use. No torch header: this file compiles with nvcc alone
// (scripts/check_cuda.sh).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/fused_adam.h"

namespace statestore {
namespace cuda {
namespace {

template <DType GD, DType PD, bool kAmsgrad>
__device__ __forceinline__ void adam_chunk(const AdamTensorArgs& t, int64_t begin, int64_t end) {
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    adam_element<GD, PD, kAmsgrad>(i, t.w, t.g, static_cast<float*>(t.m), static_cast<float*>(t.v),
                                   t.vmax, t.p_out, t.s);
  }
}

template <DType GD, bool kAmsgrad>
__device__ __forceinline__ void adam_chunk_p(const AdamTensorArgs& t, int64_t b, int64_t e) {
  switch (t.p_dtype) {
    case DType::kNone: adam_chunk<GD, DType::kNone, kAmsgrad>(t, b, e); break;
    case DType::kF32: adam_chunk<GD, DType::kF32, kAmsgrad>(t, b, e); break;
    case DType::kF16: adam_chunk<GD, DType::kF16, kAmsgrad>(t, b, e); break;
    case DType::kBF16: adam_chunk<GD, DType::kBF16, kAmsgrad>(t, b, e); break;
  }
}

// Grid-stride over chunks of all tensors; a chunk's tensor is found by binary search in the
// prefix sums of chunk counts.
template <bool kAmsgrad>
__global__ void fused_adam_kernel(const AdamTensorArgs* __restrict__ meta,
                                  const int64_t* __restrict__ prefix, int ntensors,
                                  int64_t nchunks) {
  for (int64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    int64_t begin, end;
    const AdamTensorArgs t = meta[chunk_range(meta, prefix, ntensors, c, kCudaChunk, &begin, &end)];
    switch (t.g_dtype) {
      case DType::kF32: adam_chunk_p<DType::kF32, kAmsgrad>(t, begin, end); break;
      case DType::kF16: adam_chunk_p<DType::kF16, kAmsgrad>(t, begin, end); break;
      case DType::kBF16: adam_chunk_p<DType::kBF16, kAmsgrad>(t, begin, end); break;
      case DType::kNone: break;
    }
  }
}

}  // namespace

int launch_fused_adam(const AdamTensorArgs* meta, const int64_t* chunk_prefix, int ntensors,
                      int64_t nchunks, bool amsgrad, int num_sms, void* stream) {
  if (ntensors <= 0 || nchunks <= 0) return 0;
  constexpr int kThreads = 256;
  const int64_t max_blocks = static_cast<int64_t>(num_sms > 0 ? num_sms : 1) * 16;
  const unsigned blocks = static_cast<unsigned>(nchunks < max_blocks ? nchunks : max_blocks);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (amsgrad) {
    fused_adam_kernel<true><<<blocks, kThreads, 0, s>>>(meta, chunk_prefix, ntensors, nchunks);
  } else {
    fused_adam_kernel<false><<<blocks, kThreads, 0, s>>>(meta, chunk_prefix, ntensors, nchunks);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace cuda
}  // namespace statestore
