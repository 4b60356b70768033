#include "engine/cuda/gpu_model.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/cuda_status.h"
#include "common/formats.h"
#include "common/status.h"
#include "engine/linear_attention_state.h"
#include "engine/loader.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "common/thread_pool.h"
#include "engine/cuda/attention/paged_attention.h"
#include "engine/cuda/experts/routed_experts.h"
#include "engine/cuda/hybrid/handoff_kernels.h"
#include "engine/cuda/hybrid/hybrid_profile.h"
#include "engine/cuda/ops/delta_net.h"
#include "engine/cuda/ops/gemm.h"
#include "engine/cuda/ops/rope_table.h"
#include "engine/cuda/ops/token_ops.h"
#include "engine/cuda/route_kernels.h"
#include "engine/rope.h"
#include "graph_capture/graph_cache.h"
#include "moe_cache/gpu/ensure_kernels.h"
#include "moe_cache/gpu/gather_kernels.h"
#include "moe_cache/gpu/slot_pool.h"
#include "moe_overlap/fork_join.h"
#include "moe_overlap/stream_pair.h"
#endif
#include "moe_cache/pinning.h"

namespace moe::engine::gpu {

absl::StatusOr<std::unique_ptr<moe_cache::ExpertStore>> ExpertStoreFromBanks(
    absl::Span<const cpu_moe::ExpertBank> banks, int num_layers, int num_experts) {
  if (banks.empty()) return absl::InvalidArgumentError("no expert banks");
  const cpu_moe::ExpertBank& b0 = banks[0];
  if (num_layers <= 0) num_layers = static_cast<int>(banks.size());
  if (num_experts <= 0) num_experts = b0.num_experts;
  const common::WeightFormat f = b0.format;
  const bool panel_format = f == common::WeightFormat::kQ4_0 || f == common::WeightFormat::kMxfp4 ||
                            f == common::WeightFormat::kNvfp4;
  for (const cpu_moe::ExpertBank& b : banks) {
    if (b.format != b0.format || b.hidden != b0.hidden || b.intermediate != b0.intermediate ||
        b.num_experts <= 0) {
      return absl::InvalidArgumentError("expert banks of different formats or shapes");
    }
    if ((b.layout == cpu_moe::Layout::kPanels) != panel_format) {
      return absl::InvalidArgumentError(
          "expert banks must be bf16 or fp8_block row-major, or a 4-bit format in panels");
    }
  }
  ASSIGN_OR_RETURN(moe_cache::BankLayout layout,
                   ExpertBankLayout(b0.format, b0.hidden, b0.intermediate));
  // Where expert e of a cpu_moe bank keeps the payload of store bank `sb`: codes and fp8 block
  // scales dense per expert, nvfp4 global scales one float per expert at global_scale_stride
  // (up's own where the bank has them, else the gate's, which then serve both).
  auto source = [&](const cpu_moe::ExpertBank& b, int sb, int e) -> const uint8_t* {
    const std::string& name = layout.bank(sb).name;
    const uint64_t n = layout.bank(sb).bytes;
    auto dense = [&](const void* base) {
      return base == nullptr ? nullptr : static_cast<const uint8_t*>(base) + e * n;
    };
    auto global = [&](const float* g) {
      return g == nullptr ? nullptr
                          : reinterpret_cast<const uint8_t*>(g + static_cast<int64_t>(e) *
                                                                     b.global_scale_stride);
    };
    if (name == "gate_up") return dense(b.gate_up_weights);
    if (name == "down") return dense(b.down_weights);
    if (name == "gate_up_scales") return dense(b.gate_up_scales);
    if (name == "down_scales") return dense(b.down_scales);
    if (name == "gate_up_global_scale") return global(b.gate_up_global_scales);
    if (name == "up_global_scale") {
      return global(b.up_global_scales != nullptr ? b.up_global_scales : b.gate_up_global_scales);
    }
    if (name == "down_global_scale") return global(b.down_global_scales);
    return nullptr;
  };
  for (int sb = 0; sb < layout.num_banks(); ++sb) {
    for (const cpu_moe::ExpertBank& b : banks) {
      if (source(b, sb, 0) == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            "format ", std::string(common::WeightFormatName(f)),
            ": a cpu_moe bank has nothing for the store's '", layout.bank(sb).name, "' bank"));
      }
    }
  }
  // cpu_moe counts per expert the codes and scales of gate_up and down and one global scale
  // each (nvfp4); the store also holds up's global scale.
  const uint64_t cpu_bytes = b0.BytesPerExpert() + (f == common::WeightFormat::kNvfp4 ? 4 : 0);
  if (cpu_bytes != layout.bytes_per_expert()) {
    return absl::InvalidArgumentError(absl::StrCat("cpu_moe bank of ", cpu_bytes,
                                                   " bytes per expert; the store wants ",
                                                   layout.bytes_per_expert()));
  }
  moe_cache::ExpertStore::Options so;
  so.num_layers = num_layers;
  so.num_experts = num_experts;
  ASSIGN_OR_RETURN(std::unique_ptr<moe_cache::ExpertStore> store,
                   moe_cache::ExpertStore::Create(so, layout));
  const int total = num_layers * num_experts;
  const int workers = std::max(1, std::min(8, static_cast<int>(std::thread::hardware_concurrency())));
  std::vector<absl::Status> errors(workers);
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      for (int g = w; g < total && errors[w].ok(); g += workers) {
        const int l = g / num_experts, e = g % num_experts;
        const cpu_moe::ExpertBank& b = banks[l % banks.size()];
        const int src = e % b.num_experts;
        for (int sb = 0; sb < layout.num_banks() && errors[w].ok(); ++sb) {
          errors[w] = store->WriteBank(
              l, e, sb, absl::MakeConstSpan(source(b, sb, src), layout.bank(sb).bytes));
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) RETURN_IF_ERROR(e);
  return store;
}

absl::StatusOr<std::vector<cpu_moe::ExpertBank>> CpuBanksFromStore(
    const moe_cache::ExpertStore& store, common::WeightFormat format, int num_layers,
    int num_experts, int hidden, int intermediate,
    std::vector<std::vector<uint8_t>>* dense_scales) {
  const bool panels = format == common::WeightFormat::kQ4_0 ||
                      format == common::WeightFormat::kMxfp4 ||
                      format == common::WeightFormat::kNvfp4;
  std::vector<cpu_moe::ExpertBank> banks;
  for (int m = 0; m < num_layers; ++m) {
    common::ExpertLayerView view = store.LayerView(
        m, format, panels ? common::ExpertLayout::kPanels : common::ExpertLayout::kRowMajor,
        hidden, intermediate);
    const std::pair<const char*, common::ExpertArray*> scale_arrays[] = {
        {"gate_up_scales", &view.gate_up_scales}, {"down_scales", &view.down_scales}};
    for (const auto& [name, array] : scale_arrays) {
      const int b = store.FindBank(name);
      if (b < 0 || store.layout().bank(b).pitch == store.layout().bank(b).bytes) continue;
      const uint64_t bytes = store.layout().bank(b).bytes;
      std::vector<uint8_t>& dense = dense_scales->emplace_back(bytes * num_experts);
      for (int e = 0; e < num_experts; ++e) {
        std::memcpy(dense.data() + e * bytes, array->Expert(e), bytes);
      }
      *array = common::ExpertArray{dense.data(), bytes};
    }
    absl::StatusOr<cpu_moe::ExpertBank> bank = cpu_moe::BankFromView(view);
    if (!bank.ok()) {
      return absl::Status(bank.status().code(),
                          absl::StrCat("MoE layer ", m, " of the expert store: ",
                                       bank.status().message()));
    }
    banks.push_back(*bank);
  }
  return banks;
}

#if MOE_HAVE_CUDA

namespace {

// One device allocation, freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() {
    if (p_ != nullptr) cudaFree(p_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  absl::Status Allocate(uint64_t bytes, const std::string& what) {
    const cudaError_t e = cudaMalloc(&p_, std::max<uint64_t>(bytes, 16));
    if (e != cudaSuccess) {
      cudaGetLastError();
      p_ = nullptr;
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      return absl::ResourceExhaustedError(absl::StrCat(
          "GPU memory: ", what, " (", FormatBytes(bytes), ") did not fit: ",
          cudaGetErrorString(e), "; ", FormatBytes(free_b), " free of ", FormatBytes(total_b)));
    }
    bytes_ = bytes;
    return absl::OkStatus();
  }
  void* get() const { return p_; }
  uint64_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  uint64_t bytes_ = 0;
};

// A bf16 [n, k] matrix in device memory.
struct DenseW {
  const uint16_t* w = nullptr;
  int n = 0, k = 0;
  bool empty() const { return w == nullptr; }
};

struct GpuLayer {
  const float* input_norm = nullptr;
  const float* post_norm = nullptr;
  // Full attention (q holds per head the query and its output gate where the model gates).
  int kv_index = -1;
  DenseW q, k, v, o;
  const float *q_bias = nullptr, *k_bias = nullptr, *v_bias = nullptr;
  const float *q_norm = nullptr, *k_norm = nullptr;
  bool is_moe = false;
  int moe_index = -1;
  DenseW router;
  DenseW shared_gate_up, shared_down, shared_gate;  // empty without a shared expert
  DenseW mlp_gate_up, mlp_down;                     // dense layers only
  // Gated DeltaNet (linear attention): in_proj [qkv; z; b; a] stacked, out_proj; f32 conv taps
  // [kernel, conv_dim], dt_bias, A_log, the gated norm's weight.
  int linear_index = -1;
  DenseW lin_in, lin_out;
  const float *conv = nullptr, *dt_bias = nullptr, *a_log = nullptr, *lin_norm = nullptr;
};

std::vector<uint16_t> ToBf16(const Tensor& t) {
  std::vector<uint16_t> out(static_cast<size_t>(t.numel()));
  if (t.dtype == DType::kBf16) {
    std::memcpy(out.data(), t.bf16(), out.size() * 2);
  } else {
    for (size_t i = 0; i < out.size(); ++i) out[i] = common::FloatToBf16(t.f32()[i]);
  }
  return out;
}

std::vector<float> ToF32(const Tensor& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  for (int64_t r = 0; r < t.rows; ++r) {
    for (int64_t c = 0; c < t.cols; ++c) out[r * t.cols + c] = t.At(r, c);
  }
  return out;
}

}  // namespace

// Auto mode: passes of each decode bucket timed before its mode is fixed (half in each mode).
constexpr int kAutoTrials = 8;

struct GpuModel::Impl {
  const ModelWeights* w = nullptr;
  const moe_cache::ExpertStore* store = nullptr;
  GpuModelOptions opt;
  GpuMemoryPlan plan;
  int max_context = 0;
  int step_rows = 0;    // Tm: rows of one pass
  int max_chunks = 0;   // chunks of one pass
  int max_blocks = 0;   // block table width (blocks per sequence)
  int kv_blocks = 0;
  int total_slots = 0;
  int rows_per_call = 0;  // rows of one ensure call (the pool holds their experts)
  int max_calls = 0;      // ensure calls of one pass
  int logit_rows = 0;
  int max_bucket = 0;  // largest decode bucket (a power of two); 0: no buckets
  int seq_cap = 0;     // sequences the per-pass buffers hold: max(max_chunks, max_bucket)
  uint64_t dense_bytes = 0;
  RoutingOverride* routing = nullptr;
  GpuCacheStats stats;

  std::vector<std::unique_ptr<DeviceBuffer>> owned;
  std::vector<GpuLayer> layers;
  DenseW embed, lm_head;
  const float* final_norm = nullptr;

