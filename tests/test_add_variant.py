"""Adding a variant takes one source file and one CMake call (issue: the house, ready for the next variants).

A throwaway variant, written here into a temporary directory, joins the build through W8A8_CPU_EXTRA_VARIANTS (a file
with one w8a8_cpu_add_variant call) without editing a file of the tree. The torch-free kernel test runner then finds it
in the generated dispatch table, dispatch picks it for its higher PRIORITY, and it passes every check every variant
passes (bit-exact sweeps against int64, the packed-format rejections and fuzzing, the MoE driver, bit-identical driver
outputs across variants). Its panel is 8 x 4 instead of the shipped 16 x 4, so the drivers' geometry is read from the
interface, not assumed."""
import shutil
import subprocess
import textwrap

import pytest

from conftest import cmake_build

pytestmark = [
    pytest.mark.slow_under_emulation,  # a native CMake build of the kernel library and its tests (~1 min)
    pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("c++") is None,
                       reason="needs cmake and a C++ compiler"),
]

VARIANT_SOURCE = """
// A throwaway variant: the reference tile on an 8-channel panel. Plain C++ on raw pointers, as every variant.
#include "microkernel.h"
#include "ref_kernel.h"

namespace w8a8_cpu {
extern const MicroKernel kThrowawayKernel;
const MicroKernel kThrowawayKernel = {
    /*name=*/"throwaway",
    /*required_features=*/0,
    /*geometry=*/fixed_geometry<8, 4, 3, 1>,
    /*reads_any_layout=*/false,
    pack_rows_one_by_one<ref_pack_a_row>,
    ref_tile,
    ref_row_absmax_bits,
    ref_quantize_row,
};
}  // namespace w8a8_cpu
"""


def test_one_file_and_one_cmake_call_add_a_dispatched_exact_variant(tmp_path):
    (tmp_path / "throwaway.cpp").write_text(VARIANT_SOURCE)
    (tmp_path / "probe.cpp").write_text("int main() { return 0; }\n")
    (tmp_path / "extra.cmake").write_text(textwrap.dedent(f"""\
        w8a8_cpu_add_variant(throwaway SYMBOL kThrowawayKernel PRIORITY 900 FLAGS -O2
          PROBE {tmp_path / 'probe.cpp'} SOURCES {tmp_path / 'throwaway.cpp'})
        """))
    build = tmp_path / "build"
    configured = cmake_build(build, "-DW8A8_CPU_BUILD_TORCH_OPS=OFF", "-DW8A8_CPU_BUILD_KERNEL_TESTS=ON",
                             f"-DW8A8_CPU_EXTRA_VARIANTS={tmp_path / 'extra.cmake'}")
    assert "throwaway" in configured
    table = (build / "generated" / "variant_table.inc").read_text()
    assert "W8A8_CPU_VARIANT(throwaway, kThrowawayKernel, 900)" in table
    run = subprocess.run([str(build / "w8a8_kernel_tests"), "--shapes", "60", "--expect-selected", "throwaway"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr
    lines = run.stdout.splitlines()
    assert any("selected variant: throwaway" in line for line in lines)
    assert any(line.split()[:3] == ["throwaway", "matmul", "sweep:"] and line.endswith(" 0 mismatches")
               for line in lines), run.stdout[-3000:]
    assert "driver output bit-identical across" in run.stdout and run.stdout.rstrip().splitlines()[-1].startswith("OK")
