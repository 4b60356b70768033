#include "engine/tokenizer/internal/jinja_value.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace moe::tokenizer::internal {

using Json = nlohmann::ordered_json;

std::string PyFloatRepr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  if (x == 0) return std::signbit(x) ? "-0.0" : "0.0";
  // Shortest round-tripping significand digits.
  char buf[40];
  int precision = 0;
  for (; precision < 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*e", precision, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  std::snprintf(buf, sizeof(buf), "%.*e", precision, x);
  // buf: [-]d.ddde[+-]XX
  std::string s(buf);
  const bool negative = s[0] == '-';
  if (negative) s.erase(0, 1);
  const size_t e = s.find('e');
  const int exponent = std::atoi(s.c_str() + e + 1);
  std::string digits;
  for (size_t i = 0; i < e; ++i) {
    if (s[i] != '.') digits.push_back(s[i]);
  }
  std::string out;
  if (exponent >= -4 && exponent < 16) {
    // Python switches to exponent form when the decimal exponent is < -4 or >= 16.
    const int point = exponent + 1;  // digits before the decimal point
    if (point <= 0) {
      out = "0." + std::string(-point, '0') + digits;
    } else if (point >= static_cast<int>(digits.size())) {
      out = digits + std::string(point - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, point) + "." + digits.substr(point);
    }
  }
  if (out.empty()) {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char exp[16];
    std::snprintf(exp, sizeof(exp), "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    out += exp;
  }
  return negative ? "-" + out : out;
}

namespace {

void AppendPyStringRepr(const std::string& s, std::string* out) {
  // Python picks single quotes unless the string has one and no double quote.
  const bool has_single = s.find('\'') != std::string::npos;
  const bool has_double = s.find('"') != std::string::npos;
  const char q = has_single && !has_double ? '"' : '\'';
  out->push_back(q);
  for (unsigned char c : s) {
    switch (c) {
      case '\\':
        *out += "\\\\";
        break;
      case '\n':
        *out += "\\n";
        break;
      case '\r':
        *out += "\\r";
        break;
      case '\t':
        *out += "\\t";
        break;
      default:
        if (c == q) {
          out->push_back('\\');
          out->push_back(static_cast<char>(c));
        } else if (c < 0x20 || c == 0x7F) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\x%02x", c);
          *out += buf;
        } else {
          out->push_back(static_cast<char>(c));
        }
    }
  }
  out->push_back(q);
}

void AppendRepr(const Json& x, std::string* out) {
  switch (x.type()) {
    case Json::value_t::null:
      *out += "None";
      return;
    case Json::value_t::boolean:
      *out += x.get<bool>() ? "True" : "False";
      return;
    case Json::value_t::number_integer:
      *out += std::to_string(x.get<int64_t>());
      return;
    case Json::value_t::number_unsigned:
      *out += std::to_string(x.get<uint64_t>());
      return;
    case Json::value_t::number_float:
      *out += PyFloatRepr(x.get<double>());
      return;
    case Json::value_t::string:
      AppendPyStringRepr(x.get_ref<const std::string&>(), out);
      return;
    case Json::value_t::array: {
      out->push_back('[');
      bool first = true;
      for (const Json& v : x) {
        if (!first) *out += ", ";
        first = false;
        AppendRepr(v, out);
      }
      out->push_back(']');
      return;
    }
    case Json::value_t::object: {
      out->push_back('{');
      bool first = true;
      for (auto it = x.begin(); it != x.end(); ++it) {
        if (!first) *out += ", ";
        first = false;
        AppendPyStringRepr(it.key(), out);
        *out += ": ";
        AppendRepr(it.value(), out);
      }
      out->push_back('}');
      return;
    }
    default:
      *out += "None";
      return;
  }
}

void AppendJsonString(const std::string& s, std::string* out) {
  out->push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        *out += "\\\"";
        break;
      case '\\':
        *out += "\\\\";
        break;
      case '\n':
        *out += "\\n";
        break;
      case '\r':
        *out += "\\r";
        break;
      case '\t':
        *out += "\\t";
        break;
      case '\b':
        *out += "\\b";
        break;
      case '\f':
        *out += "\\f";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          *out += buf;
        } else {
          out->push_back(static_cast<char>(c));
        }
    }
  }
  out->push_back('"');
}

void AppendJson(const Json& x, std::optional<int> indent, const std::string& item_sep,
                const std::string& key_sep, int depth, std::string* out) {
  auto newline = [&](int level) {
    out->push_back('\n');
    out->append(static_cast<size_t>(*indent) * level, ' ');
  };
  switch (x.type()) {
    case Json::value_t::null:
      *out += "null";
      return;
    case Json::value_t::boolean:
      *out += x.get<bool>() ? "true" : "false";
      return;
    case Json::value_t::number_integer:
      *out += std::to_string(x.get<int64_t>());
      return;
    case Json::value_t::number_unsigned:
      *out += std::to_string(x.get<uint64_t>());
      return;
    case Json::value_t::number_float: {
      const double d = x.get<double>();
      *out += std::isnan(d)   ? "NaN"
              : std::isinf(d) ? (d > 0 ? "Infinity" : "-Infinity")
                              : PyFloatRepr(d);
      return;
    }
    case Json::value_t::string:
      AppendJsonString(x.get_ref<const std::string&>(), out);
      return;
    case Json::value_t::array: {
      if (x.empty()) {
        *out += "[]";
        return;
      }
      out->push_back('[');
      bool first = true;
      for (const Json& v : x) {
        if (!first) *out += item_sep;
        first = false;
        if (indent) newline(depth + 1);
        AppendJson(v, indent, item_sep, key_sep, depth + 1, out);
      }
      if (indent) newline(depth);
      out->push_back(']');
      return;
    }
    case Json::value_t::object: {
      if (x.empty()) {
        *out += "{}";
        return;
      }
      out->push_back('{');
      bool first = true;
      for (auto it = x.begin(); it != x.end(); ++it) {
        if (!first) *out += item_sep;
        first = false;
        if (indent) newline(depth + 1);
        AppendJsonString(it.key(), out);
        *out += key_sep;
        AppendJson(it.value(), indent, item_sep, key_sep, depth + 1, out);
      }
      if (indent) newline(depth);
      out->push_back('}');
      return;
    }
    default:
      *out += "null";
      return;
  }
}

}  // namespace

std::string PyStr(const Json& x) {
  if (x.is_string()) return x.get<std::string>();
  std::string out;
  AppendRepr(x, &out);
  return out;
}

std::string PyRepr(const Json& x) {
  std::string out;
  AppendRepr(x, &out);
  return out;
}

std::string PyJsonDumps(const Json& x, std::optional<int> indent,
                        std::optional<std::string> item_sep, std::optional<std::string> key_sep) {
  std::string out;
  AppendJson(x, indent, item_sep.value_or(indent ? "," : ", "), key_sep.value_or(": "), 0, &out);
  return out;
}

}  // namespace moe::tokenizer::internal
