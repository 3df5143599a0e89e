# aarch64 ISA variants. Each is its own TU with its own flags; the rest of the library is baseline armv8-a.
# neon.cpp also holds the A packing and quantization every aarch64 variant shares, compiled for the
# baseline so it never contains sdot/smmla (GCC auto-vectorises into them in +dotprod / +i8mm TUs).
w8a8_cpu_add_variant(neon
  GUARD W8A8_CPU_HAVE_NEON
  FLAGS -march=armv8-a
  PROBE csrc/aarch64/probe_neon.cpp
  SOURCES csrc/aarch64/neon.cpp)

# dotprod and i8mm reuse the neon TU's quantization and A packing, so they need the neon variant.
if(W8A8_CPU_COMPILER_HAS_W8A8_CPU_HAVE_NEON)
  w8a8_cpu_add_variant(dotprod
    GUARD W8A8_CPU_HAVE_DOTPROD
    FLAGS -march=armv8.2-a+dotprod
    PROBE csrc/aarch64/probe_dotprod.cpp
    SOURCES csrc/aarch64/dotprod.cpp)
  w8a8_cpu_add_variant(i8mm
    GUARD W8A8_CPU_HAVE_I8MM
    FLAGS -march=armv8.2-a+i8mm+dotprod
    PROBE csrc/aarch64/probe_i8mm.cpp
    SOURCES csrc/aarch64/i8mm.cpp)
endif()
