// The table of ISA variants compiled into this build and the process-wide choice among them.
#pragma once

#include <string>
#include <vector>

#include "microkernel.h"

namespace w8a8_cpu {

// Every variant compiled into this build, from the portable reference to the best.
const std::vector<const MicroKernel*>& compiled_kernels();

// Whether the running CPU has everything `kernel` needs.
bool cpu_supports(const MicroKernel& kernel);

// The variant ops use now. First use picks $W8A8_CPU_ISA if set (throwing std::invalid_argument if it
// names no compiled variant or one this CPU lacks), else the best compiled variant the CPU supports.
const MicroKernel& active_kernel();

// Makes `name` the active variant (same checks as $W8A8_CPU_ISA). Process-wide: do not switch while
// other threads run ops.
void set_active_kernel(const std::string& name);

}  // namespace w8a8_cpu
