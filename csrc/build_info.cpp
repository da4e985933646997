// What this extension was compiled against, as a string that statestore reads from the file
// before loading it (statestore/_build_check.py): an extension built for another torch (or
// CUDA) is refused at `import statestore` with one clear error, never loaded. setup.py compiles
// this file into every extension. The torch release is that of the headers compiled against.
#include <torch/version.h>
#ifdef STATESTORE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#define STATESTORE_STR2(x) #x
#define STATESTORE_STR(x) STATESTORE_STR2(x)
#ifdef STATESTORE_WITH_CUDA
#define STATESTORE_BUILD_CUDA STATESTORE_STR(CUDART_VERSION)
#else
#define STATESTORE_BUILD_CUDA "none"
#endif

namespace {
// `used`: kept although nothing refers to it; stripping removes symbols, not this data.
__attribute__((used)) const char kBuildInfo[] =
    "statestore-build-info:torch=" STATESTORE_STR(TORCH_VERSION_MAJOR) "." STATESTORE_STR(
        TORCH_VERSION_MINOR) "." STATESTORE_STR(TORCH_VERSION_PATCH) ";cuda=" STATESTORE_BUILD_CUDA
    ";end";
}  // namespace
