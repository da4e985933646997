// Torch binding of the CPU Adam kernels: the `statestore` op library (schemas with mutation
// annotations, CPU implementations), run-time choice of the SIMD path, multi-threading with
// torch's intra-op threads, and the module `statestore._C_adam`.
//
// Threading: the elements of every tensor of a call are cut into fixed chunks (kChunk
// elements); at::parallel_for hands each thread a contiguous run of chunks. The update is
// elementwise with no reduction, and the SIMD body and the scalar tail compute the same bits,
// so results do not depend on the number of threads.
// torch's headers are most of this file's compile time: only those used (not
// <torch/extension.h>, the whole C++ frontend).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/isfinite.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam/adam_checks.h"
#include "adam/adam_kernels.h"
#ifdef STATESTORE_WITH_CUDA
#include "cuda/fused_adam.h"
#include "cuda/fused_adam_moments.h"
#endif

namespace statestore {
namespace cpu {
namespace {

constexpr int64_t kChunk = 1 << 14;  // elements per work item (64 KiB of fp32)

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq");
}

const SimdKernels* best_kernels() {
  if (cpu_has_avx512()) return &avx512_kernels();
  if (cpu_has_avx2()) return &avx2_kernels();
  return &scalar_kernels();
}

std::atomic<const SimdKernels*>& active() {
  static std::atomic<const SimdKernels*> k{best_kernels()};
  return k;
}

std::vector<std::string> simd_supported() {
  std::vector<std::string> out;
  if (cpu_has_avx512()) out.emplace_back("avx512");
  if (cpu_has_avx2()) out.emplace_back("avx2");
  out.emplace_back("scalar");
  return out;
}

// Selects a path by name ("avx512", "avx2", "scalar", or "auto"/"" for the best the
// processor supports). Never selects a path the processor lacks: that is an error.
std::string set_simd(const std::string& name) {
  const SimdKernels* k = nullptr;
  if (name.empty() || name == "auto") {
    k = best_kernels();
  } else if (name == "avx512") {
    if (!cpu_has_avx512())
      throw std::runtime_error("set_simd: this processor does not support AVX-512 (F/BW/VL/DQ)");
    k = &avx512_kernels();
  } else if (name == "avx2") {
    if (!cpu_has_avx2())
      throw std::runtime_error("set_simd: this processor does not support AVX2+FMA+F16C");
    k = &avx2_kernels();
  } else if (name == "scalar") {
    k = &scalar_kernels();
  } else {
    throw std::invalid_argument("set_simd: unknown SIMD path '" + name +
                                "' (expected avx512, avx2, scalar or auto)");
  }
  active().store(k);
  return k->name;
}

pybind11::tuple simd_in_use() {
  const SimdKernels* k = active().load();
  return pybind11::make_tuple(std::string(k->name), k->width_bits);
}

using checks::storage_of;

// Runs kernel(job, b, e) over every element range [b, e) of every job, in parallel over fixed
// chunks of kChunk elements.
template <typename Job, typename Kernel>
void run_chunked(const std::vector<Job>& jobs, Kernel kernel) {
  std::vector<int64_t> prefix(jobs.size() + 1, 0);
  int64_t total = 0;
  for (size_t t = 0; t < jobs.size(); ++t) {
    prefix[t + 1] = prefix[t] + (jobs[t].n + kChunk - 1) / kChunk;
    total += jobs[t].n;
  }
  if (total <= 2 * kChunk || at::get_num_threads() <= 1 || at::in_parallel_region()) {
    for (const auto& j : jobs) kernel(j, 0, j.n);
    return;
  }
  at::parallel_for(0, prefix.back(), 1, [&](int64_t cb, int64_t ce) {
    size_t t = static_cast<size_t>(std::upper_bound(prefix.begin(), prefix.end(), cb) - prefix.begin()) - 1;
    for (int64_t c = cb; c < ce;) {
      while (prefix[t + 1] <= c) ++t;
      const int64_t cend = std::min(ce, prefix[t + 1]);
      const int64_t b = (c - prefix[t]) * kChunk;
      const int64_t e = std::min(jobs[t].n, (cend - prefix[t]) * kChunk);
      kernel(jobs[t], b, e);
      c = cend;
    }
  });
}

// The `statestore::adam_` op on CPU, every encoding of the moments: the arguments are
// checked once (checks::adam_jobs, shared with the CUDA binding), then every tensor is
// updated in parallel over fixed chunks (kChunk is a multiple of kQBlock, so int8 blocks
// never straddle two threads).
void adam_cpu(STATESTORE_ADAM_OP_PARAMS) {
  static_assert(kChunk % kQBlock == 0, "chunks must hold whole int8 blocks");
  const std::vector<AdamTensorArgs> jobs = checks::adam_jobs(STATESTORE_ADAM_OP_ARGS, nullptr);
  run_chunked(jobs, active().load()->adam);
}

// A buffer of floats to test for non-finite values.
struct FiniteJob {
  const void* data;
  DType dtype;
  int64_t n;
};

// True when every element of every job is finite: in parallel over fixed chunks, stopping
// early once one is not.
bool all_finite(const std::vector<FiniteJob>& jobs) {
  const SimdKernels& k = *active().load();
  constexpr int64_t kFiniteChunk = 1 << 16;
  std::vector<int64_t> prefix(jobs.size() + 1, 0);
  for (size_t t = 0; t < jobs.size(); ++t) prefix[t + 1] = prefix[t] + (jobs[t].n + kFiniteChunk - 1) / kFiniteChunk;
  std::atomic<bool> ok{true};
  auto body = [&](int64_t cb, int64_t ce) {
    size_t t = static_cast<size_t>(std::upper_bound(prefix.begin(), prefix.end(), cb) - prefix.begin()) - 1;
    for (int64_t c = cb; c < ce && ok.load(std::memory_order_relaxed); ++c) {
      while (prefix[t + 1] <= c) ++t;
      const int64_t b = (c - prefix[t]) * kFiniteChunk;
      const int64_t e = std::min(jobs[t].n, b + kFiniteChunk);
      if (!k.finite(jobs[t].data, jobs[t].dtype, b, e)) ok.store(false, std::memory_order_relaxed);
    }
  };
  if (prefix.back() <= 2 || at::get_num_threads() <= 1 || at::in_parallel_region()) body(0, prefix.back());
  else at::parallel_for(0, prefix.back(), 1, body);
  return ok.load();
}

bool grads_finite_cpu(at::TensorList grads) {
  std::vector<FiniteJob> jobs;
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    TORCH_CHECK(g.device().is_cpu(), "grads_finite: grads[", i, "] is on ", g.device(), ", expected cpu");
    const DType d = storage_of(g.scalar_type());
    if (d == DType::kNone || !g.is_contiguous()) {
      if (g.is_floating_point() || g.is_complex()) {
        if (!at::isfinite(g).all().item<bool>()) return false;
      }
      continue;
    }
    if (g.numel() > 0) jobs.push_back({g.data_ptr(), d, g.numel()});
  }
  return all_finite(jobs);
}

// Roofline probe (benchmarks only): p += g; m += g; v += g over fp32 tensors, with the
// threading of adam_.
void bandwidth_probe(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m,
                     const at::Tensor& v) {
  for (const at::Tensor* t : {&p, &g, &m, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == at::kFloat &&
                    t->numel() == p.numel(),
                "bandwidth_probe: p, g, m, v must be contiguous float32 CPU tensors of one size");
  }
  const SimdKernels& k = *active().load();
  float* pp = p.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const int64_t nchunks = (p.numel() + kChunk - 1) / kChunk;
  const int64_t n = p.numel();
  pybind11::gil_scoped_release nogil;
  at::parallel_for(0, nchunks, 1, [&](int64_t cb, int64_t ce) {
    k.probe(pp, gp, mp, vp, cb * kChunk, std::min(n, ce * kChunk));
  });
}

// dst <- src, byte for byte, with the active path's streaming stores (stream_copy). For
// buffers headed to a device; one thread, without the GIL: a copy into a store's ring runs
// beside the disk's transfers, and a second thread took CPU from the I/O completions here
// (benchmarks/nvme_io.py, docs/nvme.md "Copies into the ring").
void stream_copy(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu(),
              "stream_copy: dst and src must be CPU tensors, got ", dst.device(), " and ",
              src.device());
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(),
              "stream_copy: dst and src must be contiguous");
  TORCH_CHECK(dst.scalar_type() == src.scalar_type(), "stream_copy: dst is ", dst.scalar_type(),
              ", src is ", src.scalar_type(), "; the copy does not convert");
  TORCH_CHECK(dst.numel() == src.numel(), "stream_copy: dst has ", dst.numel(),
              " elements, src has ", src.numel());
  const int64_t n = src.numel() * static_cast<int64_t>(src.element_size());
  if (n == 0) return;
  void* d = dst.data_ptr();
  const void* s = src.data_ptr();
  const auto db = reinterpret_cast<uintptr_t>(d), sb = reinterpret_cast<uintptr_t>(s);
  TORCH_CHECK(db + static_cast<uintptr_t>(n) <= sb || sb + static_cast<uintptr_t>(n) <= db,
              "stream_copy: dst and src overlap");
  const SimdKernels& k = *active().load();
  pybind11::gil_scoped_release nogil;
  k.stream_copy(d, s, n);
}

