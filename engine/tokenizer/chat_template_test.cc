// ChatTemplate against Jinja2 itself: every render here is compared byte for byte with what
// testdata/render_jinja.py (Jinja2 set up as transformers' apply_chat_template sets it up) gives
// for the same template and inputs: the Qwen3 template (vendored tokenizer_config.json) and the
// Qwen2.5 template over seeded conversations, then one small template per supported construct.
// Where Jinja2 raises, Render must fail too.
#include "engine/tokenizer/chat_template.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace moe::tokenizer {
namespace {

using Json = nlohmann::ordered_json;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string TmpDir() {
  const char* t = std::getenv("TEST_TMPDIR");
  return t ? t : "/tmp";
}

struct Job {
  std::string name;
  std::string source;
  ChatTemplateInputs inputs;
  std::string bos, eos;
};

// Renders every job with Jinja2 in one Python run: [{"text"} | {"error"}].
Json RenderWithJinja2(const std::vector<Job>& jobs) {
  Json request = {{"jobs", Json::array()}};
  for (const Job& j : jobs) {
    Json job = {{"template", j.source},
                {"messages", j.inputs.messages},
                {"tools", j.inputs.tools},
                {"add_generation_prompt", j.inputs.add_generation_prompt},
                {"kwargs", j.inputs.kwargs}};
    if (!j.bos.empty()) job["bos_token"] = j.bos;
    if (!j.eos.empty()) job["eos_token"] = j.eos;
    request["jobs"].push_back(job);
  }
  const std::string in = TmpDir() + "/jinja_request.json";
  const std::string out = TmpDir() + "/jinja_renders.json";
  std::ofstream(in) << request.dump();
  const std::string cmd =
      "/usr/bin/python3 engine/tokenizer/testdata/render_jinja.py < " + in + " > " + out;
  if (std::system(cmd.c_str()) != 0) {
    ADD_FAILURE() << "the Jinja2 reference failed to run: " << cmd;
    return Json::array();
  }
  return Json::parse(ReadFile(out));
}

void ExpectSameAsJinja2(const std::vector<Job>& jobs, int* compared) {
  const Json ref = RenderWithJinja2(jobs);
  ASSERT_EQ(ref.size(), jobs.size());
  for (size_t i = 0; i < jobs.size(); ++i) {
    const Job& j = jobs[i];
    auto t = ChatTemplate::FromSource(j.source, j.bos, j.eos);
    ASSERT_TRUE(t.ok()) << j.name << ": " << t.status();
    const absl::StatusOr<std::string> got = (*t)->Render(j.inputs);
    if (ref[i].contains("error")) {
      EXPECT_FALSE(got.ok()) << j.name << ": Jinja2 raised " << ref[i]["error"]
                             << " but we rendered " << Json(*got).dump();
      if (!got.ok()) {
        EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
      }
    } else {
      ASSERT_TRUE(got.ok()) << j.name << ": " << got.status();
      EXPECT_EQ(*got, ref[i]["text"].get<std::string>()) << j.name;
    }
    ++*compared;
  }
}

// --- seeded conversations ---

class ConversationGenerator {
 public:
  explicit ConversationGenerator(uint32_t seed) : rng_(seed) {}

  int Int(int lo, int hi) {
    return lo + static_cast<int>(rng_() % static_cast<uint32_t>(hi - lo + 1));
  }
  bool Chance(int percent) { return Int(0, 99) < percent; }
  template <typename T>
  const T& Pick(const std::vector<T>& v) {
    return v[Int(0, static_cast<int>(v.size()) - 1)];
  }

  std::string Text() {
    static const std::vector<std::string> kTexts = {
        "Hello!",
        "What's the weather in Paris tomorrow?",
        "Explain MoE offloading in one line.",
        "多专家模型如何在内存中缓存？",
        "Ça va? «quotes» and \"double\" and 'single'",
        "emoji 👩‍👩‍👧 🏳️‍🌈",
        "line one\nline two\n\n  indented",
        "\n\nleading newlines",
        "trailing newlines\n\n",
        "tabs\tand  spaces",
        "مرحبا بالعالم",
        "नमस्ते",
        "{\"json\": [1, 2, 3]}",
        "",
        "<tool_response>\nnot really a tool\n</tool_response>",
        "Use <b>html</b> & entities"};
    return Pick(kTexts);
  }

