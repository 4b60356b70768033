// A small .npy reader and writer (format versions 1-3, little-endian, C order) for the arrays
// the engine's tools and tests exchange with numpy: int32 / int64 token ids and float32 logits.
// Plain functions; thread-safe.
#ifndef MOE_ENGINE_NPY_H_
#define MOE_ENGINE_NPY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moe::engine {

struct NpyArray {
  std::string dtype;  // "<i4", "<i8", "<f4"
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;  // C order
  int64_t numel() const;
  // Elements converted (int64 ids must fit int32); InvalidArgument for another dtype.
  absl::StatusOr<std::vector<int32_t>> AsInt32() const;
  absl::StatusOr<std::vector<float>> AsFloat32() const;
};

// InvalidArgument naming the problem (magic, header, dtype, order, size) and the path.
absl::StatusOr<NpyArray> ReadNpy(const std::string& path);
absl::Status WriteNpyFloat32(const std::string& path, const std::vector<int64_t>& shape,
                             const float* data);

}  // namespace moe::engine

#endif  // MOE_ENGINE_NPY_H_
