// The GPU memory plan on Qwen3-30B-A3B's shape for an 80 GB (H100) and a 141 GB (H200) card:
// byte counts from the shapes worked out independently here, given budgets of 10/25/50% of the
// experts and the automatic budget, and every error (budget below top-k slots, a KV cache or a
// budget that does not fit, dense weights larger than the card) with its numbers.
#include "engine/gpu_memory_plan.h"

#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"

namespace moe::engine {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20, kGiB = uint64_t{1} << 30;
// nvidia-smi's total less about 600 MiB that a CUDA context takes.
constexpr uint64_t kH100Free = (81559 - 600) * kMiB;
constexpr uint64_t kH200Free = (143771 - 600) * kMiB;

ModelConfig Qwen3_30B_A3B() {
  ModelConfig c;
  c.model_type = "qwen3_moe";
  c.vocab_size = 151936;
  c.hidden_size = 2048;
  c.intermediate_size = 6144;
  c.moe_intermediate_size = 768;
  c.num_hidden_layers = 48;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 4;
  c.head_dim = 128;
  c.max_position_embeddings = 40960;
  c.num_experts = 128;
  c.num_experts_per_tok = 8;
  c.norm_topk_prob = true;
  c.qk_norm = true;
  return c;
}

// bf16: embeddings and LM head 151936 x 2048 each; per layer q 4096x2048, k and v 512x2048,
// o 2048x4096, q/k norms 128 each, two RMSNorms of 2048, router 128x2048; final norm 2048.
constexpr uint64_t kDenseBytes =
    2ull * 151936 * 2048 * 2 +
    48ull * ((4096ull * 2048 + 2 * 512 * 2048 + 2048 * 4096 + 2 * 128) * 2 + 2 * 2048 * 2 +
             128 * 2048 * 2) +
    2048 * 2;
// One expert: gate, up [768, 2048] and down [2048, 768] in bf16.
constexpr uint64_t kExpertBf16 = 3ull * 2048 * 768 * 2;
// q4_0: 18-byte blocks of 32 weights.
constexpr uint64_t kExpertQ4 = 2ull * 768 * (2048 / 32 * 18) + 2048ull * (768 / 32 * 18);
constexpr uint64_t kAllExpertsBf16 = 48ull * 128 * kExpertBf16;
// bf16 K and V of one token in every layer.
constexpr uint64_t kKvPerToken = 2ull * 48 * 4 * 128 * 2;

GpuMemoryRequest Request(uint64_t free, double budget_gib, int context, int batch) {
  GpuMemoryRequest r;
  r.gpu_free_bytes = free;
  r.expert_budget_gib = budget_gib;
  r.max_context = context;
  r.max_batch = batch;
  return r;
}

void CheckConsistent(const GpuMemoryPlan& p, uint64_t free) {
  EXPECT_EQ(p.dense.total(), kDenseBytes);
  EXPECT_EQ(p.kv_bytes, static_cast<uint64_t>(p.kv_blocks) * 16 * kKvPerToken);
  EXPECT_EQ(p.kv_blocks, p.max_batch * ((p.max_context + 15) / 16));
  EXPECT_EQ(p.expert_bytes, static_cast<uint64_t>(p.slots_per_layer) * 48 * p.slot_bytes);
  EXPECT_GE(p.slots_per_layer, 8);
  EXPECT_LE(p.slots_per_layer, 128);
  EXPECT_EQ(p.dense.total() + p.kv_bytes + p.scratch_bytes() + p.expert_bytes, p.planned_bytes());
  EXPECT_LE(p.planned_bytes() + p.safety_reserve_bytes, free);
  EXPECT_DOUBLE_EQ(p.resident_fraction(), p.slots_per_layer / 128.0);
}

TEST(GpuMemoryPlanTest, GivenBudgetsOfTenTwentyFiveAndFiftyPercent) {
  for (uint64_t free : {kH100Free, kH200Free}) {
    for (double share : {0.10, 0.25, 0.50}) {
      const double budget = share * kAllExpertsBf16 / kGiB;
      auto p = PlanGpuMemory(Qwen3_30B_A3B(), Request(free, budget, 4096, 8));
      ASSERT_TRUE(p.ok()) << p.status();
      std::printf("%s\n", p->Summary().c_str());
      EXPECT_EQ(p->slot_bytes, kExpertBf16);
      EXPECT_EQ(p->slots_per_layer, static_cast<int>(share * 128));  // 12, 32, 64
      EXPECT_FALSE(p->automatic_budget);
      EXPECT_EQ(p->kv_bytes, 4096ull * 8 * kKvPerToken);  // 3 GiB
      CheckConsistent(*p, free);
      const std::string s = p->Summary();
      EXPECT_NE(s.find(absl::StrCat(p->slots_per_layer, " slots per MoE layer x 48 layers")),
                std::string::npos)
          << s;
      EXPECT_NE(s.find(absl::StrFormat("%.1f%% of the 6144 routed experts resident",
                                       100.0 * p->slots_per_layer / 128)),
                std::string::npos)
          << s;
      EXPECT_NE(s.find("2048 blocks of 16 tokens"), std::string::npos) << s;
    }
  }
}

TEST(GpuMemoryPlanTest, AutomaticBudgetTakesWhatIsLeft) {
  // A short context: every expert fits on both cards (54 GiB of bf16 experts).
  for (uint64_t free : {kH100Free, kH200Free}) {
    auto p = PlanGpuMemory(Qwen3_30B_A3B(), Request(free, 0, 4096, 8));
    ASSERT_TRUE(p.ok()) << p.status();
    std::printf("%s\n", p->Summary().c_str());
    EXPECT_TRUE(p->automatic_budget);
    EXPECT_EQ(p->slots_per_layer, 128);
    CheckConsistent(*p, free);
  }
  // 32768 x 8 tokens of KV (24 GiB): on the 80 GB card the experts no longer all fit, and the
  // plan leaves less than one more slot per layer beyond the safety reserve.
  auto p = PlanGpuMemory(Qwen3_30B_A3B(), Request(kH100Free, 0, 32768, 8));
  ASSERT_TRUE(p.ok()) << p.status();
  std::printf("%s\n", p->Summary().c_str());
  EXPECT_EQ(p->kv_bytes, 24 * kGiB);
  EXPECT_LT(p->slots_per_layer, 128);
  EXPECT_GT(p->slots_per_layer, 100);
  CheckConsistent(*p, kH100Free);
  EXPECT_GE(p->left_bytes(), p->safety_reserve_bytes);
  EXPECT_LT(p->left_bytes() - p->safety_reserve_bytes, 48 * kExpertBf16);
  // The 141 GB card still holds every expert.
  auto h200 = PlanGpuMemory(Qwen3_30B_A3B(), Request(kH200Free, 0, 32768, 8));
  ASSERT_TRUE(h200.ok()) << h200.status();
  EXPECT_EQ(h200->slots_per_layer, 128);
  // q4_0 experts: the layout the loader builds.
  GpuMemoryRequest q4 = Request(kH100Free, 0, 32768, 8);
  q4.expert_format = common::WeightFormat::kQ4_0;
  auto pq = PlanGpuMemory(Qwen3_30B_A3B(), q4);
  ASSERT_TRUE(pq.ok()) << pq.status();
  EXPECT_EQ(pq->slot_bytes, kExpertQ4);
  EXPECT_EQ(pq->slots_per_layer, 128);
}

TEST(GpuMemoryPlanTest, BudgetBelowTopKSlotsIsAnError) {
  // 48 x 9 MiB per slot row: 0.5 GiB holds one slot per layer.
  auto p = PlanGpuMemory(Qwen3_30B_A3B(), Request(kH100Free, 0.5, 4096, 8));
  ASSERT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string m(p.status().message());
  EXPECT_NE(m.find("--gpu-expert-budget-gb 0.5 holds 1 expert slots per MoE layer"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("needs at least 8 per layer: 3.38 GiB"), std::string::npos) << m;
  // Exactly top-k slots is enough.
  auto ok =
      PlanGpuMemory(Qwen3_30B_A3B(), Request(kH100Free, 8.0 * 48 * kExpertBf16 / kGiB, 4096, 8));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->slots_per_layer, 8);
}

TEST(GpuMemoryPlanTest, KvCacheThatDoesNotFitNamesItsNumbers) {
  auto small = PlanGpuMemory(Qwen3_30B_A3B(), Request(kH100Free, 0, 4096, 32));
  ASSERT_TRUE(small.ok()) << small.status();
  const uint64_t after =
      kH100Free - small->dense.total() - small->scratch_bytes() - small->safety_reserve_bytes;
  auto p = PlanGpuMemory(Qwen3_30B_A3B(), Request(kH100Free, 0, 32768, 32));
  ASSERT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted);
  const std::string m(p.status().message());
  EXPECT_NE(m.find("KV cache for --max-context 32768 x --max-batch 32 needs 96.0 GiB, " +
                   FormatBytes(after) + " free after dense weights"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("lower --max-context or --max-batch"), std::string::npos) << m;
  // A context past the model's positions is a bad value, not a memory problem.
  EXPECT_EQ(PlanGpuMemory(Qwen3_30B_A3B(), Request(kH200Free, 0, 65536, 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(GpuMemoryPlanTest, BudgetsThatDoNotFitAndBudgetsAboveEveryExpert) {
  // 60 GiB asks for every expert (54 GiB), more than the 80 GB card has left with 24 GiB of KV.
  auto p = PlanGpuMemory(Qwen3_30B_A3B(), Request(kH100Free, 60, 32768, 8));
  ASSERT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted);
  const std::string m(p.status().message());
  EXPECT_NE(m.find("--gpu-expert-budget-gb 60 needs 54.0 GiB for 128 slots per MoE layer"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("pass 0 (automatic)"), std::string::npos) << m;
  // On the 141 GB card it fits, capped at every expert.
  auto q = PlanGpuMemory(Qwen3_30B_A3B(), Request(kH200Free, 60, 32768, 8));
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_TRUE(q->budget_capped);
  EXPECT_EQ(q->slots_per_layer, 128);
  EXPECT_EQ(q->expert_bytes, kAllExpertsBf16);
  // A card smaller than the dense weights.
  auto tiny = PlanGpuMemory(Qwen3_30B_A3B(), Request(3 * kGiB, 0, 4096, 1));
  ASSERT_EQ(tiny.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(tiny.status().message().find("dense weights need 2.87 GiB"), std::string::npos)
      << tiny.status();
}

TEST(GpuMemoryPlanTest, TiedEmbeddingsCountedOnce) {
  ModelConfig tied = Qwen3_30B_A3B();
  tied.tie_word_embeddings = true;
  const DenseWeightBytes a = DenseWeightBytesOf(Qwen3_30B_A3B()), b = DenseWeightBytesOf(tied);
  EXPECT_EQ(a.total() - b.total(), 151936ull * 2048 * 2);
  EXPECT_EQ(b.lm_head, 0u);
  EXPECT_EQ(b.embeddings, a.embeddings);
  auto p = PlanGpuMemory(tied, Request(kH100Free, 10, 4096, 8));
  ASSERT_TRUE(p.ok());
  EXPECT_NE(p->Summary().find("tied LM head"), std::string::npos);
}

TEST(GpuMemoryPlanTest, SharedExpertAndDenseLayersAreDenseWeights) {
  ModelConfig c = Qwen3_30B_A3B();
  c.shared_expert_intermediate_size = 1024;
  c.mlp_only_layers = {0, 47};
  const DenseWeightBytes d = DenseWeightBytesOf(c);
  EXPECT_EQ(d.shared_expert, 46ull * (3 * 2048 * 1024 + 2048) * 2);
  EXPECT_EQ(d.dense_mlp, 2ull * 3 * 2048 * 6144 * 2);
  EXPECT_EQ(d.router, 46ull * 128 * 2048 * 2);
  auto p = PlanGpuMemory(c, Request(kH100Free, 0, 4096, 8));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->moe_layers, 46);
}

TEST(GpuMemoryPlanTest, BadRequestValues) {
  const ModelConfig c = Qwen3_30B_A3B();
  EXPECT_EQ(PlanGpuMemory(c, Request(kH100Free, -1, 4096, 8)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanGpuMemory(c, Request(kH100Free, 0, 4096, 0)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanGpuMemory(c, Request(0, 0, 4096, 8)).status().code(),
            absl::StatusCode::kInvalidArgument);
  // max_context 0: min(max_position_embeddings, 4096), as the CPU engine.
  auto p = PlanGpuMemory(c, Request(kH100Free, 0, 0, 8));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->max_context, 4096);
}

TEST(GpuMemoryPlanTest, GatedDeltaNetLayersHoldStatesNotKv) {
  // model_config's Qwen3.6-35B-A3B: 10 full-attention layers, 30 Gated DeltaNet.
  const ModelConfig c = Qwen36_35B_A3B();
  ASSERT_EQ(c.NumKvLayers(), 10);
  ASSERT_EQ(c.NumLinearAttentionLayers(), 30);
  auto p = PlanGpuMemory(c, Request(kH100Free, 0, 131072, 2));
  ASSERT_TRUE(p.ok()) << p.status();
  // K and V of the 10 full-attention layers only: 2 x 10 x 2 heads x 256 x bf16 per token.
  EXPECT_EQ(p->kv_block_bytes, 16ull * 2 * 10 * 2 * 256 * 2);
  EXPECT_EQ(p->kv_blocks, 2 * 131072 / 16);
  // Per sequence and DeltaNet layer: conv inputs [3, 2 x 2048 + 4096] and the state
  // [32, 128, 128], f32.
  const uint64_t per_seq = 30ull * (3 * 8192 + 32 * 128 * 128) * 4;
  EXPECT_EQ(p->state_bytes_per_sequence, per_seq);
  EXPECT_EQ(p->state_slots, 2);
  EXPECT_EQ(p->linear_state_bytes, 2 * per_seq);
  // Dense: a DeltaNet layer's in_proj (8192 + 4096 + 64 rows) and out_proj (4096 columns) in
  // bf16 plus its f32 conv taps, dt_bias, A_log and norm; a full-attention layer's gated q
  // (2 x 4096 rows), k and v (512 rows), o, q/k norms.
  const uint64_t linear = (12352ull * 2048 + 2048ull * 4096) * 2 + (4ull * 8192 + 64 + 128) * 4;
  const uint64_t full = (2 * 4096ull * 2048 + 2 * 512ull * 2048 + 2048ull * 4096 + 2 * 256) * 2;
  EXPECT_EQ(p->dense.attention, 30 * linear + 10 * full);
  EXPECT_EQ(p->dense.total() + p->kv_bytes + p->linear_state_bytes + p->scratch_bytes() +
                p->expert_bytes,
            p->planned_bytes());
  EXPECT_NE(p->Summary().find("linear-attention states"), std::string::npos) << p->Summary();
  // States of many sequences that do not fit are an error naming them.
  auto big = PlanGpuMemory(c, Request(8 * kGiB, 0, 4096, 4096));
  ASSERT_FALSE(big.ok());
}

}  // namespace
}  // namespace moe::engine