  Json Tools() {
    static const std::vector<Json> kTools = {
        Json::parse(
            R"({"type": "function", "function": {"name": "get_weather", "description": "Weather for a city — °C", "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "城市"}, "days": {"type": "integer", "default": 3}}, "required": ["city"]}}})"),
        Json::parse(
            R"({"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "top_k": {"type": "number", "default": 0.5}, "safe": {"type": "boolean", "default": true}, "lang": {"enum": ["en", "zh", null]}}}}})"),
        Json::parse(
            R"({"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {"expr": {"type": "string", "pattern": "^[0-9+*/() -]+$"}, "precision": {"type": "number", "minimum": 1e-05, "maximum": 1e20}}}}})"),
        Json::parse(
            R"({"type": "function", "function": {"name": "noop", "description": "", "parameters": {}}})")};
    Json tools = Json::array();
    const int n = Int(1, 4);
    for (int i = 0; i < n; ++i) tools.push_back(kTools[(i + Int(0, 3)) % kTools.size()]);
    return tools;
  }

  Json ToolCall() {
    static const std::vector<std::string> kNames = {"get_weather", "search", "calc"};
    Json args = Json::object();
    args["city"] = Pick(std::vector<std::string>{"Paris", "北京", "São Paulo"});
    if (Chance(50)) args["days"] = Int(1, 7);
    if (Chance(30)) args["ratio"] = 0.25;
    if (Chance(30)) args["nested"] = Json::parse(R"({"a": [1, {"b": null}], "ok": false})");
    Json fn = {{"name", Pick(kNames)}};
    // Both spellings clients send: a JSON object, or the object already serialised to text.
    fn["arguments"] = Chance(60) ? args : Json(args.dump());
    if (Chance(85))
      return Json{
          {"id", "call_" + std::to_string(Int(0, 999))}, {"type", "function"}, {"function", fn}};
    return fn;  // without the {"function": ...} wrapper
  }

  Job Conversation(const std::string& name, const std::string& source) {
    Job job;
    job.name = name;
    job.source = source;
    Json& m = job.inputs.messages;
    if (Chance(50))
      m.push_back(
          {{"role", "system"}, {"content", Chance(80) ? "You are a careful assistant." : Text()}});
    if (Chance(50)) job.inputs.tools = Tools();
    const int turns = Int(1, 4);
    for (int t = 0; t < turns; ++t) {
      m.push_back({{"role", "user"}, {"content", Text()}});
      if (t == turns - 1 && Chance(50)) break;  // ends on the user: the usual generation prompt
      Json a = {{"role", "assistant"}};
      const int style = Int(0, 3);
      std::string content = Text();
      if (style == 1) content = "<think>\nweighing options\n</think>\n\n" + content;
      a["content"] = content;
      if (style == 2) a["reasoning_content"] = "step 1, then step 2";
      if (Chance(40)) {
        a["tool_calls"] = Json::array();
        const int calls = Int(1, 3);
        for (int c = 0; c < calls; ++c) a["tool_calls"].push_back(ToolCall());
        if (Chance(30)) a["content"] = "";
        m.push_back(a);
        const int responses = Int(1, calls);
        for (int r = 0; r < responses; ++r) {
          m.push_back({{"role", "tool"}, {"content", Chance(50) ? "{\"temp\": 21.5}" : Text()}});
        }
        if (Chance(50)) {
          Json after = {{"role", "assistant"}, {"content", "Done: " + Text()}};
          m.push_back(after);
        }
      } else {
        m.push_back(a);
      }
    }
    job.inputs.add_generation_prompt = Chance(70);
    const int thinking = Int(0, 2);
    if (thinking == 1) job.inputs.kwargs["enable_thinking"] = true;
    if (thinking == 2) job.inputs.kwargs["enable_thinking"] = false;
    return job;
  }

 private:
  std::mt19937 rng_;
};

std::string Qwen3Template() {
  const Json config = Json::parse(ReadFile("third_party/qwen3_tokenizer/tokenizer_config.json"));
  return config["chat_template"].get<std::string>();
}

