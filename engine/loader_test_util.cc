#include "engine/loader_test_util.h"

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace moe::engine::testing {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

absl::StatusOr<std::string> MakeTinyModel(const std::string& name, const std::string& flags) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const char* src = std::getenv("TEST_SRCDIR");
  const char* ws = std::getenv("TEST_WORKSPACE");
  if (tmp == nullptr || src == nullptr || ws == nullptr) {
    return absl::FailedPreconditionError("run under bazel test (TEST_TMPDIR, TEST_SRCDIR)");
  }
  const std::string dir = absl::StrCat(tmp, "/", name);
  const std::string cmd = absl::StrCat("rm -rf '", dir, "' && '", src, "/", ws,
                                       "/tools/make_tiny_model' --out '", dir, "' ", flags);
  if (std::system(cmd.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("failed: ", cmd));
  }
  return dir;
}

absl::StatusOr<std::vector<OwnedTensor>> ReadAll(const std::string& path) {
  ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> f, SafetensorsFile::Open(path));
  std::vector<OwnedTensor> out;
  for (const StTensor& t : f->tensors()) {
    out.push_back({t.name, t.dtype, t.shape, std::vector<uint8_t>(t.data, t.data + t.bytes)});
  }
  return out;
}

absl::Status WriteAll(const std::string& path, const std::vector<OwnedTensor>& tensors) {
  SafetensorsWriter w;
  for (const OwnedTensor& t : tensors) RETURN_IF_ERROR(w.Add(t.name, t.dtype, t.shape, t.bytes));
  return w.WriteFile(path);
}

absl::Status RewriteTensors(const std::string& path,
                            const std::function<void(std::vector<OwnedTensor>&)>& edit) {
  ASSIGN_OR_RETURN(std::vector<OwnedTensor> all, ReadAll(path));
  edit(all);
  return WriteAll(path, all);
}

absl::Status RewriteHeader(const std::string& path,
                           const std::function<void(nlohmann::json&)>& edit) {
  const std::string bytes = ReadFile(path);
  if (bytes.size() < 8) return absl::InvalidArgumentError("short file");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
  nlohmann::json h = nlohmann::json::parse(bytes.substr(8, n));
  edit(h);
  std::string header = h.dump();
  while (header.size() % 8 != 0) header += ' ';
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((header.size() >> (8 * i)) & 0xFF);
  WriteFile(path, out + header + bytes.substr(8 + n));
  return absl::OkStatus();
}

}  // namespace moe::engine::testing
