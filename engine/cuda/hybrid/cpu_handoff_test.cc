#include "engine/cuda/hybrid/cpu_handoff.h"

#include <chrono>
#include <cstring>
#include <random>
#include <cstdlib>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace moe::engine::hybrid {
namespace {

// y[t, c] = sum over routes of weight * (x[t, c] + expert id): a function the "GPU" can check.
absl::Status Compute(int, int tokens, const int32_t* ids, const float* weights, const float* x,
                     float* y, int k, int h) {
  for (int t = 0; t < tokens; ++t) {
    bool any = false;
    for (int j = 0; j < k; ++j) any = any || ids[t * k + j] >= 0;
    if (!any) continue;
    for (int c = 0; c < h; ++c) {
      float s = 0;
      for (int j = 0; j < k; ++j) {
        const int e = ids[t * k + j];
        if (e >= 0) s += weights[t * k + j] * (x[t * h + c] + static_cast<float>(e));
      }
      y[t * h + c] = s;
    }
  }
  return absl::OkStatus();
}

struct Block {
  explicit Block(const HandoffShape& s) : bytes(HandoffBytes(s)) {
    mem = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    std::memset(mem, 0, bytes);
    view = MakeHandoffView(mem, s);
  }
  ~Block() { std::free(mem); }
  size_t bytes;
  void* mem;
  HandoffView view;
};

// Posts a request as the GPU does (payload, then the number with release) and waits for it.
void PostAndWait(const HandoffView& v, uint32_t seq, int layer, int tokens) {
  v.ctrl->layer = layer;
  v.ctrl->num_tokens = tokens;
  __atomic_store_n(&v.ctrl->request_seq, seq, __ATOMIC_RELEASE);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (__atomic_load_n(&v.ctrl->done_seq, __ATOMIC_ACQUIRE) != seq) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "request " << seq << " unanswered";
  }
}

TEST(CpuHandoffTest, LayoutIsAlignedAndDisjoint) {
  const HandoffShape s{5, 3, 36};
  Block b(s);
  const HandoffView& v = b.view;
  for (const void* p : {static_cast<const void*>(v.ids), static_cast<const void*>(v.weights),
                        static_cast<const void*>(v.x), static_cast<const void*>(v.y)}) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
  }
  EXPECT_GE(reinterpret_cast<uint8_t*>(v.weights), reinterpret_cast<uint8_t*>(v.ids + 15));
  EXPECT_GE(reinterpret_cast<uint8_t*>(v.x), reinterpret_cast<uint8_t*>(v.weights + 15));
  EXPECT_GE(reinterpret_cast<uint8_t*>(v.y), reinterpret_cast<uint8_t*>(v.x + 5 * 36));
  EXPECT_LE(reinterpret_cast<uint8_t*>(v.y + 5 * 36), static_cast<uint8_t*>(b.mem) + b.bytes);
}

TEST(CpuHandoffTest, AnswersEveryRequestWithItsRows) {
  const int K = 4, H = 64, T = 3;
  Block b({T, K, H});
  const HandoffView& v = b.view;
  CpuWorker worker(v, [&](int layer, int tokens, const int32_t* ids, const float* w,
                          const float* x, float* y) {
    return Compute(layer, tokens, ids, w, x, y, K, H);
  });
  worker.Arm();
  std::mt19937 rng(5);
  for (uint32_t seq = 1; seq <= 2000; ++seq) {
    const int tokens = 1 + static_cast<int>(rng() % T);
    for (int i = 0; i < tokens * K; ++i) {
      v.ids[i] = rng() % 3 == 0 ? static_cast<int32_t>(rng() % 64) : -1;
      v.weights[i] = static_cast<float>(rng() % 8) / 8.0f;
    }
    for (int i = 0; i < tokens * H; ++i) v.x[i] = static_cast<float>(rng() % 100) + seq;
    PostAndWait(v, seq, static_cast<int>(seq % 48), tokens);
    EXPECT_EQ(v.ctrl->status, 0);
    for (int t = 0; t < tokens; ++t) {
      bool any = false;
      for (int j = 0; j < K; ++j) any = any || v.ids[t * K + j] >= 0;
      if (!any) continue;
      for (int c = 0; c < H; c += 7) {
        float want = 0;
        for (int j = 0; j < K; ++j) {
          const int e = v.ids[t * K + j];
          if (e >= 0) want += v.weights[t * K + j] * (v.x[t * H + c] + static_cast<float>(e));
        }
        ASSERT_EQ(v.y[t * H + c], want) << "request " << seq << " row " << t;
      }
    }
  }
  worker.Disarm();
  EXPECT_EQ(worker.requests(), 2000);
  EXPECT_TRUE(worker.TakeError().ok());
}

TEST(CpuHandoffTest, AComputeErrorIsAnsweredAndReported) {
  Block b({2, 2, 8});
  const HandoffView& v = b.view;
  CpuWorker worker(v, [](int layer, int, const int32_t*, const float*, const float*, float*) {
    return layer == 3 ? absl::ResourceExhaustedError("no scratch for layer 3") : absl::OkStatus();
  });
  worker.Arm();
  PostAndWait(v, 1, 2, 1);
  EXPECT_EQ(v.ctrl->status, 0);
  PostAndWait(v, 2, 3, 1);  // answered although it failed: the GPU must never wait forever
  EXPECT_EQ(v.ctrl->status, static_cast<int32_t>(absl::StatusCode::kResourceExhausted));
  PostAndWait(v, 3, 4, 1);
  worker.Disarm();
  const absl::Status st = worker.TakeError();
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("layer 3"), absl::string_view::npos);
  EXPECT_TRUE(worker.TakeError().ok());  // taken
}

TEST(CpuHandoffTest, DisarmedItDoesNotAnswerAndArmedAgainItDoes) {
  Block b({1, 1, 4});
  const HandoffView& v = b.view;
  CpuWorker worker(v, [](int, int, const int32_t*, const float*, const float*, float*) {
    return absl::OkStatus();
  });
  v.ctrl->num_tokens = 1;
  __atomic_store_n(&v.ctrl->request_seq, 1u, __ATOMIC_RELEASE);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(__atomic_load_n(&v.ctrl->done_seq, __ATOMIC_ACQUIRE), 0u);  // asleep while disarmed
  worker.Arm();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (__atomic_load_n(&v.ctrl->done_seq, __ATOMIC_ACQUIRE) != 1u) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline);
  }
  worker.Disarm();
  EXPECT_EQ(worker.requests(), 1);
}

}  // namespace
}  // namespace moe::engine::hybrid