// ---- step plans -------------------------------------------------------------------------
//
// A StepPlan is an optimizer step compiled once (statestore/optim/_units.py, StepProgram):
// per parameter, the parameter and what its gradient must look like; per param group, the
// group's dict and its "params" list; and either each parameter's states (resident stores:
// the store's live tensors, held) or the pipeline units of a streaming store (per unit, each
// parameter range and where its states are in the unit's list of tensors). A step is then:
//   begin(): 1. checks, changing nothing: the groups and their parameters are the planned
//      objects, in order; every planned parameter still has its data, dtype and size, and a
//      gradient of the planned dtype, strided, contiguous, of its shape, on its device; no
//      other parameter of the groups has a gradient. Anything else: kPlanStale (the caller
//      steps the general way and plans again).
//      2. with check_finite, a gradient holding inf or nan: kPlanSkipped (nothing changed).
//      3. each planned parameter's step count, read from the optimizer's `steps` dict (never
//      cached here: resume does not depend on this object), plus one, and its bias
//      correction as statestore.kernels._dispatch.bias_terms computes it (double math, the
//      same libm calls); then the counts are written back in the planned order, each one's
//      previous value first recorded in `undo` (None: it had none), as ParamTable does.
//   then the kernel, without the GIL: run() (begin() and every parameter's states: on the
//   CPU, the SIMD kernel of `adam_` in one parallel loop over all chunks; on CUDA, one
//   table of every tensor of every group copied to device memory and one launch,
//   cuda::run_adam_jobs; with `dispatch`, the `statestore::adam_` op through the dispatcher,
//   one call per group, the op's own route), or run_unit() for each unit a streaming
//   store's pipeline hands out.
// Resident states are checked once, when planned, by checks::adam_jobs (the op's own
// checks); a unit's tensors at each run_unit (cheap C++ checks, the same rules).
constexpr int kPlanOk = 0;
constexpr int kPlanStale = 1;
constexpr int kPlanSkipped = 2;