  std::unique_ptr<moe_overlap::StreamPair> pair;
  std::unique_ptr<DenseGemm> gemm;
  std::unique_ptr<DeviceRopeTable> rope;
  std::unique_ptr<PagedKvPool> kv;
  std::unique_ptr<DecodeWorkspace> decode_ws;
  std::unique_ptr<moe_cache::SlotPool> pool;
  SlotBanks banks;
  std::unique_ptr<moe_cache::DeviceCacheState> cache;
  moe_cache::GatherDescriptor desc{};
  moe_cache::GatherLaunchConfig gather;
  std::unique_ptr<ExpertWorkspace> expert_ws;
  // Gated DeltaNet layers: the states of every slot (LinearAttentionState's layout), the pass's
  // pieces.
  DeltaNetShape dn;
  int state_slots = 0;
  int64_t state_layer_stride = 0, state_conv_floats = 0, state_slot_stride = 0;
  float* d_state = nullptr;
  int32_t *d_piece_first = nullptr, *d_piece_rows = nullptr, *d_piece_start = nullptr,
          *d_piece_slot = nullptr;
  int32_t *h_piece_first = nullptr, *h_piece_rows = nullptr, *h_piece_start = nullptr,
          *h_piece_slot = nullptr;
  float *qg = nullptr, *qgate = nullptr, *lin_proj = nullptr, *lin_conv = nullptr,
        *lin_g = nullptr, *lin_beta = nullptr, *lin_core = nullptr;
  uint16_t* lin_coreb = nullptr;
  int64_t lin_proj_cols = 0;

  // Device activations and per-pass inputs (carved from one allocation).
  int32_t *d_tokens = nullptr, *d_positions = nullptr, *d_seq_ids = nullptr,
          *d_seq_lens = nullptr, *d_tables = nullptr, *d_forced = nullptr;
  float *h = nullptr, *xn = nullptr, *q = nullptr, *k = nullptr, *v = nullptr, *attn = nullptr;
  float *router_logits = nullptr, *route_w = nullptr, *mlp = nullptr, *shared_out = nullptr,
        *gate_logit = nullptr, *sel = nullptr, *logits = nullptr;
  uint16_t *xb = nullptr, *attnb = nullptr, *actb = nullptr, *selb = nullptr;
  int32_t *route_ids = nullptr, *slot_ids = nullptr, *plan_counts = nullptr;
  moe_cache::MissPlanEntry* plan_entries = nullptr;
  // Pinned host staging of the per-pass inputs and the plan counts read back.
  void* host_block = nullptr;
  int32_t *h_tokens = nullptr, *h_positions = nullptr, *h_seq_ids = nullptr,
          *h_seq_lens = nullptr, *h_tables = nullptr, *h_forced = nullptr, *h_counts = nullptr;
  float* h_logits = nullptr;  // pinned [logit_rows, V]: a decode bucket's logits
  int32_t* d_ensure_error = nullptr;  // the ensure kernel's error flag (an id >= E)
  std::vector<int32_t> forced;  // [moe_layers, rows, k] of the current Forward

  // Decode buckets captured as graphs (with the routing mode they were captured in).
  std::unique_ptr<graph_capture::GraphCache> graphs;
  std::unique_ptr<graph_capture::GraphCache> graphs_hybrid;  // the same buckets in hybrid mode
  bool graphs_on = false;
  bool graphs_forced = false;
  // Auto mode: per decode bucket, the mode chosen (-1: still trying both), and the trial passes'
  // times (milliseconds) in each mode.
  std::vector<int> auto_choice;
  std::vector<std::vector<double>> auto_ms[2];
  int fail_graph_after = -1;  // test hook: captures until an injected out-of-memory
  // The pinned policy: heat of the routes seen, flags uploaded between forwards.
  std::unique_ptr<moe_cache::HotPinner> pinner;
  std::vector<uint8_t> pinned_flags;
  // Prefill streaming: two layer buffers (every expert of one MoE layer each) and their events.
  int stream_min_rows = 0;  // 0: off
  uint64_t stream_layer_bytes = 0;
  SlotBanks stage[2];
  cudaEvent_t copied[2] = {nullptr, nullptr}, consumed[2] = {nullptr, nullptr};
  // Hybrid experts: the split table on the device, the CPU's banks (read in place from the
  // store), its pool, and the handoff (declared last: its worker uses the others).
  int32_t* d_fetch_table = nullptr;
  std::vector<cpu_moe::ExpertBank> cpu_banks;
  // fp8_block shapes whose scale rows the store pads: the CPU's dense copies of them.
  std::vector<std::vector<uint8_t>> cpu_dense_scales;
  cpu_moe::Options cpu_opt;
  std::unique_ptr<common::ThreadPool> cpu_pool;
  std::vector<uint8_t> cpu_seen;  // the worker thread's scratch
  std::atomic<int64_t> cpu_experts{0}, cpu_routes{0};
  bool pass_hybrid = false;  // the pass being enqueued splits its misses with the CPU
  std::vector<int32_t> last_fetches;  // experts fetched by each ensure call of the last pass
  double worker_busy_seen = 0;     // the worker's counters already in `stats`
  int64_t worker_requests_seen = 0;
  std::unique_ptr<hybrid::GpuHandoff> handoff;

  ~Impl() {
    cudaDeviceSynchronize();
    handoff.reset();
    if (d_fetch_table != nullptr) cudaFree(d_fetch_table);
    if (host_block != nullptr) cudaFreeHost(host_block);
    if (h_logits != nullptr) cudaFreeHost(h_logits);
    for (cudaEvent_t e : {copied[0], copied[1], consumed[0], consumed[1]}) {
      if (e != nullptr) cudaEventDestroy(e);
    }
  }
  // Copies MoE layer `m`'s experts whole into layer buffer `buf` on the side stream, after the
  // compute that last read that buffer.
  absl::Status StreamLayer(int m, int buf);
  // A fresh HotPinner (no heat, nothing pinned) and cleared flags, for the pinned policy.
  absl::Status NewPinner() {
    const ModelConfig& c = w->config;
    const int M = c.NumMoeLayers(), E = c.num_experts;
    moe_cache::PinningConfig pc;
    pc.adapt_every = opt.adapt_every;
    ASSIGN_OR_RETURN(moe_cache::HotPinner hp,
                     moe_cache::HotPinner::Create(
                         M, E, total_slots, std::min(E, rows_per_call * c.num_experts_per_tok),
                         pc));
    pinner = std::make_unique<moe_cache::HotPinner>(std::move(hp));
    pinned_flags.assign(static_cast<size_t>(M) * E, 0);
    return absl::OkStatus();
  }
  absl::Status StreamedMoeBlock(const GpuLayer& lw, int rows);
  absl::Status InitHybrid();

  CUstream_st* stream() const { return pair->compute(); }

  absl::Status Init(const ModelWeights* weights, const moe_cache::ExpertStore* st,
                    const GpuModelOptions& options);
  absl::StatusOr<const uint16_t*> UploadBf16(const std::vector<uint16_t>& host,
                                             const std::string& what);
  absl::StatusOr<const float*> UploadF32(const Tensor& t, const std::string& what);
  absl::StatusOr<DenseW> UploadMatrix(const Tensor& t, const std::string& what);
  absl::StatusOr<DenseW> UploadStacked(const Tensor& a, const Tensor& b, const std::string& what);
  // Matrices of one input width stacked row-wise into one (one GEMM for several projections).
  absl::StatusOr<DenseW> UploadRows(std::initializer_list<const Tensor*> parts,
                                    const std::string& what);
  DeltaNetState LayerState(int linear_index) const {
    DeltaNetState st;
    st.conv = d_state + linear_index * state_layer_stride;
    st.recurrent = st.conv + state_conv_floats;
    st.slot_stride = state_slot_stride;
    st.num_slots = state_slots;
    return st;
  }
  // The token mixer of a Gated DeltaNet layer: from xb (the normed input, bf16) into h.
  absl::Status LinearAttention(const GpuLayer& lw, int rows, int pieces);
  // Fills the KV cache and the linear-attention states with values for benchmarks.
  absl::Status FillSyntheticContext(uint64_t seed);

  absl::Status Gemm(const DenseW& w, const uint16_t* x, int rows, float* y, bool accumulate,
                    const float* bias = nullptr);

  struct Piece {
    int chunk = 0;
    int offset = 0;  // first token of the chunk in this piece
    int count = 0;
    bool last = false;  // holds the chunk's last token
  };
  // One pass as enqueued: `rows` rows of `seqs` pieces; a decode bucket pads the batch with
  // rows of position -1 (no KV write, no route, zero attention) up to the bucket.
  struct PassInputs {
    int rows = 0;
    int real_rows = 0;
    int seqs = 0;
    bool all_decode = false;
    bool bucket = false;        // padded decode bucket: logits of every row into h_logits
    bool streamed = false;      // experts streamed whole per layer (a long prefill pass)
    std::vector<int> sel_rows;  // rows whose logits the caller wants, in order
  };
  // Fills the pinned staging buffers of a pass (the previous pass has finished).
  PassInputs StagePass(absl::Span<const ModelChunk> chunks, const std::vector<Piece>& pieces,
                       int row0, int total_rows, int bucket);
  // Every device operation of a pass on the compute stream (and the side stream it forks):
  // no allocation, no synchronisation, so a decode bucket's pass can be captured. Eager passes
  // that are not a bucket write the wanted logits to `out` (pageable, so only outside capture).
  absl::Status EnqueuePass(absl::Span<const ModelChunk> chunks, const std::vector<Piece>& pieces,
                           const PassInputs& in, std::vector<float>* out);
  // Waits for the pass, checks the ensure kernel's error flag, adds the statistics, copies a
  // bucket's wanted logits out and feeds the hot-expert pinner.
  absl::Status FinishPass(const PassInputs& in, std::vector<float>* out);
  absl::Status RunPass(absl::Span<const ModelChunk> chunks, const std::vector<Piece>& pieces,
                       int row0, int total_rows, std::vector<float>* out);
  absl::Status MoeBlock(const GpuLayer& lw, int rows);
  int CallsPerPass(int rows) const {
    return rows_per_call > 0 ? w->config.NumMoeLayers() * ((rows + rows_per_call - 1) / rows_per_call)
                             : 0;
  }
};

absl::StatusOr<const uint16_t*> GpuModel::Impl::UploadBf16(const std::vector<uint16_t>& host,
                                                           const std::string& what) {
  auto buf = std::make_unique<DeviceBuffer>();
  RETURN_IF_ERROR(buf->Allocate(host.size() * 2, what));
  CUDA_RETURN_IF_ERROR(cudaMemcpy(buf->get(), host.data(), host.size() * 2, cudaMemcpyHostToDevice));
  dense_bytes += host.size() * 2;
  const auto* p = static_cast<const uint16_t*>(buf->get());
  owned.push_back(std::move(buf));
  return p;
}

absl::StatusOr<const float*> GpuModel::Impl::UploadF32(const Tensor& t, const std::string& what) {
  if (t.empty()) return nullptr;
  const std::vector<float> host = ToF32(t);
  auto buf = std::make_unique<DeviceBuffer>();
  RETURN_IF_ERROR(buf->Allocate(host.size() * 4, what));
  CUDA_RETURN_IF_ERROR(cudaMemcpy(buf->get(), host.data(), host.size() * 4, cudaMemcpyHostToDevice));
  dense_bytes += host.size() * 4;
  const auto* p = static_cast<const float*>(buf->get());
  owned.push_back(std::move(buf));
  return p;
}

