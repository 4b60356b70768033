// A Jinja interpreter for chat templates: lexer (template text -> text and tag pieces, applying
// whitespace control, trim_blocks and lstrip_blocks as Jinja's lexer does) -> parser (a statement
// and expression tree) -> evaluator over JSON-like values. It covers what the Qwen family's
// templates and transformers' rendering use; any other construct is an InvalidArgument naming
// it and its template line.
//
// Errors inside the interpreter are thrown as TemplateError and turned into absl::Status at the
// two public entry points (FromSource, Render); no exception leaves this file.
#include "engine/tokenizer/chat_template.h"

#include <unicode/uchar.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/tokenizer/internal/jinja_value.h"
#include "engine/tokenizer/internal/utf8.h"

namespace moe::tokenizer {
namespace {

using Json = nlohmann::ordered_json;
using internal::PyJsonDumps;
using internal::PyStr;

struct TemplateError {
  std::string message;
  int line;
};

[[noreturn]] void Fail(int line, std::string message) {
  throw TemplateError{std::move(message), line};
}

// Python's str.isspace for one code point (White_Space plus the ASCII separators 0x1C-0x1F).
bool IsPySpace(char32_t c) {
  return (c >= 0x1C && c <= 0x1F) || u_hasBinaryProperty(c, UCHAR_WHITE_SPACE);
}

std::u32string ToU32(const std::string& s) {
  std::u32string out;
  size_t i = 0;
  while (i < s.size()) out.push_back(internal::NextCodePoint(s, &i));
  return out;
}

std::string FromU32(const std::u32string& s) {
  std::string out;
  for (char32_t c : s) internal::AppendUtf8(c, &out);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Values.

struct Value;
struct Args;
class Context;
using Function = std::function<Value(Args&, Context&, int line)>;

struct Value {
  enum class Kind { kUndefined, kJson, kNamespace, kCallable };
  Kind kind = Kind::kUndefined;
  Json json;
  std::shared_ptr<Json> ns;            // kNamespace: shared so `set ns.x` is seen everywhere
  std::shared_ptr<const Function> fn;  // kCallable
  std::string name;                    // kUndefined: what was looked up; kCallable: its name

  static Value Undefined(std::string what) {
    Value v;
    v.name = std::move(what);
    return v;
  }
  static Value Of(Json j) {
    Value v;
    v.kind = Kind::kJson;
    v.json = std::move(j);
    return v;
  }
  static Value Func(std::string name, Function f) {
    Value v;
    v.kind = Kind::kCallable;
    v.name = std::move(name);
    v.fn = std::make_shared<const Function>(std::move(f));
    return v;
  }
  bool undefined() const { return kind == Kind::kUndefined; }
  bool is_json() const { return kind == Kind::kJson; }
  bool is_string() const { return is_json() && json.is_string(); }
  bool is_number() const { return is_json() && json.is_number(); }
  bool is_integer() const { return is_json() && json.is_number_integer(); }
  bool is_none() const { return is_json() && json.is_null(); }
  const std::string& str() const { return json.get_ref<const std::string&>(); }
};

struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;

  // Positional `i` or keyword `name`; nullptr when neither was passed.
  const Value* Get(size_t i, const char* name) const {
    if (i < pos.size()) return &pos[i];
    for (const auto& [k, v] : kw) {
      if (k == name) return &v;
    }
    return nullptr;
  }
};

bool Truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
      return false;
    case Value::Kind::kNamespace:
    case Value::Kind::kCallable:
      return true;
    case Value::Kind::kJson:
      break;
  }
  const Json& j = v.json;
  switch (j.type()) {
    case Json::value_t::null:
      return false;
    case Json::value_t::boolean:
      return j.get<bool>();
    case Json::value_t::number_integer:
      return j.get<int64_t>() != 0;
    case Json::value_t::number_unsigned:
      return j.get<uint64_t>() != 0;
    case Json::value_t::number_float:
      return j.get<double>() != 0;
    case Json::value_t::string:
      return !j.get_ref<const std::string&>().empty();
    case Json::value_t::array:
    case Json::value_t::object:
      return !j.empty();
    default:
      return false;
  }
}

std::string TypeName(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
      return "undefined";
    case Value::Kind::kNamespace:
      return "namespace";
    case Value::Kind::kCallable:
      return "function";
    case Value::Kind::kJson:
      break;
  }
  switch (v.json.type()) {
    case Json::value_t::null:
      return "NoneType";
    case Json::value_t::boolean:
      return "bool";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned:
      return "int";
    case Json::value_t::number_float:
      return "float";
    case Json::value_t::string:
      return "str";
    case Json::value_t::array:
      return "list";
    case Json::value_t::object:
      return "dict";
    default:
      return "value";
  }
}

// The JSON a value stands for where data is needed (list elements, tojson).
Json ToJson(const Value& v, int line) {
  switch (v.kind) {
    case Value::Kind::kJson:
      return v.json;
    case Value::Kind::kNamespace:
      return *v.ns;
    case Value::Kind::kUndefined:
      return Json();
    case Value::Kind::kCallable:
      break;
  }
  Fail(line, absl::StrCat("a function (", v.name, ") cannot be used as data"));
}

// str(value) as Jinja prints it.
std::string ToText(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
      return "";
    case Value::Kind::kJson:
      return PyStr(v.json);
    case Value::Kind::kNamespace:
      return "<Namespace " + internal::PyRepr(*v.ns) + ">";
    case Value::Kind::kCallable:
      return "<function " + v.name + ">";
  }
  return "";
}

[[noreturn]] void FailUndefined(const Value& v, int line) {
  Fail(line, absl::StrCat("'", v.name, "' is undefined"));
}

bool JsonEquals(const Json& a, const Json& b) {
  // Python compares 1 == 1.0 and True == 1 as equal.
  if ((a.is_number() || a.is_boolean()) && (b.is_number() || b.is_boolean())) {
    auto num = [](const Json& j) {
      return j.is_boolean() ? (j.get<bool>() ? 1.0 : 0.0) : j.get<double>();
    };
    if (a.is_number_integer() && b.is_number_integer()) return a.get<int64_t>() == b.get<int64_t>();
    return num(a) == num(b);
  }
  if (a.type() != b.type()) return false;
  if (a.is_array()) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i) {
      if (!JsonEquals(a[i], b[i])) return false;
    }
    return true;
  }
  if (a.is_object()) {
    if (a.size() != b.size()) return false;
    for (auto it = a.begin(); it != a.end(); ++it) {
      auto jt = b.find(it.key());
      if (jt == b.end() || !JsonEquals(it.value(), *jt)) return false;
    }
    return true;
  }
  return a == b;
}

bool ValueEquals(const Value& a, const Value& b) {
  if (a.undefined() || b.undefined()) return a.undefined() && b.undefined();
  if (a.kind != b.kind) return false;
  if (a.kind == Value::Kind::kNamespace) return a.ns == b.ns;
  if (a.kind == Value::Kind::kCallable) return a.fn == b.fn;
  return JsonEquals(a.json, b.json);
}

// <0, 0, >0 as Python orders numbers, strings and lists; other pairs are a TypeError.
int Compare(const Value& a, const Value& b, int line) {
  if (a.is_json() && b.is_json()) {
    const Json& x = a.json;
    const Json& y = b.json;
    if ((x.is_number() || x.is_boolean()) && (y.is_number() || y.is_boolean())) {
      if (x.is_number_integer() && y.is_number_integer()) {
        const int64_t p = x.get<int64_t>(), q = y.get<int64_t>();
        return p < q ? -1 : p > q ? 1 : 0;
      }
      auto num = [](const Json& j) {
        return j.is_boolean() ? (j.get<bool>() ? 1.0 : 0.0) : j.get<double>();
      };
      const double p = num(x), q = num(y);
      return p < q ? -1 : p > q ? 1 : 0;
    }
    if (x.is_string() && y.is_string()) {
      // UTF-8 byte order is code point order, as Python compares str.
      const int c = x.get_ref<const std::string&>().compare(y.get_ref<const std::string&>());
      return c < 0 ? -1 : c > 0 ? 1 : 0;
    }
    if (x.is_array() && y.is_array()) {
      for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
        if (!JsonEquals(x[i], y[i])) return Compare(Value::Of(x[i]), Value::Of(y[i]), line);
      }
      return x.size() < y.size() ? -1 : x.size() > y.size() ? 1 : 0;
    }
  }
  Fail(line, absl::StrCat("cannot compare ", TypeName(a), " and ", TypeName(b)));
}

// Items a for loop (or a filter) iterates: list elements, dict keys, string characters.
std::vector<Value> Iterate(const Value& v, int line) {
  std::vector<Value> out;
  if (v.undefined()) return out;  // Jinja's default Undefined iterates as empty
  if (v.kind == Value::Kind::kJson) {
    const Json& j = v.json;
    if (j.is_array()) {
      out.reserve(j.size());
      for (const Json& e : j) out.push_back(Value::Of(e));
      return out;
    }
    if (j.is_object()) {
      for (auto it = j.begin(); it != j.end(); ++it) out.push_back(Value::Of(it.key()));
      return out;
    }
    if (j.is_string()) {
      for (char32_t c : ToU32(j.get<std::string>()))
        out.push_back(Value::Of(FromU32(std::u32string(1, c))));
      return out;
    }
  }
  Fail(line, absl::StrCat("'", TypeName(v), "' object is not iterable"));
}

int64_t Length(const Value& v, int line) {
  if (v.undefined()) return 0;
  if (v.is_json()) {
    if (v.json.is_string()) return static_cast<int64_t>(ToU32(v.str()).size());
    if (v.json.is_array() || v.json.is_object()) return static_cast<int64_t>(v.json.size());
  }
  if (v.kind == Value::Kind::kNamespace) return static_cast<int64_t>(v.ns->size());
  Fail(line, absl::StrCat("object of type '", TypeName(v), "' has no len()"));
}

// ---------------------------------------------------------------------------------------------
// Lexer: template source -> pieces (text, {{ expression }}, {% statement %}), each tag's inside as
// tokens.

struct Token {
  enum class Type { kName, kString, kInt, kFloat, kOp };
  Type type;
  std::string text;  // name, decoded string, operator
  int64_t i = 0;
  double f = 0;
  int line = 0;
};

struct Piece {
  enum class Type { kText, kExpr, kStmt };
  Type type;
  std::string text;  // kText
  std::vector<Token> tokens;
  int line;
};

