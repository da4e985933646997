// Where the cycles of the compressed-moment kernels go: each stage of the SIMD body timed
// alone on cache-resident data (one thread), then the whole kernels. Built and run by
// `benchmarks/adam_step.py --stages` (one binary per instruction set the processor has):
//
//   c++ -O3 -std=c++17 -ffp-contract=off -fno-math-errno -Icsrc -DSTAGES_AVX2
//       benchmarks/moment_stages.cpp -o /tmp/stages && /tmp/stages 4096
//
// It includes the ISA file itself (csrc/adam/adam_avx2.cpp or adam_avx512.cpp), so the stages
// are the kernel's own building blocks (VecAdam, VecHash, VecBf16, VecF8, SimdMoments),
// compiled with the extension's flags. Prints one line per stage: name, ns per element.
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

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>


using namespace statestore;
using namespace statestore::cpu;

// best time per element (ns) of f over n elements: rounds of enough calls for ~0.5 ms each
static double ns_per_elem(const std::function<void()>& f, int64_t n, int rounds) {
  const int64_t calls = std::max<int64_t>(1, 200000 / n);
  for (int i = 0; i < 20; ++i) f();
  double best = 1e30;
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t c = 0; c < calls; ++c) f();
    const std::chrono::duration<double, std::nano> dt = std::chrono::steady_clock::now() - t0;
    best = std::min(best, dt.count() / static_cast<double>(calls * n));
  }
  return best;
}

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
  I weyl = VecHash<V>::weyl(0);
  const I step = VecHash<V>::step();
  for (int64_t i = 0; i + W <= n; i += W) {
    if constexpr (kStoch) {
      VecBf16<V, true>::store(m + i, v + i, V::load(mi + i), V::load(vi + i),
                              VecHash<V>::bits16(weyl, 1u), VecHash<V>::bits16(weyl, 2u));
      weyl = V::addi(weyl, step);
    } else {
      VecBf16<V, false>::store(m + i, v + i, V::load(mi + i), V::load(vi + i), weyl, weyl);
    }
  }
}
__attribute__((noinline)) void st_hash(float* o, int64_t n) {
  I weyl = VecHash<V>::weyl(0);
  const I step = VecHash<V>::step();
  for (int64_t i = 0; i + W <= n; i += W) {
    const I a = VecHash<V>::mix(weyl, 1u), b = VecHash<V>::mix(weyl, 2u);
    weyl = V::addi(weyl, step);
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
}  // namespace
}  // namespace cpu
}  // namespace statestore
#pragma GCC pop_options

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) / kQBlock * kQBlock : 4096;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 60;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<float> ud(0.0f, 1.0f);
  std::vector<float> w(n), g(n), m(n), v(n), mo(n), vo(n), mt(n), vt(n), sc(n / kQBlock + 1, 0.01f),
      sc2(n / kQBlock + 1, 0.02f);
  std::vector<uint16_t> mb(n), vb(n);
  std::vector<int8_t> mi(n);
  std::vector<uint8_t> vi(n);
  for (int64_t i = 0; i < n; ++i) {
    w[i] = nd(rng);
    g[i] = nd(rng) * 1e-2f;
    m[i] = nd(rng) * 1e-3f;
    v[i] = std::fabs(nd(rng)) * 1e-5f;
    mb[i] = float_to_bf16(m[i]);
    vb[i] = float_to_bf16(v[i]);
    mi[i] = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
    vi[i] = static_cast<uint8_t>(rng() % 256);
    mt[i] = m[i] * 100.0f;                   // within the scales of st_int8_encode
    vt[i] = std::sqrt(v[i]) * 5.0f * std::pow(10.0f, -2.0f * ud(rng));
  }
  const AdamHyper hyper{1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0, true, false};
  const AdamScalars s = make_adam_scalars(hyper, 1e-3 / (1 - std::pow(0.9, 5)),
                                          std::sqrt(1 - std::pow(0.999, 5)));
  AdamTensorArgs codes{};
  codes.m = mi.data();
  codes.v = vi.data();
  codes.seed_m = 1;
  codes.seed_v = 2;
  auto row = [&](const char* name, const std::function<void()>& f) {
    std::printf("%s\t%.4f\n", name, ns_per_elem(f, n, rounds));
  };
  std::printf("isa\t%s\nelements\t%ld\n", STAGES_KERNELS().name, static_cast<long>(n));
  row("stage: loads and stores of an fp32 step", [&] { st_ldst(w.data(), g.data(), m.data(), v.data(), n); });
  row("stage: sqrt and division", [&] { st_sqrtdiv(mo.data(), m.data(), v.data(), n); });
  row("stage: update (fp32 m, v in and out)", [&] { st_update(s, w.data(), g.data(), m.data(), v.data(), n); });
  row("stage: bf16 decode m, v", [&] { st_bf16_decode(mb.data(), vb.data(), mo.data(), vo.data(), n); });
  row("stage: bf16 encode m, v, nearest", [&] { st_bf16_encode<false>(m.data(), v.data(), mb.data(), vb.data(), n); });
  row("stage: random bits (two hashes)", [&] { st_hash(mo.data(), n); });
  row("stage: bf16 encode m, v, stochastic", [&] { st_bf16_encode<true>(m.data(), v.data(), mb.data(), vb.data(), n); });
  row("stage: int8 decode m, v", [&] { st_int8_decode(mi.data(), vi.data(), 0.01f, 0.02f, mo.data(), vo.data(), n); });
  row("stage: int8 block max m, v", [&] { st_block_max(mt.data(), vt.data(), mo.data(), n); });
  row("stage: int8 encode m, v, nearest", [&] { st_int8_encode<false>(codes, mt.data(), vt.data(), n); });
  row("stage: int8 encode m, v, stochastic", [&] { st_int8_encode<true>(codes, mt.data(), vt.data(), n); });
  const SimdKernels& K = STAGES_KERNELS();
  for (DType pd : {DType::kNone, DType::kBF16}) {
    std::vector<uint16_t> pb(n);
    const char* pn = pd == DType::kNone ? "fp32 params" : "bf16 params + fp32 masters";
    AdamTensorArgs b{};
    b.w = w.data();
    b.g = g.data();
    b.m = m.data();
    b.v = v.data();
    b.kind = MomentKind::kF32;
    b.g_dtype = DType::kF32;
    b.p_dtype = pd;
    b.p_out = pd == DType::kNone ? nullptr : pb.data();
    b.n = n;
    b.s = s;
    char name[160];
    std::snprintf(name, sizeof name, "kernel: fp32 moments, %s", pn);
    row(name, [&] { K.adam(b, 0, n); });
    for (MomentKind k : {MomentKind::kBF16, MomentKind::kInt8}) {
      for (bool st : {false, true}) {
        AdamTensorArgs a{};
        a.w = w.data();
        a.g = g.data();
        a.g_dtype = DType::kF32;
        a.p_dtype = pd;
        a.p_out = b.p_out;
        a.kind = k;
        a.stochastic = st;
        a.seed_m = 1;
        a.seed_v = 2;
        a.n = n;
        a.s = s;
        if (k == MomentKind::kBF16) {
          a.m = mb.data();
          a.v = vb.data();
        } else {
          a.m = mi.data();
          a.v = vi.data();
          a.m_scale = sc.data();
          a.v_scale = sc2.data();
        }
        std::snprintf(name, sizeof name, "kernel: %s moments %s, %s",
                      k == MomentKind::kBF16 ? "bf16" : "int8", st ? "stochastic" : "nearest", pn);
        row(name, [&] { K.adam(a, 0, n); });
      }
    }
  }
  return 0;
}
