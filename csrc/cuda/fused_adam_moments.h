// Fused multi-tensor CUDA Adam over compressed moments (moment_dtype "bf16" / "int8"): the
// interface between fused_adam_moments.cu (nvcc, no torch header) and its torch binding
// (fused_adam_binding.cpp). Plain C++.
#pragma once

#include <cstdint>
#include <string>

#include "adam_math.h"

namespace statestore {
namespace cuda {

// The kernel's layout (fused_adam_moments.cu), the same bits either way: kBlock, one thread
// block of kQBlock threads per chunk of kQBlock elements (an int8 block: its scale from a
// block-wide max); kWide, one thread block per chunk of kCudaChunk elements, an int8 block
// per warp. Chosen per process (fused_adam_binding.cpp: set_moments_kernel, the environment
// variable STATESTORE_CUDA_MOMENTS).
enum class MomentsKernel { kBlock = 0, kWide = 1 };

// Elements a chunk of `layout` holds (what `chunk_prefix` counts).
int64_t moments_chunk(MomentsKernel layout);

// Launches one kernel over every tensor. `meta` (ntensors entries, device memory) are the
// tensors' AdamTensorArgs, `chunk_prefix` (ntensors + 1, device memory) prefix sums of
// ceil(n / moments_chunk(layout)). Returns the launch's cudaError_t as an int (0: success).
int launch_fused_adam_moments(MomentsKernel layout, const AdamTensorArgs* meta,
                              const int64_t* chunk_prefix, int ntensors, int64_t nchunks,
                              bool amsgrad, bool int8, int num_sms, void* stream);

// The layout this process launches: "block" (the default) or "wide"; the first call reads
// STATESTORE_CUDA_MOMENTS. set_moments_kernel changes it and returns the name now in use.
// Both raise (c10::Error) for another name. Defined in fused_adam_binding.cpp.
std::string moments_kernel();
std::string set_moments_kernel(const std::string& name);

}  // namespace cuda
}  // namespace statestore