// Python's unicode-escape decoding of a string literal's inside (Jinja's lexer uses it).
std::string Unescape(const std::string& s, int line) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\' || i + 1 >= s.size()) {
      out.push_back(s[i]);
      continue;
    }
    const char c = s[++i];
    auto hex = [&](int n) -> char32_t {
      if (i + n >= s.size() + 0 && i + n > s.size() - 1 + 1)
        Fail(line, "truncated escape in string");
      char32_t v = 0;
      for (int k = 1; k <= n; ++k) {
        if (i + k >= s.size() || !std::isxdigit(static_cast<unsigned char>(s[i + k]))) {
          Fail(line, "bad escape in string literal");
        }
        const char h = s[i + k];
        v = v * 16 +
            (std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : (std::tolower(h) - 'a' + 10));
      }
      i += n;
      return v;
    };
    switch (c) {
      case 'n':
        out.push_back('\n');
        break;
      case 't':
        out.push_back('\t');
        break;
      case 'r':
        out.push_back('\r');
        break;
      case 'b':
        out.push_back('\b');
        break;
      case 'f':
        out.push_back('\f');
        break;
      case 'v':
        out.push_back('\v');
        break;
      case 'a':
        out.push_back('\a');
        break;
      case '\\':
        out.push_back('\\');
        break;
      case '\'':
        out.push_back('\'');
        break;
      case '"':
        out.push_back('"');
        break;
      case '\n':
        break;
      case 'x':
        internal::AppendUtf8(hex(2), &out);
        break;
      case 'u':
        internal::AppendUtf8(hex(4), &out);
        break;
      case 'U':
        internal::AppendUtf8(hex(8), &out);
        break;
      default:
        if (c >= '0' && c <= '7') {
          char32_t v = c - '0';
          for (int k = 0; k < 2 && i + 1 < s.size() && s[i + 1] >= '0' && s[i + 1] <= '7'; ++k) {
            v = v * 8 + (s[++i] - '0');
          }
          internal::AppendUtf8(v, &out);
        } else {
          out.push_back('\\');
          out.push_back(c);
        }
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(std::string source) : src_(std::move(source)) {
    // Jinja normalizes newlines to "\n" and drops one trailing newline (keep_trailing_newline
    // is off in transformers).
    std::string s;
    for (size_t i = 0; i < src_.size(); ++i) {
      if (src_[i] == '\r') {
        s.push_back('\n');
        if (i + 1 < src_.size() && src_[i + 1] == '\n') ++i;
      } else {
        s.push_back(src_[i]);
      }
    }
    if (!s.empty() && s.back() == '\n') s.pop_back();
    src_ = std::move(s);
  }

  std::vector<Piece> Run() {
    std::vector<Piece> pieces;
    size_t pos = 0;
    bool line_starting = true;
    while (pos < src_.size()) {
      size_t k = pos;
      while (true) {
        k = src_.find('{', k);
        if (k == std::string::npos || k + 1 >= src_.size()) {
          k = std::string::npos;
          break;
        }
        const char c = src_[k + 1];
        if (c == '{' || c == '%' || c == '#') break;
        ++k;
      }
      std::string text = src_.substr(pos, k == std::string::npos ? std::string::npos : k - pos);
      if (k == std::string::npos) {
        AddText(&pieces, text, pos);
        break;
      }
      const char kind = src_[k + 1];
      const char sign = k + 2 < src_.size() ? src_[k + 2] : 0;
      if (sign == '-') {
        text = RStripPy(text);
      } else if (sign != '+' && kind != '{') {
        // lstrip_blocks: remove the indentation before a block or comment tag on its own line.
        const size_t l_pos = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
        if ((l_pos > 0 || line_starting) && l_pos < text.size() && AllPySpace(text.substr(l_pos))) {
          text.resize(l_pos);
        }
      }
      AddText(&pieces, text, pos);
      const int line = LineAt(k);
      size_t p = k + 2 + ((sign == '-' || sign == '+') ? 1 : 0);
      if (kind == '#') {
        const size_t end = src_.find("#}", p);
        if (end == std::string::npos) Fail(line, "unterminated comment");
        const bool strip = end > p && src_[end - 1] == '-';
        const bool keep = end > p && src_[end - 1] == '+';
        pos = AfterTag(end + 2, strip, /*trim=*/!keep);
      } else {
        Piece piece;
        piece.type = kind == '{' ? Piece::Type::kExpr : Piece::Type::kStmt;
        piece.line = line;
        const char close = kind == '{' ? '}' : '%';
        bool strip = false, keep = false;
        p = LexTag(p, close, &piece.tokens, &strip, &keep);
        pos = AfterTag(p, strip, /*trim=*/kind == '%' && !keep);
        pieces.push_back(std::move(piece));
      }
      line_starting = pos > 0 && src_[pos - 1] == '\n';
    }
    return pieces;
  }

 private:
  static bool AllPySpace(const std::string& s) {
    size_t i = 0;
    while (i < s.size()) {
      if (!IsPySpace(internal::NextCodePoint(s, &i))) return false;
    }
    return true;
  }
  static std::string RStripPy(const std::string& s) {
    size_t end = s.size();
    while (end > 0) {
      size_t start = end - 1;
      while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
      size_t q = start;
      if (!IsPySpace(internal::NextCodePoint(s, &q))) break;
      end = start;
    }
    return s.substr(0, end);
  }

  int LineAt(size_t pos) const {
    return 1 + static_cast<int>(std::count(src_.begin(), src_.begin() + pos, '\n'));
  }

  void AddText(std::vector<Piece>* pieces, const std::string& text, size_t pos) const {
    if (text.empty()) return;
    Piece p;
    p.type = Piece::Type::kText;
    p.text = text;
    p.line = LineAt(pos);
    pieces->push_back(std::move(p));
  }

  // Position after a tag's closing: "-" strips all following whitespace, trim_blocks one "\n".
  size_t AfterTag(size_t pos, bool strip, bool trim) const {
    if (strip) {
      while (pos < src_.size()) {
        size_t q = pos;
        if (!IsPySpace(internal::NextCodePoint(src_, &q))) break;
        pos = q;
      }
    } else if (trim && pos < src_.size() && src_[pos] == '\n') {
      ++pos;
    }
    return pos;
  }

  // Tokenizes a tag's inside from `p` up to its closing ("}}" or "%}", optionally preceded by
  // "-" or "+"); returns the position after the closing.
  size_t LexTag(size_t p, char close, std::vector<Token>* tokens, bool* strip, bool* keep) {
    const int line = LineAt(p);
    int depth = 0;  // open brackets: inside them "}}" is not the end of the tag, as in Jinja
    while (true) {
      while (p < src_.size() && std::isspace(static_cast<unsigned char>(src_[p]))) ++p;
      if (p >= src_.size()) Fail(line, "unterminated tag");
      auto closes_at = [&](size_t q) {
        return depth == 0 && q + 1 < src_.size() && src_[q] == close && src_[q + 1] == '}';
      };
      if (closes_at(p)) return p + 2;
      if ((src_[p] == '-' || src_[p] == '+') && closes_at(p + 1)) {
        (src_[p] == '-' ? *strip : *keep) = true;
        return p + 3;
      }
      Token t;
      t.line = LineAt(p);
      const char c = src_[p];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t q = p;
        while (q < src_.size() &&
               (std::isalnum(static_cast<unsigned char>(src_[q])) || src_[q] == '_'))
          ++q;
        t.type = Token::Type::kName;
        t.text = src_.substr(p, q - p);
        p = q;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        size_t q = p;
        bool is_float = false;
        while (q < src_.size() &&
               (std::isdigit(static_cast<unsigned char>(src_[q])) || src_[q] == '_'))
          ++q;
        if (q + 1 < src_.size() && src_[q] == '.' &&
            std::isdigit(static_cast<unsigned char>(src_[q + 1]))) {
          is_float = true;
          ++q;
          while (q < src_.size() && std::isdigit(static_cast<unsigned char>(src_[q]))) ++q;
        }
        if (q < src_.size() && (src_[q] == 'e' || src_[q] == 'E')) {
          size_t r = q + 1;
          if (r < src_.size() && (src_[r] == '+' || src_[r] == '-')) ++r;
          if (r < src_.size() && std::isdigit(static_cast<unsigned char>(src_[r]))) {
            is_float = true;
            q = r;
            while (q < src_.size() && std::isdigit(static_cast<unsigned char>(src_[q]))) ++q;
          }
        }
        std::string num = src_.substr(p, q - p);
        num.erase(std::remove(num.begin(), num.end(), '_'), num.end());
        if (is_float) {
          t.type = Token::Type::kFloat;
          t.f = std::strtod(num.c_str(), nullptr);
        } else {
          t.type = Token::Type::kInt;
          t.i = std::strtoll(num.c_str(), nullptr, 10);
        }
        p = q;
      } else if (c == '\'' || c == '"') {
        size_t q = p + 1;
        while (q < src_.size() && src_[q] != c) q += src_[q] == '\\' ? 2 : 1;
        if (q >= src_.size()) Fail(t.line, "unterminated string literal");
        t.type = Token::Type::kString;
        t.text = Unescape(src_.substr(p + 1, q - p - 1), t.line);
        p = q + 1;
      } else {
        static const char* const kOps[] = {"**", "//", "==", "!=", "<=", ">=", "+", "-", "*",
                                           "/",  "%",  "~",  "<",  ">",  "(",  ")", "[", "]",
                                           "{",  "}",  ",",  ".",  ":",  "|",  "="};
        bool found = false;
        for (const char* op : kOps) {
          if (src_.compare(p, std::strlen(op), op) == 0) {
            t.type = Token::Type::kOp;
            t.text = op;
            p += std::strlen(op);
            found = true;
            if (t.text == "(" || t.text == "[" || t.text == "{") ++depth;
            if ((t.text == ")" || t.text == "]" || t.text == "}") && depth > 0) --depth;
            break;
          }
        }
        if (!found) Fail(t.line, absl::StrCat("unexpected character '", std::string(1, c), "'"));
      }
      tokens->push_back(std::move(t));
    }
  }

  std::string src_;
};

// ---------------------------------------------------------------------------------------------
// Tree.

struct Expr {
  explicit Expr(int l) : line(l) {}
  virtual ~Expr() = default;
  virtual Value Eval(Context& ctx) const = 0;
  int line;
};
using ExprPtr = std::unique_ptr<Expr>;

enum class Flow { kNormal, kBreak, kContinue };

struct Stmt {
  explicit Stmt(int l) : line(l) {}
  virtual ~Stmt() = default;
  virtual Flow Exec(Context& ctx, std::string* out) const = 0;
  int line;
};
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

Flow ExecBody(const Body& body, Context& ctx, std::string* out) {
  for (const StmtPtr& s : body) {
    const Flow f = s->Exec(ctx, out);
    if (f != Flow::kNormal) return f;
  }
  return Flow::kNormal;
}

// Variables: a stack of scopes. A for loop or a macro call opens one; if/else does not (as in
// Jinja, a `set` inside a loop is not seen after it).
class Context {
 public:
  explicit Context(std::map<std::string, Value> globals) { scopes_.push_back(std::move(globals)); }
  Value Lookup(const std::string& name) const {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
      auto f = it->find(name);
      if (f != it->end()) return f->second;
    }
    return Value::Undefined(name);
  }
  void Set(const std::string& name, Value v) { scopes_.back()[name] = std::move(v); }
  void Push() { scopes_.emplace_back(); }
  void Pop() { scopes_.pop_back(); }
  int depth = 0;  // macro call depth, bounded against runaway recursion
  // Loop iterations and macro calls so far: a template (it comes with the model files) must not
  // be able to hang a server, so rendering stops with an error past kMaxSteps.
  int64_t steps = 0;
  static constexpr int64_t kMaxSteps = 1'000'000;
  void Step(int line) {
    if (++steps > kMaxSteps) Fail(line, "template too expensive (more than 1M loop iterations)");
  }

 private:
  std::vector<std::map<std::string, Value>> scopes_;
};

struct ScopeGuard {
  explicit ScopeGuard(Context& c) : ctx(c) { ctx.Push(); }
  ~ScopeGuard() { ctx.Pop(); }
  Context& ctx;
};

// --- expressions ---

struct Literal : Expr {
  Literal(int l, Json j) : Expr(l), value(Value::Of(std::move(j))) {}
  Value Eval(Context&) const override { return value; }
  Value value;
};

struct Name : Expr {
  Name(int l, std::string n) : Expr(l), name(std::move(n)) {}
  Value Eval(Context& ctx) const override { return ctx.Lookup(name); }
  std::string name;
};

struct ListExpr : Expr {
  using Expr::Expr;
  Value Eval(Context& ctx) const override {
    Json arr = Json::array();
    for (const ExprPtr& e : items) arr.push_back(ToJson(e->Eval(ctx), line));
    return Value::Of(std::move(arr));
  }
  std::vector<ExprPtr> items;
};

