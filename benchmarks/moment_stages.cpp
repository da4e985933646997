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

// Random states of n elements as the kernels take them: w ~ N(0, 1), g ~ 1e-2 N, exp_avg ~ 1e-3 N,
// exp_avg_sq ~ 1e-5 |N| (fp32 and their bf16 encodings) and uniform int8 codes; returns the
// generator, for what the caller draws next.
static std::mt19937 fill_states(unsigned seed, int64_t n, float* w, float* g, float* m, float* v, uint16_t* mb,
                                uint16_t* vb, int8_t* mi, uint8_t* vi) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  for (int64_t i = 0; i < n; ++i) {
    w[i] = nd(rng);
    g[i] = nd(rng) * 1e-2f;
    m[i] = nd(rng) * 1e-3f;
    v[i] = std::fabs(nd(rng)) * 1e-5f;
    mb[i] = float_to_bf16(m[i]);
    vb[i] = float_to_bf16(v[i]);
    mi[i] = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
    vi[i] = static_cast<uint8_t>(rng() % 256);
  }
  return rng;
}

// An array carved from a thread's arena (below); data(), size() and [] as std::vector's.
template <class T>
struct Span {
  T* p = nullptr;
  int64_t n = 0;
  T* data() const { return p; }
  int64_t size() const { return n; }
  T& operator[](int64_t i) const { return p[i]; }
};

// One thread's arrays (every thread has its own, cache-resident in its core's caches), 4 KiB
// apart plus distinct offsets (BenchArena).
struct Bufs {
  BenchArena arena;
  template <class T>
  Span<T> take(int64_t n, T init = T()) {
    Span<T> a{arena.take<T>(n), n};
    for (int64_t i = 0; i < n; ++i) a[i] = init;
    return a;
  }
  Span<float> w, g, m, v, mo, vo, mt, vt, sc, sc2;
  Span<uint16_t> mb, vb, pb;
  Span<int8_t> mi;
  Span<uint8_t> vi;
  Bufs(int64_t n, unsigned seed) : arena(BenchArena::bytes_for(static_cast<size_t>(n) * 48 + 8, 15, 4096), 4096) {
    w = take<float>(n), g = take<float>(n), m = take<float>(n), v = take<float>(n);
    mo = take<float>(n), vo = take<float>(n), mt = take<float>(n), vt = take<float>(n);
    sc = take<float>(n / kQBlock + 1, 0.01f), sc2 = take<float>(n / kQBlock + 1, 0.02f);
    mb = take<uint16_t>(n), vb = take<uint16_t>(n), pb = take<uint16_t>(n);
    mi = take<int8_t>(n), vi = take<uint8_t>(n);
    std::mt19937 rng = fill_states(seed, n, w.p, g.p, m.p, v.p, mb.p, vb.p, mi.p, vi.p);
    std::uniform_real_distribution<float> ud(0.0f, 1.0f);
    for (int64_t i = 0; i < n; ++i) {
      mt[i] = m[i] * 100.0f;                 // within the scales of st_int8_encode
      vt[i] = std::sqrt(v[i]) * 5.0f * std::pow(10.0f, -2.0f * ud(rng));
    }
  }
  Bufs(const Bufs&) = delete;
};

// A thread's state arrays as the kernels take them (pointers into Bufs or StepBufs)
struct StateArrays {
  int64_t n = 0;
  float *w = nullptr, *g = nullptr, *m = nullptr, *v = nullptr, *sm = nullptr, *sv = nullptr;
  uint16_t *mb = nullptr, *vb = nullptr;
  int8_t* mi = nullptr;
  uint8_t* vi = nullptr;
  // the whole kernel's arguments for moments of kind k (fp32 grads; parameters of dtype pd
  // written to p_out besides the fp32 w)
  AdamTensorArgs args(const AdamScalars& s, MomentKind k, bool stochastic, DType pd = DType::kNone,
                      void* p_out = nullptr) const {
    AdamTensorArgs a{};
    a.w = w;
    a.g = g;
    a.g_dtype = DType::kF32;
    a.p_dtype = pd;
    a.p_out = p_out;
    a.kind = k;
    a.stochastic = stochastic;
    a.seed_m = 1;
    a.seed_v = 2;
    a.n = n;
    a.s = s;
    if (k == MomentKind::kF32) {
      a.m = m, a.v = v;
    } else if (k == MomentKind::kBF16) {
      a.m = mb, a.v = vb;
    } else {
      a.m = mi, a.v = vi, a.m_scale = sm, a.v_scale = sv;
    }
    return a;
  }
};

