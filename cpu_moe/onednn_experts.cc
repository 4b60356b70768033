// onednn_experts: per-expert GEMMs through oneDNN matmul (see onednn_experts.h).
#include "cpu_moe/onednn_experts.h"

#include <omp.h>

#include <algorithm>
#include <cfloat>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/formats.h"
#include "dnnl.hpp"

namespace moe::cpu_moe {
namespace {

using dt = dnnl::memory::data_type;
using tag = dnnl::memory::format_tag;

// Which fused matmul: the gate GEMM (swish), the up GEMM (times gate, bf16 out), the down GEMM.
enum class Stage { kGate, kUp, kDown };

struct Key {
  int64_t m, n, k;
  Stage stage;
  bool oai;
  float alpha, limit;
  int nthr;
  bool operator<(const Key& o) const {
    return std::tie(m, n, k, stage, oai, alpha, limit, nthr) <
           std::tie(o.m, o.n, o.k, o.stage, o.oai, o.alpha, o.limit, o.nthr);
  }
};

struct Prim {
  dnnl::matmul matmul;
  size_t scratchpad_bytes = 0;
};

// Per-thread buffers, grown as needed.
struct Scratch {
  std::vector<uint16_t> xg;  // [mp, H] bf16
  std::vector<float> g;      // [mp, I] fp32
  std::vector<uint16_t> a;   // [mp, I] bf16
  std::vector<float> yp;     // [mp, H] fp32
  std::vector<uint8_t> pad;  // oneDNN scratchpad
};

constexpr int kLockStripes = 256;

}  // namespace

struct OnednnExperts::Impl {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  mutable std::mutex mu;
  std::map<Key, std::shared_ptr<const Prim>> cache;
  std::mutex stripes[kLockStripes];