struct DictExpr : Expr {
  using Expr::Expr;
  Value Eval(Context& ctx) const override {
    Json obj = Json::object();
    for (const auto& [k, v] : items) {
      const Value key = k->Eval(ctx);
      if (!key.is_string()) Fail(line, "dict keys must be strings");
      obj[key.str()] = ToJson(v->Eval(ctx), line);
    }
    return Value::Of(std::move(obj));
  }
  std::vector<std::pair<ExprPtr, ExprPtr>> items;
};

Value GetAttr(const Value& obj, const std::string& name, int line);
Value GetItem(const Value& obj, const Value& key, int line);

struct Attr : Expr {
  Attr(int l, ExprPtr o, std::string n) : Expr(l), obj(std::move(o)), name(std::move(n)) {}
  Value Eval(Context& ctx) const override { return GetAttr(obj->Eval(ctx), name, line); }
  ExprPtr obj;
  std::string name;
};

struct Index : Expr {
  Index(int l, ExprPtr o, ExprPtr k) : Expr(l), obj(std::move(o)), key(std::move(k)) {}
  Value Eval(Context& ctx) const override { return GetItem(obj->Eval(ctx), key->Eval(ctx), line); }
  ExprPtr obj, key;
};

int64_t ToInt(const Value& v, int line, const char* what) {
  if (v.is_integer()) return v.json.get<int64_t>();
  if (v.is_json() && v.json.is_boolean()) return v.json.get<bool>() ? 1 : 0;
  Fail(line, absl::StrCat(what, " must be an integer, not ", TypeName(v)));
}

struct Slice : Expr {
  Slice(int l, ExprPtr o) : Expr(l), obj(std::move(o)) {}
  Value Eval(Context& ctx) const override {
    const Value v = obj->Eval(ctx);
    auto bound = [&](const ExprPtr& e) -> std::optional<int64_t> {
      if (!e) return std::nullopt;
      const Value b = e->Eval(ctx);
      if (b.is_none()) return std::nullopt;
      return ToInt(b, line, "slice index");
    };
    const std::optional<int64_t> lo = bound(start), hi = bound(stop), st = bound(step);
    const int64_t s = st.value_or(1);
    if (s == 0) Fail(line, "slice step cannot be zero");
    auto pick = [&](int64_t n) {
      // Python's slice.indices().
      auto clamp = [&](std::optional<int64_t> x, int64_t def) {
        if (!x) return def;
        int64_t y = *x < 0 ? *x + n : *x;
        if (s > 0) return std::clamp<int64_t>(y, 0, n);
        return std::clamp<int64_t>(y, -1, n - 1);
      };
      const int64_t a = clamp(lo, s > 0 ? 0 : n - 1);
      const int64_t b = clamp(hi, s > 0 ? n : -1);
      std::vector<int64_t> idx;
      for (int64_t i = a; s > 0 ? i < b : i > b; i += s) idx.push_back(i);
      return idx;
    };
    if (v.is_json() && v.json.is_array()) {
      Json out = Json::array();
      for (int64_t i : pick(static_cast<int64_t>(v.json.size()))) out.push_back(v.json[i]);
      return Value::Of(std::move(out));
    }
    if (v.is_string()) {
      const std::u32string u = ToU32(v.str());
      std::u32string out;
      for (int64_t i : pick(static_cast<int64_t>(u.size()))) out.push_back(u[i]);
      return Value::Of(FromU32(out));
    }
    if (v.undefined()) FailUndefined(v, line);
    Fail(line, absl::StrCat("'", TypeName(v), "' object cannot be sliced"));
  }
  ExprPtr obj, start, stop, step;
};

struct CallExpr : Expr {
  CallExpr(int l, ExprPtr f) : Expr(l), fn(std::move(f)) {}
  Value Eval(Context& ctx) const override {
    const Value f = fn->Eval(ctx);
    Args args;
    for (const ExprPtr& a : pos) args.pos.push_back(a->Eval(ctx));
    for (const auto& [k, a] : kw) args.kw.emplace_back(k, a->Eval(ctx));
    if (f.kind != Value::Kind::kCallable) {
      if (f.undefined()) FailUndefined(f, line);
      Fail(line, absl::StrCat("'", TypeName(f), "' object is not callable"));
    }
    return (*f.fn)(args, ctx, line);
  }
  ExprPtr fn;
  std::vector<ExprPtr> pos;
  std::vector<std::pair<std::string, ExprPtr>> kw;
};

Value ApplyFilter(const std::string& name, const Value& v, Args& args, Context& ctx, int line);
bool ApplyTest(const std::string& name, const Value& v, Args& args, int line);

struct FilterExpr : Expr {
  FilterExpr(int l, ExprPtr o, std::string n) : Expr(l), obj(std::move(o)), name(std::move(n)) {}
  Value Eval(Context& ctx) const override {
    const Value v = obj->Eval(ctx);
    Args args;
    for (const ExprPtr& a : pos) args.pos.push_back(a->Eval(ctx));
    for (const auto& [k, a] : kw) args.kw.emplace_back(k, a->Eval(ctx));
    return ApplyFilter(name, v, args, ctx, line);
  }
  ExprPtr obj;
  std::string name;
  std::vector<ExprPtr> pos;
  std::vector<std::pair<std::string, ExprPtr>> kw;
};

struct TestExpr : Expr {
  TestExpr(int l, ExprPtr o, std::string n, bool neg)
      : Expr(l), obj(std::move(o)), name(std::move(n)), negate(neg) {}
  Value Eval(Context& ctx) const override {
    const Value v = obj->Eval(ctx);
    Args args;
    for (const ExprPtr& a : pos) args.pos.push_back(a->Eval(ctx));
    return Value::Of(ApplyTest(name, v, args, line) != negate);
  }
  ExprPtr obj;
  std::string name;
  bool negate;
  std::vector<ExprPtr> pos;
};

struct Not : Expr {
  Not(int l, ExprPtr o) : Expr(l), obj(std::move(o)) {}
  Value Eval(Context& ctx) const override { return Value::Of(!Truthy(obj->Eval(ctx))); }
  ExprPtr obj;
};

struct Neg : Expr {
  Neg(int l, ExprPtr o) : Expr(l), obj(std::move(o)) {}
  Value Eval(Context& ctx) const override {
    const Value v = obj->Eval(ctx);
    if (v.is_integer()) return Value::Of(-v.json.get<int64_t>());
    if (v.is_number()) return Value::Of(-v.json.get<double>());
    Fail(line, absl::StrCat("bad operand type for unary -: '", TypeName(v), "'"));
  }
  ExprPtr obj;
};

struct AndOr : Expr {
  AndOr(int l, bool a, ExprPtr x, ExprPtr y)
      : Expr(l), is_and(a), left(std::move(x)), right(std::move(y)) {}
  Value Eval(Context& ctx) const override {
    Value l = left->Eval(ctx);
    // Python returns the deciding operand, not a bool.
    if (Truthy(l) != is_and) return l;
    return right->Eval(ctx);
  }
  bool is_and;
  ExprPtr left, right;
};

struct Conditional : Expr {
  Conditional(int l, ExprPtr t, ExprPtr c, ExprPtr e)
      : Expr(l), then(std::move(t)), cond(std::move(c)), otherwise(std::move(e)) {}
  Value Eval(Context& ctx) const override {
    if (Truthy(cond->Eval(ctx))) return then->Eval(ctx);
    if (!otherwise) return Value::Undefined("else branch");
    return otherwise->Eval(ctx);
  }
  ExprPtr then, cond, otherwise;
};

bool Contains(const Value& container, const Value& item, int line) {
  if (container.is_string()) {
    if (!item.is_string()) {
      Fail(line,
           absl::StrCat("'in <string>' requires string as left operand, not ", TypeName(item)));
    }
    return container.str().find(item.str()) != std::string::npos;
  }
  if (container.is_json() && container.json.is_array()) {
    for (const Json& e : container.json) {
      if (ValueEquals(Value::Of(e), item)) return true;
    }
    return false;
  }
  if (container.is_json() && container.json.is_object()) {
    return item.is_string() && container.json.contains(item.str());
  }
  if (container.undefined()) FailUndefined(container, line);
  Fail(line, absl::StrCat("argument of type '", TypeName(container), "' is not iterable"));
}

Value Arith(const std::string& op, const Value& a, const Value& b, int line) {
  if (a.undefined()) FailUndefined(a, line);
  if (b.undefined()) FailUndefined(b, line);
  auto type_error = [&]() {
    Fail(line, absl::StrCat("unsupported operand type(s) for ", op, ": '", TypeName(a), "' and '",
                            TypeName(b), "'"));
  };
  if (!a.is_json() || !b.is_json()) type_error();
  const Json& x = a.json;
  const Json& y = b.json;
  const bool xnum = x.is_number() || x.is_boolean(), ynum = y.is_number() || y.is_boolean();
  auto as_int = [](const Json& j) {
    return j.is_boolean() ? (j.get<bool>() ? 1 : 0) : j.get<int64_t>();
  };
  auto as_dbl = [](const Json& j) {
    return j.is_boolean() ? (j.get<bool>() ? 1.0 : 0.0) : j.get<double>();
  };
  const bool ints = xnum && ynum && !x.is_number_float() && !y.is_number_float();
  if (op == "+") {
    if (x.is_string() && y.is_string())
      return Value::Of(x.get<std::string>() + y.get<std::string>());
    if (x.is_array() && y.is_array()) {
      Json out = x;
      for (const Json& e : y) out.push_back(e);
      return Value::Of(std::move(out));
    }
    if (ints) return Value::Of(as_int(x) + as_int(y));
    if (xnum && ynum) return Value::Of(as_dbl(x) + as_dbl(y));
    type_error();
  }
  if (op == "*") {
    if ((x.is_string() || x.is_array()) && (y.is_number_integer() || y.is_boolean())) {
      const int64_t n = as_int(y);
      const size_t unit = x.is_string() ? x.get_ref<const std::string&>().size() : x.size();
      if (n > 0 && unit > 0 && static_cast<uint64_t>(n) > (64u << 20) / unit) {
        Fail(line, "repetition result too large");
      }
      if (x.is_string()) {
        std::string out;
        for (int64_t i = 0; i < n; ++i) out += x.get_ref<const std::string&>();
        return Value::Of(out);
      }
      Json out = Json::array();
      for (int64_t i = 0; i < n; ++i) {
        for (const Json& e : x) out.push_back(e);
      }
      return Value::Of(std::move(out));
    }
    if ((y.is_string() || y.is_array()) && (x.is_number_integer() || x.is_boolean())) {
      return Arith(op, b, a, line);
    }
    if (ints) return Value::Of(as_int(x) * as_int(y));
    if (xnum && ynum) return Value::Of(as_dbl(x) * as_dbl(y));
    type_error();
  }
  if (!xnum || !ynum) type_error();
  if (op == "-") {
    if (ints) return Value::Of(as_int(x) - as_int(y));
    return Value::Of(as_dbl(x) - as_dbl(y));
  }
  if (op == "/") {
    if (as_dbl(y) == 0) Fail(line, "division by zero");
    return Value::Of(as_dbl(x) / as_dbl(y));
  }
  if (op == "//" || op == "%") {
    if (as_dbl(y) == 0) Fail(line, "integer division or modulo by zero");
    if (ints) {
      const int64_t p = as_int(x), q = as_int(y);
      int64_t d = p / q;
      if ((p % q != 0) && ((p < 0) != (q < 0))) --d;  // Python floors
      return Value::Of(op == "//" ? d : p - d * q);
    }
    const double p = as_dbl(x), q = as_dbl(y);
    const double d = std::floor(p / q);
    return Value::Of(op == "//" ? d : p - d * q);
  }
  if (op == "**") {
    if (ints && as_int(y) >= 0) {
      int64_t r = 1;
      for (int64_t i = 0; i < as_int(y); ++i) r *= as_int(x);
      return Value::Of(r);
    }
    return Value::Of(std::pow(as_dbl(x), as_dbl(y)));
  }
  Fail(line, absl::StrCat("unsupported operator ", op));
}

