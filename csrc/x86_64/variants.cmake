# x86_64 ISA variants: one w8a8_cpu_add_variant call each (see CMakeLists.txt). Each is its own TU with its own flags;
# the rest of the library is baseline x86-64.
w8a8_cpu_add_variant(avx2
  SYMBOL kAvx2Kernel PRIORITY 10
  FLAGS -mavx2 -mfma -mf16c
  PROBE csrc/x86_64/probe_avx2.cpp
  SOURCES csrc/x86_64/avx2.cpp)

# The VNNI variant reuses the AVX2 quantization (defined in avx2.cpp).
w8a8_cpu_add_variant(avx512_vnni
  SYMBOL kAvx512VnniKernel PRIORITY 20 USES avx2
  FLAGS -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512vnni
  PROBE csrc/x86_64/probe_avx512_vnni.cpp
  SOURCES csrc/x86_64/avx512_vnni.cpp)

# CRC-32C of packed weight blobs (their checksum) with the SSE4.2 crc32 instruction: its own TU with its own flag,
# chosen at run time (kFeatSse42). Without it, and on other arches, packed_weight.cpp's portable code runs.
target_sources(w8a8_kernels PRIVATE csrc/x86_64/crc32c_sse42.cpp)
set_source_files_properties(csrc/x86_64/crc32c_sse42.cpp PROPERTIES COMPILE_OPTIONS "-msse4.2")
target_compile_definitions(w8a8_kernels PRIVATE W8A8_CPU_HAVE_SSE42_CRC=1)