// _quant.py's moment_seed: the seed of state `which` of a parameter whose key hashes to `kh`,
// at step count `step`.
// (its mixing rounds are adam_math.h's ss_mix32, the element hash's)
uint32_t hash_scalar(uint32_t x) { return ss_mix32(x); }
uint32_t moment_seed(uint32_t kh, int which, int64_t step) {
  return hash_scalar(kh ^ hash_scalar(static_cast<uint32_t>(static_cast<uint64_t>(step) * 2u +
                                                            static_cast<uint64_t>(which))));
}

void call_adam_op(STATESTORE_ADAM_OP_PARAMS) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("statestore::adam_", "")
          .typed<void(at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                      at::TensorList, at::TensorList, at::TensorList,
                      const c10::List<std::optional<at::Tensor>>&, at::ArrayRef<int64_t>,
                      at::ArrayRef<int64_t>, at::ArrayRef<int64_t>, at::ArrayRef<double>,
                      c10::string_view)>();
  op.call(params, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales,
          max_exp_avg_sqs, masters, steps, seeds, offsets, hyper, moments);
}

class StepPlan {
 public:
  StepPlan(const std::string& moments, bool dispatch)
      : moments_(moments), coding_(checks::moment_coding(moments)), dispatch_(dispatch) {}

  // A param group: its dict and its "params" list (every parameter, planned or not).
  int64_t add_group(const pybind11::object& group, const pybind11::list& params) {
    Group g;
    g.dict = group;
    for (const pybind11::handle h : params) {
      Member m;
      m.obj = pybind11::reinterpret_borrow<pybind11::object>(h);
      m.tensor = h.cast<at::Tensor>();
      g.members.push_back(std::move(m));
    }
    groups_.push_back(std::move(g));
    return static_cast<int64_t>(groups_.size()) - 1;
  }

  // Parameter `member` of group `group` is updated each step: its key (the `steps` dict's),
  // the key's hash (compressed moments' seeds) and a gradient as it will come. Returns its
  // entry's index.
  int64_t add_entry(int64_t group, int64_t member, const pybind11::object& key,
                    int64_t key_hash, const at::Tensor& grad) {
    TORCH_CHECK(group >= 0 && group < static_cast<int64_t>(groups_.size()),
                "StepPlan: no group ", group);
    Group& g = groups_[static_cast<size_t>(group)];
    TORCH_CHECK(member >= 0 && member < static_cast<int64_t>(g.members.size()) &&
                    g.members[static_cast<size_t>(member)].entry < 0,
                "StepPlan: group ", group, " has no unplanned parameter ", member);
    const at::Tensor& p = g.members[static_cast<size_t>(member)].tensor;
    if (!entries_.empty()) {
      TORCH_CHECK(p.device() == device_, "StepPlan: parameters on ", device_, " and ",
                  p.device());
    } else {
      device_ = p.device();
    }
    TORCH_CHECK(p.is_contiguous() && grad.layout() == at::kStrided &&
                    grad.sizes() == p.sizes() && grad.device() == p.device() &&
                    checks::storage_of(grad.scalar_type()) != DType::kNone,
                "StepPlan: the parameter or its gradient cannot be planned");
    Entry e;
    e.group = static_cast<size_t>(group);
    e.param = p;
    e.key = key;
    e.key_hash = static_cast<uint32_t>(key_hash);
    e.p_data = p.data_ptr();
    e.p_dtype = p.scalar_type();
    e.numel = p.numel();
    e.g_dtype = grad.scalar_type();
    g.members[static_cast<size_t>(member)].entry = static_cast<int64_t>(entries_.size());
    entries_.push_back(std::move(e));
    return static_cast<int64_t>(entries_.size()) - 1;
  }