TEST(ChatTemplateTest, Qwen3TemplateMatchesJinja2) {
  const std::string source = Qwen3Template();
  ConversationGenerator gen(3);
  std::vector<Job> jobs;
  for (int i = 0; i < 40; ++i)
    jobs.push_back(gen.Conversation("qwen3 #" + std::to_string(i), source));
  // A content of null makes the template itself fail (`'</think>' in None`): so must we.
  Job bad = jobs[0];
  bad.name = "qwen3 null content";
  bad.inputs.messages =
      Json::parse(R"([{"role": "user", "content": "hi"}, {"role": "assistant", "content": null}])");
  jobs.push_back(bad);
  int compared = 0;
  ExpectSameAsJinja2(jobs, &compared);
  EXPECT_EQ(compared, 41);
}

TEST(ChatTemplateTest, Qwen25TemplateMatchesJinja2) {
  const std::string source = ReadFile("engine/tokenizer/testdata/qwen2_5_chat_template.jinja");
  ASSERT_FALSE(source.empty());
  ConversationGenerator gen(25);
  std::vector<Job> jobs;
  for (int i = 0; i < 40; ++i)
    jobs.push_back(gen.Conversation("qwen2.5 #" + std::to_string(i), source));
  int compared = 0;
  ExpectSameAsJinja2(jobs, &compared);
  EXPECT_EQ(compared, 40);
}

TEST(ChatTemplateTest, FromDirectoryReadsQwen3) {
  auto t = ChatTemplate::FromDirectory("third_party/qwen3_tokenizer");
  ASSERT_TRUE(t.ok()) << t.status();
  ChatTemplateInputs in;
  in.messages = Json::parse(R"([{"role": "user", "content": "hi"}])");
  in.kwargs["enable_thinking"] = false;
  auto r = (*t)->Render(in);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  EXPECT_EQ(ChatTemplate::FromDirectory("/nonexistent").status().code(),
            absl::StatusCode::kNotFound);
}

