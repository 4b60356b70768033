// MakeGatherDescriptor: host-side pairing of a store and a pool (see gather_kernels.h).
#include "absl/strings/str_cat.h"
#include "moe_cache/gpu/expert_store.h"
#include "moe_cache/gpu/gather_kernels.h"
#include "moe_cache/gpu/slot_pool.h"

namespace moe::moe_cache {

absl::StatusOr<GatherDescriptor> MakeGatherDescriptor(const ExpertStore& store,
                                                      const SlotPool& pool) {
  const BankLayout& a = store.layout();
  const BankLayout& b = pool.layout();
  if (a.num_banks() != b.num_banks()) {
    return absl::InvalidArgumentError(absl::StrCat("store has ", a.num_banks(),
                                                   " banks but the slot pool ", b.num_banks()));
  }
  if (store.memory_kind() != HostMemoryKind::kPinnedMapped) {
    return absl::FailedPreconditionError(
        "copy_missing needs a pinned-mapped expert store (is a CUDA device visible?)");
  }
  GatherDescriptor desc;
  desc.num_banks = a.num_banks();
  for (int i = 0; i < a.num_banks(); ++i) {
    if (a.bank(i).pitch != b.bank(i).pitch) {
      return absl::InvalidArgumentError(absl::StrCat("bank '", a.bank(i).name, "' pitch ",
                                                     a.bank(i).pitch, " != slot pitch ",
                                                     b.bank(i).pitch));
    }
    desc.banks[i].src_device = store.bank_device(i);
    desc.banks[i].src_host = store.bank_host(i);
    desc.banks[i].dst = pool.bank(i);
    desc.banks[i].pitch = a.bank(i).pitch;
    desc.chunks_per_expert += a.bank(i).pitch / 16;
  }
  return desc;
}

}  // namespace moe::moe_cache
