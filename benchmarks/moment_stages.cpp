// Where the cycles of the compressed-moment kernels go: each stage of the SIMD body timed
// alone on cache-resident data (one thread), then the whole kernels. Built and run by
// `benchmarks/adam_step.py --stages` (one binary per instruction set the processor has):
//
//   c++ -O3 -std=c++17 -ffp-contract=off -fno-math-errno -Icsrc -DSTAGES_AVX2
//       benchmarks/moment_stages.cpp -o /tmp/stages -lpthread && /tmp/stages 4096 60 1
//
// It includes the ISA file itself (csrc/adam/adam_avx2.cpp or adam_avx512.cpp), so the stages
// are the kernel's own building blocks (VecAdam, VecHash, VecBf16, VecF8, SimdMoments),
// compiled with the extension's flags. Prints one line per stage: name, ns per element.
// Arguments: elements per array (4096), rounds (60), threads (1: with T, T threads run each
// stage at once, each on arrays of its own, and the figure is the machine's ns per element),
// seconds (3: rounds go on at least that long, to outlast the host's slow spells), elements a
// round and thread (200000: whole calls of the arrays), and elements a thread in RAM (0: the
// stages; N > 0: the overlap probe instead, `adam_step.py --overlap`: the fp32 update plus K
// independent hashes a vector and the whole kernels, each on the cache-resident arrays and on
// arrays of N elements, one call a round).
// No torch; timing only, nothing is checked here (the tests check the bits).
#if defined(STAGES_AVX512)
#include "adam/adam_avx512.cpp"
#define STAGES_OPS Avx512Ops
#define STAGES_KERNELS avx512_kernels
#else
#include "adam/adam_avx2.cpp"
#define STAGES_OPS Avx2Ops
#define STAGES_KERNELS avx2_kernels
#endif

#include "bench_common.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>


using namespace statestore;
using namespace statestore::cpu;

