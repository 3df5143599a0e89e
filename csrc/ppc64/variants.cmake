# ppc64le ISA variants. Each is its own TU with its own flags; the rest of the library is built for the
# compiler's default ppc64le target (POWER8). vsx.cpp also holds the A packing and quantization both
# variants share, compiled for POWER8 so it never contains POWER10 instructions.
w8a8_cpu_add_variant(vsx
  GUARD W8A8_CPU_HAVE_VSX
  FLAGS -mcpu=power8 -mvsx
  PROBE csrc/ppc64/probe_vsx.cpp
  SOURCES csrc/ppc64/vsx.cpp)

# mma reuses the vsx TU's quantization and A packing, so it needs the vsx variant.
if(W8A8_CPU_COMPILER_HAS_W8A8_CPU_HAVE_VSX)
  w8a8_cpu_add_variant(mma
    GUARD W8A8_CPU_HAVE_MMA
    FLAGS -mcpu=power10 -mmma
    PROBE csrc/ppc64/probe_mma.cpp
    SOURCES csrc/ppc64/mma.cpp)
endif()