struct BinOp : Expr {
  BinOp(int l, std::string o, ExprPtr x, ExprPtr y)
      : Expr(l), op(std::move(o)), left(std::move(x)), right(std::move(y)) {}
  Value Eval(Context& ctx) const override {
    const Value a = left->Eval(ctx);
    const Value b = right->Eval(ctx);
    if (op == "~") return Value::Of(ToText(a) + ToText(b));
    if (op == "==") return Value::Of(ValueEquals(a, b));
    if (op == "!=") return Value::Of(!ValueEquals(a, b));
    if (op == "in") return Value::Of(Contains(b, a, line));
    if (op == "notin") return Value::Of(!Contains(b, a, line));
    if (op == "<") return Value::Of(Compare(a, b, line) < 0);
    if (op == ">") return Value::Of(Compare(a, b, line) > 0);
    if (op == "<=") return Value::Of(Compare(a, b, line) <= 0);
    if (op == ">=") return Value::Of(Compare(a, b, line) >= 0);
    return Arith(op, a, b, line);
  }
  std::string op;
  ExprPtr left, right;
};

// --- statements ---

struct TextStmt : Stmt {
  TextStmt(int l, std::string t) : Stmt(l), text(std::move(t)) {}
  Flow Exec(Context&, std::string* out) const override {
    out->append(text);
    return Flow::kNormal;
  }
  std::string text;
};

struct OutputStmt : Stmt {
  OutputStmt(int l, ExprPtr e) : Stmt(l), expr(std::move(e)) {}
  Flow Exec(Context& ctx, std::string* out) const override {
    out->append(ToText(expr->Eval(ctx)));
    return Flow::kNormal;
  }
  ExprPtr expr;
};

struct IfStmt : Stmt {
  using Stmt::Stmt;
  Flow Exec(Context& ctx, std::string* out) const override {
    for (const auto& [cond, body] : branches) {
      if (Truthy(cond->Eval(ctx))) return ExecBody(body, ctx, out);
    }
    return ExecBody(else_body, ctx, out);
  }
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body else_body;
};

struct ForStmt : Stmt {
  using Stmt::Stmt;
  Flow Exec(Context& ctx, std::string* out) const override {
    const Value seq = iter->Eval(ctx);
    std::vector<Value> items = Iterate(seq, line);
    ScopeGuard scope(ctx);
    if (filter) {
      // `for x in y if c`: the condition sees the loop variables; loop.* counts what passes.
      std::vector<Value> kept;
      for (Value& item : items) {
        Bind(ctx, item);
        if (Truthy(filter->Eval(ctx))) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    if (items.empty()) return ExecBody(else_body, ctx, out);
    const int64_t n = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < n; ++i) {
      ctx.Step(line);
      Bind(ctx, items[i]);
      if (!uses_loop) {
        if (ExecBody(body, ctx, out) == Flow::kBreak) break;
        continue;
      }
      Json loop = {
          {"index", i + 1},  {"index0", i},        {"revindex", n - i}, {"revindex0", n - i - 1},
          {"first", i == 0}, {"last", i == n - 1}, {"length", n},       {"depth", 1},
          {"depth0", 0}};
      if (i > 0) loop["previtem"] = ToJson(items[i - 1], line);
      if (i + 1 < n) loop["nextitem"] = ToJson(items[i + 1], line);
      ctx.Set("loop", Value::Of(std::move(loop)));
      const Flow f = ExecBody(body, ctx, out);
      if (f == Flow::kBreak) break;
    }
    return Flow::kNormal;
  }
  void Bind(Context& ctx, const Value& item) const {
    if (targets.size() == 1) {
      ctx.Set(targets[0], item);
      return;
    }
    if (!item.is_json() || !item.json.is_array() || item.json.size() != targets.size()) {
      Fail(line,
           absl::StrCat("cannot unpack ", TypeName(item), " into ", targets.size(), " names"));
    }
    for (size_t k = 0; k < targets.size(); ++k) ctx.Set(targets[k], Value::Of(item.json[k]));
  }
  std::vector<std::string> targets;
  ExprPtr iter, filter;
  Body body, else_body;
  bool uses_loop = true;  // false when nothing inside names `loop`: skip building it
};

struct SetStmt : Stmt {
  using Stmt::Stmt;
  Flow Exec(Context& ctx, std::string* out) const override {
    Value v;
    if (value) {
      v = value->Eval(ctx);
    } else {
      std::string captured;  // {% set x %}...{% endset %}
      ExecBody(body, ctx, &captured);
      v = Value::Of(captured);
    }
    (void)out;
    if (!attr.empty()) {
      const Value ns = ctx.Lookup(targets[0]);
      if (ns.kind != Value::Kind::kNamespace) {
        Fail(line,
             absl::StrCat("cannot assign attribute on non-namespace object '", targets[0], "'"));
      }
      (*ns.ns)[attr] = ToJson(v, line);
      return Flow::kNormal;
    }
    if (targets.size() == 1) {
      ctx.Set(targets[0], std::move(v));
      return Flow::kNormal;
    }
    if (!v.is_json() || !v.json.is_array() || v.json.size() != targets.size()) {
      Fail(line, "cannot unpack the value into the names of the set");
    }
    for (size_t k = 0; k < targets.size(); ++k) ctx.Set(targets[k], Value::Of(v.json[k]));
    return Flow::kNormal;
  }
  std::vector<std::string> targets;
  std::string attr;  // `set ns.attr = ...`
  ExprPtr value;
  Body body;
};

struct LoopControl : Stmt {
  LoopControl(int l, Flow f) : Stmt(l), flow(f) {}
  Flow Exec(Context&, std::string*) const override { return flow; }
  Flow flow;
};

struct BodyStmt : Stmt {  // {% generation %} ... {% endgeneration %}: renders its body
  using Stmt::Stmt;
  Flow Exec(Context& ctx, std::string* out) const override { return ExecBody(body, ctx, out); }
  Body body;
};

struct MacroDef {
  std::string name;
  std::vector<std::pair<std::string, ExprPtr>> params;  // default expression or null
  Body body;
};

struct MacroStmt : Stmt {
  using Stmt::Stmt;
  Flow Exec(Context& ctx, std::string*) const override {
    const MacroDef* m = def.get();
    ctx.Set(m->name, Value::Func(m->name, [m](Args& args, Context& c, int line) -> Value {
              if (++c.depth > 64) Fail(line, "macro recursion too deep");
              c.Step(line);
              ScopeGuard scope(c);
              if (args.pos.size() > m->params.size())
                Fail(line, absl::StrCat("too many arguments to macro ", m->name));
              for (size_t i = 0; i < m->params.size(); ++i) {
                const auto& [pname, def_expr] = m->params[i];
                const Value* a = args.Get(i, pname.c_str());
                if (a) {
                  c.Set(pname, *a);
                } else if (def_expr) {
                  c.Set(pname, def_expr->Eval(c));
                } else {
                  c.Set(pname, Value::Undefined(pname));
                }
              }
              std::string out;
              ExecBody(m->body, c, &out);
              --c.depth;
              return Value::Of(out);
            }));
    return Flow::kNormal;
  }
  std::shared_ptr<MacroDef> def;
};

// ---------------------------------------------------------------------------------------------
// Parser.

const std::set<std::string>& KnownFilters() {
  static const auto* const k = new std::set<std::string>{
      "abs",     "capitalize", "count",  "d",      "default",    "dictsort",   "first",
      "float",   "int",        "items",  "join",   "last",       "length",     "list",
      "lower",   "map",        "max",    "min",    "reject",     "rejectattr", "replace",
      "reverse", "round",      "safe",   "select", "selectattr", "sort",       "string",
      "sum",     "title",      "tojson", "trim",   "unique",     "upper",      "wordcount"};
  return *k;
}

const std::set<std::string>& KnownTests() {
  static const auto* const k = new std::set<std::string>{
      "boolean", "callable", "defined",  "divisibleby", "eq",   "equalto",   "even",
      "false",   "float",    "ge",       "gt",          "in",   "integer",   "iterable",
      "le",      "lower",    "lt",       "mapping",     "ne",   "none",      "number",
      "odd",     "sameas",   "sequence", "string",      "true", "undefined", "upper",
      "==",      "!=",       "<",        ">",           "<=",   ">="};
  return *k;
}

class Parser {
 public:
  explicit Parser(std::vector<Piece> pieces) : pieces_(std::move(pieces)) {}

  Body ParseTemplate() {
    Body body = ParseBody({});
    if (at_ < pieces_.size()) {
      Fail(pieces_[at_].line, absl::StrCat("unexpected '", pieces_[at_].tokens[0].text, "'"));
    }
    return body;
  }

 private:
  // Statements until a {% tag %} whose name is in `ends` (left unconsumed) or the end.
  Body ParseBody(const std::set<std::string>& ends) {
    Body body;
    while (at_ < pieces_.size()) {
      Piece& p = pieces_[at_];
      if (p.type == Piece::Type::kText) {
        body.push_back(std::make_unique<TextStmt>(p.line, p.text));
        ++at_;
        continue;
      }
      if (p.type == Piece::Type::kExpr) {
        StartTokens(p);
        ExprPtr e = ParseExpr();
        ExpectEnd();
        body.push_back(std::make_unique<OutputStmt>(p.line, std::move(e)));
        ++at_;
        continue;
      }
      if (p.tokens.empty() || p.tokens[0].type != Token::Type::kName)
        Fail(p.line, "empty or malformed tag");
      const std::string& tag = p.tokens[0].text;
      if (ends.count(tag)) return body;
      body.push_back(ParseStatement(p));
    }
    if (!ends.empty()) {
      std::string expected;
      for (const std::string& e : ends)
        absl::StrAppend(&expected, expected.empty() ? "" : " or ", "'", e, "'");
      Fail(pieces_.empty() ? 1 : pieces_.back().line,
           absl::StrCat("unexpected end of template, expected ", expected));
    }
    return body;
  }

  // Consumes the closing tag `name` (no arguments).
  void Close(const std::string& name) {
    Piece& p = pieces_[at_];
    StartTokens(p);
    ExpectName(name);
    ExpectEnd();
    ++at_;
  }

  std::string CurrentTag() const { return pieces_[at_].tokens[0].text; }