#pragma GCC push_options
#if defined(STAGES_AVX512)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#else
#pragma GCC target("avx2,fma,f16c")
#endif
namespace statestore {
namespace cpu {
namespace {
using V = STAGES_OPS;
using F = V::F;
using I = V::I;
constexpr int64_t W = V::kWidth;

__attribute__((noinline)) void st_ldst(float* w, const float* g, float* m, float* v, int64_t n) {
  for (int64_t i = 0; i + W <= n; i += W) {
    const F gi = V::load(g + i);
    V::store(w + i, V::add(V::load(w + i), gi));
    V::store(m + i, V::add(V::load(m + i), gi));
    V::store(v + i, V::add(V::load(v + i), gi));
  }
}
__attribute__((noinline)) void st_sqrtdiv(float* w, const float* m, const float* v, int64_t n) {
  for (int64_t i = 0; i + W <= n; i += W) V::store(w + i, V::div(V::load(m + i), V::sqrt(V::load(v + i))));
}
__attribute__((noinline)) void st_update(const AdamScalars& s, float* w, const float* g, float* m,
                                         float* v, int64_t n) {
  const VecAdam<V> c(s);
  for (int64_t i = 0; i + W <= n; i += W) {
    F wi = V::load(w + i), gi = V::load(g + i), mi = V::load(m + i), vi = V::load(v + i);
    c.update<false>(wi, gi, mi, vi, nullptr);
    V::store(w + i, wi);
    V::store(m + i, mi);
    V::store(v + i, vi);
  }
}
__attribute__((noinline)) void st_bf16_decode(const uint16_t* m, const uint16_t* v, float* mo,
                                              float* vo, int64_t n) {
  for (int64_t i = 0; i + W <= n; i += W) {
    V::store(mo + i, V::load_bf16(m + i));
    V::store(vo + i, V::load_bf16(v + i));
  }
}
template <bool kStoch>
__attribute__((noinline)) void st_bf16_encode(const float* mi, const float* vi, uint16_t* m,
                                              uint16_t* v, int64_t n) {
  I wm = VecHash<V>::start(0, 1u), wv = VecHash<V>::start(0, 2u);
  const I step = VecHash<V>::step();
  for (int64_t i = 0; i + W <= n; i += W) {
    if constexpr (kStoch) {
      VecBf16<V, true>::store(m + i, v + i, V::load(mi + i), V::load(vi + i), VecHash<V>::bits16(wm),
                              VecHash<V>::bits16(wv));
      wm = V::addi(wm, step);
      wv = V::addi(wv, step);
    } else {
      VecBf16<V, false>::store(m + i, v + i, V::load(mi + i), V::load(vi + i), wm, wv);
    }
  }
}
__attribute__((noinline)) void st_hash(float* o, int64_t n) {
  I wm = VecHash<V>::start(0, 1u), wv = VecHash<V>::start(0, 2u);
  const I step = VecHash<V>::step();
  for (int64_t i = 0; i + W <= n; i += W) {
    const I a = VecHash<V>::mix(wm), b = VecHash<V>::mix(wv);
    wm = V::addi(wm, step);
    wv = V::addi(wv, step);
    V::store(o + i, V::casti(V::xori(a, b)));
  }
}
__attribute__((noinline)) void st_int8_decode(const int8_t* mc, const uint8_t* vc, float sm, float sv,
                                              float* mo, float* vo, int64_t n) {
  const F smv = V::set1(sm * 0x1p112f), smn = V::set1(-sm * 0x1p112f), svv = V::set1(sv * 0x1p112f);
  for (int64_t i = 0; i + W <= n; i += W) {
    V::store(mo + i, VecF8<V>::decode_m<true>(V::load_i8_i(mc + i), smv, smn));
    V::store(vo + i, VecF8<V>::decode_v<true>(V::load_u8_i(vc + i), svv));
  }
}
__attribute__((noinline)) void st_block_max(const float* m, const float* v, float* out, int64_t n) {
  for (int64_t b = 0; b + kQBlock <= n; b += kQBlock) {
    I am = V::seti(0u), av = V::seti(0u), smin = V::seti(0x7fffffffu);
    for (int64_t i = b; i < b + kQBlock; i += W) {
      const F mi = V::load(m + i), vi = V::load(v + i);
      am = V::maxu(am, V::castf(V::abs(mi)));
      av = V::maxu(av, V::castf(V::abs(vi)));
      smin = V::mini(smin, V::castf(vi));
    }
    out[b / kQBlock] = bits_to_float(V::hmaxu(am) ^ V::hmaxu(av) ^ static_cast<uint32_t>(V::hmini(smin)));
  }
}
template <bool kStoch>
__attribute__((noinline)) void st_int8_encode(const AdamTensorArgs& a, const float* mt,
                                              const float* vt, int64_t n) {
  const QScale qm = make_qscale_m(0.2f, true), qv = make_qscale_v(0.04f, true);
  for (int64_t b = 0; b + kQBlock <= n; b += kQBlock)
    SimdMoments<V>::encode_int8<kStoch, true, false>(a, b, b + kQBlock, mt + b, vt + b, qm, qv);
}
// The overlap probe: the fp32 update with the kernel's prefetches, plus K hashes a vector
// (VecHash::bits16 of carried indices, folded into one register): integer work the update
// does not wait for and that waits on nothing of the update's. Cache-resident, its time is
// the arithmetic's; in RAM, with K large enough, it would be the same if the core hid its
// memory traffic behind the arithmetic, and the fp32 step's time in RAM if it hid the
// arithmetic behind the memory traffic.
template <int K>
__attribute__((noinline)) void st_update_hashes(const AdamScalars& s, float* w, const float* g, float* m,
                                                float* v, int64_t n, uint32_t* sink) {
  const VecAdam<V> c(s);
  I h[K > 0 ? K : 1];
  for (int k = 0; k < K; ++k) h[k] = VecHash<V>::start(static_cast<uint32_t>(k) << 24, 1u);
  const I step = VecHash<V>::step();
  I acc = V::seti(0u);
  for (int64_t i = 0; i + W <= n; i += W) {
    if ((i & 15) == 0 && i + kPrefetchElems < n) {
      prefetch_ahead<4>(w, i);
      prefetch_ahead<4>(g, i);
      prefetch_ahead<4>(m, i);
      prefetch_ahead<4>(v, i);
    }
    F wi = V::load(w + i), gi = V::load(g + i), mi = V::load(m + i), vi = V::load(v + i);
    c.update<false>(wi, gi, mi, vi, nullptr);
    V::store(w + i, wi);
    V::store(m + i, mi);
    V::store(v + i, vi);
    for (int k = 0; k < K; ++k) {
      acc = V::xori(acc, VecHash<V>::bits16(h[k]));
      h[k] = V::addi(h[k], step);
    }
  }
  alignas(64) uint32_t out[W];
  V::store_i(out, acc);
  *sink ^= out[0];
}
}  // namespace
}  // namespace cpu
}  // namespace statestore
#pragma GCC pop_options