  // Resident stores: entry `entry`'s states, the store's live tensors (held by the plan).
  void set_states(int64_t entry, const at::Tensor& grad, const at::Tensor& exp_avg,
                  const at::Tensor& exp_avg_sq,
                  const std::optional<at::Tensor>& max_exp_avg_sq,
                  const std::optional<at::Tensor>& master,
                  const std::optional<at::Tensor>& exp_avg_scale,
                  const std::optional<at::Tensor>& exp_avg_sq_scale) {
    TORCH_CHECK(units_.empty(), "StepPlan: a plan of units holds no states");
    Entry& e = entry_at(entry);
    TORCH_CHECK(grad.scalar_type() == e.g_dtype, "StepPlan: not the planned gradient");
    const std::vector<at::Tensor> one_p{e.param}, one_g{grad}, one_m{exp_avg}, one_v{exp_avg_sq};
    std::vector<at::Tensor> ms, vs, vmax;
    if (exp_avg_scale.has_value()) ms.push_back(*exp_avg_scale);
    if (exp_avg_sq_scale.has_value()) vs.push_back(*exp_avg_sq_scale);
    if (max_exp_avg_sq.has_value()) vmax.push_back(*max_exp_avg_sq);
    c10::List<std::optional<at::Tensor>> masters;
    if (master.has_value()) masters.push_back(*master);
    const std::vector<int64_t> one{1};
    const std::vector<double> hyper{1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0, 0.0, 1.0,
                                    vmax.empty() ? 0.0 : 1.0};
    const std::vector<int64_t> seeds = coding_.stochastic ? std::vector<int64_t>{0, 0}
                                                          : std::vector<int64_t>{};
    const at::Device dev = device_;
    // the op's own checks, once: dtypes, sizes, contiguity, devices
    const std::vector<AdamTensorArgs> jobs = checks::adam_jobs(
        checks::AdamOpArgs{one_p, one_g, one_m, one_v, ms, vs, vmax, masters, one, seeds, {},
                           hyper, moments_},
        dev.is_cpu() ? nullptr : &dev);
    e.exp_avg = exp_avg;
    e.exp_avg_sq = exp_avg_sq;
    e.max_exp_avg_sq = max_exp_avg_sq;
    e.master = master;
    e.exp_avg_scale = exp_avg_scale;
    e.exp_avg_sq_scale = exp_avg_sq_scale;
    e.has_states = true;
    e.empty = jobs.empty();
    if (!e.empty) e.tmpl = jobs[0];
  }

  // Streaming stores: a new unit (its index).
  int64_t add_unit() {
    units_.emplace_back();
    return static_cast<int64_t>(units_.size()) - 1;
  }

  // Elements [a, b) of entry `entry` are in unit `unit`, their states at these positions of
  // the unit's list of tensors (-1: not kept).
  void add_slice(int64_t unit, int64_t entry, int64_t a, int64_t b, int64_t exp_avg,
                 int64_t exp_avg_sq, int64_t max_exp_avg_sq, int64_t master,
                 int64_t exp_avg_scale, int64_t exp_avg_sq_scale) {
    TORCH_CHECK(unit >= 0 && unit < static_cast<int64_t>(units_.size()), "StepPlan: no unit ",
                unit);
    TORCH_CHECK(device_.is_cpu(), "StepPlan: units are planned on the CPU only");
    const Entry& e = entry_at(entry);
    TORCH_CHECK(0 <= a && a <= b && b <= e.numel, "StepPlan: elements [", a, ", ", b,
                ") of a parameter of ", e.numel);
    TORCH_CHECK(exp_avg >= 0 && exp_avg_sq >= 0, "StepPlan: a slice without its moments");
    TORCH_CHECK(coding_.kind != MomentKind::kInt8 ||
                    (a % kQBlock == 0 && exp_avg_scale >= 0 && exp_avg_sq_scale >= 0),
                "StepPlan: int8 moments need block-aligned slices and their scales");
    TORCH_CHECK((master >= 0) == (e.p_dtype != at::kFloat) &&
                    checks::storage_of(e.p_dtype) != DType::kNone,
                "StepPlan: an fp32 master goes with a low-precision parameter, and only then");
    units_[static_cast<size_t>(unit)].push_back(
        Slice{static_cast<size_t>(entry), a, b, exp_avg, exp_avg_sq, max_exp_avg_sq, master,
              exp_avg_scale, exp_avg_sq_scale});
  }

