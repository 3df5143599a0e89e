// The table of ISA variants compiled into this build, the process-wide choice among them and per-thread overrides.
#pragma once

#include <string>
#include <vector>

#include "microkernel.h"

namespace w8a8_cpu {

// Every variant compiled into this build, from the portable reference to the best.
const std::vector<const MicroKernel*>& compiled_kernels();

// Whether the running CPU has everything `kernel` needs.
bool cpu_supports(const MicroKernel& kernel);

// The variant ops called from this thread use now: the thread's override if it has one, else the process
// default. First use picks the default: $W8A8_CPU_ISA if set (throwing std::invalid_argument if it names no
// compiled variant or one this CPU lacks), else the best compiled variant the CPU supports.
const MicroKernel& active_kernel();

// Makes `name` this thread's variant (same checks as $W8A8_CPU_ISA); "" removes the override. Returns the
// previous override ("" for none), so nested and overlapping scopes in different threads restore correctly.
// Thread-local because the variant is read once per op in the calling thread (workers get it passed down).
std::string set_thread_kernel(const std::string& name);

}  // namespace w8a8_cpu