  StmtPtr ParseStatement(Piece& p) {
    NestingGuard guard(this);
    StartTokens(p);
    const int line = p.line;
    const std::string tag = Next().text;
    if (tag == "if") {
      auto s = std::make_unique<IfStmt>(line);
      ExprPtr cond = ParseExpr();
      ExpectEnd();
      ++at_;
      while (true) {
        Body body = ParseBody({"elif", "else", "endif"});
        s->branches.emplace_back(std::move(cond), std::move(body));
        const std::string t = CurrentTag();
        if (t == "elif") {
          StartTokens(pieces_[at_]);
          Next();
          cond = ParseExpr();
          ExpectEnd();
          ++at_;
          continue;
        }
        if (t == "else") {
          Close("else");
          s->else_body = ParseBody({"endif"});
        }
        Close("endif");
        return s;
      }
    }
    if (tag == "for") {
      auto s = std::make_unique<ForStmt>(line);
      s->targets.push_back(ExpectIdent());
      while (PeekOp(",")) {
        Next();
        s->targets.push_back(ExpectIdent());
      }
      ExpectName("in");
      s->iter = ParseOr(/*allow_ternary_if=*/false);
      if (PeekName("if")) {
        Next();
        s->filter = ParseOr(false);
      }
      if (PeekName("recursive")) Fail(line, "unsupported construct: recursive for loop");
      ExpectEnd();
      ++at_;
      s->uses_loop = BodyMentionsLoop();
      s->body = ParseBody({"else", "endfor"});
      if (CurrentTag() == "else") {
        Close("else");
        s->else_body = ParseBody({"endfor"});
      }
      Close("endfor");
      return s;
    }
    if (tag == "set") {
      auto s = std::make_unique<SetStmt>(line);
      s->targets.push_back(ExpectIdent());
      if (PeekOp(".")) {
        Next();
        s->attr = ExpectIdent();
      }
      while (PeekOp(",")) {
        Next();
        s->targets.push_back(ExpectIdent());
      }
      if (PeekOp("=")) {
        Next();
        s->value = ParseTuple();
        ExpectEnd();
        ++at_;
        return s;
      }
      ExpectEnd();
      ++at_;
      s->body = ParseBody({"endset"});
      Close("endset");
      return s;
    }
    if (tag == "macro") {
      auto s = std::make_unique<MacroStmt>(line);
      s->def = std::make_shared<MacroDef>();
      s->def->name = ExpectIdent();
      ExpectOp("(");
      while (!PeekOp(")")) {
        std::string name = ExpectIdent();
        ExprPtr def;
        if (PeekOp("=")) {
          Next();
          def = ParseExpr();
        }
        s->def->params.emplace_back(std::move(name), std::move(def));
        if (!PeekOp(",")) break;
        Next();
      }
      ExpectOp(")");
      ExpectEnd();
      ++at_;
      s->def->body = ParseBody({"endmacro"});
      Close("endmacro");
      return s;
    }
    if (tag == "break" || tag == "continue") {
      ExpectEnd();
      ++at_;
      return std::make_unique<LoopControl>(line, tag == "break" ? Flow::kBreak : Flow::kContinue);
    }
    if (tag == "generation") {
      ExpectEnd();
      ++at_;
      auto s = std::make_unique<BodyStmt>(line);
      s->body = ParseBody({"endgeneration"});
      Close("endgeneration");
      return s;
    }
    Fail(line, absl::StrCat("unsupported construct: {% ", tag, " %}"));
  }

  // Whether any tag between here and the matching endfor uses the name `loop` (then the loop
  // object is built on each iteration; most loops never read it).
  bool BodyMentionsLoop() const {
    int depth = 0;
    for (size_t i = at_; i < pieces_.size(); ++i) {
      const Piece& p = pieces_[i];
      if (p.type == Piece::Type::kText || p.tokens.empty()) continue;
      if (p.type == Piece::Type::kStmt && p.tokens[0].type == Token::Type::kName) {
        if (p.tokens[0].text == "for") ++depth;
        if (p.tokens[0].text == "endfor" && depth-- == 0) return false;
      }
      for (const Token& t : p.tokens) {
        if (t.type == Token::Type::kName && t.text == "loop") return true;
      }
    }
    return false;
  }

  // --- token cursor over one tag ---
  void StartTokens(Piece& p) {
    toks_ = &p.tokens;
    tok_ = 0;
    line_ = p.line;
  }
  bool AtEnd() const { return tok_ >= toks_->size(); }
  const Token& Peek() const {
    if (AtEnd()) Fail(line_, "unexpected end of tag");
    return (*toks_)[tok_];
  }
  const Token& Next() {
    const Token& t = Peek();
    ++tok_;
    return t;
  }
  bool PeekOp(const char* op) const {
    return !AtEnd() && (*toks_)[tok_].type == Token::Type::kOp && (*toks_)[tok_].text == op;
  }
  bool PeekName(const char* name) const {
    return !AtEnd() && (*toks_)[tok_].type == Token::Type::kName && (*toks_)[tok_].text == name;
  }
  void ExpectOp(const char* op) {
    if (!PeekOp(op)) Fail(line_, absl::StrCat("expected '", op, "'", Found()));
    ++tok_;
  }
  void ExpectName(const std::string& name) {
    if (!PeekName(name.c_str())) Fail(line_, absl::StrCat("expected '", name, "'", Found()));
    ++tok_;
  }
  std::string ExpectIdent() {
    if (AtEnd() || Peek().type != Token::Type::kName)
      Fail(line_, absl::StrCat("expected a name", Found()));
    return Next().text;
  }
  void ExpectEnd() {
    if (!AtEnd()) Fail(line_, absl::StrCat("expected end of tag", Found()));
  }
  std::string Found() const {
    if (AtEnd()) return ", found end of tag";
    return absl::StrCat(", found '", (*toks_)[tok_].text, "'");
  }
  int Line() const { return AtEnd() ? line_ : (*toks_)[tok_].line; }

  // --- expressions (Jinja's precedence) ---
  ExprPtr ParseExpr() { return ParseOr(true); }

  // An expression or a bare tuple `a, b` (set's right side).
  ExprPtr ParseTuple() {
    ExprPtr first = ParseExpr();
    if (!PeekOp(",")) return first;
    auto list = std::make_unique<ListExpr>(first->line);
    list->items.push_back(std::move(first));
    while (PeekOp(",")) {
      Next();
      if (AtEnd()) break;
      list->items.push_back(ParseExpr());
    }
    return list;
  }

  // Nesting bound: templates come with model files, and a deeply nested one must be an error,
  // not a stack overflow.
  struct NestingGuard {
    explicit NestingGuard(Parser* p) : parser(p) {
      if (++parser->nesting_ > 200) Fail(parser->Line(), "template nested too deeply");
    }
    ~NestingGuard() { --parser->nesting_; }
    Parser* parser;
  };

  ExprPtr ParseOr(bool allow_ternary_if) {
    NestingGuard guard(this);
    ExprPtr left = ParseAnd();
    while (PeekName("or")) {
      const int line = Line();
      Next();
      left = std::make_unique<AndOr>(line, false, std::move(left), ParseAnd());
    }
    if (allow_ternary_if && PeekName("if")) {
      const int line = Line();
      Next();
      ExprPtr cond = ParseOr(false);
      ExprPtr otherwise;
      if (PeekName("else")) {
        Next();
        otherwise = ParseOr(true);
      }
      return std::make_unique<Conditional>(line, std::move(left), std::move(cond),
                                           std::move(otherwise));
    }
    return left;
  }

  ExprPtr ParseAnd() {
    ExprPtr left = ParseNot();
    while (PeekName("and")) {
      const int line = Line();
      Next();
      left = std::make_unique<AndOr>(line, true, std::move(left), ParseNot());
    }
    return left;
  }

  ExprPtr ParseNot() {
    if (PeekName("not")) {
      const int line = Line();
      Next();
      return std::make_unique<Not>(line, ParseNot());
    }
    return ParseCompare();
  }

  ExprPtr ParseCompare() {
    ExprPtr left = ParseMath1();
    while (true) {
      const int line = Line();
      std::string op;
      if (!AtEnd() && Peek().type == Token::Type::kOp &&
          (Peek().text == "==" || Peek().text == "!=" || Peek().text == "<" || Peek().text == ">" ||
           Peek().text == "<=" || Peek().text == ">=")) {
        op = Next().text;
      } else if (PeekName("in")) {
        Next();
        op = "in";
      } else if (PeekName("not") && tok_ + 1 < toks_->size() && (*toks_)[tok_ + 1].text == "in" &&
                 (*toks_)[tok_ + 1].type == Token::Type::kName) {
        tok_ += 2;
        op = "notin";
      } else {
        return left;
      }
      // Chained comparisons (a < b < c) are rare in templates; evaluate pairwise left to right.
      left = std::make_unique<BinOp>(line, op, std::move(left), ParseMath1());
    }
  }

  ExprPtr ParseMath1() {
    ExprPtr left = ParseConcat();
    while (PeekOp("+") || PeekOp("-")) {
      const int line = Line();
      const std::string op = Next().text;
      left = std::make_unique<BinOp>(line, op, std::move(left), ParseConcat());
    }
    return left;
  }

  ExprPtr ParseConcat() {
    ExprPtr left = ParseMath2();
    while (PeekOp("~")) {
      const int line = Line();
      Next();
      left = std::make_unique<BinOp>(line, "~", std::move(left), ParseMath2());
    }
    return left;
  }

  ExprPtr ParseMath2() {
    ExprPtr left = ParsePow();
    while (PeekOp("*") || PeekOp("/") || PeekOp("//") || PeekOp("%")) {
      const int line = Line();
      const std::string op = Next().text;
      left = std::make_unique<BinOp>(line, op, std::move(left), ParsePow());
    }
    return left;
  }

  ExprPtr ParsePow() {
    ExprPtr left = ParseUnary(true);
    while (PeekOp("**")) {
      const int line = Line();
      Next();
      left = std::make_unique<BinOp>(line, "**", std::move(left), ParseUnary(true));
    }
    return left;
  }

  ExprPtr ParseUnary(bool with_filter) {
    const int line = Line();
    ExprPtr node;
    if (PeekOp("-")) {
      Next();
      node = std::make_unique<Neg>(line, ParseUnary(false));
    } else if (PeekOp("+")) {
      Next();
      node = ParseUnary(false);
    } else {
      node = ParsePrimary();
    }
    node = ParsePostfix(std::move(node));
    if (with_filter) node = ParseFilterAndTest(std::move(node));
    return node;
  }

  ExprPtr ParsePrimary() {
    const int line = Line();
    const Token& t = Next();
    switch (t.type) {
      case Token::Type::kString: {
        std::string s = t.text;
        while (!AtEnd() && Peek().type == Token::Type::kString) s += Next().text;  // 'a' 'b'
        return std::make_unique<Literal>(line, Json(s));
      }
      case Token::Type::kInt:
        return std::make_unique<Literal>(line, Json(t.i));
      case Token::Type::kFloat:
        return std::make_unique<Literal>(line, Json(t.f));
      case Token::Type::kName:
        if (t.text == "true" || t.text == "True")
          return std::make_unique<Literal>(line, Json(true));
        if (t.text == "false" || t.text == "False")
          return std::make_unique<Literal>(line, Json(false));
        if (t.text == "none" || t.text == "None") return std::make_unique<Literal>(line, Json());
        return std::make_unique<Name>(line, t.text);
      case Token::Type::kOp:
        break;
    }
    if (t.text == "(") {
      if (PeekOp(")")) {
        Next();
        return std::make_unique<ListExpr>(line);  // () : an empty tuple
      }
      ExprPtr e = ParseExpr();
      if (PeekOp(",")) {
        auto list = std::make_unique<ListExpr>(line);
        list->items.push_back(std::move(e));
        while (PeekOp(",")) {
          Next();
          if (PeekOp(")")) break;
          list->items.push_back(ParseExpr());
        }
        e = std::move(list);
      }
      ExpectOp(")");
      return e;
    }
    if (t.text == "[") {
      auto list = std::make_unique<ListExpr>(line);
      while (!PeekOp("]")) {
        list->items.push_back(ParseExpr());
        if (!PeekOp(",")) break;
        Next();
      }
      ExpectOp("]");
      return list;
    }
    if (t.text == "{") {
      auto dict = std::make_unique<DictExpr>(line);
      while (!PeekOp("}")) {
        ExprPtr k = ParseExpr();
        ExpectOp(":");
        ExprPtr v = ParseExpr();
        dict->items.emplace_back(std::move(k), std::move(v));
        if (!PeekOp(",")) break;
        Next();
      }
      ExpectOp("}");
      return dict;
    }
    Fail(line, absl::StrCat("unexpected '", t.text, "'"));
  }

