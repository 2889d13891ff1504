// The process-wide malloc policy of the flashmesh binary.
#pragma once

namespace fm {

// Keeps memory that a decode step frees inside the process for the next step, instead of
// glibc's defaults: buffers above a dynamic threshold mmap'd and munmap'd per allocation, and
// the heap top trimmed back to the kernel when it is freed. Each of those changes the page
// tables, and on the VMs this project measures on a page-table change costs the next weight
// reads their TLB: one 1 MB mmap/munmap per layer took an expert-pattern benchmark from 29 to
// 5.5 GB/s (docs/performance.md). Call once at start-up, before any threads.
void HoldFreedHeapMemory();

}  // namespace fm
