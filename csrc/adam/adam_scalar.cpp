// Scalar CPU Adam: the portable path and the reference the SIMD paths must match bit for bit.
#include "adam/adam_kernels.h"

namespace statestore {
namespace cpu {
namespace {

struct ScalarAdam {
  template <DType GD, DType PD, bool kAmsgrad>
  static void run(const AdamTensorArgs& a, int64_t begin, int64_t end) {
    adam_scalar_range<GD, PD, kAmsgrad>(a, begin, end);
  }
};

struct ScalarMoments {
  template <DType GD, DType PD, bool kAmsgrad, MomentKind MK, bool kStochastic>
  static void run(const AdamTensorArgs& a, int64_t begin, int64_t end) {  // a.stochastic read
    moments_scalar_range<GD, PD, kAmsgrad, MK>(a, begin, end);
  }
};

STATESTORE_DEFINE_PROBE(scalar_probe)

// No streaming stores without SIMD: a plain copy.
void scalar_stream_copy(void* dst, const void* src, int64_t n) {
  std::memcpy(dst, src, static_cast<size_t>(n));
}

void scalar_adam(const AdamTensorArgs& a, int64_t begin, int64_t end) {
  dispatch_range<ScalarAdam, ScalarMoments>(a, begin, end);
}

}  // namespace

const SimdKernels& scalar_kernels() {
  static const SimdKernels k{"scalar", 32, &scalar_adam, &finite_range_scalar, &scalar_probe, &scalar_stream_copy};
  return k;
}

}  // namespace cpu
}  // namespace statestore