// One thread's arrays (every thread has its own): its states (bench_common.h: w, g, m, v and
// their bf16 and int8 forms, scales 0.01 and 0.02), and for the stages fp32 arrays mo, vo (a
// stage's outputs) and mt, vt (new moments and square roots within the int8 encoder's
// scales), all in one arena, 4 KiB apart plus distinct offsets.
struct Bufs : BenchStates {
  float *mo, *vo, *mt, *vt;
  Bufs(int64_t n_, unsigned seed) : BenchStates(n_, seed, 4096, 0.01f, 0.02f, static_cast<size_t>(n_) * 16, 4) {
    mo = arena.take<float>(n), vo = arena.take<float>(n), mt = arena.take<float>(n), vt = arena.take<float>(n);
    std::uniform_real_distribution<float> ud(0.0f, 1.0f);
    for (int64_t i = 0; i < n; ++i) {
      mt[i] = m[i] * 100.0f;                 // within the scales of st_int8_encode
      vt[i] = std::sqrt(v[i]) * 5.0f * std::pow(10.0f, -2.0f * ud(rng));
    }
  }
};

// A row: what T threads run at once (f(t): thread t's part, `calls` calls of `elems` elements)
struct Row {
  std::string name;
  std::function<void(int)> f;
  int64_t elems;
  int64_t calls;
};

// Best time per element of each row, the rows taken in turn within every round (not one
// row's rounds back to back), for at least min_seconds: on a host whose speed changes for
// tenths of a second at a time (the AVX2 development host), each row's best then comes
// from the same fast spells. With T threads, each runs the row on its own arrays at the
// same time, and the time per element is the wall time over the elements of all threads
// (the machine's, not one core's).
static std::vector<double> time_rows(const std::vector<Row>& rows, int nthreads, int rounds, double min_seconds) {
  BenchTeam team(nthreads);
  std::vector<double> best(rows.size(), 1e30);
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  for (int r = -2; r < rounds || elapsed() < min_seconds; ++r) {       // two rounds of warm-up
    for (size_t k = 0; k < rows.size(); ++k) {
      const std::function<void(int)> job = [&](int t) {
        for (int64_t c = 0; c < rows[k].calls; ++c) rows[k].f(t);
      };
      const auto t0 = std::chrono::steady_clock::now();
      team.run(job);
      const std::chrono::duration<double, std::nano> dt = std::chrono::steady_clock::now() - t0;
      if (r >= 0) {
        best[k] = std::min(best[k], dt.count() / static_cast<double>(rows[k].calls * rows[k].elems * nthreads));
      }
    }
  }
  return best;
}

// The overlap probe's arrays: the states alone (bench_common.h), scales 0.01 and 0.02, in one
// arena, 4 KiB apart plus distinct offsets
struct ProbeStates : BenchStates {
  ProbeStates(int64_t n_, unsigned seed) : BenchStates(n_, seed, 4096, 0.01f, 0.02f) {}
};

