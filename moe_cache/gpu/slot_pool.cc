#include "moe_cache/gpu/slot_pool.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/cuda_status.h"
#include "common/status.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace moe::moe_cache {

absl::StatusOr<int> SlotsForBudget(uint64_t budget_bytes, const BankLayout& layout,
                                   int max_slots) {
  const uint64_t per = layout.padded_bytes_per_expert();
  if (per == 0) return absl::InvalidArgumentError("empty bank layout");
  const uint64_t slots = budget_bytes / per;
  if (slots == 0) {
    return absl::InvalidArgumentError(absl::StrCat("GPU expert budget of ", budget_bytes,
                                                   " bytes holds no expert of ", per, " bytes"));
  }
  return static_cast<int>(std::min<uint64_t>(slots, static_cast<uint64_t>(max_slots)));
}

absl::StatusOr<std::unique_ptr<SlotPool>> SlotPool::Create(int num_slots,
                                                           const BankLayout& layout) {
  if (num_slots <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("slot pool needs > 0 slots, got ", num_slots));
  }
  RETURN_IF_ERROR(common::CudaAvailable());
  std::unique_ptr<SlotPool> pool(new SlotPool());
  pool->num_slots_ = num_slots;
  pool->layout_ = layout;
#if MOE_HAVE_CUDA
  for (int b = 0; b < layout.num_banks(); ++b) {
    void* p = nullptr;
    const uint64_t bytes = static_cast<uint64_t>(num_slots) * layout.bank(b).pitch;
    cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
      return absl::ResourceExhaustedError(absl::StrCat("cudaMalloc of ", bytes,
                                                       " bytes for slot bank '",
                                                       layout.bank(b).name,
                                                       "' failed: ", cudaGetErrorString(err)));
    }
    pool->banks_[b] = static_cast<uint8_t*>(p);
  }
#endif
  return pool;
}

SlotPool::~SlotPool() {
#if MOE_HAVE_CUDA
  for (uint8_t* p : banks_) {
    if (p != nullptr) cudaFree(p);
  }
#endif
}

}  // namespace moe::moe_cache