  ExprPtr ParsePostfix(ExprPtr node) {
    while (!AtEnd()) {
      const int line = Line();
      if (PeekOp(".")) {
        Next();
        if (!AtEnd() && Peek().type == Token::Type::kInt) {
          node = std::make_unique<Index>(line, std::move(node),
                                         std::make_unique<Literal>(line, Json(Next().i)));
        } else {
          node = std::make_unique<Attr>(line, std::move(node), ExpectIdent());
        }
      } else if (PeekOp("[")) {
        Next();
        ExprPtr start, stop, step;
        bool is_slice = false;
        if (!PeekOp(":")) start = ParseExpr();
        if (PeekOp(":")) {
          is_slice = true;
          Next();
          if (!PeekOp(":") && !PeekOp("]")) stop = ParseExpr();
          if (PeekOp(":")) {
            Next();
            if (!PeekOp("]")) step = ParseExpr();
          }
        }
        ExpectOp("]");
        if (is_slice) {
          auto s = std::make_unique<Slice>(line, std::move(node));
          s->start = std::move(start);
          s->stop = std::move(stop);
          s->step = std::move(step);
          node = std::move(s);
        } else {
          node = std::make_unique<Index>(line, std::move(node), std::move(start));
        }
      } else if (PeekOp("(")) {
        Next();
        auto call = std::make_unique<CallExpr>(line, std::move(node));
        ParseCallArgs(&call->pos, &call->kw);
        node = std::move(call);
      } else {
        break;
      }
    }
    return node;
  }

  // After "(": arguments up to and including ")".
  void ParseCallArgs(std::vector<ExprPtr>* pos, std::vector<std::pair<std::string, ExprPtr>>* kw) {
    while (!PeekOp(")")) {
      if (!AtEnd() && Peek().type == Token::Type::kName && tok_ + 1 < toks_->size() &&
          (*toks_)[tok_ + 1].type == Token::Type::kOp && (*toks_)[tok_ + 1].text == "=") {
        std::string name = Next().text;
        Next();
        kw->emplace_back(std::move(name), ParseExpr());
      } else {
        if (!kw->empty()) Fail(Line(), "positional argument follows keyword argument");
        pos->push_back(ParseExpr());
      }
      if (!PeekOp(",")) break;
      Next();
    }
    ExpectOp(")");
  }

  ExprPtr ParseFilterAndTest(ExprPtr node) {
    while (true) {
      const int line = Line();
      if (PeekOp("|")) {
        Next();
        std::string name = ExpectIdent();
        if (!KnownFilters().count(name))
          Fail(line, absl::StrCat("unsupported filter '", name, "'"));
        auto f = std::make_unique<FilterExpr>(line, std::move(node), name);
        if (PeekOp("(")) {
          Next();
          ParseCallArgs(&f->pos, &f->kw);
        }
        node = std::move(f);
      } else if (PeekName("is")) {
        Next();
        bool negate = false;
        if (PeekName("not")) {
          Next();
          negate = true;
        }
        std::string name;
        if (!AtEnd() && Peek().type == Token::Type::kOp) {
          name = Next().text;  // is == x, is < x ...
        } else {
          name = ExpectIdent();
        }
        if (!KnownTests().count(name)) Fail(line, absl::StrCat("unsupported test '", name, "'"));
        auto t = std::make_unique<TestExpr>(line, std::move(node), name, negate);
        if (PeekOp("(")) {
          Next();
          std::vector<std::pair<std::string, ExprPtr>> kw;
          ParseCallArgs(&t->pos, &kw);
        } else if (!AtEnd() &&
                   (Peek().type != Token::Type::kName ||
                    (Peek().text != "and" && Peek().text != "or" && Peek().text != "else" &&
                     Peek().text != "if" && Peek().text != "is" && Peek().text != "in" &&
                     Peek().text != "not")) &&
                   !(Peek().type == Token::Type::kOp && Peek().text != "(" && Peek().text != "[" &&
                     Peek().text != "{" && Peek().text != "-")) {
          // `is sameas false`, `is divisibleby 3`: one argument without parentheses.
          t->pos.push_back(ParseUnary(false));
        }
        node = std::move(t);
      } else {
        return node;
      }
    }
  }

  std::vector<Piece> pieces_;
  int nesting_ = 0;
  size_t at_ = 0;
  std::vector<Token>* toks_ = nullptr;
  size_t tok_ = 0;
  int line_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Attributes, methods, filters, tests.

std::string PyStrip(const std::string& s, const Value* chars, bool left, bool right) {
  const std::u32string u = ToU32(s);
  std::u32string set;
  const bool whitespace = !chars || chars->is_none() || chars->undefined();
  if (!whitespace) set = ToU32(chars->is_string() ? chars->str() : ToText(*chars));
  auto strip_it = [&](char32_t c) {
    return whitespace ? IsPySpace(c) : set.find(c) != std::u32string::npos;
  };
  size_t b = 0, e = u.size();
  if (left) {
    while (b < e && strip_it(u[b])) ++b;
  }
  if (right) {
    while (e > b && strip_it(u[e - 1])) --e;
  }
  return FromU32(u.substr(b, e - b));
}

Json PySplit(const std::string& s, const Value* sep, const Value* maxsplit_v, int line) {
  int64_t maxsplit = -1;
  if (maxsplit_v && !maxsplit_v->undefined()) maxsplit = ToInt(*maxsplit_v, line, "maxsplit");
  Json out = Json::array();
  if (!sep || sep->is_none() || sep->undefined()) {
    // Runs of whitespace, none empty.
    const std::u32string u = ToU32(s);
    size_t i = 0;
    while (true) {
      while (i < u.size() && IsPySpace(u[i])) ++i;
      if (i >= u.size()) break;
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
        size_t e = u.size();
        while (e > i && IsPySpace(u[e - 1])) --e;
        out.push_back(FromU32(u.substr(i, e - i)));
        break;
      }
      size_t j = i;
      while (j < u.size() && !IsPySpace(u[j])) ++j;
      out.push_back(FromU32(u.substr(i, j - i)));
      i = j;
    }
    return out;
  }
  if (!sep->is_string()) Fail(line, "split separator must be a string");
  const std::string& d = sep->str();
  if (d.empty()) Fail(line, "empty separator");
  size_t start = 0;
  while (true) {
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) break;
    const size_t k = s.find(d, start);
    if (k == std::string::npos) break;
    out.push_back(s.substr(start, k - start));
    start = k + d.size();
  }
  out.push_back(s.substr(start));
  return out;
}

std::string PyReplace(const std::string& s, const std::string& from, const std::string& to,
                      int64_t count) {
  if (from.empty()) {
    // Python inserts `to` between every character (and at both ends).
    const std::u32string u = ToU32(s);
    std::string out;
    int64_t n = 0;
    for (size_t i = 0; i <= u.size(); ++i) {
      if (count < 0 || n < count) {
        out += to;
        ++n;
      }
      if (i < u.size()) internal::AppendUtf8(u[i], &out);
    }
    return out;
  }
  std::string out;
  size_t start = 0;
  int64_t n = 0;
  while (count < 0 || n < count) {
    const size_t k = s.find(from, start);
    if (k == std::string::npos) break;
    out.append(s, start, k - start);
    out += to;
    start = k + from.size();
    ++n;
  }
  out.append(s, start, std::string::npos);
  return out;
}

std::string CaseMap(const std::string& s, int mode) {  // 0 lower, 1 upper, 2 title, 3 capitalize
  const std::u32string u = ToU32(s);
  std::string out;
  bool prev_cased = false;
  for (size_t i = 0; i < u.size(); ++i) {
    char32_t c = u[i];
    char32_t m = c;
    if (mode == 0) m = u_tolower(c);
    if (mode == 1) m = u_toupper(c);
    if (mode == 2) m = prev_cased ? u_tolower(c) : u_totitle(c);
    if (mode == 3) m = i == 0 ? u_totitle(c) : u_tolower(c);
    prev_cased = u_hasBinaryProperty(c, UCHAR_CASED) || u_hasBinaryProperty(c, UCHAR_CASE_IGNORABLE)
                     ? (u_hasBinaryProperty(c, UCHAR_CASED) ||
                        (prev_cased && u_hasBinaryProperty(c, UCHAR_CASE_IGNORABLE)))
                     : false;
    internal::AppendUtf8(m, &out);
  }
  return out;
}

bool StartsOrEnds(const std::string& s, const Value& arg, bool starts, int line) {
  auto one = [&](const Json& p) {
    if (!p.is_string()) Fail(line, "startswith/endswith argument must be a string");
    const std::string& x = p.get_ref<const std::string&>();
    if (x.size() > s.size()) return false;
    return starts ? s.compare(0, x.size(), x) == 0
                  : s.compare(s.size() - x.size(), x.size(), x) == 0;
  };
  if (arg.is_json() && arg.json.is_array()) {
    for (const Json& p : arg.json) {
      if (one(p)) return true;
    }
    return false;
  }
  if (!arg.is_json()) Fail(line, "startswith/endswith argument must be a string");
  return one(arg.json);
}

Value StringMethod(const std::string& self, const std::string& name) {
  static const std::set<std::string> kMethods = {
      "startswith", "endswith",   "split",   "rsplit",  "strip",      "lstrip", "rstrip",
      "replace",    "upper",      "lower",   "title",   "capitalize", "find",   "count",
      "join",       "splitlines", "isdigit", "isalpha", "isspace",    "format"};
  if (!kMethods.count(name)) return Value::Undefined(absl::StrCat("str.", name));
  return Value::Func("str." + name, [self, name](Args& a, Context&, int l) -> Value {
    const Value* a0 = a.Get(0, "");
    if (name == "startswith" || name == "endswith") {
      if (!a0) Fail(l, absl::StrCat(name, "() takes at least 1 argument"));
      return Value::Of(StartsOrEnds(self, *a0, name == "startswith", l));
    }
    if (name == "split") return Value::Of(PySplit(self, a.Get(0, "sep"), a.Get(1, "maxsplit"), l));
    if (name == "rsplit") {
      const Value* mx = a.Get(1, "maxsplit");
      if (mx && !mx->undefined() && ToInt(*mx, l, "maxsplit") >= 0) {
        Fail(l, "unsupported construct: rsplit with maxsplit");
      }
      return Value::Of(PySplit(self, a.Get(0, "sep"), nullptr, l));
    }
    if (name == "strip") return Value::Of(PyStrip(self, a0, true, true));
    if (name == "lstrip") return Value::Of(PyStrip(self, a0, true, false));
    if (name == "rstrip") return Value::Of(PyStrip(self, a0, false, true));
    if (name == "replace") {
      const Value* b = a.Get(1, "");
      if (!a0 || !b || !a0->is_string() || !b->is_string()) Fail(l, "replace() takes two strings");
      const Value* c = a.Get(2, "count");
      return Value::Of(PyReplace(self, a0->str(), b->str(), c ? ToInt(*c, l, "count") : -1));
    }
    if (name == "upper") return Value::Of(CaseMap(self, 1));
    if (name == "lower") return Value::Of(CaseMap(self, 0));
    if (name == "title") return Value::Of(CaseMap(self, 2));
    if (name == "capitalize") return Value::Of(CaseMap(self, 3));
    if (name == "find" || name == "count") {
      if (!a0 || !a0->is_string()) Fail(l, absl::StrCat(name, "() takes a string"));
      const std::string& sub = a0->str();
      if (name == "find") {
        const size_t k = self.find(sub);
        if (k == std::string::npos) return Value::Of(-1);
        return Value::Of(static_cast<int64_t>(ToU32(self.substr(0, k)).size()));
      }
      if (sub.empty()) return Value::Of(static_cast<int64_t>(ToU32(self).size() + 1));
      int64_t n = 0;
      for (size_t k = self.find(sub); k != std::string::npos; k = self.find(sub, k + sub.size()))
        ++n;
      return Value::Of(n);
    }
    if (name == "join") {
      if (!a0) Fail(l, "join() takes an iterable");
      std::string out;
      bool first = true;
      for (const Value& v : Iterate(*a0, l)) {
        if (!v.is_string()) Fail(l, "join() expects strings");
        if (!first) out += self;
        first = false;
        out += v.str();
      }
      return Value::Of(out);
    }
    if (name == "splitlines") {
      Json out = Json::array();
      size_t start = 0;
      for (size_t i = 0; i < self.size(); ++i) {
        if (self[i] == '\n' || self[i] == '\r') {
          out.push_back(self.substr(start, i - start));
          if (self[i] == '\r' && i + 1 < self.size() && self[i + 1] == '\n') ++i;
          start = i + 1;
        }
      }
      if (start < self.size()) out.push_back(self.substr(start));
      return Value::Of(std::move(out));
    }
    if (name == "isdigit" || name == "isalpha" || name == "isspace") {
      const std::u32string u = ToU32(self);
      bool ok = !u.empty();
      for (char32_t c : u) {
        if (name == "isdigit") ok = ok && u_isdigit(c);
        if (name == "isalpha") ok = ok && u_isalpha(c);
        if (name == "isspace") ok = ok && IsPySpace(c);
      }
      return Value::Of(ok);
    }
    Fail(l, absl::StrCat("unsupported construct: str.", name, "()"));
  });
}