  int64_t size() const { return static_cast<int64_t>(entries_.size()); }

  // Steps 1-3 above (`hypers`: per group, the op's `hyper` argument, AdamHyper).
  int begin(const pybind11::list& param_groups, const pybind11::dict& steps,
            const pybind11::dict& undo, const std::vector<std::vector<double>>& hypers,
            bool check_finite) {
    // 1. checks
    const size_t ng = groups_.size();
    if (static_cast<size_t>(PyList_GET_SIZE(param_groups.ptr())) != ng || hypers.size() != ng)
      return kPlanStale;
    hy_.clear();
    hyper_args_ = hypers;
    for (const std::vector<double>& h : hypers) {
      if (checks::hyper_problem(h) != nullptr) return kPlanStale;
      hy_.push_back(checks::adam_hyper(h));
    }
    grads_.assign(entries_.size(), at::Tensor());
    for (size_t gi = 0; gi < ng; ++gi) {
      const Group& g = groups_[gi];
      PyObject* d = PyList_GET_ITEM(param_groups.ptr(), static_cast<Py_ssize_t>(gi));
      if (d != g.dict.ptr() || !PyDict_Check(d)) return kPlanStale;
      PyObject* ps = PyDict_GetItemString(d, "params");
      if (ps == nullptr || !PyList_Check(ps) ||
          static_cast<size_t>(PyList_GET_SIZE(ps)) != g.members.size())
        return kPlanStale;
      for (size_t j = 0; j < g.members.size(); ++j) {
        const Member& m = g.members[j];
        if (PyList_GET_ITEM(ps, static_cast<Py_ssize_t>(j)) != m.obj.ptr()) return kPlanStale;
        at::Tensor grad = m.tensor.grad();
        if (m.entry < 0) {
          if (grad.defined()) return kPlanStale;
          continue;
        }
        const Entry& e = entries_[static_cast<size_t>(m.entry)];
        const at::Tensor& p = e.param;
        if (!grad.defined() || p.data_ptr() != e.p_data || p.scalar_type() != e.p_dtype ||
            p.numel() != e.numel || !p.is_contiguous() || grad.layout() != at::kStrided ||
            grad.scalar_type() != e.g_dtype || grad.device() != p.device() ||
            grad.sizes() != p.sizes() || !grad.is_contiguous())
          return kPlanStale;
        grads_[static_cast<size_t>(m.entry)] = std::move(grad);
      }
    }
    // 2. non-finite gradients
    if (check_finite) {
      if (!device_.is_cpu()) return kPlanStale;  // the CUDA check is the general path's
      std::vector<FiniteJob> fj;
      for (size_t i = 0; i < entries_.size(); ++i) {
        if (entries_[i].numel > 0)
          fj.push_back({grads_[i].data_ptr(), checks::storage_of(entries_[i].g_dtype),
                        entries_[i].numel});
      }
      bool ok;
      {
        pybind11::gil_scoped_release nogil;
        ok = all_finite(fj);
      }
      if (!ok) {
        grads_.clear();
        return kPlanSkipped;
      }
    }
    // 3. step counts and the bias corrections
    const size_t n = entries_.size();
    counts_.resize(n);
    scalars_.resize(n);
    for (size_t i = 0; i < n; ++i) {
      const Entry& e = entries_[i];
      PyObject* old = PyDict_GetItem(steps.ptr(), e.key.ptr());  // borrowed, or null
      int64_t c = 1;
      if (old != nullptr) {
        if (!PyLong_CheckExact(old)) return kPlanStale;
        int overflow = 0;
        const long long v = PyLong_AsLongLongAndOverflow(old, &overflow);
        if (overflow != 0 || (v == -1 && PyErr_Occurred())) {
          PyErr_Clear();
          return kPlanStale;
        }
        c = static_cast<int64_t>(v) + 1;
      }
      if (!make_adam_scalars(hy_[e.group], c, &scalars_[i])) return kPlanStale;
      counts_[i] = c;
    }
    // From here on the step is made: each count's previous value recorded, then the count.
    for (size_t i = 0; i < n; ++i) {
      PyObject* key = entries_[i].key.ptr();
      if (PyDict_GetItem(undo.ptr(), key) == nullptr) {
        PyObject* old = PyDict_GetItem(steps.ptr(), key);
        if (PyDict_SetItem(undo.ptr(), key, old != nullptr ? old : Py_None) != 0)
          throw pybind11::error_already_set();
      }
      pybind11::int_ v(counts_[i]);
      if (PyDict_SetItem(steps.ptr(), key, v.ptr()) != 0) throw pybind11::error_already_set();
    }
    return kPlanOk;
  }