// One small template per construct, each with inputs that exercise it.
TEST(ChatTemplateTest, ConstructsMatchJinja2) {
  const std::vector<std::string> templates = {
      // loops and loop variables
      "{% for m in messages %}{{ loop.index }}/{{ loop.index0 }}/{{ loop.revindex }}/{{ "
      "loop.revindex0 }}/{{ loop.first }}/{{ loop.last }}/{{ loop.length }} {% endfor %}",
      "{% for m in messages if m.role != 'system' %}{{ loop.index }}:{{ m.role }},{% endfor %}",
      "{% for m in messages %}{% if loop.index0 == 1 %}{% continue %}{% endif %}{% if loop.index > "
      "3 %}{% break %}{% endif %}{{ m.role }} {% endfor %}",
      "{% for x in [] %}x{% else %}empty{% endfor %}",
      "{% for k, v in {'a': 1, 'b': [2, 3]}.items() %}{{ k }}={{ v }};{% endfor %}",
      "{% for c in 'héllo' %}[{{ c }}]{% endfor %}",
      "{% for m in messages %}{{ loop.previtem.role if loop.previtem is defined else '-' }}>{{ "
      "loop.nextitem.role if loop.nextitem is defined else '-' }} {% endfor %}",
      // slicing, indexing, in
      "{{ messages[::-1] | map(attribute='role') | join(',') }}|{{ messages[1:] | length }}|{{ "
      "messages[-1].role }}|{{ 'abcdef'[1:-1] }}|{{ 'abcdef'[::2] }}|{{ [1,2,3,4,5][3:0:-1] }}",
      "{{ 'a' in 'cat' }} {{ 'z' not in 'cat' }} {{ 2 in [1, 2] }} {{ 'role' in messages[0] }} {{ "
      "'x' in {'x': 1} }}",
      // tests
      "{{ x is defined }} {{ y is undefined }} {{ none is none }} {{ 's' is string }} {{ {} is "
      "mapping }} {{ [] is iterable }} {{ [] is sequence }} {{ 3 is number }} {{ 3 is integer }} "
      "{{ 3.5 is float }} {{ true is boolean }} {{ false is false }} {{ true is true }} {{ 4 is "
      "even }} {{ 3 is odd }} {{ 9 is divisibleby(3) }} {{ 1 is not none }}",
      // operators
      "{{ 1 + 2 * 3 - 4 / 2 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 2 ** 10 }} "
      "{{ 'ab' ~ 3 ~ none }} {{ 'x' * 3 }} {{ [1] + [2] }} {{ 0.1 + 0.2 }} {{ 1e20 }} {{ 1.0 }} {{ "
      "10 / 4 }}",
      "{{ 1 < 2 }} {{ 'a' < 'b' }} {{ 2 >= 2 }} {{ 1 == 1.0 }} {{ 'a' != 'a' }} {{ not true }} {{ "
      "true and 'x' }} {{ '' or 'fallback' }} {{ 0 or [] }}",
      "{{ 'yes' if messages else 'no' }} {{ 'a' if false else 'b' if true else 'c' }}",
      // string methods
      "{{ '  x y  '.strip() }}|{{ 'xxhixx'.strip('x') }}|{{ '\\n\\nhi'.lstrip('\\n') }}|{{ "
      "'hi\\n\\n'.rstrip() }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'a b c'.split(' "
      "', 1) }}|{{ 'hello'.replace('l', 'L') }}|{{ 'Hello World'.upper() }}|{{ 'Hello "
      "World'.lower() }}|{{ 'hello world'.title() }}|{{ 'abc'.startswith('ab') }}|{{ "
      "'abc'.endswith(('x', 'c')) }}|{{ 'a</think>b'.split('</think>')[-1] }}|{{ ', '.join(['a', "
      "'b']) }}|{{ 'abcabc'.find('c') }}|{{ 'abcabc'.count('bc') }}",
      // dict methods
      "{% set d = {'b': 1, 'a': {'c': [1, 2]}} %}{{ d.keys() | list }} {{ d.values() | list }} {% "
      "for k, v in d.items() %}{{ k }}:{{ v }},{% endfor %} {{ d.get('a') }} {{ d.get('z', 'dflt') "
      "}} {{ d.get('z') }} {{ d['b'] }}",
      // filters
      "{{ messages | length }} {{ 'abc' | count }} {{ '  t  ' | trim }} {{ undefined_var | "
      "default('dv') }} {{ '' | default('e', true) }} {{ [3, 1, 2] | first }} {{ [3, 1, 2] | last "
      "}} {{ [3, 1, 2] | sort | list }} {{ [3, 1, 2] | join('-') }} {{ 'x' | list }} {{ 42 | "
      "string }} {{ '7' | int + 1 }} {{ 'q' | upper }} {{ 'Q' | lower }} {{ 'ab cd' | title }} {{ "
      "'<b>' | safe }} {% for k, v in {'k': 'v'} | items %}{{ k }}={{ v }}{% endfor %} {{ [1, 1, "
      "2] | unique | list }} {{ [1, 2] | reverse | list }} {{ [-1.5] | map('abs') | list }}",
      "{{ messages | selectattr('role', 'equalto', 'user') | map(attribute='content') | list }} {{ "
      "messages | rejectattr('role', 'eq', 'user') | list | length }} {{ [0, 1, '', 'a'] | select "
      "| list }} {{ [0, 1, '', 'a'] | reject | list }} {{ messages | map(attribute='role') | "
      "unique | list }}",
      // tojson
      "{{ tools | tojson }}\n{{ tools | tojson(indent=2) }}\n{{ {'ü': 'ñ', 'q': '\"\\\\', 'n': "
      "none, 'f': 1.5, 'i': -3, 'b': false, 'e': [], 'o': {}} | tojson }}\n{{ [1, 'two'] | "
      "tojson(separators=(',', ':')) }}",
      // Python str() of values
      "{{ {'a': [1, 2.5, none, true, 'it\\'s']} }} {{ [none, false] }} {{ none }} {{ true }} {{ "
      "3.0 }} {{ 1e-7 }} {{ 123456789012345678.0 }}",
      // whitespace control and comments
      "a  {{- ' b ' -}}  c\n  {%- if true %}\n    d\n  {%- endif %}\n{# a comment #}\n  {#- "
      "trimmed -#}  e\n{% if true %}\n  f\n{% endif %}\n  {% if true %}g{% endif %}\n  {%+ if true "
      "%}h{% endif %}",
      "{% for m in messages %}\n    {{ m.role }}\n{% endfor %}\ntail",
      "line\n    {% set x = 1 %}\nafter {{ x }}\n{{ 'raw \\t tab \\u00e9 \\x41' }} {{ \"dq 'in' "
      "dq\" }} {{ 'adj' 'acent' }}",
      // set, namespace, scoping, macros
      "{% set ns = namespace(count=0, last=none) %}{% for m in messages %}{% set ns.count = "
      "ns.count + 1 %}{% set ns.last = m.role %}{% endfor %}{{ ns.count }} {{ ns.last }}",
      "{% set x = 'outer' %}{% for m in messages %}{% set x = 'inner' %}{% endfor %}{{ x }}",
      "{% set x = 'a' %}{% if true %}{% set x = 'b' %}{% endif %}{{ x }}",
      "{% set block %}captured {{ messages | length }}{% endset %}[{{ block }}]",
      "{% macro tag(name, body='none') %}<{{ name }}>{{ body }}</{{ name }}>{% endmacro %}{{ "
      "tag('a') }}{{ tag('b', 'x') }}{{ tag(name='c', body=1) }}",
      "{% set a, b = 1, 2 %}{{ a }}{{ b }} {{ range(3) | list }} {{ range(1, 7, 2) | list }}",
      // special tokens and kwargs
      "{{ bos_token }}|{{ eos_token }}|{{ custom_flag }}|{{ enable_thinking is defined }}",
      // raise_exception and errors Jinja2 raises too
      "{% if messages | length > 1 %}{{ raise_exception('too many messages') }}{% endif %}ok",
      "{{ missing.attribute }}",
      "{{ 'a' + 1 }}",
      "{{ messages[0].content + none }}",
  };
  ChatTemplateInputs base;
  base.messages = Json::parse(
      R"([{"role": "system", "content": "sys"}, {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2 ü"}])");
  base.tools = Json::parse(
      R"([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "number", "default": 0.1}}}}}])");
  base.kwargs = Json::parse(R"({"x": 1, "custom_flag": "on"})");
  std::vector<Job> jobs;
  for (size_t i = 0; i < templates.size(); ++i) {
    Job j;
    j.name = "construct #" + std::to_string(i) + ": " + templates[i].substr(0, 60);
    j.source = templates[i];
    j.inputs = base;
    j.bos = "<s>";
    j.eos = "</s>";
    jobs.push_back(j);
  }
  int compared = 0;
  ExpectSameAsJinja2(jobs, &compared);
}

