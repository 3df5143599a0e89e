# aarch64 ISA variants: one w8a8_cpu_add_variant call each (see CMakeLists.txt). Each is its own TU with its own
# flags; the rest of the library is baseline armv8-a. neon.cpp also holds the A packing and quantization every
# aarch64 variant shares, compiled for the baseline so it never contains sdot/smmla (GCC auto-vectorises into them
# in +dotprod / +i8mm TUs); dotprod and i8mm therefore USE neon.
w8a8_cpu_add_variant(neon
  SYMBOL kNeonKernel PRIORITY 10
  FLAGS -march=armv8-a
  PROBE csrc/aarch64/probe_neon.cpp
  SOURCES csrc/aarch64/neon.cpp)
w8a8_cpu_add_variant(dotprod
  SYMBOL kDotprodKernel PRIORITY 20 USES neon
  FLAGS -march=armv8.2-a+dotprod
  PROBE csrc/aarch64/probe_dotprod.cpp
  SOURCES csrc/aarch64/dotprod.cpp)
w8a8_cpu_add_variant(i8mm
  SYMBOL kI8mmKernel PRIORITY 30 USES neon
  FLAGS -march=armv8.2-a+i8mm+dotprod
  PROBE csrc/aarch64/probe_i8mm.cpp
  SOURCES csrc/aarch64/i8mm.cpp)
