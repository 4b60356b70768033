// copy_missing: the one-launch gather kernel is byte-identical to the per-bank cudaMemcpyAsync
// fallback and to the host rows at every miss count from 0 to S, leaves slots outside the plan
// untouched, and replays correctly from a captured graph with new plans (GPU test; skips
// without a GPU). Also the CPU-side checks of ExpertStore and SlotsForBudget.
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "common/gpu_test_util.h"
#include "gtest/gtest.h"
#include "moe_cache/gpu/expert_store.h"
#include "moe_cache/gpu/gather_kernels.h"
#include "moe_cache/gpu/slot_pool.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace moe::moe_cache {
namespace {

BankLayout TestLayout() {
  // Odd payloads on purpose: padding to 16 bytes must be handled.
  auto layout = BankLayout::Create({{"gate_up", 4096}, {"down", 1032}, {"scales", 40}});
  EXPECT_TRUE(layout.ok());
  return *layout;
}

std::unique_ptr<ExpertStore> FilledStore(int layers, int experts, uint32_t seed) {
  auto store = ExpertStore::Create({layers, experts, false}, TestLayout());
  EXPECT_TRUE(store.ok()) << store.status();
  std::mt19937 rng(seed);
  const BankLayout& layout = (*store)->layout();
  for (int l = 0; l < layers; ++l) {
    for (int e = 0; e < experts; ++e) {
      for (int b = 0; b < layout.num_banks(); ++b) {
        std::vector<uint8_t> bytes(layout.bank(b).bytes);
        for (auto& x : bytes) x = static_cast<uint8_t>(rng());
        EXPECT_TRUE((*store)->WriteBank(l, e, b, bytes).ok());
      }
    }
  }
  return std::move(*store);
}

TEST(ExpertStoreTest, LayoutPadsRowsTo16Bytes) {
  BankLayout layout = TestLayout();
  EXPECT_EQ(layout.bank(0).pitch, 4096u);
  EXPECT_EQ(layout.bank(1).pitch, 1040u);
  EXPECT_EQ(layout.bank(2).pitch, 48u);
  EXPECT_EQ(layout.bytes_per_expert(), 4096u + 1032u + 40u);
  EXPECT_EQ(layout.padded_bytes_per_expert(), 4096u + 1040u + 48u);
  EXPECT_FALSE(BankLayout::Create({}).ok());
  EXPECT_FALSE(BankLayout::Create({{"x", 0}}).ok());
}

TEST(ExpertStoreTest, WritesLandInTheirRowsAndBadWritesAreRejected) {
  auto store = FilledStore(2, 3, 7);
  std::vector<uint8_t> row(1032);
  std::iota(row.begin(), row.end(), 0);
  ASSERT_TRUE(store->WriteBank(1, 2, 1, row).ok());
  const uint8_t* at = store->expert_bank(1 * 3 + 2, 1);
  EXPECT_EQ(std::memcmp(at, row.data(), row.size()), 0);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(at) % 16, 0u);
  EXPECT_EQ(store->WriteBank(2, 0, 0, row).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->WriteBank(0, 3, 0, row).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->WriteBank(0, 0, 3, row).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->WriteBank(0, 0, 0, row).code(), absl::StatusCode::kInvalidArgument);  // size
  EXPECT_FALSE(ExpertStore::Create({0, 3, false}, TestLayout()).ok());
}

TEST(ExpertStoreTest, LargePageableBanksAreHugePageAlignedAndHoldTheirRows) {
  if (common::CudaAvailable().ok()) {
    GTEST_SKIP() << "a visible GPU makes the store pinned-mapped; this checks the pageable path";
  }
  // 1 layer x 600 experts x 4096 bytes: the first bank is over 2 MiB, the others are not.
  auto store = ExpertStore::Create({1, 600, false}, TestLayout());
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_EQ((*store)->memory_kind(), HostMemoryKind::kPageable);
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*store)->bank_host(0)) % (size_t{2} << 20), 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*store)->bank_host(1)) % 64, 0u);
  std::vector<uint8_t> row(4096);
  for (int e : {0, 311, 599}) {
    for (size_t i = 0; i < row.size(); ++i) row[i] = static_cast<uint8_t>(i * 7 + e);
    ASSERT_TRUE((*store)->WriteBank(0, e, 0, row).ok());
    EXPECT_EQ(std::memcmp((*store)->expert_bank(e, 0), row.data(), row.size()), 0) << e;
  }
}

TEST(SlotPoolTest, SlotsFollowTheByteBudget) {
  BankLayout layout = TestLayout();
  const uint64_t per = layout.padded_bytes_per_expert();
  EXPECT_EQ(*SlotsForBudget(per * 10 + per / 2, layout, 1000), 10);
  EXPECT_EQ(*SlotsForBudget(per * 10, layout, 4), 4);
  EXPECT_EQ(SlotsForBudget(per - 1, layout, 10).status().code(),
            absl::StatusCode::kInvalidArgument);
}

#if MOE_HAVE_CUDA

std::vector<uint8_t> PoolBytes(const SlotPool& pool) {
  std::vector<uint8_t> out;
  for (int b = 0; b < pool.layout().num_banks(); ++b) {
    const uint64_t bytes = pool.num_slots() * pool.layout().bank(b).pitch;
    const size_t at = out.size();
    out.resize(at + bytes);
    EXPECT_EQ(cudaMemcpy(out.data() + at, pool.bank(b), bytes, cudaMemcpyDeviceToHost),
              cudaSuccess);
  }
  return out;
}