Value DictMethod(const Json& self, const std::string& name) {
  if (name != "items" && name != "keys" && name != "values" && name != "get") {
    return Value::Undefined(name);
  }
  return Value::Func("dict." + name, [self, name](Args& a, Context&, int l) -> Value {
    if (name == "get") {
      const Value* k = a.Get(0, "key");
      if (!k) Fail(l, "get() takes a key");
      if (k->is_string()) {
        auto it = self.find(k->str());
        if (it != self.end()) return Value::Of(*it);
      }
      const Value* d = a.Get(1, "default");
      return d ? *d : Value::Of(Json());
    }
    Json out = Json::array();
    for (auto it = self.begin(); it != self.end(); ++it) {
      if (name == "items") out.push_back(Json::array({it.key(), it.value()}));
      if (name == "keys") out.push_back(it.key());
      if (name == "values") out.push_back(it.value());
    }
    return Value::Of(std::move(out));
  });
}

Value GetAttr(const Value& obj, const std::string& name, int line) {
  if (obj.undefined()) FailUndefined(obj, line);
  if (obj.kind == Value::Kind::kNamespace) {
    auto it = obj.ns->find(name);
    if (it == obj.ns->end()) return Value::Undefined(name);
    return Value::Of(*it);
  }
  if (obj.is_json()) {
    const Json& j = obj.json;
    if (j.is_object()) {
      // Jinja tries the Python attribute first: d.items is the method even when a key "items"
      // exists.
      Value m = DictMethod(j, name);
      if (!m.undefined()) return m;
      auto it = j.find(name);
      if (it != j.end()) return Value::Of(*it);
      return Value::Undefined(name);
    }
    if (j.is_string()) return StringMethod(j.get<std::string>(), name);
  }
  return Value::Undefined(name);
}

Value GetItem(const Value& obj, const Value& key, int line) {
  if (obj.undefined()) FailUndefined(obj, line);
  if (obj.is_json()) {
    const Json& j = obj.json;
    if (j.is_object()) {
      if (key.is_string()) {
        auto it = j.find(key.str());
        if (it != j.end()) return Value::Of(*it);
        Value m = DictMethod(j, key.str());
        if (!m.undefined()) return m;
      }
      return Value::Undefined(key.is_string() ? key.str() : ToText(key));
    }
    if (j.is_array() || j.is_string()) {
      if (key.is_string()) return GetAttr(obj, key.str(), line);
      if (!key.is_integer())
        Fail(line, absl::StrCat("indices must be integers, not ", TypeName(key)));
      int64_t i = key.json.get<int64_t>();
      if (j.is_array()) {
        const int64_t n = static_cast<int64_t>(j.size());
        if (i < 0) i += n;
        if (i < 0 || i >= n) return Value::Undefined("list index out of range");
        return Value::Of(j[i]);
      }
      const std::u32string u = ToU32(j.get<std::string>());
      const int64_t n = static_cast<int64_t>(u.size());
      if (i < 0) i += n;
      if (i < 0 || i >= n) return Value::Undefined("string index out of range");
      return Value::Of(FromU32(u.substr(i, 1)));
    }
  }
  if (obj.kind == Value::Kind::kNamespace && key.is_string()) return GetAttr(obj, key.str(), line);
  return Value::Undefined(ToText(key));
}

Value CallTest(const std::string& name, const Value& v, const Value* arg, int line) {
  Args a;
  if (arg) a.pos.push_back(*arg);
  return Value::Of(ApplyTest(name, v, a, line));
}

bool ApplyTest(const std::string& name, const Value& v, Args& args, int line) {
  const Value* arg = args.Get(0, "");
  auto need_arg = [&]() -> const Value& {
    if (!arg) Fail(line, absl::StrCat("test '", name, "' needs an argument"));
    return *arg;
  };
  const bool json = v.is_json();
  if (name == "defined") return !v.undefined();
  if (name == "undefined") return v.undefined();
  if (name == "none") return v.is_none();
  if (name == "string") return v.is_string();
  if (name == "mapping") return (json && v.json.is_object()) || v.kind == Value::Kind::kNamespace;
  if (name == "iterable")
    return json && (v.json.is_array() || v.json.is_object() || v.json.is_string());
  if (name == "sequence")
    return json && (v.json.is_array() || v.json.is_object() || v.json.is_string());
  if (name == "number") return json && (v.json.is_number() || v.json.is_boolean());
  if (name == "integer") return json && v.json.is_number_integer();
  if (name == "float") return json && v.json.is_number_float();
  if (name == "boolean") return json && v.json.is_boolean();
  if (name == "true") return json && v.json.is_boolean() && v.json.get<bool>();
  if (name == "false") return json && v.json.is_boolean() && !v.json.get<bool>();
  if (name == "callable") return v.kind == Value::Kind::kCallable;
  if (name == "lower") return v.is_string() && CaseMap(v.str(), 0) == v.str();
  if (name == "upper") return v.is_string() && CaseMap(v.str(), 1) == v.str();
  if (name == "odd" || name == "even") {
    const int64_t n = ToInt(v, line, name.c_str());
    return ((n % 2) != 0) == (name == "odd");
  }
  if (name == "divisibleby") {
    const int64_t d = ToInt(need_arg(), line, "divisibleby");
    if (d == 0) Fail(line, "division by zero");
    return ToInt(v, line, "divisibleby") % d == 0;
  }
  if (name == "eq" || name == "equalto" || name == "==") return ValueEquals(v, need_arg());
  if (name == "ne" || name == "!=") return !ValueEquals(v, need_arg());
  if (name == "sameas") {
    const Value& o = need_arg();
    // `is sameas` is identity: for the singletons (None, True, False) it is equality.
    if (!v.is_json() || !o.is_json()) return false;
    if (v.json.type() != o.json.type()) return false;
    return (v.json.is_null() || v.json.is_boolean()) && v.json == o.json;
  }
  if (name == "lt" || name == "<") return Compare(v, need_arg(), line) < 0;
  if (name == "le" || name == "<=") return Compare(v, need_arg(), line) <= 0;
  if (name == "gt" || name == ">") return Compare(v, need_arg(), line) > 0;
  if (name == "ge" || name == ">=") return Compare(v, need_arg(), line) >= 0;
  if (name == "in") return Contains(need_arg(), v, line);
  Fail(line, absl::StrCat("unsupported test '", name, "'"));
}

Value Attribute(const Value& item, const std::string& path, int line) {
  // Jinja's attribute="a.b" and attribute="0" forms.
  Value v = item;
  size_t start = 0;
  while (true) {
    const size_t dot = path.find('.', start);
    const std::string part =
        path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    const bool numeric = !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit);
    if (v.undefined()) return v;
    v = numeric ? GetItem(v, Value::Of(std::stoll(part)), line) : GetItem(v, Value::Of(part), line);
    if (dot == std::string::npos) return v;
    start = dot + 1;
  }
}

