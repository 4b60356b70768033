// .npy files (NumPy's array format, versions 1.0-3.0): a reader and a writer for float32 and
// int32 arrays of any rank, little-endian, C order, as numpy.save writes them. int64 arrays
// (NumPy's default integer) are read as int32 when every value fits; int16 and int8 arrays are
// read as int32. Every problem with a file
// (magic, version, header, dtype, Fortran order, shape, size) is InvalidArgument naming the origin.
// Plain functions and values; thread-safe.
#ifndef MOE_COMMON_NPY_H_
#define MOE_COMMON_NPY_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace moe::common {

enum class NpyDtype { kFloat32, kInt32 };

struct NpyArray {
  NpyDtype dtype = NpyDtype::kFloat32;
  std::vector<int64_t> shape;  // any rank; {} is a scalar (one element)
  std::vector<float> f32;      // the elements in C order when dtype == kFloat32
  std::vector<int32_t> i32;    // ... when dtype == kInt32

  int64_t numel() const;
};

absl::StatusOr<NpyArray> ParseNpy(std::string_view bytes, const std::string& origin);
absl::StatusOr<NpyArray> ReadNpy(const std::string& path);

// Format 1.0 (2.0 when the header needs it), header padded to a multiple of 64 bytes, exactly as
// numpy.save writes the same array. InvalidArgument when the element count does not match the
// shape.
absl::StatusOr<std::string> SerializeNpy(const NpyArray& array);
absl::Status WriteNpy(const std::string& path, const NpyArray& array);
absl::Status WriteNpyFloat32(const std::string& path, std::vector<int64_t> shape,
                             absl::Span<const float> data);
absl::Status WriteNpyInt32(const std::string& path, std::vector<int64_t> shape,
                           absl::Span<const int32_t> data);

}  // namespace moe::common

#endif  // MOE_COMMON_NPY_H_
