#include "common/status.h"

#include <string>

#include "gtest/gtest.h"

namespace moe::common {
namespace {

absl::Status FailIf(bool fail) {
  return fail ? absl::InvalidArgumentError("bad") : absl::OkStatus();
}

absl::Status Chain(bool fail, int* reached) {
  RETURN_IF_ERROR(FailIf(fail));
  *reached = 1;
  return absl::OkStatus();
}

absl::StatusOr<std::string> Name(bool fail) {
  if (fail) return absl::NotFoundError("no name");
  return std::string("expert");
}

absl::StatusOr<int> Length(bool fail) {
  ASSIGN_OR_RETURN(std::string name, Name(fail));
  return static_cast<int>(name.size());
}

TEST(StatusTest, ReturnIfErrorStopsOnError) {
  int reached = 0;
  EXPECT_EQ(Chain(true, &reached).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reached, 0);
  EXPECT_TRUE(Chain(false, &reached).ok());
  EXPECT_EQ(reached, 1);
}

TEST(StatusTest, AssignOrReturnPropagatesAndAssigns) {
  EXPECT_EQ(Length(true).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(Length(false).ok());
  EXPECT_EQ(*Length(false), 6);
}

}  // namespace
}  // namespace moe::common
