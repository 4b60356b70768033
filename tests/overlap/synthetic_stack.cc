#include "tests/overlap/synthetic_stack.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/cuda_status.h"
#include "common/status.h"
#include "moe_overlap/fork_join.h"
#include "tests/overlap/synthetic_kernels.h"

#if MOE_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#endif

namespace moe::overlap_test {


absl::StatusOr<std::unique_ptr<SyntheticMoeStack>> SyntheticMoeStack::Create(
    const StackConfig& config) {
  std::unique_ptr<SyntheticMoeStack> stack(new SyntheticMoeStack());
  RETURN_IF_ERROR(stack->Init(config));
  return stack;
}

int SyntheticMoeStack::CountMismatches(const StepResult& r, int batch) const {
  const int n = batch * config_.top_k;
  int bad = 0;
  for (int l = 0; l < config_.layers; ++l) {
    for (int i = 0; i < n; ++i) {
      const int32_t id = r.ids[l * n + i];
      if (id < 0 || id >= config_.experts) continue;
      if (r.checksums[l * n + i] != expected_[l * config_.experts + id]) ++bad;
    }
  }
  return bad;
}

#if MOE_HAVE_CUDA

namespace {

uint64_t SplitMix(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

void FillBytes(uint64_t seed, uint8_t* out, uint64_t n) {
  uint64_t st = seed;
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t v = SplitMix(&st);
    std::memcpy(out + i, &v, 8);
  }
  const uint64_t v = SplitMix(&st);
  for (int b = 0; i < n; ++i, ++b) out[i] = static_cast<uint8_t>(v >> (8 * b));
}

// Random bf16 in about [-scale, scale): the top 16 bits of a float.
void FillBf16(uint64_t seed, float scale, std::vector<uint16_t>* out) {
  uint64_t st = seed;
  for (auto& x : *out) {
    const float f = (static_cast<float>(SplitMix(&st) >> 40) * (1.f / 16777216.f) * 2.f - 1.f) *
                    scale;
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    x = static_cast<uint16_t>(bits >> 16);
  }
}

}  // namespace

namespace {

#define BLAS_RETURN_IF_ERROR(expr)                                                   \
  do {                                                                               \
    const cublasStatus_t moe_blas_ = (expr);                                         \
    if (moe_blas_ != CUBLAS_STATUS_SUCCESS) {                                        \
      return absl::InternalError(absl::StrCat("cuBLAS: ", cublasGetStatusName(moe_blas_), \
                                              " in ", #expr));                       \
    }                                                                                \
  } while (0)

// Row-major Y[T, N] = X[T, K] . W[N, K]^T: column-major Y^T = W^T X^T (W is K x N column-major).
absl::Status Gemm(cublasHandle_t h, const uint16_t* w, const uint16_t* x, void* y,
                  cudaDataType_t y_type, int n, int t, int k) {
  const float alpha = 1.f, beta = 0.f;
  BLAS_RETURN_IF_ERROR(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, t, k, &alpha, w, CUDA_R_16BF,
                                    k, x, CUDA_R_16BF, k, &beta, y, y_type, n,
                                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

constexpr size_t kBlasWorkspace = 32 << 20;

}  // namespace

absl::Status SyntheticMoeStack::Init(const StackConfig& c) {
  RETURN_IF_ERROR(common::CudaAvailable());
  if (c.layers < 1 || c.experts < 1 || c.experts > kMaxRoutedExperts || c.top_k < 1 ||
      c.top_k > kMaxTopK || c.top_k > c.experts || c.hidden < 16 || c.hidden % 16 != 0 ||
      c.inter < 16 || c.inter % 16 != 0 || c.shared_inter < 8 || c.shared_inter % 8 != 0 ||
      c.max_batch < 1 || c.vocab < 1 || c.slots < c.max_batch * c.top_k) {
    return absl::InvalidArgumentError("synthetic stack: bad shape (slots must hold one call)");
  }
  config_ = c;
  ASSIGN_OR_RETURN(own_pair_, moe_overlap::StreamPair::Create(c.overlap));
  moe_overlap::OverlapOptions other = c.overlap;
  other.overlap = !other.overlap;
  ASSIGN_OR_RETURN(alt_pair_, moe_overlap::StreamPair::CreateWithStreams(
                                  other, own_pair_->compute(), own_pair_->side()));
  pair_ = own_pair_.get();

  // Routed experts: 4-bit weights, one scale byte per 16 weights.
  const uint64_t gu = 2ull * c.inter * c.hidden, dn = 1ull * c.hidden * c.inter;
  ASSIGN_OR_RETURN(moe_cache::BankLayout layout,
                   moe_cache::BankLayout::Create({{"gate_up", gu / 2},
                                                  {"down", dn / 2},
                                                  {"gate_up_scales", gu / 16},
                                                  {"down_scales", dn / 16}}));
  ASSIGN_OR_RETURN(store_,
                   moe_cache::ExpertStore::Create({c.layers, c.experts, true}, layout));
  const int total = c.layers * c.experts;
  expected_.assign(total, 0);
  {
    // Fill and checksum in parallel: writes to distinct experts may run concurrently.
    std::vector<absl::Status> errors(std::max(1, c.host_threads));
    std::vector<std::thread> threads;
    for (int w = 0; w < static_cast<int>(errors.size()); ++w) {
      threads.emplace_back([&, w] {
        std::vector<uint8_t> row;
        for (int g = w; g < total && errors[w].ok(); g += static_cast<int>(errors.size())) {
          uint32_t sum = 0;
          for (int b = 0; b < layout.num_banks(); ++b) {
            row.resize(layout.bank(b).bytes);
            FillBytes((static_cast<uint64_t>(c.seed) << 40) ^ (uint64_t(g) << 4) ^ b, row.data(),
                      row.size());
            errors[w] = store_->WriteBank(g / c.experts, g % c.experts, b, row);
            if (!errors[w].ok()) break;
            // The consumer reads the slot's whole pitch; read it back from the store.
            sum += HostChecksum(store_->expert_bank(g, b), layout.bank(b).pitch);
          }
          expected_[g] = sum;
        }
      });
    }
    for (auto& t : threads) t.join();
    for (const auto& e : errors) RETURN_IF_ERROR(e);
  }
  RETURN_IF_ERROR(ResetCache(c.slots));

  // Dense weights and activations: one arena, carved with 256-byte alignment.
  const int64_t T = c.max_batch, H = c.hidden, E = c.experts, K = c.top_k, Is = c.shared_inter;
  const int64_t L = c.layers;
  size_t offset = 0;
  std::vector<std::pair<void**, size_t>> parts = {
      {reinterpret_cast<void**>(&tokens_), T * 4},
      {reinterpret_cast<void**>(&embed_), c.vocab * H * 2},
      {reinterpret_cast<void**>(&router_w_), L * E * H * 2},
      {reinterpret_cast<void**>(&shared_gu_w_), L * 2 * Is * H * 2},
      {reinterpret_cast<void**>(&shared_d_w_), L * H * Is * 2},
      {reinterpret_cast<void**>(&x_), T * H * 2},
      {reinterpret_cast<void**>(&h_), T * H * 4},
      {reinterpret_cast<void**>(&logits_), T * E * 4},
      {reinterpret_cast<void**>(&gate_up_), T * 2 * Is * 2},
      {reinterpret_cast<void**>(&act_), T * Is * 2},
      {reinterpret_cast<void**>(&shared_out_), T * H * 2},
      {reinterpret_cast<void**>(&ids_), L * T * K * 4},
      {reinterpret_cast<void**>(&weights_), L * T * K * 4},
      {reinterpret_cast<void**>(&slot_ids_), L * T * K * 4},
      {reinterpret_cast<void**>(&plan_counts_), L * 4},
      {reinterpret_cast<void**>(&plans_), L * T * K * sizeof(moe_cache::MissPlanEntry)},
      {reinterpret_cast<void**>(&partials_), T * K * kChecksumSplit * 4},
      {reinterpret_cast<void**>(&checksums_), L * T * K * 4},
      {&blas_workspace_, kBlasWorkspace},
  };
  std::vector<size_t> offsets;
  for (const auto& p : parts) {
    offsets.push_back(offset);
    offset += (p.second + 255) / 256 * 256;
  }
  CUDA_RETURN_IF_ERROR(cudaMalloc(&arena_, offset));
  CUDA_RETURN_IF_ERROR(cudaMemset(arena_, 0, offset));
  for (size_t i = 0; i < parts.size(); ++i) {
    *parts[i].first = static_cast<uint8_t*>(arena_) + offsets[i];
  }
  auto upload = [&](void* dst, uint64_t seed, size_t count, float scale) -> absl::Status {
    std::vector<uint16_t> host(count);
    FillBf16(seed, scale, &host);
    CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, host.data(), count * 2, cudaMemcpyHostToDevice));
    return absl::OkStatus();
  };
  const uint64_t s = static_cast<uint64_t>(c.seed) << 8;
  RETURN_IF_ERROR(upload(embed_, s + 1, c.vocab * H, 1.f));
  RETURN_IF_ERROR(upload(router_w_, s + 2, L * E * H, 1.f / 16));
  RETURN_IF_ERROR(upload(shared_gu_w_, s + 3, L * 2 * Is * H, 1.f / 16));
  RETURN_IF_ERROR(upload(shared_d_w_, s + 4, L * H * Is, 1.f / 16));

  cublasHandle_t handle = nullptr;
  BLAS_RETURN_IF_ERROR(cublasCreate(&handle));
  blas_ = handle;
  // The handle lives on the compute stream; cublasSetStream resets the workspace, so the
  // caller-owned workspace is set after it: nothing is allocated inside a capture.
  BLAS_RETURN_IF_ERROR(cublasSetStream(handle, pair_->compute()));
  BLAS_RETURN_IF_ERROR(cublasSetWorkspace(handle, blas_workspace_, kBlasWorkspace));
  BLAS_RETURN_IF_ERROR(cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_HOST));

  CUDA_RETURN_IF_ERROR(
      cudaHostAlloc(reinterpret_cast<void**>(&staging_), kStagingRing * T * 4, cudaHostAllocDefault));
  for (auto& e : staging_done_) {
    CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return absl::OkStatus();
}

absl::Status SyntheticMoeStack::ResetCache(int slots) {
  if (slots < config_.max_batch * config_.top_k) {
    return absl::InvalidArgumentError("slots must hold one call's experts");
  }
  CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());  // nothing may still use the old pool
  state_.reset();
  pool_.reset();
  ASSIGN_OR_RETURN(pool_, moe_cache::SlotPool::Create(slots, store_->layout()));
  ASSIGN_OR_RETURN(desc_, moe_cache::MakeGatherDescriptor(*store_, *pool_));
  ASSIGN_OR_RETURN(state_, moe_cache::DeviceCacheState::Create(
                               config_.layers, config_.experts, slots,
                               moe_cache::DefaultPolicyParams(config_.policy)));
  config_.slots = slots;
  return absl::OkStatus();
}

SyntheticMoeStack::~SyntheticMoeStack() {
  // Nothing may still read the buffers below.
  cudaDeviceSynchronize();
  if (blas_ != nullptr) cublasDestroy(static_cast<cublasHandle_t>(blas_));
  for (auto& e : staging_done_) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  if (staging_ != nullptr) cudaFreeHost(staging_);
  if (arena_ != nullptr) cudaFree(arena_);
}

absl::Status SyntheticMoeStack::SetTokens(const std::vector<int32_t>& tokens) {
  if (tokens.empty() || static_cast<int>(tokens.size()) > config_.max_batch) {
    return absl::InvalidArgumentError("batch outside 1..max_batch");
  }
  const int slot = staging_next_;
  staging_next_ = (staging_next_ + 1) % kStagingRing;
  int32_t* host = staging_ + slot * config_.max_batch;
  CUDA_RETURN_IF_ERROR(cudaEventSynchronize(staging_done_[slot]));
  std::memcpy(host, tokens.data(), tokens.size() * 4);
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(tokens_, host, tokens.size() * 4, cudaMemcpyHostToDevice,
                                       pair_->compute()));
  CUDA_RETURN_IF_ERROR(cudaEventRecord(staging_done_[slot], pair_->compute()));
  return absl::OkStatus();
}

absl::Status SyntheticMoeStack::EnqueueRouter(int layer, int batch, CUstream_st* stream) {
  const int64_t H = config_.hidden, E = config_.experts, K = config_.top_k;
  const int64_t T = config_.max_batch;
  RETURN_IF_ERROR(Gemm(static_cast<cublasHandle_t>(blas_), router_w_ + layer * E * H, x_, logits_,
                       CUDA_R_32F, static_cast<int>(E), batch, static_cast<int>(H)));
  return LaunchTopK(logits_, batch, static_cast<int>(E), static_cast<int>(K),
                    ids_ + layer * T * K, weights_ + layer * T * K, stream);
}

absl::Status SyntheticMoeStack::EnqueueSharedExpert(int layer, int batch, CUstream_st* stream) {
  const int64_t H = config_.hidden, Is = config_.shared_inter;
  cublasHandle_t h = static_cast<cublasHandle_t>(blas_);
  RETURN_IF_ERROR(Gemm(h, shared_gu_w_ + layer * 2 * Is * H, x_, gate_up_, CUDA_R_16BF,
                       static_cast<int>(2 * Is), batch, static_cast<int>(H)));
  RETURN_IF_ERROR(LaunchSiluMul(gate_up_, batch, static_cast<int>(Is), act_, stream));
  return Gemm(h, shared_d_w_ + layer * H * Is, act_, shared_out_, CUDA_R_16BF,
              static_cast<int>(H), batch, static_cast<int>(Is));
}

absl::Status SyntheticMoeStack::EnqueueStep(int batch, LayerTimers* timers) {
  if (batch < 1 || batch > config_.max_batch) {
    return absl::InvalidArgumentError("batch outside 1..max_batch");
  }
  if (timers != nullptr && timers->side_begin.size() < static_cast<size_t>(config_.layers)) {
    return absl::InvalidArgumentError("timers: one event per layer needed");
  }
  CUstream_st* compute = pair_->compute();
  const int64_t T = config_.max_batch, K = config_.top_k, n = batch * K;
  RETURN_IF_ERROR(LaunchEmbed(tokens_, embed_, config_.vocab, batch, config_.hidden, x_, h_,
                              compute));
  if (timers != nullptr && !timers->stages.empty() &&
      timers->stages.size() < static_cast<size_t>(config_.layers * LayerTimers::kStageMarks)) {
    return absl::InvalidArgumentError("timers: kStageMarks stage events per layer needed");
  }
  const bool stages = timers != nullptr && !timers->stages.empty();
  auto mark = [&](int l, int m) -> absl::Status {
    if (stages) {
      CUDA_RETURN_IF_ERROR(
          cudaEventRecord(timers->stages[l * LayerTimers::kStageMarks + m], compute));
    }
    return absl::OkStatus();
  };
  for (int l = 0; l < config_.layers; ++l) {
    // cuBLAS runs on the handle's stream, which is the compute stream: the router and the shared
    // expert are compute-branch work by construction.
    RETURN_IF_ERROR(mark(l, 0));
    RETURN_IF_ERROR(EnqueueRouter(l, batch, compute));
    RETURN_IF_ERROR(mark(l, 1));
    int32_t* slots = slot_ids_ + l * T * K;
    moe_cache::MissPlanEntry* plan = plans_ + l * T * K;
    // Single writer of the slot map and the miss plan: the compute stream, before the fork.
    RETURN_IF_ERROR(moe_cache::LaunchEnsureExperts(state_->view(), l, ids_ + l * T * K,
                                                   static_cast<int32_t>(n), slots,
                                                   plan_counts_ + l, plan, compute));
    RETURN_IF_ERROR(mark(l, 2));
    {
      moe_overlap::ForkJoinScope scope(*pair_);
      RETURN_IF_ERROR(scope.Side([&](CUstream_st* s) -> absl::Status {
        if (timers != nullptr) CUDA_RETURN_IF_ERROR(cudaEventRecord(timers->side_begin[l], s));
        RETURN_IF_ERROR(moe_cache::LaunchCopyMissing(desc_, plan_counts_ + l, plan,
                                                     config_.gather, s));
        if (timers != nullptr) CUDA_RETURN_IF_ERROR(cudaEventRecord(timers->side_end[l], s));
        return absl::OkStatus();
      }));
      RETURN_IF_ERROR(scope.Compute([&](CUstream_st* s) -> absl::Status {
        if (timers != nullptr) CUDA_RETURN_IF_ERROR(cudaEventRecord(timers->compute_begin[l], s));
        RETURN_IF_ERROR(EnqueueSharedExpert(l, batch, s));
        if (timers != nullptr) CUDA_RETURN_IF_ERROR(cudaEventRecord(timers->compute_end[l], s));
        return absl::OkStatus();
      }));
      RETURN_IF_ERROR(scope.Join());
    }
    RETURN_IF_ERROR(mark(l, 3));
    RETURN_IF_ERROR(LaunchChecksum(desc_, slots, static_cast<int>(n), partials_, compute));
    RETURN_IF_ERROR(LaunchCombine(partials_, weights_ + l * T * K, shared_out_, batch,
                                  static_cast<int>(K), config_.hidden, checksums_ + l * T * K, h_,
                                  x_, compute));
    RETURN_IF_ERROR(mark(l, 4));
  }
  return absl::OkStatus();
}

absl::StatusOr<SyntheticMoeStack::StepResult> SyntheticMoeStack::ReadStep(int batch) const {
  const int64_t L = config_.layers, T = config_.max_batch, K = config_.top_k, n = batch * K;
  CUstream_st* s = pair_->compute();
  StepResult r;
  r.hidden.resize(batch * config_.hidden);
  r.ids.resize(L * n);
  r.slots.resize(L * n);
  r.plan_counts.resize(L);
  r.checksums.resize(L * n);
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(r.hidden.data(), h_, r.hidden.size() * 4,
                                       cudaMemcpyDeviceToHost, s));
  for (int64_t l = 0; l < L; ++l) {
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(r.ids.data() + l * n, ids_ + l * T * K, n * 4,
                                         cudaMemcpyDeviceToHost, s));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(r.slots.data() + l * n, slot_ids_ + l * T * K, n * 4,
                                         cudaMemcpyDeviceToHost, s));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(r.checksums.data() + l * n, checksums_ + l * T * K,
                                         n * 4, cudaMemcpyDeviceToHost, s));
  }
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(r.plan_counts.data(), plan_counts_, L * 4,
                                       cudaMemcpyDeviceToHost, s));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  return r;
}

