#include "common/aligned_buffer.h"

#include <sys/mman.h>

namespace moe::common {

bool AdviseHugePages(void* p, size_t bytes) {
#ifdef MADV_HUGEPAGE
  return madvise(p, bytes, MADV_HUGEPAGE) == 0;
#else
  (void)p;
  (void)bytes;
  return false;
#endif
}

}  // namespace moe::common