absl::StatusOr<DenseW> GpuModel::Impl::UploadMatrix(const Tensor& t, const std::string& what) {
  DenseW d;
  if (t.empty()) return d;
  ASSIGN_OR_RETURN(d.w, UploadBf16(ToBf16(t), what));
  d.n = static_cast<int>(t.rows);
  d.k = static_cast<int>(t.cols);
  return d;
}

absl::StatusOr<DenseW> GpuModel::Impl::UploadStacked(const Tensor& a, const Tensor& b,
                                                     const std::string& what) {
  DenseW d;
  if (a.empty()) return d;
  if (a.cols != b.cols || a.rows != b.rows) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": gate and up shapes differ"));
  }
  std::vector<uint16_t> host = ToBf16(a);
  const std::vector<uint16_t> second = ToBf16(b);
  host.insert(host.end(), second.begin(), second.end());
  ASSIGN_OR_RETURN(d.w, UploadBf16(host, what));
  d.n = static_cast<int>(a.rows * 2);
  d.k = static_cast<int>(a.cols);
  return d;
}

absl::StatusOr<DenseW> GpuModel::Impl::UploadRows(std::initializer_list<const Tensor*> parts,
                                                  const std::string& what) {
  DenseW d;
  std::vector<uint16_t> host;
  for (const Tensor* t : parts) {
    if (d.k != 0 && t->cols != d.k) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": input widths differ"));
    }
    d.k = static_cast<int>(t->cols);
    d.n += static_cast<int>(t->rows);
    const std::vector<uint16_t> b = ToBf16(*t);
    host.insert(host.end(), b.begin(), b.end());
  }
  ASSIGN_OR_RETURN(d.w, UploadBf16(host, what));
  return d;
}

absl::Status GpuModel::Impl::Gemm(const DenseW& w, const uint16_t* x, int rows, float* y,
                                  bool accumulate, const float* bias) {
  GemmArgs a;
  a.w = w.w;
  a.bias = bias;
  a.accumulate = accumulate;
  a.n = w.n;
  a.k = w.k;
  if (!opt.deterministic || rows <= 1) {
    a.x = x;
    a.y = y;
    a.rows = rows;
    return gemm->Run(a);
  }
  // One row at a time: a row's result does not depend on how many rows the batch has.
  a.rows = 1;
  for (int r = 0; r < rows; ++r) {
    a.x = x + static_cast<int64_t>(r) * w.k;
    a.y = y + static_cast<int64_t>(r) * w.n;
    RETURN_IF_ERROR(gemm->Run(a));
  }
  return absl::OkStatus();
}

