# Cross-build for 64-bit Arm Linux with Debian's cross compiler; tests run
# under qemu-user. Install the packages first: scripts/install-deps.sh --arm64
#   cmake -S . -B build-arm64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake
# Choose the emulated CPU with QEMU_CPU, which qemu reads itself:
#   (unset) or QEMU_CPU=max                    NEON, SVE, SVE2 with 512-bit vectors
#   QEMU_CPU=max,sve=off                       NEON only
#   QEMU_CPU=max,sve-default-vector-length=32  SVE with 256-bit vectors (16: 128-bit)

set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)

# Debian multiarch: arm64 -dev packages put libraries and CMake package
# configs (hwy, absl, GTest) in /usr/lib/aarch64-linux-gnu; headers are in
# /usr/include, shared with amd64. Naming the architecture makes find_package
# and find_library look there and not in /usr/lib/x86_64-linux-gnu, so no
# separate sysroot is needed (this is what Debian's own debtoolchainfilegen
# relies on too).
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)

# Run arm64 programs (ctest, gtest_discover_tests) through qemu; the host
# kernel has no binfmt handler for them. `-L /` makes qemu use the arm64
# loader and C library of libc6:arm64 (in /lib, pulled in by the arm64 -dev
# packages, same version as amd64's), so loader and libc match. With
# -L /usr/aarch64-linux-gnu the loader would come from libc6-arm64-cross but
# libc.so.6 still from /lib/aarch64-linux-gnu: two glibc builds mixed.
if(EXISTS /usr/bin/qemu-aarch64-static)
  set(CMAKE_CROSSCOMPILING_EMULATOR /usr/bin/qemu-aarch64-static -L /)
else()
  set(CMAKE_CROSSCOMPILING_EMULATOR /usr/bin/qemu-aarch64 -L /)
endif()
