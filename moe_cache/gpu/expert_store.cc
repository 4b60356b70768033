#include "moe_cache/gpu/expert_store.h"

#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/aligned_buffer.h"
#include "common/cuda_status.h"
#include "common/status.h"

#if MOE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace moe::moe_cache {

namespace {
constexpr size_t kHugePage = common::AlignedBuffer<uint8_t>::kHugePageBytes;
}  // namespace

absl::StatusOr<std::unique_ptr<ExpertStore>> ExpertStore::Create(const Options& options,
                                                                 const BankLayout& layout) {
  if (options.num_layers <= 0 || options.num_experts <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("expert store needs layers > 0 and experts > 0, got ",
                                                   options.num_layers, " x ", options.num_experts));
  }
  if (layout.num_banks() == 0) return absl::InvalidArgumentError("expert store: empty bank layout");
  std::unique_ptr<ExpertStore> store(new ExpertStore());
  store->num_layers_ = options.num_layers;
  store->num_experts_ = options.num_experts;
  store->layout_ = layout;
  RETURN_IF_ERROR(store->Allocate(options.require_pinned));
  return store;
}

absl::Status ExpertStore::Allocate(bool require_pinned) {
  const uint64_t rows = static_cast<uint64_t>(num_layers_) * num_experts_;
  bool pinned = false;
#if MOE_HAVE_CUDA
  pinned = common::CudaDeviceCount() > 0;
#endif
  if (!pinned && require_pinned) {
    return absl::UnavailableError(
        absl::StrCat("pinned host memory needs a CUDA device: ", common::CudaAvailable().message()));
  }
  kind_ = pinned ? HostMemoryKind::kPinnedMapped : HostMemoryKind::kPageable;
  for (int b = 0; b < layout_.num_banks(); ++b) {
    const uint64_t bytes = rows * layout_.bank(b).pitch;
#if MOE_HAVE_CUDA
    if (pinned) {
      void* p = nullptr;
      cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
      if (err != cudaSuccess) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "cudaHostAlloc of ", bytes, " bytes for bank '", layout_.bank(b).name,
            "' failed: ", cudaGetErrorString(err)));
      }
      host_[b] = static_cast<uint8_t*>(p);
      void* dev = nullptr;
      CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&dev, p, 0));
      device_[b] = static_cast<const uint8_t*>(dev);
      // Padding bytes are part of every copy; give them a defined value.
      std::memset(p, 0, bytes);
      continue;
    }
#endif
    // Banks of 2 MiB and more go on transparent huge pages (best effort): the CPU expert kernels
    // stream them, and 4 KiB pages cost a TLB miss every 4 KiB (see common::AdviseHugePages).
    const size_t align = bytes >= kHugePage ? kHugePage : 64;
    void* p = std::aligned_alloc(align, (bytes + align - 1) / align * align);
    if (p != nullptr && align == kHugePage) common::AdviseHugePages(p, bytes);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes,
                                                       " bytes of host memory for bank '",
                                                       layout_.bank(b).name, "'"));
    }
    std::memset(p, 0, bytes);
    host_[b] = static_cast<uint8_t*>(p);
  }
  return absl::OkStatus();
}

ExpertStore::~ExpertStore() {
  for (int b = 0; b < kMaxBanks; ++b) {
    if (host_[b] == nullptr) continue;
#if MOE_HAVE_CUDA
    if (kind_ == HostMemoryKind::kPinnedMapped) {
      cudaFreeHost(host_[b]);
      continue;
    }
#endif
    std::free(host_[b]);
  }
}

uint64_t ExpertStore::total_bytes() const {
  return static_cast<uint64_t>(num_layers_) * num_experts_ * layout_.padded_bytes_per_expert();
}

const uint8_t* ExpertStore::expert_bank(int global_expert, int b) const {
  return host_[b] + static_cast<uint64_t>(global_expert) * layout_.bank(b).pitch;
}

common::ExpertArray ExpertStore::LayerArray(int layer, int b) const {
  return common::ExpertArray{expert_bank(layer * num_experts_, b), layout_.bank(b).pitch};
}

int ExpertStore::FindBank(std::string_view name) const {
  for (int b = 0; b < layout_.num_banks(); ++b) {
    if (layout_.bank(b).name == name) return b;
  }
  return -1;
}

common::ExpertLayerView ExpertStore::LayerView(int layer, common::WeightFormat format,
                                               common::ExpertLayout expert_layout, int hidden,
                                               int intermediate) const {
  common::ExpertLayerView v;
  v.format = format;
  v.layout = expert_layout;
  v.num_experts = num_experts_;
  v.hidden = hidden;
  v.intermediate = intermediate;
  auto array = [&](std::string_view name) {
    const int b = FindBank(name);
    return b < 0 ? common::ExpertArray() : LayerArray(layer, b);
  };
  v.gate_up = array("gate_up");
  v.down = array("down");
  v.gate_up_scales = array("gate_up_scales");
  v.down_scales = array("down_scales");
  v.gate_up_global_scale = array("gate_up_global_scale");
  v.down_global_scale = array("down_global_scale");
  v.up_global_scale = array("up_global_scale");
  return v;
}

absl::Status ExpertStore::WriteBank(int layer, int expert, int bank,
                                    absl::Span<const uint8_t> bytes) {
  if (layer < 0 || layer >= num_layers_ || expert < 0 || expert >= num_experts_) {
    return absl::InvalidArgumentError(absl::StrCat("expert (", layer, ", ", expert,
                                                   ") out of range [", num_layers_, ", ",
                                                   num_experts_, ")"));
  }
  if (bank < 0 || bank >= layout_.num_banks()) {
    return absl::InvalidArgumentError(
        absl::StrCat("bank ", bank, " out of range; layout has ", layout_.num_banks()));
  }
  if (bytes.size() != layout_.bank(bank).bytes) {
    return absl::InvalidArgumentError(absl::StrCat("bank '", layout_.bank(bank).name, "' of expert (",
                                                   layer, ", ", expert, ") takes ",
                                                   layout_.bank(bank).bytes, " bytes, got ",
                                                   bytes.size()));
  }
  std::memcpy(host_[bank] + (static_cast<uint64_t>(layer) * num_experts_ + expert) *
                                layout_.bank(bank).pitch,
              bytes.data(), bytes.size());
  return absl::OkStatus();
}

}  // namespace moe::moe_cache
