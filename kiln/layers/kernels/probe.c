/* What the OS grants: XCR0, the register state it saves on a context switch (xgetbv). A CPU
 * flag in /proc/cpuinfo says the core has an instruction; XCR0 says the kernel enabled its
 * registers (AVX: bits 1-2, AVX-512: 5-7, AMX: 17-18). Without them the first such
 * instruction faults. Built with no -m flag (baseline x86-64), so it loads on any x86 CPU.
 * kiln/layers/kernels/isa.py compiles it with `cc` and calls it through ctypes. */
#include <stdint.h>

uint64_t kiln_xcr0(void) {
  uint32_t a, b, c, d;
  __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
  if (!(c & (1u << 27))) return 0; /* no OSXSAVE: xgetbv itself would fault */
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return ((uint64_t)hi << 32) | lo;
}
