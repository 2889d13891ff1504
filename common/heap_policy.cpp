#include "common/heap_policy.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace fm {

void HoldFreedHeapMemory() {
#if defined(__GLIBC__)
  // Allocations below 32 MiB (glibc's largest fixed threshold; a step's scratch is far
  // smaller) come from the heap; up to 1 GiB of free heap top is kept; the heap grows in
  // 64 MiB steps. A long prefill may keep its peak scratch until exit, bounded by the above.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  mallopt(M_TOP_PAD, 64 << 20);
#endif
}

}  // namespace fm