absl::Status GpuModel::Impl::Init(const ModelWeights* weights, const moe_cache::ExpertStore* st,
                                  const GpuModelOptions& options) {
  w = weights;
  store = st;
  opt = options;
  const ModelConfig& c = w->config;
  const int H = c.hidden_size, nh = c.num_attention_heads, nkv = c.num_key_value_heads,
            hd = c.head_dim, E = c.num_experts, K = c.num_experts_per_tok,
            L = c.num_hidden_layers, M = c.NumMoeLayers();
  if (c.model_type != "qwen3_moe" && c.model_type != "qwen2_moe" &&
      c.model_type != "qwen3_5_moe") {
    return absl::InvalidArgumentError(absl::StrCat(
        "the CUDA backend serves qwen3_moe, qwen2_moe and qwen3_5_moe, not ", c.model_type));
  }
  const int LL = c.NumLinearAttentionLayers();
  if (LL > 0) {
    const LinearAttentionConfig& la = c.linear;
    dn.num_key_heads = la.num_key_heads;
    dn.num_value_heads = la.num_value_heads;
    dn.key_head_dim = la.key_head_dim;
    dn.value_head_dim = la.value_head_dim;
    dn.conv_kernel = la.conv_kernel;
    if (la.num_key_heads <= 0 || la.num_value_heads <= 0 ||
        la.num_value_heads % la.num_key_heads != 0 || la.key_head_dim <= 0 ||
        la.key_head_dim > kMaxDeltaHeadDim || la.value_head_dim <= 0 ||
        la.value_head_dim > kMaxDeltaHeadDim || la.conv_kernel < 2 || la.conv_kernel > 8) {
      return absl::InvalidArgumentError(absl::StrCat(
          "linear attention of ", la.num_key_heads, " key / ", la.num_value_heads,
          " value heads of ", la.key_head_dim, " / ", la.value_head_dim, ", conv kernel ",
          la.conv_kernel, ": the GPU kernels serve head dims up to ", kMaxDeltaHeadDim,
          " and kernels of 2 to 8 taps"));
    }
  }
  if (nh <= 0 || nkv <= 0 || nh % nkv != 0 || static_cast<int>(w->layers.size()) != L) {
    return absl::InvalidArgumentError("bad attention heads or layer count");
  }
  if (opt.max_batch < 1 || opt.max_step_tokens < 0 || opt.max_context < 0 || opt.kv_blocks < 0 ||
      opt.kv_block_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GPU model options: max_batch ", opt.max_batch, " must be >= 1; max_step_tokens ",
        opt.max_step_tokens, ", max_context ", opt.max_context, ", kv_blocks ", opt.kv_blocks,
        " >= 0"));
  }
  if (M > 0) {
    if (store == nullptr) return absl::InvalidArgumentError("no expert store");
    if (w->expert_format != common::WeightFormat::kBf16 &&
        w->expert_format != common::WeightFormat::kQ4_0 &&
        w->expert_format != common::WeightFormat::kFp8Block &&
        w->expert_format != common::WeightFormat::kNvfp4) {
      return absl::InvalidArgumentError(
          absl::StrCat("the CUDA backend computes bf16, q4_0, fp8_block and nvfp4 experts, not ",
                       std::string(common::WeightFormatName(w->expert_format))));
    }
    if (store->num_layers() != M || store->num_experts() != E) {
      return absl::InvalidArgumentError(absl::StrCat(
          "expert store of ", store->num_layers(), " x ", store->num_experts(),
          " experts for a model of ", M, " MoE layers x ", E));
    }
    if (E > kMaxRouterExperts || K > kMaxRouterTopK || K > E) {
      return absl::InvalidArgumentError(absl::StrCat("top-", K, " of ", E,
                                                     " experts: the GPU router serves at most ",
                                                     kMaxRouterTopK, " of ", kMaxRouterExperts));
    }
  }
  max_context = opt.max_context > 0
                    ? opt.max_context
                    : std::min(c.max_position_embeddings > 0 ? c.max_position_embeddings : 4096,
                               4096);
  step_rows = opt.max_step_tokens > 0 ? opt.max_step_tokens : std::max(opt.max_batch, 256);
  if (K > 0) step_rows = std::min(step_rows, ExpertWorkspace::kMaxRoutes / K);
  max_chunks = std::min(opt.max_batch, step_rows);
  // Decode buckets: powers of two up to the first that holds max_chunks, within one pass.
  max_bucket = 1;
  while (max_bucket < max_chunks) max_bucket <<= 1;
  while (max_bucket > step_rows) max_bucket >>= 1;
  seq_cap = std::max(max_chunks, max_bucket);
  logit_rows = std::min(step_rows, std::max({opt.max_batch, 8, max_bucket}));

  RETURN_IF_ERROR(common::CudaAvailable());
  size_t free_b = 0, total_b = 0;
  CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_b, &total_b));
  GpuMemoryRequest req;
  req.expert_format = w->expert_format;
  req.gpu_free_bytes = free_b;
  req.expert_budget_gib = opt.expert_budget_gib;
  req.max_context = max_context;
  req.max_batch = opt.max_batch;
  req.max_step_tokens = step_rows;
  req.kv_block_size = opt.kv_block_size;
  // Prefill streaming's double buffer: two MoE layers of experts, planned as scratch when they
  // fit beside everything else.
  uint64_t stream_bytes = 0;
  if (M > 0 && opt.prefill_stream) {
    const moe_cache::BankLayout& lay = store->layout();
    for (int b = 0; b < lay.num_banks(); ++b) stream_bytes += lay.bank(b).pitch;
    stream_layer_bytes = stream_bytes * E;
    stream_bytes = 2 * stream_layer_bytes;
  }
  req.prefill_stream_bytes = stream_bytes;
  absl::StatusOr<GpuMemoryPlan> planned = PlanGpuMemory(c, req);
  if (!planned.ok() && stream_bytes > 0 &&
      planned.status().code() == absl::StatusCode::kResourceExhausted) {
    req.prefill_stream_bytes = stream_bytes = 0;
    planned = PlanGpuMemory(c, req);
  }
  if (!planned.ok()) return planned.status();
  plan = *std::move(planned);
  if (stream_bytes > 0 && plan.slots_per_layer >= E) {
    plan.prefill_stream_bytes = stream_bytes = 0;  // every expert resident: nothing to stream
  }
  if (opt.print_plan) std::fprintf(stderr, "%s\n", plan.Summary().c_str());
  kv_blocks = opt.kv_blocks > 0 ? opt.kv_blocks : plan.kv_blocks;
  if (LL > 0) {
    state_slots = plan.state_slots;
    const LinearAttentionConfig& la = c.linear;
    state_conv_floats = static_cast<int64_t>(la.conv_kernel - 1) * la.conv_dim();
    state_layer_stride =
        state_conv_floats + static_cast<int64_t>(la.num_value_heads) * la.key_head_dim *
                                la.value_head_dim;
    state_slot_stride = state_layer_stride * LL;
    auto buf = std::make_unique<DeviceBuffer>();
    RETURN_IF_ERROR(buf->Allocate(static_cast<uint64_t>(state_slot_stride) * state_slots * 4,
                                  absl::StrCat("linear-attention states of ", state_slots,
                                               " sequences")));
    CUDA_RETURN_IF_ERROR(cudaMemset(buf->get(), 0, buf->bytes()));
    d_state = static_cast<float*>(buf->get());
    owned.push_back(std::move(buf));
  }
  max_blocks = (max_context + opt.kv_block_size - 1) / opt.kv_block_size;
  if (kv_blocks < max_blocks) {
    return absl::InvalidArgumentError(absl::StrCat("kv_blocks ", kv_blocks,
                                                   " cannot hold one sequence of max_context ",
                                                   max_context, " (needs ", max_blocks, ")"));
  }

  moe_overlap::OverlapOptions oo;
  oo.overlap = opt.overlap;
  ASSIGN_OR_RETURN(oo, moe_overlap::OverlapOptionsFromEnv(oo));
  ASSIGN_OR_RETURN(pair, moe_overlap::StreamPair::Create(oo));
  ASSIGN_OR_RETURN(gemm, DenseGemm::Create(pair->compute()));

  // Dense weights, bf16 (norms and biases f32).
  ASSIGN_OR_RETURN(embed, UploadMatrix(w->embed_tokens, "embeddings"));
  if (w->lm_head.empty()) {
    lm_head = embed;
  } else {
    ASSIGN_OR_RETURN(lm_head, UploadMatrix(w->lm_head, "LM head"));
  }
  ASSIGN_OR_RETURN(final_norm, UploadF32(w->final_norm, "final norm"));
  layers.resize(L);
  for (int l = 0; l < L; ++l) {
    const LayerWeights& lw = w->layers[l];
    GpuLayer& g = layers[l];
    const std::string at = absl::StrCat("layer ", l, " ");
    ASSIGN_OR_RETURN(g.input_norm, UploadF32(lw.input_layernorm, at + "input norm"));
    ASSIGN_OR_RETURN(g.post_norm, UploadF32(lw.post_attention_layernorm, at + "post norm"));
    if (c.IsLinearAttentionLayer(l)) {
      g.linear_index = c.LinearLayerIndex(l);
      ASSIGN_OR_RETURN(g.lin_in, UploadRows({&lw.in_proj_qkv, &lw.in_proj_z, &lw.in_proj_b,
                                             &lw.in_proj_a},
                                            at + "linear attention in_proj"));
      ASSIGN_OR_RETURN(g.lin_out, UploadMatrix(lw.out_proj, at + "linear attention out_proj"));
      ASSIGN_OR_RETURN(g.conv, UploadF32(lw.conv1d, at + "conv1d"));
      ASSIGN_OR_RETURN(g.dt_bias, UploadF32(lw.dt_bias, at + "dt_bias"));
      ASSIGN_OR_RETURN(g.a_log, UploadF32(lw.a_log, at + "A_log"));
      ASSIGN_OR_RETURN(g.lin_norm, UploadF32(lw.linear_norm, at + "linear attention norm"));
      if (g.lin_in.n != c.linear.conv_dim() + c.linear.value_dim() +
                            2 * c.linear.num_value_heads ||
          g.lin_out.k != c.linear.value_dim() || g.conv == nullptr || g.dt_bias == nullptr ||
          g.a_log == nullptr || g.lin_norm == nullptr) {
        return absl::InvalidArgumentError(at + "linear attention weights of the wrong shape");
      }
      lin_proj_cols = std::max<int64_t>(lin_proj_cols, g.lin_in.n);
    } else {
      g.kv_index = c.KvLayerIndex(l);
      ASSIGN_OR_RETURN(g.q, UploadMatrix(lw.q_proj, at + "q_proj"));
      ASSIGN_OR_RETURN(g.k, UploadMatrix(lw.k_proj, at + "k_proj"));
      ASSIGN_OR_RETURN(g.v, UploadMatrix(lw.v_proj, at + "v_proj"));
      ASSIGN_OR_RETURN(g.o, UploadMatrix(lw.o_proj, at + "o_proj"));
      ASSIGN_OR_RETURN(g.q_bias, UploadF32(lw.q_bias, at + "q bias"));
      ASSIGN_OR_RETURN(g.k_bias, UploadF32(lw.k_bias, at + "k bias"));
      ASSIGN_OR_RETURN(g.v_bias, UploadF32(lw.v_bias, at + "v bias"));
      ASSIGN_OR_RETURN(g.q_norm, UploadF32(lw.q_norm, at + "q norm"));
      ASSIGN_OR_RETURN(g.k_norm, UploadF32(lw.k_norm, at + "k norm"));
      if (g.q.n != (c.attn_output_gate ? 2 : 1) * nh * hd) {
        return absl::InvalidArgumentError(absl::StrCat(at, "q_proj has ", g.q.n, " rows, not ",
                                                       (c.attn_output_gate ? 2 : 1) * nh * hd));
      }
    }
    g.is_moe = lw.is_moe;
    g.moe_index = lw.moe_index;
    if (lw.is_moe) {
      ASSIGN_OR_RETURN(g.router, UploadMatrix(lw.router, at + "router"));
      ASSIGN_OR_RETURN(g.shared_gate_up, UploadStacked(lw.shared_gate_proj, lw.shared_up_proj,
                                                       at + "shared expert gate/up"));
      ASSIGN_OR_RETURN(g.shared_down, UploadMatrix(lw.shared_down_proj, at + "shared expert down"));
      ASSIGN_OR_RETURN(g.shared_gate, UploadMatrix(lw.shared_expert_gate, at + "shared gate"));
    } else {
      ASSIGN_OR_RETURN(g.mlp_gate_up,
                       UploadStacked(lw.mlp_gate_proj, lw.mlp_up_proj, at + "MLP gate/up"));
      ASSIGN_OR_RETURN(g.mlp_down, UploadMatrix(lw.mlp_down_proj, at + "MLP down"));
    }
  }

  ASSIGN_OR_RETURN(RopeParams rp, ComputeRopeParams(c));
  ASSIGN_OR_RETURN(RopeCosSin cs, BuildRopeCosSin(rp, hd, max_context));
  ASSIGN_OR_RETURN(rope, DeviceRopeTable::Create(cs));

  {
    auto kvp = PagedKvPool::Create(std::max(1, c.NumKvLayers()), nkv, hd, opt.kv_block_size, kv_blocks);
    if (!kvp.ok()) {
      const uint64_t bytes = 2ull * c.NumKvLayers() * nkv * hd * opt.kv_block_size * kv_blocks * 2;
      return absl::Status(kvp.status().code(),
                          absl::StrCat("GPU memory: KV cache of ", kv_blocks, " blocks (",
                                       FormatBytes(bytes), "): ", kvp.status().message()));
    }
    kv = *std::move(kvp);
  }
  DecodeWorkspaceConfig dc;
  dc.max_batch = seq_cap;
  dc.num_q_heads = nh;
  dc.num_kv_heads = nkv;
  dc.head_dim = hd;
  dc.max_context = max_context;
  ASSIGN_OR_RETURN(decode_ws, DecodeWorkspace::Create(dc));

  const int64_t T = step_rows;
  if (M > 0) {
    total_slots = std::min(plan.total_slots(), M * E);
    {
      auto p = moe_cache::SlotPool::Create(total_slots, store->layout());
      if (!p.ok()) {
        return absl::Status(
            p.status().code(),
            absl::StrCat("GPU memory: expert cache of ", total_slots, " slots (",
                         FormatBytes(total_slots * store->layout().padded_bytes_per_expert()),
                         "): ", p.status().message()));
      }
      pool = *std::move(p);
    }
    ASSIGN_OR_RETURN(banks, SlotBanksFromPool(*pool, w->expert_format, H, c.moe_intermediate_size));
    ASSIGN_OR_RETURN(desc, moe_cache::MakeGatherDescriptor(*store, *pool));
    ASSIGN_OR_RETURN(cache, moe_cache::DeviceCacheState::Create(
                                M, E, total_slots, moe_cache::DefaultPolicyParams(opt.cache_policy)));
    ExpertWorkspaceOptions eo;
    eo.max_tokens = step_rows;
    eo.top_k = K;
    eo.hidden = H;
    eo.intermediate = c.moe_intermediate_size;
    eo.max_groups = E;
    ASSIGN_OR_RETURN(expert_ws, ExpertWorkspace::Create(eo));
    // An ensure call may place at most total_slots distinct experts: rows beyond that share the
    // layer in several calls.
    rows_per_call = total_slots >= E ? step_rows : std::max(1, total_slots / K);
    max_calls = M * ((step_rows + rows_per_call - 1) / rows_per_call);
    if (stream_bytes > 0) {
      stream_min_rows = opt.prefill_stream_min_rows > 0 ? opt.prefill_stream_min_rows
                                                        : std::max(2, (4 * E + K - 1) / K);
      auto buf = std::make_unique<DeviceBuffer>();
      RETURN_IF_ERROR(buf->Allocate(stream_bytes, "prefill expert stream (two MoE layers)"));
      const moe_cache::BankLayout& lay = store->layout();
      uint8_t* at = static_cast<uint8_t*>(buf->get());
      for (int i = 0; i < 2; ++i) {
        // Per buffer, each bank's E experts at the store's pitch: the slot banks of E slots.
        const uint8_t* bases[moe_cache::kMaxBanks] = {};
        for (int b = 0; b < lay.num_banks(); ++b) {
          bases[b] = at;
          at += static_cast<uint64_t>(lay.bank(b).pitch) * E;
        }
        ASSIGN_OR_RETURN(stage[i], SlotBanksFromLayout(lay, bases, E, w->expert_format, H,
                                                       c.moe_intermediate_size));
      }
      owned.push_back(std::move(buf));
      for (cudaEvent_t* e : {&copied[0], &copied[1], &consumed[0], &consumed[1]}) {
        CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
      }
    }
  }

  // Activations: one allocation, carved with 256-byte alignment.
  const int64_t Q = static_cast<int64_t>(nh) * hd, KV = static_cast<int64_t>(nkv) * hd;
  int64_t mlp_cols = 0;
  for (const GpuLayer& g : layers) {
    mlp_cols = std::max<int64_t>({mlp_cols, g.shared_gate_up.n, g.mlp_gate_up.n});
  }
  const int64_t routes = std::max<int64_t>(1, T * K);
  const int64_t V = c.vocab_size;
  const int64_t M64 = std::max(1, M);
  std::vector<std::pair<void**, uint64_t>> parts = {
      {reinterpret_cast<void**>(&d_tokens), T * 4},
      {reinterpret_cast<void**>(&d_positions), T * 4},
      {reinterpret_cast<void**>(&d_seq_ids), T * 4},
      {reinterpret_cast<void**>(&d_seq_lens), static_cast<uint64_t>(seq_cap) * 4},
      {reinterpret_cast<void**>(&d_tables), static_cast<uint64_t>(seq_cap) * max_blocks * 4},
      {reinterpret_cast<void**>(&d_ensure_error), 4},
      {reinterpret_cast<void**>(&d_forced), M64 * routes * 4},
      {reinterpret_cast<void**>(&h), T * H * 4},
      {reinterpret_cast<void**>(&xn), T * H * 4},
      {reinterpret_cast<void**>(&q), T * Q * 4},
      {reinterpret_cast<void**>(&k), T * KV * 4},
      {reinterpret_cast<void**>(&v), T * KV * 4},
      {reinterpret_cast<void**>(&attn), T * Q * 4},
      {reinterpret_cast<void**>(&router_logits), T * std::max(1, E) * 4},
      {reinterpret_cast<void**>(&route_w), routes * 4},
      {reinterpret_cast<void**>(&mlp), T * std::max<int64_t>(1, mlp_cols) * 4},
      {reinterpret_cast<void**>(&shared_out), T * H * 4},
      {reinterpret_cast<void**>(&gate_logit), T * 4},
      {reinterpret_cast<void**>(&sel), static_cast<uint64_t>(logit_rows) * H * 4},
      {reinterpret_cast<void**>(&logits), static_cast<uint64_t>(logit_rows) * V * 4},
      {reinterpret_cast<void**>(&xb), T * H * 2},
      {reinterpret_cast<void**>(&attnb), T * Q * 2},
      {reinterpret_cast<void**>(&actb), T * std::max<int64_t>(1, mlp_cols) * 2},
      {reinterpret_cast<void**>(&selb), static_cast<uint64_t>(logit_rows) * H * 2},
      {reinterpret_cast<void**>(&route_ids), M64 * routes * 4},
      {reinterpret_cast<void**>(&slot_ids), routes * 4},
      {reinterpret_cast<void**>(&plan_counts), static_cast<uint64_t>(std::max(1, max_calls)) * 4},
      {reinterpret_cast<void**>(&plan_entries), routes * sizeof(moe_cache::MissPlanEntry)},
  };
  if (c.attn_output_gate) {
    parts.push_back({reinterpret_cast<void**>(&qg), T * 2 * Q * 4});
    parts.push_back({reinterpret_cast<void**>(&qgate), T * Q * 4});
  }
  if (LL > 0) {
    const int64_t C = dn.conv_dim(), Vd = dn.value_dim(), nv = dn.num_value_heads;
    for (int32_t** a : {&d_piece_first, &d_piece_rows, &d_piece_start, &d_piece_slot}) {
      parts.push_back({reinterpret_cast<void**>(a), static_cast<uint64_t>(seq_cap) * 4});
    }
    parts.push_back({reinterpret_cast<void**>(&lin_proj), T * lin_proj_cols * 4});
    parts.push_back({reinterpret_cast<void**>(&lin_conv), T * C * 4});
    parts.push_back({reinterpret_cast<void**>(&lin_g), T * nv * 4});
    parts.push_back({reinterpret_cast<void**>(&lin_beta), T * nv * 4});
    parts.push_back({reinterpret_cast<void**>(&lin_core), T * Vd * 4});
    parts.push_back({reinterpret_cast<void**>(&lin_coreb), T * Vd * 2});
  }
  uint64_t total = 0;
  std::vector<uint64_t> offsets;
  for (const auto& p : parts) {
    offsets.push_back(total);
    total += (p.second + 255) / 256 * 256;
  }
  auto arena = std::make_unique<DeviceBuffer>();
  RETURN_IF_ERROR(arena->Allocate(total, absl::StrCat("activations of ", T, " rows")));
  CUDA_RETURN_IF_ERROR(cudaMemset(arena->get(), 0, total));
  for (size_t i = 0; i < parts.size(); ++i) {
    *parts[i].first = static_cast<uint8_t*>(arena->get()) + offsets[i];
  }
  owned.push_back(std::move(arena));

  const uint64_t host_ints = 3 * T + seq_cap + static_cast<uint64_t>(seq_cap) * max_blocks +
                             M64 * routes + std::max(1, max_calls) + 4ull * seq_cap;
  CUDA_RETURN_IF_ERROR(cudaHostAlloc(&host_block, host_ints * 4, cudaHostAllocDefault));
  int32_t* p = static_cast<int32_t*>(host_block);
  h_tokens = p;
  h_positions = h_tokens + T;
  h_seq_ids = h_positions + T;
  h_seq_lens = h_seq_ids + T;
  h_tables = h_seq_lens + seq_cap;
  h_forced = h_tables + static_cast<int64_t>(seq_cap) * max_blocks;
  h_counts = h_forced + M64 * routes;
  h_piece_first = h_counts + std::max(1, max_calls);
  h_piece_rows = h_piece_first + seq_cap;
  h_piece_start = h_piece_rows + seq_cap;
  h_piece_slot = h_piece_start + seq_cap;
  {
    const uint64_t bytes = static_cast<uint64_t>(logit_rows) * V * 4;
    const cudaError_t e = cudaHostAlloc(reinterpret_cast<void**>(&h_logits), bytes,
                                        cudaHostAllocDefault);
    if (e != cudaSuccess) {
      cudaGetLastError();
      h_logits = nullptr;
      return absl::ResourceExhaustedError(absl::StrCat("pinned host memory: logits of ",
                                                       logit_rows, " rows (", FormatBytes(bytes),
                                                       "): ", cudaGetErrorString(e)));
    }
  }
  {
    int buckets = 0;
    for (int b = 1; b <= max_bucket; b <<= 1) ++buckets;
    graphs = std::make_unique<graph_capture::GraphCache>(buckets);
    graphs_hybrid = std::make_unique<graph_capture::GraphCache>(buckets);
    graphs_on = opt.graphs;
    auto_choice.assign(buckets, -1);
    auto_ms[0].assign(buckets, {});
    auto_ms[1].assign(buckets, {});
  }
  if (opt.pin_hot_experts && M > 0) {
    if (opt.cache_policy != moe_cache::kPolicyScored || opt.adapt_every < 1) {
      return absl::InvalidArgumentError(
          "pinning hot experts needs the scored policy and adapt_every >= 1");
    }
    RETURN_IF_ERROR(NewPinner());
  }
  if (opt.hybrid && M > 0) RETURN_IF_ERROR(InitHybrid());
  CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return absl::OkStatus();
}