  // begin(), then the kernel over every entry's held states (resident stores).
  int run(const pybind11::list& param_groups, const pybind11::dict& steps,
          const std::vector<std::vector<double>>& hypers, bool check_finite) {
    TORCH_CHECK(units_.empty(), "StepPlan: a plan of units steps unit by unit (run_unit)");
    pybind11::dict undo;
    const int status = begin(param_groups, steps, undo, hypers, check_finite);
    if (status != kPlanOk) return status;
    if (dispatch_ || !(device_.is_cpu() || device_.is_cuda())) {
      dispatch_groups();
      grads_.clear();
      return kPlanOk;
    }
    std::vector<AdamTensorArgs> jobs;
    jobs.reserve(entries_.size());
    for (size_t i = 0; i < entries_.size(); ++i) {
      const Entry& e = entries_[i];
      TORCH_CHECK(e.has_states, "StepPlan: a parameter without its states");
      if (e.empty) continue;
      AdamTensorArgs t = e.tmpl;
      t.g = grads_[i].data_ptr();
      finish_args(t, i);
      jobs.push_back(t);
    }
    if (device_.is_cpu()) {
      pybind11::gil_scoped_release nogil;
      run_chunked(jobs, active().load()->adam);
    } else {
#ifdef STATESTORE_WITH_CUDA
      // every tensor of every group: one table in device memory, one launch
      pybind11::gil_scoped_release nogil;
      ::statestore::cuda::run_adam_jobs(jobs.data(), jobs.size(), device_.index());
#else
      TORCH_CHECK(false, "StepPlan: this build of statestore has no CUDA kernels");
#endif
    }
    grads_.clear();
    return kPlanOk;
  }

