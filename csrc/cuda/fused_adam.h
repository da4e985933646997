// Fused multi-tensor CUDA Adam: the interface between the CUDA source (fused_adam.cu, compiled
// by nvcc with no torch header) and its torch binding (fused_adam_binding.cpp). Plain C++.
#pragma once

#include <cstdint>

#include "adam_math.h"

namespace statestore {
namespace cuda {

// Elements of one tensor handled by one block iteration.
constexpr int64_t kCudaChunk = 16384;

// One tensor of a launch; an array of these lives in device memory. w is the fp32 weight (the
// parameter or its fp32 master), p_out the low-precision parameter written back from it in
// the same pass (nullptr when w is the parameter), vmax nullptr without amsgrad.
struct CudaAdamTensor {
  float* w;
  const void* g;
  float* m;
  float* v;
  float* vmax;
  void* p_out;
  int64_t n;
  AdamScalars s;
  int32_t g_dtype;  // statestore::DType
  int32_t p_dtype;  // statestore::DType, kNone when p_out is nullptr
};

// Launches one kernel over every tensor. `meta` (ntensors entries) and `chunk_prefix`
// (ntensors + 1 prefix sums of ceil(n / kCudaChunk)) are device pointers. `stream` is a
// cudaStream_t. Returns the cudaError_t of the launch as an int (0: success).
int launch_fused_adam(const CudaAdamTensor* meta, const int64_t* chunk_prefix, int ntensors,
                      int64_t nchunks, bool amsgrad, int num_sms, void* stream);

}  // namespace cuda
}  // namespace statestore