absl::Status GpuModel::Impl::InitHybrid() {
  const ModelConfig& c = w->config;
  const int M = c.NumMoeLayers(), E = c.num_experts, K = c.num_experts_per_tok,
            H = c.hidden_size;
  if (opt.hybrid_max_rows < 1) {
    return absl::InvalidArgumentError("hybrid experts: hybrid_max_rows must be at least 1");
  }
  cpu_dense_scales.clear();
  ASSIGN_OR_RETURN(cpu_banks, CpuBanksFromStore(*store, w->expert_format, M, E, H,
                                                c.moe_intermediate_size, &cpu_dense_scales));
  int threads = opt.hybrid_threads;
  if (threads <= 0) threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) - 1);
  // The polling thread computes too (cpu_moe's caller takes part).
  cpu_pool = std::make_unique<common::ThreadPool>(threads - 1);
  if (!(opt.hybrid_profile.pcie_gather_gbps > 0)) {
    std::fprintf(stderr,
                 "hybrid experts: no bandwidth profile given; measuring one on this model's "
                 "experts (about 4 s)\n");
    ASSIGN_OR_RETURN(hybrid::HybridProfileMeasurement pm,
                     hybrid::MeasureHybridProfile(*store, cpu_banks, K, cpu_opt, *cpu_pool, 1.0));
    std::fprintf(stderr,
                 "hybrid experts: host link %.1f GB/s alone, %.1f beside the CPU; CPU experts "
                 "%.1f GB/s alone, %.1f beside the link\n",
                 pm.link_alone_gbps, pm.link_both_gbps, pm.cpu_alone_gbps, pm.cpu_both_gbps);
    opt.hybrid_profile = pm.profile();
  }
  ASSIGN_OR_RETURN(std::vector<int32_t> table, moe_cache::FetchTable(opt.hybrid_profile, E));
  CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&d_fetch_table), table.size() * 4));
  CUDA_RETURN_IF_ERROR(
      cudaMemcpy(d_fetch_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  cpu_seen.assign(E, 0);
  hybrid::HandoffShape shape;
  shape.max_rows = std::min(rows_per_call, opt.hybrid_max_rows);
  shape.top_k = K;
  shape.hidden = H;
  ASSIGN_OR_RETURN(
      handoff,
      hybrid::GpuHandoff::Create(shape, [this, K, E](int layer, int tokens, const int32_t* ids,
                                                     const float* weights, const float* x,
                                                     float* y) -> absl::Status {
        if (layer < 0 || layer >= static_cast<int>(cpu_banks.size())) {
          return absl::InternalError(absl::StrCat("hybrid experts: a request for MoE layer ",
                                                  layer));
        }
        const int n = tokens * K;
        int64_t routes = 0, distinct = 0;
        for (int i = 0; i < n; ++i) {
          const int32_t e = ids[i];
          if (e < 0 || e >= E) continue;
          ++routes;
          if (!cpu_seen[e]) {
            cpu_seen[e] = 1;
            ++distinct;
          }
        }
        for (int i = 0; i < n; ++i) {
          if (ids[i] >= 0 && ids[i] < E) cpu_seen[ids[i]] = 0;
        }
        cpu_routes.fetch_add(routes, std::memory_order_relaxed);
        cpu_experts.fetch_add(distinct, std::memory_order_relaxed);
        return cpu_moe::Forward(cpu_banks[layer], tokens, K, absl::MakeConstSpan(ids, n),
                                absl::MakeConstSpan(weights, n), x, cpu_moe::DType::kF32, y,
                                cpu_moe::DType::kF32, cpu_opt, *cpu_pool);
      }));
  if (opt.print_plan) {
    const int show = std::min(E, 8);
    std::fprintf(stderr,
                 "hybrid experts: host link %.1f GB/s, CPU experts %.1f GB/s (profile%s): of %d "
                 "misses in a layer, %d are fetched and %d computed on the CPU by %d threads, "
                 "in passes of up to %d rows\n",
                 opt.hybrid_profile.pcie_gather_gbps, opt.hybrid_profile.cpu_expert_gbps,
                 opt.hybrid_profile.contended ? ", measured under contention" : "", show,
                 table[show], show - table[show], threads, shape.max_rows);
  }
  return absl::OkStatus();
}

absl::Status GpuModel::Impl::LinearAttention(const GpuLayer& lw, int rows, int pieces) {
  const ModelConfig& c = w->config;
  CUstream_st* s = stream();
  const int C = dn.conv_dim(), Vd = dn.value_dim(), nv = dn.num_value_heads;
  const int64_t P = lw.lin_in.n;  // [qkv (C) | z (Vd) | b (nv) | a (nv)]
  RETURN_IF_ERROR(Gemm(lw.lin_in, xb, rows, lin_proj, false));
  DeltaNetPieces pc;
  pc.num_pieces = pieces;
  pc.first_row = d_piece_first;
  pc.num_rows = d_piece_rows;
  pc.start_pos = d_piece_start;
  pc.state_slot = d_piece_slot;
  const DeltaNetState st = LayerState(lw.linear_index);
  RETURN_IF_ERROR(LaunchDeltaNetConv(lin_proj, P, rows, dn, lw.conv, pc, st, lin_conv, s));
  RETURN_IF_ERROR(LaunchDeltaNetGates(lin_conv, rows, dn, d_positions, lin_proj, P, C + Vd,
                                      C + Vd + nv, lw.a_log, lw.dt_bias, lin_g, lin_beta, s));
  RETURN_IF_ERROR(LaunchDeltaRule(lin_conv, lin_g, lin_beta, rows, dn, pc, st, lin_core, s));
  RETURN_IF_ERROR(LaunchGatedRmsNorm(lin_core, lin_proj + C, P, rows, nv, dn.value_head_dim,
                                     lw.lin_norm, c.rms_norm_eps, lin_coreb, s));
  return Gemm(lw.lin_out, lin_coreb, rows, h, /*accumulate=*/true);
}

absl::Status GpuModel::Impl::FillSyntheticContext(uint64_t seed) {
  CUstream_st* s = stream();
  for (int i = 0; i < kv->num_layers(); ++i) {
    const PagedKvLayer& kl = kv->layer(i);
    const int64_t n = static_cast<int64_t>(kv->layer_bytes() / 2);
    RETURN_IF_ERROR(LaunchFillUniformBf16(kl.k, n, -1.0f, 1.0f, seed + 2 * i, s));
    RETURN_IF_ERROR(LaunchFillUniformBf16(kl.v, n, -1.0f, 1.0f, seed + 2 * i + 1, s));
  }
  if (d_state != nullptr) {
    RETURN_IF_ERROR(LaunchFillUniformF32(d_state, state_slot_stride * state_slots, -0.05f, 0.05f,
                                         seed + 1000003, s));
  }
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  return absl::OkStatus();
}

absl::Status GpuModel::Impl::MoeBlock(const GpuLayer& lw, int rows) {
  const ModelConfig& c = w->config;
  const int H = c.hidden_size, E = c.num_experts, K = c.num_experts_per_tok;
  CUstream_st* s = stream();
  RETURN_IF_ERROR(Gemm(lw.router, xb, rows, router_logits, false));
  int32_t* own_ids = route_ids + static_cast<int64_t>(lw.moe_index) * rows * K;
  const int32_t* ids = own_ids;
  if (routing != nullptr) {
    // Forced ids (padding rows' are -1 already), weighted by the router's probabilities.
    ids = d_forced + static_cast<int64_t>(lw.moe_index) * rows * K;
    RETURN_IF_ERROR(LaunchForcedRouteWeights(router_logits, rows, E, ids, K, c.norm_topk_prob,
                                             route_w, s));
  } else {
    RETURN_IF_ERROR(
        LaunchRouterTopK(router_logits, rows, E, K, c.norm_topk_prob, own_ids, route_w, s));
    RETURN_IF_ERROR(LaunchMaskPaddedRoutes(own_ids, d_positions, rows, K, s));
  }
  const bool shared = !lw.shared_gate_up.empty();
  auto shared_expert = [&](CUstream_st*) -> absl::Status {
    const int Is = lw.shared_gate_up.n / 2;
    RETURN_IF_ERROR(Gemm(lw.shared_gate_up, xb, rows, mlp, false));
    RETURN_IF_ERROR(LaunchSiluMul(mlp, rows, Is, nullptr, actb, s));
    RETURN_IF_ERROR(Gemm(lw.shared_down, actb, rows, shared_out, false));
    return Gemm(lw.shared_gate, xb, rows, gate_logit, false);
  };
  const RouteGrouping grouping =
      opt.deterministic ? RouteGrouping::kPerRoute : RouteGrouping::kAuto;
  const int calls_per_layer = (rows + rows_per_call - 1) / rows_per_call;
  for (int r0 = 0, call = 0; r0 < rows; r0 += rows_per_call, ++call) {
    const int n = std::min(rows_per_call, rows - r0);
    const int index = lw.moe_index * calls_per_layer + call;
    if (index >= max_calls) return absl::InternalError("more ensure calls than planned");
    int32_t* count = plan_counts + index;
    const int64_t at = static_cast<int64_t>(r0) * K;
    // The single writer of the slot map and the miss plan, on the compute stream.
    RETURN_IF_ERROR(moe_cache::LaunchEnsureExperts(cache->view(), lw.moe_index, ids + at, n * K,
                                                   slot_ids + at, count, plan_entries + at, s,
                                                   d_ensure_error,
                                                   pass_hybrid ? d_fetch_table : nullptr));
    // The CPU's share of the misses leaves now, to be computed beside the copy and the GPU's
    // experts.
    if (pass_hybrid) {
      RETURN_IF_ERROR(handoff->Post(lw.moe_index, n, ids + at, slot_ids + at, route_w + at,
                                    xn + static_cast<int64_t>(r0) * H, s));
    }
    auto copy = [&](CUstream_st* cs) {
      return moe_cache::LaunchCopyMissing(desc, count, plan_entries + at, gather, cs);
    };
    if (shared && r0 == 0) {
      RETURN_IF_ERROR(moe_overlap::RunForkJoin(*pair, copy, shared_expert));
    } else {
      RETURN_IF_ERROR(copy(s));
    }
    RETURN_IF_ERROR(LaunchRoutedExperts(banks, *expert_ws, n, xn + static_cast<int64_t>(r0) * H,
                                        slot_ids + at, route_w + at,
                                        h + static_cast<int64_t>(r0) * H, s, grouping));
    if (pass_hybrid) RETURN_IF_ERROR(handoff->WaitAndAdd(n, h + static_cast<int64_t>(r0) * H, s));
  }
  if (shared) RETURN_IF_ERROR(LaunchSharedExpertCombine(h, shared_out, gate_logit, rows, H, s));
  return absl::OkStatus();
}

absl::Status GpuModel::Impl::StreamLayer(int m, int buf) {
  CUstream_st* side = pair->side();
  CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side, consumed[buf], 0));
  const moe_cache::BankLayout& lay = store->layout();
  const int E = w->config.num_experts;
  for (int b = 0; b < lay.num_banks(); ++b) {
    // Every bank the kernels read (codes, fp8 block scales, nvfp4 global scales).
    const uint8_t* dst = SlotBankBase(stage[buf], lay.bank(b).name);
    if (dst == nullptr) continue;
    const uint64_t bytes = static_cast<uint64_t>(lay.bank(b).pitch) * E;
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(const_cast<uint8_t*>(dst),
                                         store->expert_bank(m * E, b), bytes,
                                         cudaMemcpyHostToDevice, side));
  }
  CUDA_RETURN_IF_ERROR(cudaEventRecord(copied[buf], side));
  return absl::OkStatus();
}

