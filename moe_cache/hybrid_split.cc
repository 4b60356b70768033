#include "moe_cache/hybrid_split.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace moe {
namespace moe_cache {
namespace {

absl::Status CheckProfile(const BandwidthProfile& p) {
  if (!(p.pcie_gather_gbps > 0) || !std::isfinite(p.pcie_gather_gbps)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "bandwidth profile: pcie_gather_gbps must be positive, got %g", p.pcie_gather_gbps));
  }
  if (!(p.cpu_expert_gbps >= 0) || !std::isfinite(p.cpu_expert_gbps)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "bandwidth profile: cpu_expert_gbps must be >= 0, got %g", p.cpu_expert_gbps));
  }
  return absl::OkStatus();
}

// How many of n misses to fetch (the rest go to the CPU); the profile is valid.
int64_t FetchCountFor(int64_t n, const BandwidthProfile& profile) {
  const double bp = profile.pcie_gather_gbps, bc = profile.cpu_expert_gbps;
  const double ideal = static_cast<double>(n) * bp / (bp + bc);
  int64_t m = static_cast<int64_t>(std::floor(ideal));
  // Time of the slower path, in expert-bytes per GB/s (bytes per expert cancel out).
  auto slower = [&](int64_t f) {
    const double tf = static_cast<double>(f) / bp;
    const double tc = bc > 0 ? static_cast<double>(n - f) / bc : (n - f > 0 ? INFINITY : 0.0);
    return std::max(tf, tc);
  };
  if (m + 1 <= n && slower(m + 1) <= slower(m)) ++m;
  return m;
}

}  // namespace

absl::StatusOr<MissSplit> SplitMisses(absl::Span<const MissPlanEntry> misses,
                                      const BandwidthProfile& profile) {
  if (absl::Status s = CheckProfile(profile); !s.ok()) return s;
  const int64_t m = FetchCountFor(static_cast<int64_t>(misses.size()), profile);
  MissSplit out;
  out.fetch.assign(misses.begin(), misses.begin() + m);
  out.cpu.assign(misses.begin() + m, misses.end());
  return out;
}

absl::StatusOr<std::vector<int32_t>> FetchTable(const BandwidthProfile& profile,
                                                int num_experts) {
  if (absl::Status s = CheckProfile(profile); !s.ok()) return s;
  if (num_experts <= 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("split table: num_experts must be positive, got %d", num_experts));
  }
  std::vector<int32_t> table(static_cast<size_t>(num_experts) + 1);
  for (int n = 0; n <= num_experts; ++n) {
    table[n] = static_cast<int32_t>(FetchCountFor(n, profile));
  }
  return table;
}

absl::StatusOr<BandwidthProfile> ParseBandwidthProfile(const std::string& text) {
  BandwidthProfile p;
  bool have_pcie = false, have_cpu = false, have_contended = false;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    if (size_t hash = line.find('#'); hash != absl::string_view::npos) line = line.substr(0, hash);
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    const size_t eq = line.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrFormat("bandwidth profile line %d: expected key=value, got '%s'", line_no, line));
    }
    const absl::string_view key = absl::StripAsciiWhitespace(line.substr(0, eq));
    const absl::string_view value = absl::StripAsciiWhitespace(line.substr(eq + 1));
    bool* seen = nullptr;
    if (key == "pcie_gather_gbps" || key == "cpu_expert_gbps") {
      double v = 0;
      if (!absl::SimpleAtod(value, &v)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "bandwidth profile line %d: %s='%s' is not a number", line_no, key, value));
      }
      if (key == "pcie_gather_gbps") {
        p.pcie_gather_gbps = v;
        seen = &have_pcie;
      } else {
        p.cpu_expert_gbps = v;
        seen = &have_cpu;
      }
    } else if (key == "contended") {
      if (!absl::SimpleAtob(value, &p.contended)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "bandwidth profile line %d: contended='%s' is not true/false", line_no, value));
      }
      seen = &have_contended;
    } else {
      return absl::InvalidArgumentError(absl::StrFormat(
          "bandwidth profile line %d: unknown key '%s' (known: pcie_gather_gbps, "
          "cpu_expert_gbps, contended)", line_no, key));
    }
    if (*seen) {
      return absl::InvalidArgumentError(
          absl::StrFormat("bandwidth profile line %d: duplicate key '%s'", line_no, key));
    }
    *seen = true;
  }
  if (!have_pcie || !have_cpu) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bandwidth profile: missing ", !have_pcie ? "pcie_gather_gbps" : "cpu_expert_gbps"));
  }
  if (absl::Status s = CheckProfile(p); !s.ok()) return s;
  return p;
}

std::string SerializeBandwidthProfile(const BandwidthProfile& p) {
  return absl::StrFormat(
      "# moe_cache bandwidth profile (see moe_cache/hybrid_split.h)\n"
      "pcie_gather_gbps=%.17g\ncpu_expert_gbps=%.17g\ncontended=%s\n",
      p.pcie_gather_gbps, p.cpu_expert_gbps, p.contended ? "true" : "false");
}

absl::StatusOr<BandwidthProfile> ReadBandwidthProfile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open bandwidth profile ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  auto p = ParseBandwidthProfile(ss.str());
  if (!p.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", p.status().message()));
  return p;
}

absl::Status WriteBandwidthProfile(const BandwidthProfile& profile, const std::string& path) {
  if (absl::Status s = CheckProfile(profile); !s.ok()) return s;
  std::ofstream out(path, std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write bandwidth profile ", path));
  out << SerializeBandwidthProfile(profile);
  if (!out) return absl::DataLossError(absl::StrCat("short write to ", path));
  return absl::OkStatus();
}

}  // namespace moe_cache
}  // namespace moe
