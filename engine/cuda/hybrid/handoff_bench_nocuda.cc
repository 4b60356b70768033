// handoff_bench without CUDA: says so.
#include <cstdio>

int main() {
  std::fprintf(stderr, "handoff_bench: built without CUDA\n");
  return 1;
}