absl::Status GpuModel::Impl::StreamedMoeBlock(const GpuLayer& lw, int rows) {
  const ModelConfig& c = w->config;
  const int H = c.hidden_size, E = c.num_experts, K = c.num_experts_per_tok,
            M = c.NumMoeLayers();
  CUstream_st* s = stream();
  const int m = lw.moe_index, buf = m % 2;
  RETURN_IF_ERROR(Gemm(lw.router, xb, rows, router_logits, false));
  int32_t* ids = route_ids + static_cast<int64_t>(m) * rows * K;
  if (routing != nullptr) {
    ids = d_forced + static_cast<int64_t>(m) * rows * K;
    RETURN_IF_ERROR(LaunchForcedRouteWeights(router_logits, rows, E, ids, K, c.norm_topk_prob,
                                             route_w, s));
  } else {
    RETURN_IF_ERROR(
        LaunchRouterTopK(router_logits, rows, E, K, c.norm_topk_prob, ids, route_w, s));
  }
  if (!lw.shared_gate_up.empty()) {
    const int Is = lw.shared_gate_up.n / 2;
    RETURN_IF_ERROR(Gemm(lw.shared_gate_up, xb, rows, mlp, false));
    RETURN_IF_ERROR(LaunchSiluMul(mlp, rows, Is, nullptr, actb, s));
    RETURN_IF_ERROR(Gemm(lw.shared_down, actb, rows, shared_out, false));
    RETURN_IF_ERROR(Gemm(lw.shared_gate, xb, rows, gate_logit, false));
  }
  // The layer buffer holds expert e at slot e: the routed ids are the slot ids.
  CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s, copied[buf], 0));
  const RouteGrouping grouping =
      opt.deterministic ? RouteGrouping::kPerRoute : RouteGrouping::kAuto;
  for (int r0 = 0; r0 < rows; r0 += rows_per_call) {
    const int n = std::min(rows_per_call, rows - r0);
    const int64_t at = static_cast<int64_t>(r0) * K;
    RETURN_IF_ERROR(LaunchRoutedExperts(stage[buf], *expert_ws, n,
                                        xn + static_cast<int64_t>(r0) * H, ids + at, route_w + at,
                                        h + static_cast<int64_t>(r0) * H, s, grouping));
  }
  CUDA_RETURN_IF_ERROR(cudaEventRecord(consumed[buf], s));
  if (m + 2 < M) RETURN_IF_ERROR(StreamLayer(m + 2, buf));
  if (!lw.shared_gate_up.empty()) {
    RETURN_IF_ERROR(LaunchSharedExpertCombine(h, shared_out, gate_logit, rows, H, s));
  }
  return absl::OkStatus();
}

GpuModel::Impl::PassInputs GpuModel::Impl::StagePass(absl::Span<const ModelChunk> chunks,
                                                     const std::vector<Piece>& pieces, int row0,
                                                     int total_rows, int bucket) {
  const ModelConfig& c = w->config;
  const int K = c.num_experts_per_tok, M = c.NumMoeLayers();
  PassInputs in;
  in.all_decode = true;
  for (size_t p = 0; p < pieces.size(); ++p) {
    const Piece& pc = pieces[p];
    const ModelChunk& ch = chunks[pc.chunk];
    const int r = in.rows;
    for (int i = 0; i < pc.count; ++i) {
      h_tokens[r + i] = ch.tokens[pc.offset + i];
      h_positions[r + i] = ch.start + pc.offset + i;
      h_seq_ids[r + i] = static_cast<int32_t>(p);
    }
    h_seq_lens[p] = ch.start + pc.offset + pc.count;
    h_piece_first[p] = r;
    h_piece_rows[p] = pc.count;
    h_piece_start[p] = ch.start + pc.offset;
    h_piece_slot[p] = ch.state_slot;
    int32_t* table = h_tables + static_cast<int64_t>(p) * max_blocks;
    const int nb = std::min<int>(max_blocks, ch.block_table->size());
    std::copy_n(ch.block_table->data(), nb, table);
    std::fill(table + nb, table + max_blocks, 0);
    in.all_decode &= pc.count == 1;
    int first = pc.count;
    if (ch.logits == ChunkLogits::kAll) first = 0;
    if (ch.logits == ChunkLogits::kLast && pc.last) first = pc.count - 1;
    for (int i = first; i < pc.count; ++i) in.sel_rows.push_back(r + i);
    in.rows += pc.count;
  }
  in.real_rows = in.rows;
  in.seqs = static_cast<int>(pieces.size());
  in.streamed = bucket == 0 && stream_min_rows > 0 && in.rows >= stream_min_rows;
  if (bucket > 0) {
    // Padding rows: position -1 (no KV append, no rotation, no route), an empty sequence.
    for (int p = in.seqs; p < bucket; ++p) {
      h_tokens[p] = 0;
      h_positions[p] = -1;
      h_seq_ids[p] = p;
      h_seq_lens[p] = 0;
      h_piece_first[p] = p;
      h_piece_rows[p] = 1;
      h_piece_start[p] = -1;
      h_piece_slot[p] = 0;
      std::fill_n(h_tables + static_cast<int64_t>(p) * max_blocks, max_blocks, 0);
    }
    in.rows = in.seqs = bucket;
    in.bucket = true;
  }
  if (routing != nullptr) {
    for (int m = 0; m < M; ++m) {
      int32_t* dst = h_forced + static_cast<int64_t>(m) * in.rows * K;
      std::copy_n(forced.data() + (static_cast<int64_t>(m) * total_rows + row0) * K,
                  static_cast<int64_t>(in.real_rows) * K, dst);
      std::fill(dst + static_cast<int64_t>(in.real_rows) * K,
                dst + static_cast<int64_t>(in.rows) * K, -1);
    }
  }
  return in;
}

