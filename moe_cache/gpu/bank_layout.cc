#include "moe_cache/gpu/bank_layout.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace moe::moe_cache {

absl::StatusOr<BankLayout> BankLayout::Create(std::vector<BankSpec> banks) {
  if (banks.empty()) return absl::InvalidArgumentError("bank layout has no banks");
  if (banks.size() > static_cast<size_t>(kMaxBanks)) {
    return absl::InvalidArgumentError(
        absl::StrCat("bank layout has ", banks.size(), " banks; at most ", kMaxBanks));
  }
  BankLayout layout;
  for (BankSpec& b : banks) {
    if (b.bytes == 0) {
      return absl::InvalidArgumentError(absl::StrCat("bank '", b.name, "' has zero bytes"));
    }
    b.pitch = (b.bytes + kRowAlignment - 1) / kRowAlignment * kRowAlignment;
    layout.padded_bytes_ += b.pitch;
    layout.bytes_ += b.bytes;
  }
  layout.banks_ = std::move(banks);
  return layout;
}

}  // namespace moe::moe_cache