void Poison(const SlotPool& pool) {
  for (int b = 0; b < pool.layout().num_banks(); ++b) {
    ASSERT_EQ(cudaMemset(pool.bank(b), 0xA5, pool.num_slots() * pool.layout().bank(b).pitch),
              cudaSuccess);
  }
}

std::vector<MissPlanEntry> RandomPlan(int count, int experts, int slots, std::mt19937& rng) {
  std::vector<int32_t> e(experts), s(slots);
  std::iota(e.begin(), e.end(), 0);
  std::iota(s.begin(), s.end(), 0);
  std::shuffle(e.begin(), e.end(), rng);
  std::shuffle(s.begin(), s.end(), rng);
  std::vector<MissPlanEntry> plan(count);
  for (int i = 0; i < count; ++i) plan[i] = {e[i], s[i]};
  return plan;
}

// Expected pool bytes: poison everywhere, the planned rows copied from the store.
std::vector<uint8_t> Expected(const ExpertStore& store, int slots,
                              const std::vector<MissPlanEntry>& plan) {
  std::vector<uint8_t> out;
  const BankLayout& layout = store.layout();
  for (int b = 0; b < layout.num_banks(); ++b) {
    const uint64_t pitch = layout.bank(b).pitch;
    const size_t at = out.size();
    out.resize(at + slots * pitch, 0xA5);
    for (const MissPlanEntry& m : plan) {
      std::memcpy(out.data() + at + m.slot * pitch, store.expert_bank(m.expert, b), pitch);
    }
  }
  return out;
}

TEST(GatherTest, KernelMatchesMemcpyAtEveryMissCount) {
  MOE_SKIP_WITHOUT_GPU();
  constexpr int kLayers = 2, kExperts = 16, kSlots = 16;
  auto store = FilledStore(kLayers, kExperts, 11);
  ASSERT_EQ(store->memory_kind(), HostMemoryKind::kPinnedMapped);
  auto a = SlotPool::Create(kSlots, store->layout());
  auto b = SlotPool::Create(kSlots, store->layout());
  ASSERT_TRUE(a.ok() && b.ok());
  auto da = MakeGatherDescriptor(*store, **a);
  auto db = MakeGatherDescriptor(*store, **b);
  ASSERT_TRUE(da.ok() && db.ok()) << da.status();
  int32_t* d_count;
  MissPlanEntry* d_plan;
  ASSERT_EQ(cudaMalloc(&d_count, sizeof(int32_t)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_plan, sizeof(MissPlanEntry) * kSlots), cudaSuccess);
  std::mt19937 rng(5);
  for (const GatherLaunchConfig config : {GatherLaunchConfig{1, 32}, GatherLaunchConfig{3, 96},
                                          GatherLaunchConfig{28, 512}}) {
    for (int count = 0; count <= kSlots; ++count) {
      std::vector<MissPlanEntry> plan = RandomPlan(count, kLayers * kExperts, kSlots, rng);
      Poison(**a);
      Poison(**b);
      ASSERT_EQ(cudaMemcpy(d_count, &count, sizeof(int32_t), cudaMemcpyHostToDevice),
                cudaSuccess);
      if (count > 0) {
        ASSERT_EQ(cudaMemcpy(d_plan, plan.data(), sizeof(MissPlanEntry) * count,
                             cudaMemcpyHostToDevice),
                  cudaSuccess);
      }
      ASSERT_TRUE(LaunchCopyMissing(*da, d_count, d_plan, config, nullptr).ok());
      ASSERT_TRUE(CopyMissingMemcpy(*db, plan.data(), count, nullptr).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<uint8_t> got = PoolBytes(**a);
      ASSERT_EQ(got, PoolBytes(**b)) << "kernel != memcpy at " << count << " misses, "
                                     << config.blocks << " blocks";
      ASSERT_EQ(got, Expected(*store, kSlots, plan)) << count << " misses";
    }
  }
  cudaFree(d_count);
  cudaFree(d_plan);
}

TEST(GatherTest, CapturedGraphReplaysWithNewPlans) {
  MOE_SKIP_WITHOUT_GPU();
  constexpr int kLayers = 1, kExperts = 32, kSlots = 8;
  auto store = FilledStore(kLayers, kExperts, 21);
  auto pool = SlotPool::Create(kSlots, store->layout());
  ASSERT_TRUE(pool.ok());
  auto desc = MakeGatherDescriptor(*store, **pool);
  ASSERT_TRUE(desc.ok());
  int32_t* d_count;
  MissPlanEntry* d_plan;
  ASSERT_EQ(cudaMalloc(&d_count, sizeof(int32_t)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_plan, sizeof(MissPlanEntry) * kSlots), cudaSuccess);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  ASSERT_TRUE(LaunchCopyMissing(*desc, d_count, d_plan, {8, 256}, stream).ok());
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  std::mt19937 rng(3);
  for (int replay = 0; replay < 6; ++replay) {
    const int count = replay % 2 == 0 ? kSlots : 1 + replay;
    std::vector<MissPlanEntry> plan = RandomPlan(count, kExperts, kSlots, rng);
    Poison(**pool);
    ASSERT_EQ(cudaMemcpyAsync(d_count, &count, sizeof(int32_t), cudaMemcpyHostToDevice, stream),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(d_plan, plan.data(), sizeof(MissPlanEntry) * count,
                              cudaMemcpyHostToDevice, stream),
              cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    ASSERT_EQ(PoolBytes(**pool), Expected(*store, kSlots, plan)) << "replay " << replay;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  cudaFree(d_count);
  cudaFree(d_plan);
}

#endif  // MOE_HAVE_CUDA

}  // namespace
}  // namespace moe::moe_cache