absl::Status GpuModel::Impl::EnqueuePass(absl::Span<const ModelChunk> chunks,
                                         const std::vector<Piece>& pieces, const PassInputs& in,
                                         std::vector<float>* out) {
  const ModelConfig& c = w->config;
  const int H = c.hidden_size, nh = c.num_attention_heads, hd = c.head_dim,
            K = c.num_experts_per_tok, V = c.vocab_size, M = c.NumMoeLayers();
  const int64_t Q = static_cast<int64_t>(nh) * hd;
  const int rows = in.rows, P = in.seqs;
  CUstream_st* s = stream();
  if (routing != nullptr) {
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d_forced, h_forced,
                                         static_cast<size_t>(M) * rows * K * 4,
                                         cudaMemcpyHostToDevice, s));
  }
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(d_tokens, h_tokens, rows * 4, cudaMemcpyHostToDevice, s));
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(d_positions, h_positions, rows * 4, cudaMemcpyHostToDevice, s));
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d_seq_ids, h_seq_ids, rows * 4, cudaMemcpyHostToDevice, s));
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d_seq_lens, h_seq_lens, P * 4, cudaMemcpyHostToDevice, s));
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d_tables, h_tables,
                                       static_cast<size_t>(P) * max_blocks * 4,
                                       cudaMemcpyHostToDevice, s));
  if (d_state != nullptr) {
    for (auto [d, hst] : {std::pair{d_piece_first, h_piece_first}, {d_piece_rows, h_piece_rows},
                          {d_piece_start, h_piece_start}, {d_piece_slot, h_piece_slot}}) {
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d, hst, P * 4, cudaMemcpyHostToDevice, s));
    }
  }

  RETURN_IF_ERROR(LaunchEmbeddingGather(embed.w, V, H, d_tokens, rows, h, s));
  if (in.streamed) {
    // The first two MoE layers' experts start copying now (after the previous pass's reads).
    for (int i = 0; i < 2; ++i) {
      CUDA_RETURN_IF_ERROR(cudaEventRecord(consumed[i], s));
      if (i < M) RETURN_IF_ERROR(StreamLayer(i, i));
    }
  }
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const GpuLayer& lw = layers[l];
    RETURN_IF_ERROR(LaunchRmsNorm(h, rows, H, lw.input_norm, c.rms_norm_eps, nullptr, xb, s));
    if (lw.linear_index >= 0) {
      RETURN_IF_ERROR(LinearAttention(lw, rows, P));
    } else {
    const PagedKvLayer& kvl = kv->layer(lw.kv_index);
    if (c.attn_output_gate) {
      RETURN_IF_ERROR(Gemm(lw.q, xb, rows, qg, false, lw.q_bias));
      RETURN_IF_ERROR(LaunchSplitGatedQuery(qg, rows, nh, hd, q, qgate, s));
    } else {
      RETURN_IF_ERROR(Gemm(lw.q, xb, rows, q, false, lw.q_bias));
    }
    RETURN_IF_ERROR(Gemm(lw.k, xb, rows, k, false, lw.k_bias));
    RETURN_IF_ERROR(Gemm(lw.v, xb, rows, v, false, lw.v_bias));
    QkNormRopeArgs qa;
    qa.q = q;
    qa.k = k;
    qa.num_tokens = rows;
    qa.num_q_heads = nh;
    qa.num_kv_heads = c.num_key_value_heads;
    qa.head_dim = hd;
    qa.q_norm = lw.q_norm;
    qa.k_norm = lw.k_norm;
    qa.eps = c.rms_norm_eps;
    qa.positions = d_positions;
    qa.cos = rope->cos();
    qa.sin = rope->sin();
    qa.max_positions = rope->max_positions();
    qa.rotary_dim = rope->rotary_dim();
    RETURN_IF_ERROR(LaunchQkNormRope(qa, s));
    AppendKvArgs ka;
    ka.k = k;
    ka.v = v;
    ka.num_tokens = rows;
    ka.positions = d_positions;
    ka.seq_ids = d_seq_ids;
    ka.block_tables = d_tables;
    ka.max_blocks_per_seq = max_blocks;
    RETURN_IF_ERROR(LaunchAppendKv(kvl, ka, s));
    if (in.all_decode && !opt.deterministic) {
      DecodeArgs da;
      da.q = q;
      da.out = attn;
      da.seq_lens = d_seq_lens;
      da.block_tables = d_tables;
      da.max_blocks_per_seq = max_blocks;
      da.batch = P;
      da.num_q_heads = nh;
      RETURN_IF_ERROR(LaunchDecodeAttention(kvl, da, *decode_ws, s));
    } else {
      int r = 0;
      for (int p = 0; p < P; ++p) {
        // Padding pieces of a bucket are single rows.
        const int count = p < static_cast<int>(pieces.size()) ? pieces[p].count : 1;
        if (count == 1) {
          DecodeArgs da;
          da.q = q + r * Q;
          da.out = attn + r * Q;
          da.seq_lens = d_seq_lens + p;
          da.block_tables = d_tables + static_cast<int64_t>(p) * max_blocks;
          da.max_blocks_per_seq = max_blocks;
          da.batch = 1;
          da.num_q_heads = nh;
          RETURN_IF_ERROR(LaunchDecodeAttention(kvl, da, *decode_ws, s));
        } else {
          const Piece& pc = pieces[p];
          PrefillArgs pa;
          pa.q = q + r * Q;
          pa.out = attn + r * Q;
          pa.num_tokens = pc.count;
          pa.start = chunks[pc.chunk].start + pc.offset;
          pa.block_table = d_tables + static_cast<int64_t>(p) * max_blocks;
          pa.num_q_heads = nh;
          RETURN_IF_ERROR(LaunchPrefillAttention(kvl, pa, s));
        }
        r += count;
      }
    }
    if (c.attn_output_gate) {
      RETURN_IF_ERROR(LaunchSigmoidGateToBf16(attn, qgate, rows * Q, attnb, s));
    } else {
      RETURN_IF_ERROR(LaunchF32ToBf16(attn, rows * Q, attnb, s));
    }
    RETURN_IF_ERROR(Gemm(lw.o, attnb, rows, h, /*accumulate=*/true));
    }
    RETURN_IF_ERROR(LaunchRmsNorm(h, rows, H, lw.post_norm, c.rms_norm_eps, xn, xb, s));
    if (lw.is_moe && in.streamed) {
      RETURN_IF_ERROR(StreamedMoeBlock(lw, rows));
    } else if (lw.is_moe) {
      RETURN_IF_ERROR(MoeBlock(lw, rows));
    } else {
      const int I = lw.mlp_gate_up.n / 2;
      RETURN_IF_ERROR(Gemm(lw.mlp_gate_up, xb, rows, mlp, false));
      RETURN_IF_ERROR(LaunchSiluMul(mlp, rows, I, nullptr, actb, s));
      RETURN_IF_ERROR(Gemm(lw.mlp_down, actb, rows, h, /*accumulate=*/true));
    }
  }
  if (in.bucket) {
    // Every row of the bucket (rows <= logit_rows), into pinned memory: capturable.
    RETURN_IF_ERROR(LaunchRmsNorm(h, rows, H, final_norm, c.rms_norm_eps, nullptr, selb, s));
    RETURN_IF_ERROR(Gemm(lm_head, selb, rows, logits, false));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(h_logits, logits, static_cast<size_t>(rows) * V * 4,
                                         cudaMemcpyDeviceToHost, s));
  } else {
    // Final norm and LM head for the wanted rows, logit_rows at a time.
    for (size_t g0 = 0; g0 < in.sel_rows.size(); g0 += logit_rows) {
      const int n = static_cast<int>(std::min<size_t>(logit_rows, in.sel_rows.size() - g0));
      for (int i = 0; i < n;) {
        int j = i + 1;
        while (j < n && in.sel_rows[g0 + j] == in.sel_rows[g0 + j - 1] + 1) ++j;
        CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(sel + static_cast<int64_t>(i) * H,
                                             h + static_cast<int64_t>(in.sel_rows[g0 + i]) * H,
                                             static_cast<size_t>(j - i) * H * 4,
                                             cudaMemcpyDeviceToDevice, s));
        i = j;
      }
      RETURN_IF_ERROR(LaunchRmsNorm(sel, n, H, final_norm, c.rms_norm_eps, nullptr, selb, s));
      RETURN_IF_ERROR(Gemm(lm_head, selb, n, logits, false));
      const size_t base = out->size();
      out->resize(base + static_cast<size_t>(n) * V);
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out->data() + base, logits,
                                           static_cast<size_t>(n) * V * 4,
                                           cudaMemcpyDeviceToHost, s));
    }
  }
  const int calls = in.streamed ? 0 : CallsPerPass(rows);
  if (calls > 0) {
    CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(h_counts, plan_counts, calls * 4, cudaMemcpyDeviceToHost, s));
  }
  if (M > 0 && routing == nullptr) {
    // The router's choices, for the statistics and the pinner (forced ids are on the host).
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(h_forced, route_ids,
                                         static_cast<size_t>(M) * rows * K * 4,
                                         cudaMemcpyDeviceToHost, s));
  }
  return absl::OkStatus();
}

absl::Status GpuModel::Impl::FinishPass(const PassInputs& in, std::vector<float>* out) {
  const ModelConfig& c = w->config;
  const int K = c.num_experts_per_tok, V = c.vocab_size, M = c.NumMoeLayers(),
            E = c.num_experts;
  CUstream_st* s = stream();
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (M > 0) RETURN_IF_ERROR(moe_cache::TakeEnsureError(d_ensure_error, s));
  if (handoff != nullptr) {
    handoff->Disarm();
    RETURN_IF_ERROR(handoff->TakeError());
    const int64_t experts_now = cpu_experts.exchange(0, std::memory_order_relaxed);
    stats.cpu_experts += experts_now;
    stats.cpu_routes += cpu_routes.exchange(0, std::memory_order_relaxed);
    stats.bytes_cpu += static_cast<uint64_t>(experts_now) * store->bytes_per_expert();
    const double busy = handoff->worker().busy_seconds();
    const int64_t requests = handoff->worker().requests();
    stats.cpu_seconds += busy - worker_busy_seen;
    stats.handoffs += requests - worker_requests_seen;
    worker_busy_seen = busy;
    worker_requests_seen = requests;
  }
  if (in.bucket) {
    for (int r : in.sel_rows) {
      const size_t base = out->size();
      out->resize(base + V);
      std::memcpy(out->data() + base, h_logits + static_cast<size_t>(r) * V,
                  static_cast<size_t>(V) * 4);
    }
  }
  ++stats.passes;
  stats.rows += in.real_rows;
  const int calls = in.streamed ? 0 : CallsPerPass(in.rows);
  stats.ensure_calls += calls;
  if (in.streamed) {
    stats.streamed_layers += M;
    stats.bytes_fetched += static_cast<uint64_t>(M) * E * store->bytes_per_expert();
  }
  std::vector<uint8_t> seen(E);
  for (int m = 0; m < M; ++m) {
    std::fill(seen.begin(), seen.end(), 0);
    const int32_t* ids = h_forced + static_cast<int64_t>(m) * in.rows * K;
    const int64_t n = static_cast<int64_t>(in.real_rows) * K;
    for (int64_t i = 0; i < n; ++i) {
      if (ids[i] < 0 || ids[i] >= E) continue;
      ++stats.routes;
      stats.streamed_routes += in.streamed;
      if (!seen[ids[i]]) {
        seen[ids[i]] = 1;
        ++stats.distinct_experts;
      }
    }
    if (pinner != nullptr) RETURN_IF_ERROR(pinner->Observe(m, absl::MakeConstSpan(ids, n)));
  }
  last_fetches.assign(h_counts, h_counts + calls);
  for (int i = 0; i < calls; ++i) {
    stats.misses += h_counts[i];
    stats.bytes_fetched += static_cast<uint64_t>(h_counts[i]) * store->bytes_per_expert();
  }
  return absl::OkStatus();
}