Value ApplyFilter(const std::string& name, const Value& v, Args& args, Context& ctx, int line) {
  const Value* a0 = args.Get(0, "");
  auto str_arg = [&](size_t i, const char* kw, const std::string& def) -> std::string {
    const Value* a = args.Get(i, kw);
    if (!a || a->undefined()) return def;
    return ToText(*a);
  };
  if (name == "safe") return v;
  if (name == "string") return Value::Of(ToText(v));
  if (name == "length" || name == "count") return Value::Of(Length(v, line));
  if (name == "default" || name == "d") {
    const Value* boolean = args.Get(1, "boolean");
    const bool use_default = v.undefined() || (boolean && Truthy(*boolean) && !Truthy(v));
    if (!use_default) return v;
    const Value* def = args.Get(0, "default_value");
    return def ? *def : Value::Of(std::string());
  }
  if (name == "tojson") {
    std::optional<int> indent;
    if (const Value* i = args.Get(0, "indent"); i && !i->is_none() && !i->undefined()) {
      indent = static_cast<int>(ToInt(*i, line, "indent"));
    }
    std::optional<std::string> item_sep, key_sep;
    if (const Value* s = args.Get(2, "separators");
        s && s->is_json() && s->json.is_array() && s->json.size() == 2) {
      item_sep = s->json[0].get<std::string>();
      key_sep = s->json[1].get<std::string>();
    }
    if (const Value* sk = args.Get(3, "sort_keys"); sk && Truthy(*sk)) {
      Fail(line, "unsupported construct: tojson(sort_keys=true)");
    }
    if (const Value* ea = args.Get(1, "ensure_ascii"); ea && Truthy(*ea)) {
      Fail(line, "unsupported construct: tojson(ensure_ascii=true)");
    }
    if (v.undefined()) Fail(line, "Object of type Undefined is not JSON serializable");
    return Value::Of(PyJsonDumps(ToJson(v, line), indent, item_sep, key_sep));
  }
  if (name == "trim") {
    if (!v.is_string()) return Value::Of(PyStrip(ToText(v), args.Get(0, "chars"), true, true));
    return Value::Of(PyStrip(v.str(), args.Get(0, "chars"), true, true));
  }
  if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
    const int mode = name == "lower" ? 0 : name == "upper" ? 1 : name == "title" ? 2 : 3;
    return Value::Of(CaseMap(ToText(v), mode));
  }
  if (name == "replace") {
    const Value* b = args.Get(1, "new");
    if (!a0 || !b) Fail(line, "replace needs two arguments");
    const Value* c = args.Get(2, "count");
    return Value::Of(
        PyReplace(ToText(v), ToText(*a0), ToText(*b), c ? ToInt(*c, line, "count") : -1));
  }
  if (name == "int") {
    if (v.is_integer()) return v;
    if (v.is_number()) return Value::Of(static_cast<int64_t>(v.json.get<double>()));
    if (v.is_json() && v.json.is_boolean()) return Value::Of(v.json.get<bool>() ? 1 : 0);
    if (v.is_string()) {
      const std::string s = PyStrip(v.str(), nullptr, true, true);
      char* end = nullptr;
      const long long x = std::strtoll(s.c_str(), &end, 10);
      if (!s.empty() && end && *end == 0) return Value::Of(static_cast<int64_t>(x));
      const double d = std::strtod(s.c_str(), &end);
      if (!s.empty() && end && *end == 0) return Value::Of(static_cast<int64_t>(d));
    }
    const Value* def = args.Get(0, "default");
    return def ? *def : Value::Of(0);
  }
  if (name == "float") {
    if (v.is_number()) return Value::Of(v.json.get<double>());
    if (v.is_string()) {
      char* end = nullptr;
      const std::string s = PyStrip(v.str(), nullptr, true, true);
      const double d = std::strtod(s.c_str(), &end);
      if (!s.empty() && end && *end == 0) return Value::Of(d);
    }
    const Value* def = args.Get(0, "default");
    return def ? *def : Value::Of(0.0);
  }
  if (name == "abs") {
    if (v.is_integer()) return Value::Of(std::llabs(v.json.get<int64_t>()));
    if (v.is_number()) return Value::Of(std::fabs(v.json.get<double>()));
    Fail(line, "abs needs a number");
  }
  if (name == "round") {
    if (!v.is_number()) Fail(line, "round needs a number");
    const int64_t precision =
        args.Get(0, "precision") ? ToInt(*args.Get(0, "precision"), line, "precision") : 0;
    const std::string method = str_arg(1, "method", "common");
    const double scale = std::pow(10.0, static_cast<double>(precision));
    const double x = v.json.get<double>() * scale;
    double r = method == "floor" ? std::floor(x) : method == "ceil" ? std::ceil(x) : std::round(x);
    return Value::Of(r / scale);
  }
  // Filters over sequences.
  std::vector<Value> items = Iterate(v, line);
  auto to_list = [&](const std::vector<Value>& vs) {
    Json out = Json::array();
    for (const Value& x : vs) out.push_back(ToJson(x, line));
    return Value::Of(std::move(out));
  };
  if (name == "list") return to_list(items);
  if (name == "first")
    return items.empty() ? Value::Undefined("first of an empty sequence") : items.front();
  if (name == "last")
    return items.empty() ? Value::Undefined("last of an empty sequence") : items.back();
  if (name == "reverse") {
    if (v.is_string()) {
      std::u32string u = ToU32(v.str());
      std::reverse(u.begin(), u.end());
      return Value::Of(FromU32(u));
    }
    std::reverse(items.begin(), items.end());
    return to_list(items);
  }
  if (name == "join") {
    const std::string sep = str_arg(0, "d", "");
    const Value* attr = args.Get(1, "attribute");
    std::string out;
    for (size_t i = 0; i < items.size(); ++i) {
      if (i > 0) out += sep;
      out += ToText(attr ? Attribute(items[i], ToText(*attr), line) : items[i]);
    }
    return Value::Of(out);
  }
  if (name == "items") {
    if (v.undefined()) return Value::Of(Json::array());
    if (!v.is_json() || !v.json.is_object()) Fail(line, "items filter needs a mapping");
    Json out = Json::array();
    for (auto it = v.json.begin(); it != v.json.end(); ++it)
      out.push_back(Json::array({it.key(), it.value()}));
    return Value::Of(std::move(out));
  }
  if (name == "dictsort") {
    if (!v.is_json() || !v.json.is_object()) Fail(line, "dictsort needs a mapping");
    std::vector<std::pair<std::string, Json>> kv;
    for (auto it = v.json.begin(); it != v.json.end(); ++it) kv.emplace_back(it.key(), it.value());
    std::stable_sort(kv.begin(), kv.end(), [](const auto& x, const auto& y) {
      return CaseMap(x.first, 0) < CaseMap(y.first, 0);
    });
    Json out = Json::array();
    for (auto& [k, x] : kv) out.push_back(Json::array({k, x}));
    return Value::Of(std::move(out));
  }
  if (name == "map") {
    std::vector<Value> out;
    if (const Value* attr = args.Get(99, "attribute")) {
      const Value* def = args.Get(99, "default");
      for (const Value& x : items) {
        Value r = Attribute(x, ToText(*attr), line);
        out.push_back(r.undefined() && def ? *def : r);
      }
    } else {
      if (!a0 || !a0->is_string()) Fail(line, "map needs a filter name or attribute=");
      const std::string filter = a0->str();
      if (!KnownFilters().count(filter))
        Fail(line, absl::StrCat("unsupported filter '", filter, "'"));
      Args rest;
      rest.pos.assign(args.pos.begin() + 1, args.pos.end());
      rest.kw = args.kw;
      for (const Value& x : items) out.push_back(ApplyFilter(filter, x, rest, ctx, line));
    }
    return to_list(out);
  }
  if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
    const bool by_attr = name == "selectattr" || name == "rejectattr";
    const bool keep_if = name == "select" || name == "selectattr";
    size_t next = 0;
    std::string attr;
    if (by_attr) {
      if (!a0) Fail(line, absl::StrCat(name, " needs an attribute"));
      attr = ToText(*a0);
      next = 1;
    }
    const Value* test = args.Get(next, "");
    const Value* test_arg = args.Get(next + 1, "");
    if (test && (!test->is_string() || !KnownTests().count(test->str()))) {
      Fail(line, absl::StrCat("unsupported test ", ToText(*test)));
    }
    std::vector<Value> out;
    for (const Value& x : items) {
      const Value subject = by_attr ? Attribute(x, attr, line) : x;
      const bool pass =
          test ? Truthy(CallTest(test->str(), subject, test_arg, line)) : Truthy(subject);
      if (pass == keep_if) out.push_back(x);
    }
    return to_list(out);
  }
  if (name == "unique") {
    std::vector<Value> out;
    for (const Value& x : items) {
      bool seen = false;
      for (const Value& y : out) seen = seen || ValueEquals(x, y);
      if (!seen) out.push_back(x);
    }
    return to_list(out);
  }
  if (name == "sort") {
    const Value* rev = args.Get(0, "reverse");
    const Value* attr = args.Get(2, "attribute");
    auto key = [&](const Value& x) { return attr ? Attribute(x, ToText(*attr), line) : x; };
    std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
      return Compare(key(x), key(y), line) < 0;
    });
    if (rev && Truthy(*rev)) std::reverse(items.begin(), items.end());
    return to_list(items);
  }
  if (name == "sum" || name == "max" || name == "min") {
    if (name == "sum") {
      Value acc = Value::Of(0);
      for (const Value& x : items) acc = Arith("+", acc, x, line);
      return acc;
    }
    if (items.empty()) return Value::Undefined("empty sequence");
    Value best = items[0];
    for (const Value& x : items) {
      const int c = Compare(x, best, line);
      if ((name == "max" && c > 0) || (name == "min" && c < 0)) best = x;
    }
    return best;
  }
  if (name == "wordcount")
    return Value::Of(static_cast<int64_t>(PySplit(ToText(v), nullptr, nullptr, line).size()));
  Fail(line, absl::StrCat("unsupported filter '", name, "'"));
}

// ---------------------------------------------------------------------------------------------

class JinjaChatTemplate final : public ChatTemplate {
 public:
  JinjaChatTemplate(Body body, std::string bos, std::string eos)
      : body_(std::move(body)), bos_(std::move(bos)), eos_(std::move(eos)) {}

  absl::StatusOr<std::string> Render(const ChatTemplateInputs& inputs) const override {
    std::map<std::string, Value> globals;
    globals["messages"] = Value::Of(inputs.messages);
    globals["tools"] = Value::Of(inputs.tools);
    globals["documents"] = Value::Of(Json());
    globals["add_generation_prompt"] = Value::Of(inputs.add_generation_prompt);
    if (!bos_.empty()) globals["bos_token"] = Value::Of(bos_);
    if (!eos_.empty()) globals["eos_token"] = Value::Of(eos_);
    globals["raise_exception"] =
        Value::Func("raise_exception", [](Args& a, Context&, int line) -> Value {
          const Value* m = a.Get(0, "message");
          Fail(line, absl::StrCat("template raised an exception: ", m ? ToText(*m) : ""));
        });
    globals["namespace"] = Value::Func("namespace", [](Args& a, Context&, int line) -> Value {
      Value v;
      v.kind = Value::Kind::kNamespace;
      v.ns = std::make_shared<Json>(Json::object());
      for (const Value& p : a.pos) {
        if (!p.is_json() || !p.json.is_object()) Fail(line, "namespace() takes keyword arguments");
        for (auto it = p.json.begin(); it != p.json.end(); ++it) (*v.ns)[it.key()] = it.value();
      }
      for (const auto& [k, x] : a.kw) (*v.ns)[k] = ToJson(x, line);
      return v;
    });
    globals["range"] = Value::Func("range", [](Args& a, Context&, int line) -> Value {
      if (a.pos.empty() || a.pos.size() > 3) Fail(line, "range() takes 1 to 3 arguments");
      int64_t start = 0, stop, step = 1;
      if (a.pos.size() == 1) {
        stop = ToInt(a.pos[0], line, "range()");
      } else {
        start = ToInt(a.pos[0], line, "range()");
        stop = ToInt(a.pos[1], line, "range()");
        if (a.pos.size() == 3) step = ToInt(a.pos[2], line, "range()");
      }
      if (step == 0) Fail(line, "range() arg 3 must not be zero");
      Json out = Json::array();
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        if (out.size() >= 100000) Fail(line, "range() too large");
        out.push_back(i);
      }
      return Value::Of(std::move(out));
    });
    globals["dict"] = Value::Func("dict", [](Args& a, Context&, int line) -> Value {
      Json out = Json::object();
      for (const auto& [k, x] : a.kw) out[k] = ToJson(x, line);
      return Value::Of(std::move(out));
    });
    if (inputs.kwargs.is_object()) {
      for (auto it = inputs.kwargs.begin(); it != inputs.kwargs.end(); ++it) {
        globals[it.key()] = Value::Of(it.value());
      }
    }
    Context ctx(std::move(globals));
    std::string out;
    try {
      ExecBody(body_, ctx, &out);
    } catch (const TemplateError& e) {
      return absl::InvalidArgumentError(
          absl::StrCat("chat template line ", e.line, ": ", e.message));
    } catch (const Json::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat("chat template: ", e.what()));
    }
    return out;
  }

 private:
  Body body_;
  std::string bos_, eos_;
};

// A special token in tokenizer_config.json: a string or {"content": ...}; null when unset.
std::string SpecialToken(const Json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return (*it)["content"].get<std::string>();
  }
  return "";
}

}  // namespace

absl::StatusOr<std::unique_ptr<ChatTemplate>> ChatTemplate::FromSource(std::string_view source,
                                                                       std::string bos_token,
                                                                       std::string eos_token) {
  try {
    Lexer lexer{std::string(source)};
    Parser parser(lexer.Run());
    Body body = parser.ParseTemplate();
    return std::unique_ptr<ChatTemplate>(
        new JinjaChatTemplate(std::move(body), std::move(bos_token), std::move(eos_token)));
  } catch (const TemplateError& e) {
    return absl::InvalidArgumentError(absl::StrCat("chat template line ", e.line, ": ", e.message));
  }
}

absl::StatusOr<std::unique_ptr<ChatTemplate>> ChatTemplate::FromDirectory(const std::string& dir) {
  const std::string path = dir + "/tokenizer_config.json";
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream ss;
  ss << in.rdbuf();
  const Json config = Json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  }
  auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) {
    return absl::NotFoundError(absl::StrCat(path, " has no chat_template"));
  }
  std::string source;
  if (it->is_string()) {
    source = it->get<std::string>();
  } else if (it->is_array()) {
    // Several named templates: transformers uses the one named "default".
    for (const Json& t : *it) {
      if (t.is_object() && t.value("name", "") == "default" && t.contains("template") &&
          t["template"].is_string()) {
        source = t["template"].get<std::string>();
      }
    }
    if (source.empty())
      return absl::NotFoundError(absl::StrCat(path, " has no default chat_template"));
  } else {
    return absl::InvalidArgumentError(absl::StrCat(path, ": chat_template is not a string"));
  }
  auto t = FromSource(source, SpecialToken(config, "bos_token"), SpecialToken(config, "eos_token"));
  if (!t.ok())
    return absl::Status(t.status().code(), absl::StrCat(path, ": ", t.status().message()));
  return t;
}

}  // namespace moe::tokenizer