TEST(ChatTemplateTest, UnsupportedConstructsAreErrorsNamingTheLine) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"ok\n{% include 'other.jinja' %}", "line 2"},
      {"{{ x | no_such_filter }}", "no_such_filter"},
      {"\n\n{% if x is no_such_test %}{% endif %}", "line 3"},
      {"{% for x in y %}", "endfor"},
      {"{{ 'unterminated }}", "line 1"},
      {"{% extends 'base' %}", "extends"},
  };
  for (const auto& [source, needle] : cases) {
    auto t = ChatTemplate::FromSource(source);
    ASSERT_FALSE(t.ok()) << source;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find(needle), std::string::npos) << t.status();
  }
  // Templates come with model files: hostile ones are errors, not crashes or hangs.
  EXPECT_EQ(ChatTemplate::FromSource("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') +
                                     " }}")
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  std::string nested;
  for (int i = 0; i < 1000; ++i) nested += "{% if true %}";
  EXPECT_EQ(ChatTemplate::FromSource(nested).status().code(), absl::StatusCode::kInvalidArgument);
  for (const char* hostile :
       {"{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{{ 'x' * 1000000000 }}", "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}"}) {
    auto h = ChatTemplate::FromSource(hostile);
    ASSERT_TRUE(h.ok()) << hostile;
    auto r = (*h)->Render(ChatTemplateInputs());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << hostile;
  }

  auto t = ChatTemplate::FromSource("a\n{{ raise_exception('no tools allowed') }}");
  ASSERT_TRUE(t.ok());
  auto r = (*t)->Render(ChatTemplateInputs());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("no tools allowed"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("line 2"), std::string::npos) << r.status();
}

}  // namespace
}  // namespace moe::tokenizer