  // The primitive for `key`, created on first use (by the calling thread, so its thread count is
  // that thread's omp_get_max_threads(), part of the key).
  std::shared_ptr<const Prim> Get(const Key& key) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
    const dt dst_dt = key.stage == Stage::kUp ? dt::bf16 : dt::f32;
    dnnl::memory::desc src_md({key.m, key.k}, dt::bf16, tag::ab);
    dnnl::memory::desc wei_md({key.k, key.n}, dt::bf16, tag::ba);
    dnnl::memory::desc dst_md({key.m, key.n}, dst_dt, tag::ab);
    dnnl::post_ops po;
    if (key.stage == Stage::kGate) {
      if (key.oai) po.append_eltwise(1.0f, dnnl::algorithm::eltwise_clip_v2, -FLT_MAX, key.limit);
      po.append_eltwise(1.0f, dnnl::algorithm::eltwise_swish, key.oai ? key.alpha : 1.0f, 0.0f);
    } else if (key.stage == Stage::kUp) {
      if (key.oai) {
        po.append_eltwise(1.0f, dnnl::algorithm::eltwise_clip_v2, -key.limit, key.limit);
        po.append_eltwise(1.0f, dnnl::algorithm::eltwise_linear, 1.0f, 1.0f);
      }
      po.append_binary(dnnl::algorithm::binary_mul,
                       dnnl::memory::desc({key.m, key.n}, dt::f32, tag::ab));
    }
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    attr.set_post_ops(po);
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src_md, wei_md, dst_md), attr, engine);
    auto p = std::make_shared<Prim>();
    p->matmul = dnnl::matmul(pd);
    p->scratchpad_bytes = pd.scratchpad_desc().get_size();
    cache.emplace(key, p);
    return p;
  }

  // One expert: group g of `w`, run at mp >= m rows. `inner_parallel`: gather/scatter loops use
  // an OpenMP team (only outside a parallel region); `locked`: other threads scatter into y
  // concurrently. Throws dnnl::error.
  void RunExpert(const OnednnExpertsWork& w, size_t g, int mp, Scratch& s, bool inner_parallel,
                 bool locked) {
    const int64_t H = w.hidden, I = w.intermediate;
    const int e = w.experts[g];
    const int b = w.group_begin[g], m = w.group_begin[g + 1] - b;
    const int nthr = omp_get_max_threads();
    s.xg.resize(static_cast<size_t>(mp) * H);
    s.g.resize(static_cast<size_t>(mp) * I);
    s.a.resize(static_cast<size_t>(mp) * I);
    s.yp.resize(static_cast<size_t>(mp) * H);

    // Gather x rows as bf16; rows [m, mp) zero.
#pragma omp parallel for if (inner_parallel) schedule(static)
    for (int r = 0; r < mp; ++r) {
      uint16_t* dst = s.xg.data() + static_cast<size_t>(r) * H;
      if (r >= m) {
        std::memset(dst, 0, H * sizeof(uint16_t));
        continue;
      }
      const size_t t = w.route_token[b + r];
      if (w.x_bf16) {
        std::memcpy(dst, static_cast<const uint16_t*>(w.x) + t * H, H * sizeof(uint16_t));
      } else {
        const float* src = static_cast<const float*>(w.x) + t * H;
        for (int64_t j = 0; j < H; ++j) dst[j] = common::FloatToBf16(src[j]);
      }
    }

    const Key kg{mp, I, H, Stage::kGate, w.swiglu_oai, w.swiglu_alpha, w.swiglu_limit, nthr};
    const Key ku{mp, I, H, Stage::kUp, w.swiglu_oai, w.swiglu_alpha, w.swiglu_limit, nthr};
    const Key kd{mp, H, I, Stage::kDown, false, 0.0f, 0.0f, nthr};
    const std::shared_ptr<const Prim> pg = Get(kg), pu = Get(ku), pdn = Get(kd);
    s.pad.resize(std::max({pg->scratchpad_bytes, pu->scratchpad_bytes, pdn->scratchpad_bytes,
                           size_t{1}}));

    auto mem = [&](dnnl::memory::dims dims, dt type, tag t, const void* p) {
      return dnnl::memory(dnnl::memory::desc(dims, type, t), engine, const_cast<void*>(p));
    };
    const uint16_t* gate_w = w.gate_up + static_cast<size_t>(e) * 2 * I * H;
    const uint16_t* up_w = gate_w + static_cast<size_t>(I) * H;
    const uint16_t* down_w = w.down + static_cast<size_t>(e) * H * I;
    dnnl::memory xg_m = mem({mp, H}, dt::bf16, tag::ab, s.xg.data());
    dnnl::memory g_m = mem({mp, I}, dt::f32, tag::ab, s.g.data());
    dnnl::memory a_m = mem({mp, I}, dt::bf16, tag::ab, s.a.data());
    dnnl::memory yp_m = mem({mp, H}, dt::f32, tag::ab, s.yp.data());
    dnnl::memory pad_m = mem({static_cast<int64_t>(s.pad.size())}, dt::u8, tag::a, s.pad.data());
    dnnl::stream stream(engine);
    pg->matmul.execute(stream, {{DNNL_ARG_SRC, xg_m},
                                {DNNL_ARG_WEIGHTS, mem({H, I}, dt::bf16, tag::ba, gate_w)},
                                {DNNL_ARG_DST, g_m},
                                {DNNL_ARG_SCRATCHPAD, pad_m}});
    const int mul_index = w.swiglu_oai ? 2 : 0;  // the binary post-op's position in the chain
    pu->matmul.execute(stream,
                       {{DNNL_ARG_SRC, xg_m},
                        {DNNL_ARG_WEIGHTS, mem({H, I}, dt::bf16, tag::ba, up_w)},
                        {DNNL_ARG_DST, a_m},
                        {DNNL_ARG_ATTR_MULTIPLE_POST_OP(mul_index) | DNNL_ARG_SRC_1, g_m},
                        {DNNL_ARG_SCRATCHPAD, pad_m}});
    pdn->matmul.execute(stream, {{DNNL_ARG_SRC, a_m},
                                 {DNNL_ARG_WEIGHTS, mem({I, H}, dt::bf16, tag::ba, down_w)},
                                 {DNNL_ARG_DST, yp_m},
                                 {DNNL_ARG_SCRATCHPAD, pad_m}});
    stream.wait();

    // Scatter-add. Sequential experts own y alone and split it by columns (a token may hold two
    // rows of one expert); parallel experts lock the token's stripe.
    if (inner_parallel) {
      constexpr int64_t kCols = 256;
#pragma omp parallel for schedule(static)
      for (int64_t j0 = 0; j0 < H; j0 += kCols) {
        const int64_t j1 = std::min(H, j0 + kCols);
        for (int r = 0; r < m; ++r) {
          const float wt = w.route_weight[b + r];
          float* yr = w.y + static_cast<size_t>(w.route_token[b + r]) * H;
          const float* pr = s.yp.data() + static_cast<size_t>(r) * H;
          for (int64_t j = j0; j < j1; ++j) yr[j] += wt * pr[j];
        }
      }
    } else {
      for (int r = 0; r < m; ++r) {
        const size_t t = w.route_token[b + r];
        const float wt = w.route_weight[b + r];
        float* yr = w.y + t * H;
        const float* pr = s.yp.data() + static_cast<size_t>(r) * H;
        std::unique_lock<std::mutex> lock(stripes[t % kLockStripes], std::defer_lock);
        if (locked) lock.lock();
        for (int64_t j = 0; j < H; ++j) yr[j] += wt * pr[j];
      }
    }
  }
};

