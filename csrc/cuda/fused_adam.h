// Fused multi-tensor CUDA Adam: the interface between the CUDA source (fused_adam.cu, compiled
// by nvcc with no torch header) and its torch binding (fused_adam_binding.cpp). Plain C++.
#pragma once

#include <cstdint>

#include "adam_math.h"

namespace statestore {
namespace cuda {

// Elements of one tensor handled by one block iteration.
constexpr int64_t kCudaChunk = 16384;

// Launches one kernel over every tensor of fp32 moments. `meta` (ntensors AdamTensorArgs,
// adam_math.h, as checks::adam_jobs fills them) and `chunk_prefix`
// (ntensors + 1 prefix sums of ceil(n / kCudaChunk)) are device pointers. `stream` is a
// cudaStream_t. Returns the cudaError_t of the launch as an int (0: success).
int launch_fused_adam(const AdamTensorArgs* meta, const int64_t* chunk_prefix, int ntensors,
                      int64_t nchunks, bool amsgrad, int num_sms, void* stream);

}  // namespace cuda
}  // namespace statestore
