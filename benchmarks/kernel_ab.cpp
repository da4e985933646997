// Two builds of the CPU Adam kernels side by side in one process: the same arrays, rounds
// alternating between build A and build B, and every output of both compared byte for byte.
// Built and run by `benchmarks/kernel_ab.py` (which compiles one ISA file of each source tree
// and links both here);
// a change to the kernels is then timed against the code it replaces on the same host in the
// same minutes, which two separate runs on this host (its speed moves by up to 1.4x for tenths
// of a second at a time) cannot do.
//
// Arguments: elements per array, rounds, threads (T threads at once, each on arrays of its
// own), elements a round (at least; whole calls). Prints one row per configuration: best ns
// an element of A and of B, and B / A. Exit status 1 when an output differs.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "adam/adam_kernels.h"
#include "bench_common.h"

// The two builds, each compiled with its namespace renamed (statestore -> kab_a / kab_b: no
// inline function of one build can stand in for the other's at link time) and its kernels'
// accessor renamed to kab_kernels. The structs are the same definitions in both trees.
namespace kab_a {
namespace cpu {
const statestore::cpu::SimdKernels& kab_kernels();
}  // namespace cpu
}  // namespace kab_a
namespace kab_b {
namespace cpu {
const statestore::cpu::SimdKernels& kab_kernels();
}  // namespace cpu
}  // namespace kab_b

using namespace statestore;
using namespace statestore::cpu;

namespace {

// One thread's states (bench_common.h), arrays 64 KiB apart plus distinct offsets
struct Data : BenchStates {
  Data(int64_t n_, unsigned seed) : BenchStates(n_, seed, 65536, 0.01f, 0.0004f) {}
  // every byte an update writes
  std::vector<char> outputs() const {
    std::vector<char> o;
    auto add = [&](const void* p, size_t bytes) {
      o.insert(o.end(), static_cast<const char*>(p), static_cast<const char*>(p) + bytes);
    };
    add(w, n * 4), add(m, n * 4), add(v, n * 4), add(mb, n * 2), add(vb, n * 2), add(pb, n * 2);
    add(mi, n), add(vi, n), add(sm, (n / kQBlock + 1) * 4), add(sv, (n / kQBlock + 1) * 4);
    return o;
  }
};

struct Config {
  const char* name;
  MomentKind kind;
  bool stochastic;
  DType params;
  DType grads;
};

AdamTensorArgs args_of(const Data& d, const Config& c, const AdamScalars& s, uint32_t seed) {
  return d.args(s, c.kind, c.stochastic, c.params, c.grads, seed, ~seed);
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::max<int64_t>(std::atoll(argv[1]), 1) : 4096;
  const int rounds = argc > 2 ? std::max(std::atoi(argv[2]), 1) : 200;
  const int nthreads = argc > 3 ? std::max(std::atoi(argv[3]), 1) : 1;
  const int64_t per_round = argc > 4 ? std::atoll(argv[4]) : 400000;
  const SimdKernels* K[2] = {&kab_a::cpu::kab_kernels(), &kab_b::cpu::kab_kernels()};
  const AdamScalars s = bench_scalars();
  const Config configs[] = {
      {"fp32 moments", MomentKind::kF32, false, DType::kNone, DType::kF32},
      {"bf16 moments, nearest", MomentKind::kBF16, false, DType::kNone, DType::kF32},
      {"bf16 moments, stochastic", MomentKind::kBF16, true, DType::kNone, DType::kF32},
      {"int8 moments, nearest", MomentKind::kInt8, false, DType::kNone, DType::kF32},
      {"int8 moments, stochastic", MomentKind::kInt8, true, DType::kNone, DType::kF32},
      {"fp32 moments, bf16 grads", MomentKind::kF32, false, DType::kNone, DType::kBF16},
      {"bf16 stochastic, bf16 grads", MomentKind::kBF16, true, DType::kNone, DType::kBF16},
      {"int8 nearest, bf16 grads", MomentKind::kInt8, false, DType::kNone, DType::kBF16},
      {"fp32 moments, bf16 params", MomentKind::kF32, false, DType::kBF16, DType::kF32},
      {"bf16 stochastic, bf16 params", MomentKind::kBF16, true, DType::kBF16, DType::kF32},
      {"int8 nearest, bf16 params", MomentKind::kInt8, false, DType::kBF16, DType::kF32},
  };
  const int nc = sizeof(configs) / sizeof(configs[0]);
  // The bits: three steps of each configuration on both builds, from the same start, over a
  // size with a tail.
  bool same = true;
  {
    const int64_t nb = 3 * 16384 + 77;
    for (const Config& c : configs) {
      Data a(nb, 7), b(nb, 7);
      for (uint32_t step = 1; step <= 3; ++step) {
        K[0]->adam(args_of(a, c, s, 11 + step), 0, nb);
        K[1]->adam(args_of(b, c, s, 11 + step), 0, nb);
      }
      if (a.outputs() != b.outputs()) {
        std::printf("BITS DIFFER: %s\n", c.name);
        same = false;
      }
    }
    if (same) std::printf("bits: identical (%d configurations, 3 steps, %ld elements)\n", nc, static_cast<long>(nb));
  }
  std::vector<std::unique_ptr<Data>> data;
  for (int t = 0; t < nthreads; ++t) data.push_back(std::make_unique<Data>(n, 1u + static_cast<unsigned>(t)));
  const int64_t calls = std::max<int64_t>(1, per_round / n);
  BenchTeam team(nthreads);
  std::vector<double> best(2 * nc, 1e30);
  // rounds in turn over the configurations and the two builds: each row's best comes from the
  // same spells of the host as every other row's
  for (int r = -1; r < rounds; ++r) {
    for (int ci = 0; ci < nc; ++ci) {
      for (int b = 0; b < 2; ++b) {
        const auto t0 = std::chrono::steady_clock::now();
        team.run([&](int t) {
          const AdamTensorArgs a = args_of(*data[t], configs[ci], s, 1);
          for (int64_t q = 0; q < calls; ++q) K[b]->adam(a, 0, n);
        });
        const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
        if (r >= 0) best[2 * ci + b] = std::min(best[2 * ci + b], ns / static_cast<double>(calls * n * nthreads));
      }
    }
  }
  std::printf("isa\t%s\nelements\t%ld\nthreads\t%d\nrounds\t%d\n", K[0]->name, static_cast<long>(n), nthreads, rounds);
  for (int ci = 0; ci < nc; ++ci) {
    std::printf("%s\t%.4f\t%.4f\t%.3f\n", configs[ci].name, best[2 * ci], best[2 * ci + 1], best[2 * ci + 1] / best[2 * ci]);
  }
  return same ? 0 : 1;
}