// One thread's arrays of n elements for the overlap probe and the kernels beside it (the RAM
// ones: far larger than the caches): fp32 w, g, m, v, bf16 and int8 moments and int8 scales,
// arranged as Bufs' (BenchArena).
struct StepBufs : StateArrays {
  BenchArena arena;
  StepBufs(int64_t n_, unsigned seed)
      : arena(BenchArena::bytes_for(static_cast<size_t>(n_) * 22 + static_cast<size_t>(n_ / kQBlock + 1) * 8, 10, 4096), 4096) {
    n = n_;
    w = arena.take<float>(n), g = arena.take<float>(n), m = arena.take<float>(n), v = arena.take<float>(n);
    mb = arena.take<uint16_t>(n), vb = arena.take<uint16_t>(n);
    mi = arena.take<int8_t>(n), vi = arena.take<uint8_t>(n);
    sm = arena.take<float>(n / kQBlock + 1), sv = arena.take<float>(n / kQBlock + 1);
    fill_states(seed, n, w, g, m, v, mb, vb, mi, vi);
    for (int64_t b = 0; b <= n / kQBlock; ++b) sm[b] = 0.01f, sv[b] = 0.02f;
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

static AdamScalars bench_scalars() {
  const AdamHyper hyper{1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0, true, false};
  return make_adam_scalars(hyper, 1e-3 / (1 - std::pow(0.9, 5)), std::sqrt(1 - std::pow(0.999, 5)));
}

// The stages' and kernels' rows, each on every thread's cache-resident Bufs of n elements
static std::vector<Row> stage_rows(int64_t n, int nthreads, int64_t round_elems) {
  static std::vector<std::unique_ptr<Bufs>> bufs;
  for (int t = 0; t < nthreads; ++t) bufs.push_back(std::make_unique<Bufs>(n, 1u + static_cast<unsigned>(t)));
  static const AdamScalars s = bench_scalars();
  const int64_t calls = std::max<int64_t>(1, round_elems / n);
  std::vector<Row> rows;
  auto row = [&](std::string name, std::function<void(Bufs&)> f) {
    rows.push_back({std::move(name), [f](int t) { f(*bufs[t]); }, n, calls});
  };
  row("stage: loads and stores of an fp32 step", [=](Bufs& b) { st_ldst(b.w.data(), b.g.data(), b.m.data(), b.v.data(), n); });
  row("stage: sqrt and division", [=](Bufs& b) { st_sqrtdiv(b.mo.data(), b.m.data(), b.v.data(), n); });
  row("stage: update (fp32 m, v in and out)", [=](Bufs& b) { st_update(s, b.w.data(), b.g.data(), b.m.data(), b.v.data(), n); });
  row("stage: bf16 decode m, v", [=](Bufs& b) { st_bf16_decode(b.mb.data(), b.vb.data(), b.mo.data(), b.vo.data(), n); });
  row("stage: bf16 encode m, v, nearest", [=](Bufs& b) { st_bf16_encode<false>(b.m.data(), b.v.data(), b.mb.data(), b.vb.data(), n); });
  row("stage: random bits (two hashes)", [=](Bufs& b) { st_hash(b.mo.data(), n); });
  row("stage: bf16 encode m, v, stochastic", [=](Bufs& b) { st_bf16_encode<true>(b.m.data(), b.v.data(), b.mb.data(), b.vb.data(), n); });
  row("stage: int8 decode m, v", [=](Bufs& b) { st_int8_decode(b.mi.data(), b.vi.data(), 0.01f, 0.02f, b.mo.data(), b.vo.data(), n); });
  row("stage: int8 block max m, v", [=](Bufs& b) { st_block_max(b.mt.data(), b.vt.data(), b.mo.data(), n); });
  auto codes = [](Bufs& b) {
    AdamTensorArgs c{};
    c.m = b.mi.data();
    c.v = b.vi.data();
    c.seed_m = 1;
    c.seed_v = 2;
    return c;
  };
  row("stage: int8 encode m, v, nearest", [=](Bufs& b) { st_int8_encode<false>(codes(b), b.mt.data(), b.vt.data(), n); });
  row("stage: int8 encode m, v, stochastic", [=](Bufs& b) { st_int8_encode<true>(codes(b), b.mt.data(), b.vt.data(), n); });
  const SimdKernels* K = &STAGES_KERNELS();
  for (DType pd : {DType::kNone, DType::kBF16}) {
    const char* pn = pd == DType::kNone ? "fp32 params" : "bf16 params + fp32 masters";
    for (MomentKind k : {MomentKind::kF32, MomentKind::kBF16, MomentKind::kInt8}) {
      for (bool st : {false, true}) {
        if (k == MomentKind::kF32 && st) continue;
        auto args = [=](Bufs& b) {
          StateArrays st_arrays;
          st_arrays.n = n;
          st_arrays.w = b.w.p, st_arrays.g = b.g.p, st_arrays.m = b.m.p, st_arrays.v = b.v.p;
          st_arrays.sm = b.sc.p, st_arrays.sv = b.sc2.p, st_arrays.mb = b.mb.p, st_arrays.vb = b.vb.p;
          st_arrays.mi = b.mi.p, st_arrays.vi = b.vi.p;
          return st_arrays.args(s, k, st, pd, pd == DType::kNone ? nullptr : b.pb.data());
        };
        char name[160];
        if (k == MomentKind::kF32) {
          std::snprintf(name, sizeof name, "kernel: fp32 moments, %s", pn);
        } else {
          std::snprintf(name, sizeof name, "kernel: %s moments %s, %s", k == MomentKind::kBF16 ? "bf16" : "int8",
                        st ? "stochastic" : "nearest", pn);
        }
        row(name, [K, args](Bufs& b) { K->adam(args(b), 0, b.w.size()); });
      }
    }
  }
  return rows;
}

// The overlap probe's rows: st_update_hashes<K> on each thread's cache-resident arrays (n
// elements) and on its RAM arrays (n_ram), for K = 0, 1, 2, 4, 6, 8 hashes a vector.
static std::vector<Row> overlap_rows(int64_t n, int64_t n_ram, int nthreads, int64_t round_elems) {
  static const AdamScalars s = bench_scalars();
  static std::vector<std::unique_ptr<StepBufs>> cache, ram;
  static uint32_t sink = 0;
  for (int t = 0; t < nthreads; ++t) {
    cache.push_back(std::make_unique<StepBufs>(n, 1u + static_cast<unsigned>(t)));
    ram.push_back(std::make_unique<StepBufs>(n_ram, 101u + static_cast<unsigned>(t)));
  }
  std::vector<Row> rows;
  auto add = [&](int k, void (*fn)(const AdamScalars&, float*, const float*, float*, float*, int64_t, uint32_t*)) {
    for (bool in_ram : {false, true}) {
      char name[96];
      std::snprintf(name, sizeof name, "overlap: %d hashes, %s", k, in_ram ? "RAM" : "cache");
      const int64_t e = in_ram ? n_ram : n;
      auto& set = in_ram ? ram : cache;
      rows.push_back({name, [fn, e, &set](int t) { fn(s, set[t]->w, set[t]->g, set[t]->m, set[t]->v, e, &sink); },
                      e, in_ram ? 1 : std::max<int64_t>(1, round_elems / n)});
    }
  };
  // the whole kernels beside the probe, on the same arrays
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
    for (bool in_ram : {false, true}) {
      char name[96];
      std::snprintf(name, sizeof name, "kernel: %s, %s", kd.name, in_ram ? "RAM" : "cache");
      auto& set = in_ram ? ram : cache;
      const MomentKind kind = kd.kind;
      const bool st = kd.stochastic;
      rows.push_back({name, [kern, kind, st, &set](int t) { kern->adam(set[t]->args(s, kind, st), 0, set[t]->n); },
                      in_ram ? n_ram : n, in_ram ? 1 : std::max<int64_t>(1, round_elems / n)});
    }
  }
  add(0, st_update_hashes<0>);
  add(1, st_update_hashes<1>);
  add(2, st_update_hashes<2>);
  add(4, st_update_hashes<4>);
  add(6, st_update_hashes<6>);
  add(8, st_update_hashes<8>);
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