// Every thread's arrays (B: Bufs or ProbeStates) of n elements, shared by the rows that run on
// them: each row holds a reference, so the arrays live as long as the rows
template <class B>
using ArraySet = std::shared_ptr<std::vector<std::unique_ptr<B>>>;
template <class B>
static ArraySet<B> array_set(int64_t n, int nthreads, unsigned seed) {
  auto set = std::make_shared<std::vector<std::unique_ptr<B>>>();
  for (int t = 0; t < nthreads; ++t) set->push_back(std::make_unique<B>(n, seed + static_cast<unsigned>(t)));
  return set;
}

// A row of `calls` calls of f on thread t's arrays of `set`
template <class B>
static Row row_on(std::string name, const ArraySet<B>& set, int64_t calls, std::function<void(const B&)> f) {
  const int64_t n = (*set)[0]->n;
  return {std::move(name), [set, f](int t) { f(*(*set)[t]); }, n, calls};
}

// The stages' and kernels' rows, each on every thread's cache-resident Bufs of n elements
static std::vector<Row> stage_rows(int64_t n, int nthreads, int64_t round_elems) {
  const ArraySet<Bufs> set = array_set<Bufs>(n, nthreads, 1u);
  const AdamScalars s = bench_scalars();
  const int64_t calls = std::max<int64_t>(1, round_elems / n);
  std::vector<Row> rows;
  auto row = [&](std::string name, std::function<void(const Bufs&)> f) {
    rows.push_back(row_on<Bufs>(std::move(name), set, calls, std::move(f)));
  };
  row("stage: loads and stores of an fp32 step", [](const Bufs& b) { st_ldst(b.w, b.g, b.m, b.v, b.n); });
  row("stage: sqrt and division", [](const Bufs& b) { st_sqrtdiv(b.mo, b.m, b.v, b.n); });
  row("stage: update (fp32 m, v in and out)", [s](const Bufs& b) { st_update(s, b.w, b.g, b.m, b.v, b.n); });
  row("stage: bf16 decode m, v", [](const Bufs& b) { st_bf16_decode(b.mb, b.vb, b.mo, b.vo, b.n); });
  row("stage: bf16 encode m, v, nearest", [](const Bufs& b) { st_bf16_encode<false>(b.m, b.v, b.mb, b.vb, b.n); });
  row("stage: random bits (two hashes)", [](const Bufs& b) { st_hash(b.mo, b.n); });
  row("stage: bf16 encode m, v, stochastic", [](const Bufs& b) { st_bf16_encode<true>(b.m, b.v, b.mb, b.vb, b.n); });
  row("stage: int8 decode m, v", [](const Bufs& b) { st_int8_decode(b.mi, b.vi, 0.01f, 0.02f, b.mo, b.vo, b.n); });
  row("stage: int8 block max m, v", [](const Bufs& b) { st_block_max(b.mt, b.vt, b.mo, b.n); });
  auto codes = [](const Bufs& b) {
    AdamTensorArgs c{};
    c.m = b.mi;
    c.v = b.vi;
    c.seed_m = 1;
    c.seed_v = 2;
    return c;
  };
  row("stage: int8 encode m, v, nearest", [codes](const Bufs& b) { st_int8_encode<false>(codes(b), b.mt, b.vt, b.n); });
  row("stage: int8 encode m, v, stochastic", [codes](const Bufs& b) { st_int8_encode<true>(codes(b), b.mt, b.vt, b.n); });
  const SimdKernels* K = &STAGES_KERNELS();
  for (DType pd : {DType::kNone, DType::kBF16}) {
    const char* pn = pd == DType::kNone ? "fp32 params" : "bf16 params + fp32 masters";
    for (MomentKind k : {MomentKind::kF32, MomentKind::kBF16, MomentKind::kInt8}) {
      for (bool st : {false, true}) {
        if (k == MomentKind::kF32 && st) continue;
        char name[160];
        if (k == MomentKind::kF32) {
          std::snprintf(name, sizeof name, "kernel: fp32 moments, %s", pn);
        } else {
          std::snprintf(name, sizeof name, "kernel: %s moments %s, %s", k == MomentKind::kBF16 ? "bf16" : "int8",
                        st ? "stochastic" : "nearest", pn);
        }
        row(name, [K, s, k, st, pd](const Bufs& b) { K->adam(b.args(s, k, st, pd), 0, b.n); });
      }
    }
  }
  return rows;
}

