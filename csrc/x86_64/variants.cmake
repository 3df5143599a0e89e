# x86_64 ISA variants. Each is its own TU with its own flags; the rest of the library is baseline x86-64.
w8a8_cpu_add_variant(avx2
  GUARD W8A8_CPU_HAVE_AVX2
  FLAGS -mavx2 -mfma -mf16c
  PROBE csrc/x86_64/probe_avx2.cpp
  SOURCES csrc/x86_64/avx2.cpp)

# The VNNI variant reuses the AVX2 quantization, so it needs the AVX2 variant.
if(W8A8_CPU_COMPILER_HAS_W8A8_CPU_HAVE_AVX2)
  w8a8_cpu_add_variant(avx512_vnni
    GUARD W8A8_CPU_HAVE_AVX512VNNI
    FLAGS -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512vnni
    PROBE csrc/x86_64/probe_avx512_vnni.cpp
    SOURCES csrc/x86_64/avx512_vnni.cpp)
endif()
