// copy_missing without CUDA: the same entry points, reporting that the build has no GPU code.
#include "moe_cache/gpu/gather_kernels.h"

namespace moe::moe_cache {

absl::Status LaunchCopyMissing(const GatherDescriptor&, const int32_t*, const MissPlanEntry*,
                               const GatherLaunchConfig&, CUstream_st*) {
  return absl::UnavailableError("copy_missing: built without CUDA");
}

absl::Status CopyMissingMemcpy(const GatherDescriptor&, const MissPlanEntry*, int, CUstream_st*) {
  return absl::UnavailableError("copy_missing: built without CUDA");
}

}  // namespace moe::moe_cache