  // The kernel over unit `unit`, whose states the pipeline handed out as `tensors`; after a
  // begin() that returned kPlanOk.
  void run_unit(int64_t unit, const std::vector<at::Tensor>& tensors) {
    TORCH_CHECK(unit >= 0 && unit < static_cast<int64_t>(units_.size()), "StepPlan: no unit ",
                unit);
    TORCH_CHECK(grads_.size() == entries_.size(), "StepPlan: run_unit before begin");
    const MomentKind kind = coding_.kind;
    const at::ScalarType mt = kind == MomentKind::kF32 ? at::kFloat
                              : kind == MomentKind::kBF16 ? at::kBFloat16 : at::kChar;
    const at::ScalarType vt = kind == MomentKind::kF32 ? at::kFloat
                              : kind == MomentKind::kBF16 ? at::kBFloat16 : at::kByte;
    std::vector<AdamTensorArgs> jobs;
    for (const Slice& sl : units_[static_cast<size_t>(unit)]) {
      const Entry& e = entries_[sl.entry];
      const int64_t n = sl.b - sl.a;
      const int64_t nb = (n + kQBlock - 1) / kQBlock;
      auto state = [&](int64_t pos, at::ScalarType dt, int64_t numel) -> void* {
        TORCH_CHECK(pos >= 0 && pos < static_cast<int64_t>(tensors.size()),
                    "StepPlan: the unit has ", tensors.size(), " tensors, no ", pos);
        const at::Tensor& t = tensors[static_cast<size_t>(pos)];
        TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == dt &&
                        t.numel() == numel,
                    "StepPlan: tensor ", pos, " of unit ", unit, " is not the planned state (",
                    dt, ", ", numel, " elements)");
        return t.data_ptr();
      };
      AdamTensorArgs t{};
      t.kind = kind;
      t.stochastic = coding_.stochastic;
      t.m = state(sl.m, mt, n);
      t.v = state(sl.v, vt, n);
      if (kind == MomentKind::kInt8) {
        t.m_scale = static_cast<float*>(state(sl.ms, at::kFloat, nb));
        t.v_scale = static_cast<float*>(state(sl.vs, at::kFloat, nb));
      }
      if (sl.vmax >= 0) t.vmax = static_cast<float*>(state(sl.vmax, at::kFloat, n));
      t.offset = kind == MomentKind::kF32 ? 0 : sl.a;
      t.g_dtype = checks::storage_of(e.g_dtype);
      const at::Tensor& g = grads_[sl.entry];
      t.g = static_cast<const char*>(g.data_ptr()) + sl.a * static_cast<int64_t>(g.element_size());
      char* pdata = static_cast<char*>(e.param.data_ptr());
      if (sl.master >= 0) {
        t.w = static_cast<float*>(state(sl.master, at::kFloat, n));
        t.p_dtype = checks::storage_of(e.p_dtype);
        t.p_out = pdata + sl.a * static_cast<int64_t>(e.param.element_size());
      } else {
        t.w = reinterpret_cast<float*>(pdata) + sl.a;
        t.p_dtype = DType::kNone;
        t.p_out = nullptr;
      }
      t.n = n;
      finish_args(t, sl.entry);
      if (n > 0) jobs.push_back(t);
    }
    pybind11::gil_scoped_release nogil;
    run_chunked(jobs, active().load()->adam);
  }

  // After the last unit: the gradients are no longer held.
  void end() { grads_.clear(); }

 private:
  struct Member {
    pybind11::object obj;  // the parameter (its identity is checked)
    at::Tensor tensor;     // the same tensor (its gradient is read)
    int64_t entry = -1;    // its entry, or -1: not planned (must have no gradient)
  };
  struct Group {
    pybind11::object dict;
    std::vector<Member> members;
  };
  struct Entry {
    size_t group = 0;
    at::Tensor param;
    pybind11::object key;
    uint32_t key_hash = 0;
    const void* p_data = nullptr;
    at::ScalarType p_dtype = at::kFloat;
    at::ScalarType g_dtype = at::kFloat;
    int64_t numel = 0;
    // resident stores: the states, held (the plan's pointers stay valid)
    bool has_states = false;
    at::Tensor exp_avg, exp_avg_sq;
    std::optional<at::Tensor> max_exp_avg_sq, master, exp_avg_scale, exp_avg_sq_scale;
    bool empty = false;  // no elements: its count advances, nothing to compute
    AdamTensorArgs tmpl{};
  };
  struct Slice {
    size_t entry;
    int64_t a, b;
    int64_t m, v, vmax, master, ms, vs;  // positions in the unit's tensors, -1: none
  };

  Entry& entry_at(int64_t entry) {
    TORCH_CHECK(entry >= 0 && entry < static_cast<int64_t>(entries_.size()),
                "StepPlan: no entry ", entry);
    return entries_[static_cast<size_t>(entry)];
  }

  // The step's scalars and seeds of entry i into t.
  void finish_args(AdamTensorArgs& t, size_t i) const {
    const Entry& e = entries_[i];
    t.s = scalars_[i];
    if (coding_.stochastic) {
      t.seed_m = moment_seed(e.key_hash, 0, counts_[i]);
      t.seed_v = moment_seed(e.key_hash, 1, counts_[i]);
    }
  }

  // The op through the dispatcher, one call per group (CUDA: one launch each).
  void dispatch_groups() {
    for (size_t gi = 0; gi < groups_.size(); ++gi) {
      std::vector<at::Tensor> ps, gs, ms, vs, mss, vss, vmax;
      c10::List<std::optional<at::Tensor>> masters;
      std::vector<int64_t> steps, seeds;
      bool any_master = false;
      for (size_t i = 0; i < entries_.size(); ++i) {
        const Entry& e = entries_[i];
        if (e.group != gi) continue;
        TORCH_CHECK(e.has_states, "StepPlan: a parameter without its states");
        ps.push_back(e.param);
        gs.push_back(grads_[i]);
        ms.push_back(e.exp_avg);
        vs.push_back(e.exp_avg_sq);
        if (e.exp_avg_scale.has_value()) mss.push_back(*e.exp_avg_scale);
        if (e.exp_avg_sq_scale.has_value()) vss.push_back(*e.exp_avg_sq_scale);
        if (e.max_exp_avg_sq.has_value()) vmax.push_back(*e.max_exp_avg_sq);
        masters.push_back(e.master);
        any_master = any_master || e.master.has_value();
        steps.push_back(counts_[i]);
        seeds.push_back(moment_seed(e.key_hash, 0, counts_[i]));
        seeds.push_back(moment_seed(e.key_hash, 1, counts_[i]));
      }
      if (ps.empty()) continue;
      if (!any_master) masters = c10::List<std::optional<at::Tensor>>();
      pybind11::gil_scoped_release nogil;
      call_adam_op(ps, gs, ms, vs, mss, vss, vmax, masters, steps, seeds, {}, hyper_args_[gi],
                   moments_);
    }
  }

  std::string moments_;
  checks::MomentCoding coding_;
  bool dispatch_;
  at::Device device_{at::kCPU};
  std::vector<Group> groups_;
  std::vector<Entry> entries_;
  std::vector<std::vector<Slice>> units_;
  // during a step (begin() to the end of run() or end()): each entry's gradient, count and
  // scalars, each group's hyperparameters
  std::vector<at::Tensor> grads_;
  std::vector<int64_t> counts_;
  std::vector<AdamScalars> scalars_;
  std::vector<AdamHyper> hy_;
  std::vector<std::vector<double>> hyper_args_;  // the same, as the op's argument
};

}  // namespace
}  // namespace cpu
}  // namespace statestore

