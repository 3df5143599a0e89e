# ppc64le ISA variants: one w8a8_cpu_add_variant call each (see CMakeLists.txt). Each is its own TU with its own
# flags; the rest of the library is built for the compiler's default ppc64le target (POWER8). vsx.cpp also holds
# the A packing and quantization both variants share, compiled for POWER8 so it never contains POWER10
# instructions; mma therefore USES vsx.
w8a8_cpu_add_variant(vsx
  SYMBOL kVsxKernel PRIORITY 10
  FLAGS -mcpu=power8 -mvsx
  PROBE csrc/ppc64/probe_vsx.cpp
  SOURCES csrc/ppc64/vsx.cpp)
w8a8_cpu_add_variant(mma
  SYMBOL kMmaKernel PRIORITY 20 USES vsx
  FLAGS -mcpu=power10 -mmma
  PROBE csrc/ppc64/probe_mma.cpp
  SOURCES csrc/ppc64/mma.cpp)
