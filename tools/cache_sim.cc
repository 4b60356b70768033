// cache_sim: replays a routing trace (a .npy file or a synthetic one) through every expert-cache
// eviction policy at a list of slot counts. See --help (tools/cache_sim_lib.cc) for the flags.
#include <iostream>
#include <string>
#include <vector>

#include "tools/cache_sim_lib.h"

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  auto options = moe::tools::ParseCacheSimArgs(args);
  if (!options.ok()) {
    std::cerr << "cache_sim: " << options.status().message() << "\n";
    return 2;
  }
  if (options->help) {
    std::cout << moe::tools::CacheSimUsage();
    return 0;
  }
  absl::Status s = moe::tools::RunCacheSim(*options, std::cout);
  if (!s.ok()) {
    std::cerr << "cache_sim: " << s.message() << "\n";
    return 1;
  }
  return 0;
}
