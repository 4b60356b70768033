// ExpertStore: every routed expert of every MoE layer in host memory, bank by bank
// ([layers * experts, pitch] per bank, 16-byte aligned rows). With CUDA and a visible device the
// banks are pinned and mapped (cudaHostAlloc mapped | portable), so copies reach PCIe speed and
// gather kernels can read them directly; otherwise they are plain aligned host memory.
//
// Filled through the narrow ExpertWriter interface (the model loader writes one bank of one
// expert at a time). Owns its memory; Write() on distinct (layer, expert, bank) triples may run
// concurrently, everything else is read-only after loading.
#ifndef MOE_MOE_CACHE_GPU_EXPERT_STORE_H_
#define MOE_MOE_CACHE_GPU_EXPERT_STORE_H_

#include <cstdint>
#include <memory>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/expert_view.h"
#include "common/formats.h"
#include "moe_cache/gpu/bank_layout.h"

namespace moe::moe_cache {

// What a loader needs to fill expert weights, whatever holds them.
class ExpertWriter {
 public:
  virtual ~ExpertWriter() = default;
  // Copies `bytes` (exactly the bank's payload size) into bank `bank` of expert (layer, expert).
  virtual absl::Status WriteBank(int layer, int expert, int bank,
                                 absl::Span<const uint8_t> bytes) = 0;
};

enum class HostMemoryKind {
  kPinnedMapped,  // cudaHostAlloc(mapped | portable): DMA-able and readable by kernels
  kPageable,      // aligned host memory: CPU-only builds and machines without a GPU
};

class ExpertStore final : public ExpertWriter {
 public:
  struct Options {
    int num_layers = 0;
    int num_experts = 0;  // routed experts per layer
    // Pinned-mapped when a CUDA device is visible, else pageable. kPinnedMapped as a requirement
    // fails with Unavailable where it cannot be had.
    bool require_pinned = false;
  };

  // InvalidArgument for bad sizes; ResourceExhausted when the host memory cannot be had.
  static absl::StatusOr<std::unique_ptr<ExpertStore>> Create(const Options& options,
                                                             const BankLayout& layout);
  ~ExpertStore() override;
  ExpertStore(const ExpertStore&) = delete;
  ExpertStore& operator=(const ExpertStore&) = delete;

  absl::Status WriteBank(int layer, int expert, int bank,
                         absl::Span<const uint8_t> bytes) override;

  int num_layers() const { return num_layers_; }
  int num_experts() const { return num_experts_; }
  const BankLayout& layout() const { return layout_; }
  HostMemoryKind memory_kind() const { return kind_; }
  uint64_t bytes_per_expert() const { return layout_.bytes_per_expert(); }
  uint64_t total_bytes() const;

  // Host address of one expert's row in bank `b` (global id = layer * num_experts + expert).
  const uint8_t* expert_bank(int global_expert, int b) const;
  // Bank `b` of layer `layer` as a per-expert array (pitch: the bank's padded row).
  common::ExpertArray LayerArray(int layer, int b) const;
  // Index of the bank named `name` in the layout, or -1.
  int FindBank(std::string_view name) const;
  // Layer `layer`'s experts as the view a compute component reads in place, from the banks named
  // "gate_up", "down", "gate_up_scales", "down_scales", "gate_up_global_scale",
  // "up_global_scale" and "down_global_scale" (absent ones stay null). The format, layout and shape are the writer's,
  // which the store does not interpret. The view lives as long as the store.
  common::ExpertLayerView LayerView(int layer, common::WeightFormat format,
                                    common::ExpertLayout expert_layout, int hidden,
                                    int intermediate) const;
  // Base of bank `b` for host code, and its device-side alias for kernels (nullptr unless
  // pinned-mapped).
  const uint8_t* bank_host(int b) const { return host_[b]; }
  const uint8_t* bank_device(int b) const { return device_[b]; }

 private:
  ExpertStore() = default;
  absl::Status Allocate(bool require_pinned);

  int num_layers_ = 0;
  int num_experts_ = 0;
  BankLayout layout_;
  HostMemoryKind kind_ = HostMemoryKind::kPageable;
  uint8_t* host_[kMaxBanks] = {};
  const uint8_t* device_[kMaxBanks] = {};
};

}  // namespace moe::moe_cache

#endif  // MOE_MOE_CACHE_GPU_EXPERT_STORE_H_
