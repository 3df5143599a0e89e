# Cross toolchain for aarch64 Linux (Debian/Ubuntu g++-aarch64-linux-gnu), with qemu-user as the
# emulator so ctest / try_run run target binaries. The CPU model qemu emulates comes from the QEMU_CPU
# environment variable, which qemu-aarch64 reads itself (e.g. QEMU_CPU=neoverse-n1); unset means qemu's
# default model. ci/emulate passes -cpu explicitly instead.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(W8A8_CPU_CROSS_TRIPLE aarch64-linux-gnu)
set(W8A8_CPU_CROSS_SYSROOT /usr/${W8A8_CPU_CROSS_TRIPLE})
set(CMAKE_C_COMPILER ${W8A8_CPU_CROSS_TRIPLE}-gcc)
set(CMAKE_CXX_COMPILER ${W8A8_CPU_CROSS_TRIPLE}-g++)

set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64;-L;${W8A8_CPU_CROSS_SYSROOT})

# No CMAKE_FIND_ROOT_PATH: the cross compiler finds the target's libc/libstdc++ itself, the kernel tests
# need nothing else, and a cross torch build passes -DTorch_DIR of an aarch64 torch that lies outside
# the sysroot (re-rooting find_library would hide its libraries).