OnednnExperts::OnednnExperts(const OnednnConfig& config)
    : config_(config), impl_(std::make_unique<Impl>()) {}
OnednnExperts::~OnednnExperts() = default;

int OnednnExperts::PaddedRows(int m) const { return m <= 16 ? m : (m + 15) / 16 * 16; }

size_t OnednnExperts::num_primitives() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->cache.size();
}

absl::Status OnednnExperts::Run(const OnednnExpertsWork& w) {
  const size_t ng = w.experts.size();
  if (ng == 0) return absl::OkStatus();
  if (w.hidden <= 0 || w.intermediate <= 0 || w.gate_up == nullptr || w.down == nullptr ||
      w.x == nullptr || w.y == nullptr || w.group_begin.size() != ng + 1 ||
      w.route_token.size() != w.route_weight.size() || w.group_begin[0] < 0 ||
      static_cast<size_t>(w.group_begin[ng]) > w.route_token.size()) {
    return absl::InvalidArgumentError("onednn_experts: inconsistent work description");
  }
  // The thread bound applies to this call only: the calling thread's OpenMP setting is the
  // caller's.
  struct ThreadsScope {
    int saved = 0;
    explicit ThreadsScope(int n) {
      if (n > 0) {
        saved = omp_get_max_threads();
        omp_set_num_threads(n);
      }
    }
    ~ThreadsScope() {
      if (saved > 0) omp_set_num_threads(saved);
    }
  } threads_scope(config_.num_threads);
  OnednnThreading mode = w.threading;
  const int threads = omp_get_max_threads();
  if (mode == OnednnThreading::kAuto) {
    mode = threads > 1 && ng >= 2 * static_cast<size_t>(threads)
               ? OnednnThreading::kExpertsParallel
               : OnednnThreading::kExpertsSequential;
  }
  // Largest groups first (load balance for the parallel mode).
  std::vector<size_t> order(ng);
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return w.group_begin[a + 1] - w.group_begin[a] > w.group_begin[b + 1] - w.group_begin[b];
  });

  std::mutex err_mu;
  std::string error;
  auto guarded = [&](size_t g, Scratch& s, bool parallel_experts) {
    const int m = w.group_begin[g + 1] - w.group_begin[g];
    if (m <= 0) return;
    try {
      impl_->RunExpert(w, g, PaddedRows(m), s, !parallel_experts && threads > 1,
                       parallel_experts);
    } catch (const dnnl::error& ex) {
      std::lock_guard<std::mutex> lock(err_mu);
      if (error.empty()) error = absl::StrCat("oneDNN: ", ex.what(), " (status ", ex.status, ")");
    }
  };
  if (mode == OnednnThreading::kExpertsParallel) {
#pragma omp parallel
    {
      // Each expert single-threaded: oneDNN in this thread then sees one thread (and its
      // primitives are keyed and tuned for one).
      omp_set_num_threads(1);
      Scratch s;
#pragma omp for schedule(dynamic, 1)
      for (size_t i = 0; i < ng; ++i) guarded(order[i], s, true);
    }
  } else {
    Scratch s;
    for (size_t i = 0; i < ng; ++i) guarded(order[i], s, false);
  }
  if (!error.empty()) return absl::InternalError(error);
  return absl::OkStatus();
}

std::string OnednnExperts::CpuIsa() {
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::sse41: return "sse41";
    case dnnl::cpu_isa::avx: return "avx";
    case dnnl::cpu_isa::avx2: return "avx2";
    case dnnl::cpu_isa::avx2_vnni: return "avx2_vnni";
    case dnnl::cpu_isa::avx512_core: return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni: return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16: return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx: return "avx512_core_amx";
    default: return absl::StrCat("isa_", static_cast<int>(dnnl::get_effective_cpu_isa()));
  }
}

std::string OnednnExperts::Version() {
  const dnnl_version_t* v = dnnl_version();
  return absl::StrCat(v->major, ".", v->minor, ".", v->patch,
                      v->cpu_runtime == DNNL_RUNTIME_OMP ? " (OpenMP)" : "");
}

int OnednnExperts::MaxThreads() { return omp_get_max_threads(); }

int OnednnExperts::threads() const {
  return config_.num_threads > 0 ? config_.num_threads : omp_get_max_threads();
}

std::string OnednnExperts::WaitPolicy() {
  std::string s;
  for (const char* name : {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"}) {
    const char* v = std::getenv(name);
    if (v != nullptr && *v != '\0') absl::StrAppend(&s, s.empty() ? "" : " ", name, "=", v);
  }
  return s.empty() ? "default" : s;
}

}  // namespace moe::cpu_moe
