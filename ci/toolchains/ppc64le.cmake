# Cross toolchain for little-endian 64-bit POWER Linux (Debian/Ubuntu g++-powerpc64le-linux-gnu), with
# qemu-user as the emulator so ctest / try_run run target binaries. The CPU model qemu emulates comes from
# the QEMU_CPU environment variable, which qemu-ppc64le reads itself (e.g. QEMU_CPU=power9); unset means
# qemu's default model. ci/emulate passes -cpu explicitly instead. The compiler's default target is
# POWER8, the ppc64le baseline; only the variant TUs get other -mcpu flags.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR ppc64le)

set(W8A8_CPU_CROSS_TRIPLE powerpc64le-linux-gnu)
set(W8A8_CPU_CROSS_SYSROOT /usr/${W8A8_CPU_CROSS_TRIPLE})
set(CMAKE_C_COMPILER ${W8A8_CPU_CROSS_TRIPLE}-gcc)
set(CMAKE_CXX_COMPILER ${W8A8_CPU_CROSS_TRIPLE}-g++)

set(CMAKE_CROSSCOMPILING_EMULATOR qemu-ppc64le;-L;${W8A8_CPU_CROSS_SYSROOT})

# No CMAKE_FIND_ROOT_PATH: the cross compiler finds the target's libc/libstdc++ itself, the kernel tests
# need nothing else, and a cross torch build passes -DTorch_DIR of a ppc64le torch that lies outside
# the sysroot (re-rooting find_library would hide its libraries).
