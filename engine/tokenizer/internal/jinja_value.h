// Python-compatible text forms of JSON-like values, as a Jinja template rendered by Python shows
// them: str() / repr() of None, bools, ints, floats, strings, lists and dicts, and json.dumps as
// transformers' `tojson` filter calls it (ensure_ascii=False, key order kept, optional indent,
// default separators ", " and ": "). Stateless functions: thread-safe.
#ifndef MOE_ENGINE_TOKENIZER_INTERNAL_JINJA_VALUE_H_
#define MOE_ENGINE_TOKENIZER_INTERNAL_JINJA_VALUE_H_

#include <optional>
#include <string>

#include "nlohmann/json.hpp"

namespace moe::tokenizer::internal {

// Python's repr(float): the shortest text that reads back as the same double, fixed notation for
// 1e-4 <= |x| < 1e16 (with ".0" when integral), else "1e+16" style.
std::string PyFloatRepr(double x);

// Python's str(x) for a value decoded from JSON (strings as themselves, containers in repr form).
std::string PyStr(const nlohmann::ordered_json& x);
// Python's repr(x).
std::string PyRepr(const nlohmann::ordered_json& x);

// json.dumps(x, ensure_ascii=False, indent=indent, separators=(item_sep, key_sep)) where the
// separators default as Python's do (", " / ": " without indent, "," / ": " with one).
std::string PyJsonDumps(const nlohmann::ordered_json& x, std::optional<int> indent,
                        std::optional<std::string> item_sep = std::nullopt,
                        std::optional<std::string> key_sep = std::nullopt);

}  // namespace moe::tokenizer::internal

#endif  // MOE_ENGINE_TOKENIZER_INTERNAL_JINJA_VALUE_H_