absl::Status GpuModel::Impl::RunPass(absl::Span<const ModelChunk> chunks,
                                     const std::vector<Piece>& pieces, int row0, int total_rows,
                                     std::vector<float>* out) {
  bool decode = static_cast<int>(pieces.size()) <= max_bucket;
  for (const Piece& pc : pieces) decode &= pc.count == 1;
  int bucket = 0;
  if (decode) {
    // The same padded shape whether replayed or launched, so graph and eager agree bit for bit.
    bucket = 1;
    while (bucket < static_cast<int>(pieces.size())) bucket <<= 1;
  }
  const PassInputs in = StagePass(chunks, pieces, row0, total_rows, bucket);
  // Hybrid or offload for this pass. Auto: each decode bucket tries both modes for its first
  // kAutoTrials passes (alternating), then keeps the faster by median pass time; other passes
  // fetch every miss.
  int bucket_index = -1;
  for (int b = bucket; b > 0; b >>= 1) ++bucket_index;
  bool trial = false;
  pass_hybrid = handoff != nullptr && !in.streamed && in.rows <= opt.hybrid_max_rows;
  if (pass_hybrid && opt.hybrid_auto) {
    if (bucket_index < 0) {
      pass_hybrid = false;
    } else if (auto_choice[bucket_index] >= 0) {
      pass_hybrid = auto_choice[bucket_index] == 1;
    } else {
      trial = true;
      const size_t done = auto_ms[0][bucket_index].size() + auto_ms[1][bucket_index].size();
      pass_hybrid = done % 2 == 0;
    }
  }
  const auto pass_start = std::chrono::steady_clock::now();
  // The CPU worker polls while the pass runs (FinishPass disarms it; so does a failed enqueue).
  struct Disarm {
    hybrid::GpuHandoff* h;
    ~Disarm() {
      if (h != nullptr) h->Disarm();
    }
  } disarm{pass_hybrid ? handoff.get() : nullptr};
  if (pass_hybrid) handoff->Arm();
  if (bucket > 0 && graphs_on) {
    if (graphs_forced != (routing != nullptr)) {
      // Captured with the other routing source: capture again.
      int buckets = 0;
      for (int b = 1; b <= max_bucket; b <<= 1) ++buckets;
      graphs = std::make_unique<graph_capture::GraphCache>(buckets);
      graphs_hybrid = std::make_unique<graph_capture::GraphCache>(buckets);
      graphs_forced = routing != nullptr;
    }
    graph_capture::GraphCache& gc = pass_hybrid ? *graphs_hybrid : *graphs;
    if (!gc.Contains(bucket)) {
      if (fail_graph_after == 0) {
        fail_graph_after = -1;
        return absl::ResourceExhaustedError(absl::StrCat(
            "GPU memory: decode graph of batch bucket ", bucket,
            ": cudaGraphInstantiate: out of memory (injected)"));
      }
      if (fail_graph_after > 0) --fail_graph_after;
      ++stats.graph_captures;
    }
    absl::Status st = gc.Replay(bucket, stream(), [&](int, CUstream_st*) {
      return EnqueuePass(chunks, pieces, in, nullptr);
    });
    if (!st.ok()) {
      return absl::Status(st.code(), absl::StrCat("decode graph of batch bucket ", bucket, ": ",
                                                  st.message()));
    }
    ++stats.graph_replays;
  } else {
    RETURN_IF_ERROR(EnqueuePass(chunks, pieces, in, out));
  }
  RETURN_IF_ERROR(FinishPass(in, out));
  if (trial) {
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - pass_start)
            .count();
    auto_ms[pass_hybrid ? 1 : 0][bucket_index].push_back(ms);
    const std::vector<double>& off = auto_ms[0][bucket_index];
    const std::vector<double>& hyb = auto_ms[1][bucket_index];
    if (static_cast<int>(off.size() + hyb.size()) >= kAutoTrials) {
      auto median = [](std::vector<double> v) {
        std::sort(v.begin(), v.end());
        return v[v.size() / 2];
      };
      const double mo = median(off), mh = median(hyb);
      auto_choice[bucket_index] = mh < mo ? 1 : 0;
      if (opt.print_plan) {
        std::fprintf(stderr,
                     "hybrid experts, auto: batch bucket %d: hybrid %.2f ms, offload %.2f ms per "
                     "pass (medians of %zu and %zu): %s\n",
                     bucket, mh, mo, hyb.size(), off.size(), mh < mo ? "hybrid" : "offload");
      }
    }
  }
  return absl::OkStatus();
}

GpuModel::GpuModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GpuModel::~GpuModel() = default;

absl::StatusOr<std::unique_ptr<GpuModel>> GpuModel::Create(const ModelWeights* weights,
                                                           const moe_cache::ExpertStore* store,
                                                           const GpuModelOptions& options) {
  if (weights == nullptr) return absl::InvalidArgumentError("no weights");
  auto impl = std::make_unique<Impl>();
  RETURN_IF_ERROR(impl->Init(weights, store, options));
  return std::unique_ptr<GpuModel>(new GpuModel(std::move(impl)));
}

absl::Status GpuModel::Forward(absl::Span<const ModelChunk> chunks, std::vector<float>* logits) {
  Impl& m = *impl_;
  const ModelConfig& c = m.w->config;
  const int V = c.vocab_size, K = c.num_experts_per_tok, M = c.NumMoeLayers(),
            bs = m.opt.kv_block_size;
  int rows = 0;
  for (const ModelChunk& ch : chunks) {
    if (ch.block_table == nullptr) return absl::InvalidArgumentError("chunk without blocks");
    const int end = ch.start + static_cast<int>(ch.tokens.size());
    if (ch.start < 0 || end > m.max_context) {
      return absl::InvalidArgumentError(
          absl::StrCat("positions [", ch.start, ", ", end, ") outside [0, ", m.max_context, ")"));
    }
    const int64_t need = (static_cast<int64_t>(end) + bs - 1) / bs;
    if (static_cast<int64_t>(ch.block_table->size()) < need) {
      return absl::InvalidArgumentError("block table does not cover the chunk");
    }
    for (int64_t b = 0; b < need; ++b) {
      const int32_t id = (*ch.block_table)[b];
      if (id < 0 || id >= m.kv_blocks) {
        return absl::InvalidArgumentError(
            absl::StrCat("KV block id ", id, " outside [0, ", m.kv_blocks, ")"));
      }
    }
    for (int32_t t : ch.tokens) {
      if (t < 0 || t >= V) {
        return absl::InvalidArgumentError(
            absl::StrCat("token id ", t, " outside the vocabulary [0, ", V, ")"));
      }
    }
    rows += static_cast<int>(ch.tokens.size());
  }
  if (m.state_slots > 0) {
    std::vector<bool> used(m.state_slots, false);
    for (const ModelChunk& ch : chunks) {
      if (ch.state_slot < 0 || ch.state_slot >= m.state_slots || used[ch.state_slot]) {
        return absl::InvalidArgumentError(absl::StrCat("chunk state slot ", ch.state_slot,
                                                       ": not in [0, ", m.state_slots,
                                                       ") or used by two chunks of one batch"));
      }
      used[ch.state_slot] = true;
    }
  }
  if (rows == 0) return absl::OkStatus();
  if (m.routing != nullptr) {
    if (m.routing->moe_layers() != M || m.routing->k() != K) {
      return absl::InvalidArgumentError(absl::StrCat(
          "routing override of ", m.routing->moe_layers(), " MoE layers x top-",
          m.routing->k(), " for a model of ", M, " x top-", K));
    }
    m.forced.resize(static_cast<size_t>(M) * rows * K);
    RETURN_IF_ERROR(m.routing->Next(rows, absl::MakeSpan(m.forced)));
    for (int32_t id : m.forced) {
      if (id >= c.num_experts) {
        return absl::InvalidArgumentError(
            absl::StrCat("forced expert id ", id, " outside [0, ", c.num_experts, ")"));
      }
    }
  }
  // Passes of at most step_rows rows and max_chunks chunks, in chunk order.
  std::vector<Impl::Piece> pass;
  int pass_rows = 0, row0 = 0;
  for (size_t ci = 0; ci < chunks.size(); ++ci) {
    const int n = static_cast<int>(chunks[ci].tokens.size());
    for (int off = 0; off < n;) {
      const int count = std::min(n - off, m.step_rows);
      if (pass_rows + count > m.step_rows || static_cast<int>(pass.size()) >= m.max_chunks) {
        RETURN_IF_ERROR(m.RunPass(chunks, pass, row0, rows, logits));
        row0 += pass_rows;
        pass.clear();
        pass_rows = 0;
      }
      pass.push_back({static_cast<int>(ci), off, count, off + count == n});
      pass_rows += count;
      off += count;
    }
  }
  if (!pass.empty()) RETURN_IF_ERROR(m.RunPass(chunks, pass, row0, rows, logits));
  if (m.pinner != nullptr) {
    // Between forwards (the stream is idle): the pinned policy's flag changes.
    const std::vector<moe_cache::PinChange> changes = m.pinner->EndStep();
    if (!changes.empty()) {
      for (const moe_cache::PinChange& ch : changes) m.pinned_flags[ch.expert] = ch.pinned;
      RETURN_IF_ERROR(m.cache->UploadPinned(m.pinned_flags.data()));
      m.stats.pin_changes += static_cast<int64_t>(changes.size());
    }
  }
  return absl::OkStatus();
}

const ModelConfig& GpuModel::config() const { return impl_->w->config; }
int GpuModel::max_positions() const { return impl_->max_context; }
int GpuModel::kv_blocks() const { return impl_->kv_blocks; }
int GpuModel::kv_block_size() const { return impl_->opt.kv_block_size; }
int GpuModel::state_slots() const { return impl_->state_slots; }
absl::Status GpuModel::FillSyntheticContext(uint64_t seed) {
  return impl_->FillSyntheticContext(seed);
}
uint64_t GpuModel::memory_bytes() const {
  const Impl& m = *impl_;
  return m.dense_bytes + 2 * m.kv->layer_bytes() * m.kv->num_layers() +
         static_cast<uint64_t>(m.state_slot_stride) * m.state_slots * 4 +
         (m.pool != nullptr ? m.pool->total_bytes() : 0);
}
void GpuModel::set_routing_override(RoutingOverride* routing) { impl_->routing = routing; }
const GpuMemoryPlan& GpuModel::plan() const { return impl_->plan; }
const GpuCacheStats& GpuModel::stats() const { return impl_->stats; }
void GpuModel::ResetStats() { impl_->stats = {}; }
int GpuModel::total_slots() const { return impl_->total_slots; }
int GpuModel::max_bucket() const { return impl_->max_bucket; }
void GpuModel::InjectGraphOutOfMemory(int captures) { impl_->fail_graph_after = captures; }
void GpuModel::set_graphs(bool on) { impl_->graphs_on = on; }
bool GpuModel::graphs() const { return impl_->graphs_on; }
int GpuModel::prefill_stream_min_rows() const { return impl_->stream_min_rows; }
const std::vector<int32_t>& GpuModel::last_pass_fetches() const { return impl_->last_fetches; }
moe_cache::BandwidthProfile GpuModel::hybrid_profile() const {
  return impl_->handoff != nullptr ? impl_->opt.hybrid_profile : moe_cache::BandwidthProfile{};
}
absl::Status GpuModel::ResetExpertCache() {
  Impl& m = *impl_;
  if (m.cache == nullptr) return absl::OkStatus();
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.stream()));
  if (m.pinner != nullptr) RETURN_IF_ERROR(m.NewPinner());
  return m.cache->Reset();
}

#else  // !MOE_HAVE_CUDA

struct GpuModel::Impl {
  ModelConfig config;
  GpuMemoryPlan plan;
  GpuCacheStats stats;
};

GpuModel::GpuModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GpuModel::~GpuModel() = default;

absl::StatusOr<std::unique_ptr<GpuModel>> GpuModel::Create(const ModelWeights*,
                                                           const moe_cache::ExpertStore*,
                                                           const GpuModelOptions&) {
  return absl::UnavailableError("GPU model: built without CUDA");
}
absl::Status GpuModel::Forward(absl::Span<const ModelChunk>, std::vector<float>*) {
  return absl::UnavailableError("GPU model: built without CUDA");
}
const ModelConfig& GpuModel::config() const { return impl_->config; }
int GpuModel::max_positions() const { return 0; }
int GpuModel::kv_blocks() const { return 0; }
int GpuModel::kv_block_size() const { return 0; }
int GpuModel::state_slots() const { return 0; }
absl::Status GpuModel::FillSyntheticContext(uint64_t) {
  return absl::UnavailableError("GPU model: built without CUDA");
}
uint64_t GpuModel::memory_bytes() const { return 0; }
void GpuModel::set_routing_override(RoutingOverride*) {}
const GpuMemoryPlan& GpuModel::plan() const { return impl_->plan; }
const GpuCacheStats& GpuModel::stats() const { return impl_->stats; }
void GpuModel::ResetStats() {}
int GpuModel::total_slots() const { return 0; }
int GpuModel::max_bucket() const { return 0; }
void GpuModel::InjectGraphOutOfMemory(int) {}
void GpuModel::set_graphs(bool) {}
bool GpuModel::graphs() const { return false; }
int GpuModel::prefill_stream_min_rows() const { return 0; }
const std::vector<int32_t>& GpuModel::last_pass_fetches() const {
  static const std::vector<int32_t> none;
  return none;
}
moe_cache::BandwidthProfile GpuModel::hybrid_profile() const { return {}; }
absl::Status GpuModel::ResetExpertCache() {
  return absl::UnavailableError("GPU model: built without CUDA");
}

#endif  // MOE_HAVE_CUDA

}  // namespace moe::engine::gpu
