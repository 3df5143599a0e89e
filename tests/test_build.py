"""The op library built by a toolchain that links the C++ runtime statically still works beside torch.

A compiler that links libstdc++ statically by default (GCC configured with --with-static-standard-libraries; one
machine's /opt/gcc was) gave the op library its own copy of iostreams and locales next to the libstdc++.so that torch
loads: info() then printed garbage into its JSON (here) or crashed in std::ostream (there). The CMake file names the
shared libstdc++ before the compiler's own runtime; this builds the op library with -static-libstdc++ forced on and
checks that what it prints is right."""
import json
import platform
import shutil
import subprocess
import sys

import pytest

import w8a8_cpu
from conftest import cmake_build

pytestmark = [
    pytest.mark.slow_under_emulation,  # a native CMake build of the op library (~1 min on 2 cores)
    # GCC: the toolchain the fix is for (CMakeLists.txt names libstdc++ for GNU compilers)
    pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("g++") is None, reason="needs cmake and g++"),
]


def test_op_library_built_with_a_static_cxx_runtime_prints_right(tmp_path):
    build = tmp_path / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    cmake_build(build, *generator, "-DCMAKE_BUILD_TYPE=Release", "-DCMAKE_CXX_COMPILER=g++",
                f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_SHARED_LINKER_FLAGS=-static-libstdc++",
                target="w8a8_cpu_ops")
    library = build / "libw8a8_cpu_ops.so"
    # A fresh interpreter that loads only this library (not the installed package's), as the package's loader does.
    run = subprocess.run(
        [sys.executable, "-c", "import sys, torch; torch.ops.load_library(sys.argv[1]); "
         "print(torch.ops.w8a8_cpu._info())", str(library)],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(run.stdout)
    # the same report as the installed package's library (same source, same CPU): names and printed numbers
    installed = w8a8_cpu.info()
    assert set(report) <= set(installed) and report == {key: installed[key] for key in report}, (report, installed)
    assert report["panel_depth"] == 4 and report["arch"] == platform.machine()