TORCH_LIBRARY(statestore, m) {
  m.def(statestore::checks::kAdamSchema);
  m.def("grads_finite(Tensor[] grads) -> bool");
}

TORCH_LIBRARY_IMPL(statestore, CPU, m) {
  m.impl("adam_", &statestore::cpu::adam_cpu);
  m.impl("grads_finite", &statestore::cpu::grads_finite_cpu);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "statestore's Adam kernels; the ops are torch.ops.statestore.adam_ / grads_finite";
  m.def("set_simd", &statestore::cpu::set_simd, pybind11::arg("name"),
        "Select the CPU path: 'avx512', 'avx2', 'scalar' or 'auto'. Raises where the processor "
        "lacks it. Returns the name selected.");
  m.def("simd", &statestore::cpu::simd_in_use, "(name, width in bits) of the CPU path in use");
  m.def("bandwidth_probe", &statestore::cpu::bandwidth_probe,
        "Roofline probe for benchmarks: p += g; m += g; v += g (28 bytes an element)");
  m.def("stream_copy", &statestore::cpu::stream_copy, pybind11::arg("dst"), pybind11::arg("src"),
        "dst <- src (contiguous CPU tensors of one dtype and size) with streaming stores");
  m.def("simd_supported", &statestore::cpu::simd_supported,
        "CPU paths this processor supports, widest first");
  using statestore::cpu::StepPlan;
  pybind11::class_<StepPlan>(m, "StepPlan",
                             "An optimizer step over resident states planned once and run "
                             "by one call (statestore/optim/_units.py, StepProgram)")
      .def(pybind11::init<const std::string&, bool>(), pybind11::arg("moments"),
           pybind11::arg("dispatch") = false)
      .def("add_group", &StepPlan::add_group, pybind11::arg("group"), pybind11::arg("params"))
      .def("add_entry", &StepPlan::add_entry, pybind11::arg("group"), pybind11::arg("member"),
           pybind11::arg("key"), pybind11::arg("key_hash"), pybind11::arg("grad"))
      .def("set_states", &StepPlan::set_states, pybind11::arg("entry"), pybind11::arg("grad"),
           pybind11::arg("exp_avg"), pybind11::arg("exp_avg_sq"),
           pybind11::arg("max_exp_avg_sq"), pybind11::arg("master"),
           pybind11::arg("exp_avg_scale"), pybind11::arg("exp_avg_sq_scale"))
      .def("add_unit", &StepPlan::add_unit)
      .def("add_slice", &StepPlan::add_slice, pybind11::arg("unit"), pybind11::arg("entry"),
           pybind11::arg("a"), pybind11::arg("b"), pybind11::arg("exp_avg"),
           pybind11::arg("exp_avg_sq"), pybind11::arg("max_exp_avg_sq"),
           pybind11::arg("master"), pybind11::arg("exp_avg_scale"),
           pybind11::arg("exp_avg_sq_scale"))
      .def("__len__", &StepPlan::size)
      .def("begin", &StepPlan::begin, pybind11::arg("param_groups"), pybind11::arg("steps"),
           pybind11::arg("undo"), pybind11::arg("hypers"), pybind11::arg("check_finite"),
           "Checks, then the step counts: 0 done, 1 stale (nothing changed: step the general "
           "way), 2 skipped (a gradient holds inf or nan; nothing changed)")
      .def("run", &StepPlan::run, pybind11::arg("param_groups"), pybind11::arg("steps"),
           pybind11::arg("hypers"), pybind11::arg("check_finite"),
           "begin() and the kernel over the held states: 0 done, 1 stale, 2 skipped")
      .def("run_unit", &StepPlan::run_unit, pybind11::arg("unit"), pybind11::arg("tensors"))
      .def("end", &StepPlan::end);
#ifdef STATESTORE_WITH_CUDA
  m.attr("with_cuda") = true;
  m.def("cuda_moments", &statestore::cuda::moments_kernel,
        "The compressed-moment CUDA kernel's layout in use: 'block' or 'wide'");
  m.def("set_cuda_moments", &statestore::cuda::set_moments_kernel, pybind11::arg("name"),
        "Select the compressed-moment CUDA kernel's layout ('block' or 'wide', the same bits); "
        "returns the name now in use");
#else
  m.attr("with_cuda") = false;
#endif
}