#else  // !MOE_HAVE_CUDA

absl::Status SyntheticMoeStack::Init(const StackConfig&) {
  return absl::UnavailableError("synthetic stack: built without CUDA");
}
SyntheticMoeStack::~SyntheticMoeStack() = default;
absl::Status SyntheticMoeStack::SetTokens(const std::vector<int32_t>&) {
  return absl::UnavailableError("synthetic stack: built without CUDA");
}
absl::Status SyntheticMoeStack::ResetCache(int) {
  return absl::UnavailableError("synthetic stack: built without CUDA");
}
absl::Status SyntheticMoeStack::EnqueueRouter(int, int, CUstream_st*) {
  return absl::UnavailableError("synthetic stack: built without CUDA");
}
absl::Status SyntheticMoeStack::EnqueueSharedExpert(int, int, CUstream_st*) {
  return absl::UnavailableError("synthetic stack: built without CUDA");
}
absl::Status SyntheticMoeStack::EnqueueStep(int, LayerTimers*) {
  return absl::UnavailableError("synthetic stack: built without CUDA");
}
absl::StatusOr<SyntheticMoeStack::StepResult> SyntheticMoeStack::ReadStep(int) const {
  return absl::UnavailableError("synthetic stack: built without CUDA");
}

#endif  // MOE_HAVE_CUDA

}  // namespace moe::overlap_test
