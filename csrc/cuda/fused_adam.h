// Fused multi-tensor CUDA Adam: the interface between the CUDA source (fused_adam.cu, compiled
// by nvcc with no torch header) and its torch binding (fused_adam_binding.cpp). Plain C++.
#pragma once

#include <cstdint>

#include "adam_math.h"

namespace statestore {
namespace cuda {

// Elements of one tensor handled by one block iteration.
constexpr int64_t kCudaChunk = 16384;

// Chunk `c` of a launch over `meta` in chunks of `chunk` elements, every kernel's lookup:
// returns its tensor (the last t with prefix[t] <= c, by binary search in `prefix`, the
// ntensors + 1 prefix sums of the tensors' chunk counts) and sets its elements [*begin, *end).
SS_HD int chunk_range(const AdamTensorArgs* meta, const int64_t* prefix, int ntensors,
                      int64_t c, int64_t chunk, int64_t* begin, int64_t* end) {
  int lo = 0, hi = ntensors - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (prefix[mid] <= c) lo = mid; else hi = mid - 1;
  }
  const int64_t n = meta[lo].n;
  *begin = (c - prefix[lo]) * chunk;
  *end = *begin + chunk < n ? *begin + chunk : n;
  return lo;
}

// Launches one kernel over every tensor of fp32 moments. `meta` (ntensors AdamTensorArgs,
// adam_math.h, as checks::adam_jobs fills them) and `chunk_prefix`
// (ntensors + 1 prefix sums of ceil(n / kCudaChunk)) are device pointers. `stream` is a
// cudaStream_t. Returns the cudaError_t of the launch as an int (0: success).
int launch_fused_adam(const AdamTensorArgs* meta, const int64_t* chunk_prefix, int ntensors,
                      int64_t nchunks, bool amsgrad, int num_sms, void* stream);

// Updates every tensor of `jobs` (host array of n AdamTensorArgs in checks::adam_jobs' form:
// device pointers on CUDA device `device_index`, one moment encoding) on the current stream:
// the table and its chunk prefix are copied to device memory in one transfer and one kernel
// launch updates them all (two where amsgrad and plain tensors are mixed). A step plan's CUDA
// route (csrc/adam/adam_ops.cpp, StepPlan). Defined in fused_adam_binding.cpp (CUDA builds);
// raises (c10::Error) when a launch fails.
void run_adam_jobs(const AdamTensorArgs* jobs, size_t n, int device_index);

}  // namespace cuda
}  // namespace statestore
