// Fused multi-tensor CUDA Adam over compressed moments (moment_dtype "bf16" / "int8"): the
// interface between fused_adam_moments.cu (nvcc, no torch header) and its torch binding
// (fused_adam_binding.cpp). Plain C++.
#pragma once

#include <cstdint>

#include "adam_math.h"

namespace statestore {
namespace cuda {

// Launches one kernel over every tensor; one thread block of kQBlock threads per chunk of
// kQBlock elements (an int8 block: its scale comes from a block-wide max). `meta`
// (ntensors entries, device memory) are the tensors' AdamTensorArgs, `chunk_prefix`
// (ntensors + 1, device memory) prefix sums of ceil(n / kQBlock). Returns the launch's
// cudaError_t as an int (0: success).
int launch_fused_adam_moments(const AdamTensorArgs* meta, const int64_t* chunk_prefix,
                              int ntensors, int64_t nchunks, bool amsgrad, bool int8,
                              int num_sms, void* stream);

}  // namespace cuda
}  // namespace statestore
