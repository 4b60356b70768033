// Test helpers for the loader's tests (testonly): make a model folder with //tools:make_tiny_model
// and rewrite its safetensors (tensors or the raw header) to build broken or re-laid-out files.
#ifndef MOE_ENGINE_LOADER_TEST_UTIL_H_
#define MOE_ENGINE_LOADER_TEST_UTIL_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/safetensors.h"
#include "nlohmann/json.hpp"

namespace moe::engine::testing {

// Runs make_tiny_model (from the test's runfiles) with `flags` into $TEST_TMPDIR/<name>; returns
// the folder.
absl::StatusOr<std::string> MakeTinyModel(const std::string& name, const std::string& flags);

// A tensor held in memory.
struct OwnedTensor {
  std::string name;
  StDtype dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

absl::StatusOr<std::vector<OwnedTensor>> ReadAll(const std::string& path);
absl::Status WriteAll(const std::string& path, const std::vector<OwnedTensor>& tensors);
// Reads, lets `edit` change the tensor list, writes back.
absl::Status RewriteTensors(const std::string& path,
                            const std::function<void(std::vector<OwnedTensor>&)>& edit);
// Lets `edit` change the parsed JSON header; the data bytes stay as they are.
absl::Status RewriteHeader(const std::string& path,
                           const std::function<void(nlohmann::json&)>& edit);

std::string ReadFile(const std::string& path);
void WriteFile(const std::string& path, const std::string& bytes);

}  // namespace moe::engine::testing

#endif  // MOE_ENGINE_LOADER_TEST_UTIL_H_