// What the overlap probe writes, so that its hashes are not optimized away
static uint32_t g_probe_sink = 0;

// The overlap probe's rows: four whole kernels, then st_update_hashes<K> for K = 0, 1, 2, 4,
// 6, 8 hashes a vector, each on every thread's cache-resident arrays (n elements) and on its
// RAM arrays (n_ram: one call a round)
static std::vector<Row> overlap_rows(int64_t n, int64_t n_ram, int nthreads, int64_t round_elems) {
  const AdamScalars s = bench_scalars();
  const ArraySet<ProbeStates> cache = array_set<ProbeStates>(n, nthreads, 1u);
  const ArraySet<ProbeStates> ram = array_set<ProbeStates>(n_ram, nthreads, 101u);
  std::vector<Row> rows;
  auto both = [&](const std::string& what, const std::function<void(const ProbeStates&)>& f) {
    rows.push_back(row_on<ProbeStates>(what + ", cache", cache, std::max<int64_t>(1, round_elems / n), f));
    rows.push_back(row_on<ProbeStates>(what + ", RAM", ram, 1, f));
  };
  const SimdKernels* kern = &STAGES_KERNELS();
  const struct {
    const char* name;
    MomentKind kind;
    bool stochastic;
  } kernels[] = {{"fp32 moments", MomentKind::kF32, false},
                 {"bf16 moments stochastic", MomentKind::kBF16, true},
                 {"bf16 moments nearest", MomentKind::kBF16, false},
                 {"int8 moments nearest", MomentKind::kInt8, false}};
  for (const auto& kd : kernels) {
    const MomentKind kind = kd.kind;
    const bool st = kd.stochastic;
    both(std::string("kernel: ") + kd.name, [kern, s, kind, st](const ProbeStates& b) { kern->adam(b.args(s, kind, st), 0, b.n); });
  }
  using Probe = void (*)(const AdamScalars&, float*, const float*, float*, float*, int64_t, uint32_t*);
  const std::pair<int, Probe> probes[] = {{0, st_update_hashes<0>}, {1, st_update_hashes<1>}, {2, st_update_hashes<2>},
                                          {4, st_update_hashes<4>}, {6, st_update_hashes<6>}, {8, st_update_hashes<8>}};
  for (const auto& [k, fn] : probes) {
    both("overlap: " + std::to_string(k) + " hashes",
         [s, fn = fn](const ProbeStates& b) { fn(s, b.w, b.g, b.m, b.v, b.n, &g_probe_sink); });
  }
  return rows;
}

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) / kQBlock * kQBlock : 4096;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 60;
  const int nthreads = argc > 3 ? std::max(1, std::atoi(argv[3])) : 1;
  const double min_seconds = argc > 4 ? std::atof(argv[4]) : 3.0;
  const int64_t round_elems = argc > 5 ? std::atoll(argv[5]) : 200000;
  const int64_t n_ram = argc > 6 ? std::atoll(argv[6]) / 64 * 64 : 0;
  std::vector<Row> rows;
  if (n_ram > 0) {
    rows = overlap_rows(n, n_ram, nthreads, round_elems);
  } else {
    rows = stage_rows(n, nthreads, round_elems);
  }
  const std::vector<double> best = time_rows(rows, nthreads, rounds, min_seconds);
  std::printf("isa\t%s\nelements\t%ld\nthreads\t%d\n", STAGES_KERNELS().name, static_cast<long>(n), nthreads);
  for (size_t k = 0; k < rows.size(); ++k) std::printf("%s\t%.4f\n", rows[k].name.c_str(), best[k]);
  return 0;
}
