// Encode throughput of //engine/tokenizer on a few MB of seeded mixed text (prose, code, CJK,
// Arabic, emoji, digits), one thread, whole text and line by line; with --hf_tokenizers, the same
// text through Hugging Face tokenizers (testdata/bench_hf.mjs, Node binding) in alternating order,
// and the ratio of the medians.
//
//   tools/bazel run --config=opt //engine/tokenizer:tokenizer_bench --
//     --hf_tokenizers=/tmp/hftok/node_modules/tokenizers   (one command line)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "engine/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, tokenizer, "third_party/qwen3_tokenizer", "directory with tokenizer.json");
ABSL_FLAG(double, mb, 2.0, "size of the generated text in MB");
ABSL_FLAG(int, reps, 5, "timed repetitions of each side");
ABSL_FLAG(std::string, hf_tokenizers, "",
          "path of the Node 'tokenizers' package; empty: ours only");
ABSL_FLAG(std::string, hf_script, "engine/tokenizer/testdata/bench_hf.mjs", "the HF side's script");

namespace {

std::string MixedText(size_t bytes) {
  std::mt19937 rng(7);
  auto pick = [&](const std::vector<std::string>& v) -> const std::string& {
    return v[rng() % v.size()];
  };
  const std::vector<std::string> words = {"the",     "of",     "and",       "expert", "cache",
                                          "routing", "model",  "token",     "is",     "with",
                                          "GPU",     "memory", "bandwidth", "it's",   "they're",
                                          "Qwen",    "layer",  "attention", "naïve",  "café"};
  const std::vector<std::string> code = {
      "def",     "return",  "self.x", "(", ")", "{", "}", "==", "\t", "    ", "for i in range(10):",
      "x += 1;", "// note", "\"s\""};
  const std::vector<std::string> other = {
      "中文文本",  "日本語のテキスト",   "한국어", "مرحبا بالعالم", "नमस्ते दुनिया",
      "👍🏽",  "👨‍👩‍👧", "🚀",      "3.14159",       "2024-12-05",
      "1234567890"};
  std::string out;
  while (out.size() < bytes) {
    const int kind = static_cast<int>(rng() % 10);
    const int n = 5 + static_cast<int>(rng() % 30);
    std::string line;
    for (int i = 0; i < n; ++i) {
      if (kind < 6) {
        line += (i ? " " : "") + pick(words);
        if (rng() % 10 == 0) line += pick({",", ".", "!", "?"});
      } else if (kind < 8) {
        line += pick(code) + (rng() % 2 ? " " : "");
      } else {
        line += pick(other) + (rng() % 3 ? " " : "");
      }
    }
    out += line + "\n";
  }
  return out;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string dir = absl::GetFlag(FLAGS_tokenizer);
  auto tok = moe::tokenizer::Tokenizer::FromDirectory(dir);
  if (!tok.ok()) {
    std::cerr << tok.status() << "\n";
    return 1;
  }
  const std::string text = MixedText(static_cast<size_t>(absl::GetFlag(FLAGS_mb) * 1e6));
  const std::vector<std::string> lines = absl::StrSplit(text, '\n');
  const double mb = text.size() / 1e6;
  const std::string hf = absl::GetFlag(FLAGS_hf_tokenizers);
  const char* tmp = std::getenv("TMPDIR");
  const std::string text_path = std::string(tmp ? tmp : "/tmp") + "/tokenizer_bench_text.txt";
  if (!hf.empty()) std::ofstream(text_path, std::ios::binary) << text;

  size_t whole_tokens = 0, line_tokens = 0;
  auto ours = [&](double* whole_s, double* lines_s) {
    auto t0 = std::chrono::steady_clock::now();
    whole_tokens = (*tok)->Encode(text).size();
    auto t1 = std::chrono::steady_clock::now();
    line_tokens = 0;
    for (const std::string& l : lines) line_tokens += (*tok)->Encode(l).size();
    auto t2 = std::chrono::steady_clock::now();
    *whole_s = std::chrono::duration<double>(t1 - t0).count();
    *lines_s = std::chrono::duration<double>(t2 - t1).count();
  };
  auto theirs = [&](double* whole_s, double* lines_s) -> bool {
    const std::string cmd = absl::StrCat(
        "RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false node ", absl::GetFlag(FLAGS_hf_script),
        " --tokenizers ", hf, " --tokenizer ", dir, "/tokenizer.json --text ", text_path);
    FILE* p = popen(cmd.c_str(), "r");
    if (!p) return false;
    std::string out;
    char buf[4096];
    while (size_t n = fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
    if (pclose(p) != 0) return false;
    const nlohmann::json j = nlohmann::json::parse(out, nullptr, false);
    if (j.is_discarded()) return false;
    *whole_s = j["whole_s"];
    *lines_s = j["lines_s"];
    if (j["whole_tokens"] != whole_tokens || j["lines_tokens"] != line_tokens) {
      std::cerr << "token counts differ from HF: " << out << "\n";
    }
    return true;
  };

  double w, l;
  ours(&w, &l);  // warm-up: the word cache, as the HF side gets
  std::vector<double> our_w, our_l, hf_w, hf_l;
  bool hf_ok = !hf.empty();
  for (int r = 0; r < absl::GetFlag(FLAGS_reps); ++r) {
    // Alternate which side runs first so drift in machine speed hits both equally.
    for (int side = 0; side < 2; ++side) {
      if ((side == 0) == (r % 2 == 0)) {
        ours(&w, &l);
        our_w.push_back(w);
        our_l.push_back(l);
      } else if (hf_ok) {
        hf_ok = theirs(&w, &l);
        hf_w.push_back(w);
        hf_l.push_back(l);
      }
    }
  }
  std::printf("text: %.2f MB, %zu lines, %zu tokens whole, %zu tokens by line\n", mb, lines.size(),
              whole_tokens, line_tokens);
  std::printf("%-28s %12s %12s\n", "", "whole MB/s", "lines MB/s");
  std::printf("%-28s %12.2f %12.2f\n", "moe::tokenizer", mb / Median(our_w), mb / Median(our_l));
  if (hf_ok && !hf_w.empty()) {
    std::printf("%-28s %12.2f %12.2f\n", "HF tokenizers (Node, 1 thr)", mb / Median(hf_w),
                mb / Median(hf_l));
    std::printf("%-28s %12.2f %12.2f\n", "ratio ours/HF", Median(hf_w) / Median(our_w),
                Median(hf_l) / Median(our_l));
  } else if (!hf.empty()) {
    std::printf("HF side failed to run\n");
  }
  return 0;
}
