#!/usr/bin/env python3
"""Offline verification of the conda recipe (recipe/) with real conda tooling from PyPI.

    python ci/conda/verify.py [--skip-aarch64] [--require-aarch64]

No conda channel is reachable here, so conda-build / rattler-build cannot solve their build environments.
Instead every step uses the real tools where they work offline and stages the rest:

1. render   recipe/recipe.yaml with py-rattler-build (ci/conda/conda_build_config.yaml = trimmed conda-forge
            pinning, merged with recipe/variants.yaml) for linux-64, linux-aarch64 and linux-ppc64le, native and
            cross from linux-64, and assert the rendered requirements / variants / tests.
2. build    run the real recipe/build.sh for linux-64 against a staged $PREFIX (a venv with python + torch==2.13.0
            + the recipe's other host requirements from PyPI), collect the files it added to $PREFIX and pack
            them into a .conda with rattler_build.assemble_package (metadata from the rendered recipe).
3. install  index a file:// channel with py-rattler, install the package from it into a fresh prefix with
            py-rattler, and run the recipe's own tests (rendered `tests:`) against that installed copy, with the
            staged python/torch on PATH.
4. cross    the same for linux-aarch64: build.sh cross-compiles with aarch64-linux-gnu-g++ against the aarch64
            torch of ci/emulate-python's cache (build/emulated-aarch64: Debian arm64 rootfs + torch 2.10.0), runs
            the kernel tests through $CROSSCOMPILING_EMULATOR (qemu-aarch64), and the recipe's tests run under
            qemu-aarch64 with that rootfs' python. Skipped (with a message) when that cache or the cross tools
            are missing; build it with `bash ci/emulate-python aarch64 max python -c pass`.

What only networked CI can do (solving conda-forge/Open-CE environments, the run_exports of the real pytorch and
python packages, conda-build proper): see ci/conda/README.md.
Everything lands in build/conda-verify/ (channel: build/conda-verify/channel).
"""
from __future__ import annotations

import argparse
import asyncio
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
W = ROOT / "build" / "conda-verify"
RECIPE = ROOT / "recipe"
CBC = ROOT / "ci" / "conda" / "conda_build_config.yaml"
EMU = ROOT / "build" / "emulated-aarch64"

TOOLS = {"rattler_build": "py-rattler-build==0.73.0", "rattler": "py-rattler==0.28.0"}
TORCH_X86 = "torch==2.13.0"
HOST_PIP = ["scikit-build-core==1.1.2", "pip"]       # recipe host: python, pip, scikit-build-core (+ pytorch)
PYVER = f"{sys.version_info.major}.{sys.version_info.minor}"
ARCH_OF = {"linux-64": "x86_64", "linux-aarch64": "aarch64", "linux-ppc64le": "ppc64le"}

T0 = time.time()
SUMMARY: list[str] = []


def log(msg: str) -> None:
    print(f"[conda-verify {time.time() - T0:6.1f}s] {msg}", flush=True)


def run(cmd, **kw):
    log("$ " + (cmd if isinstance(cmd, str) else " ".join(map(str, cmd))))
    return subprocess.run(cmd, check=True, **kw)


def ensure_tools() -> None:
    missing = []
    for mod, req in TOOLS.items():
        try:
            __import__(mod)
        except ImportError:
            missing.append(req)
    if missing:
        run([sys.executable, "-m", "pip", "install", "--quiet", *missing])
    if not shutil.which("ninja"):  # build requirement; conda's comes from the build env
        run([sys.executable, "-m", "pip", "install", "--quiet", "ninja"])
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    for tool in ("cmake", "ninja", "g++"):
        if not shutil.which(tool):
            sys.exit(f"conda-verify: missing build tool {tool} (apt-get install build-essential cmake)")


# ------------------------------------------------------------------------------------------------ 1. render
def variant_config(target: str, build: str, extra_yaml: str | None = None):
    from rattler_build import JinjaConfig, PlatformConfig, VariantConfig

    jinja = JinjaConfig(platform=PlatformConfig(target_platform=target, build_platform=build, host_platform=target))
    vc = VariantConfig.from_conda_build_config(CBC, jinja).merge(
        VariantConfig.from_file_with_context(RECIPE / "variants.yaml", jinja))
    if extra_yaml:
        vc = vc.merge(VariantConfig.from_yaml(extra_yaml))
    return vc


def render(target: str, build: str = "linux-64", extra_yaml: str | None = None):
    from rattler_build import PlatformConfig, RenderConfig, Stage0Recipe

    recipe = Stage0Recipe.from_file(RECIPE / "recipe.yaml")
    platform = PlatformConfig(target_platform=target, build_platform=build, host_platform=target)
    return recipe.render(variant_config(target, build, extra_yaml), RenderConfig(platform=platform))


def names(reqs) -> list[str]:
    return [r.split()[0] if isinstance(r, str) else next(iter(r.values()))["name"] for r in reqs]


def step_render() -> None:
    for target, build in [("linux-64", "linux-64"), ("linux-aarch64", "linux-64"), ("linux-aarch64", "linux-aarch64"),
                          ("linux-ppc64le", "linux-64"), ("linux-ppc64le", "linux-ppc64le")]:
        variants = render(target, build)
        cross = target != build
        torch_pkg = "pytorch-base" if target == "linux-ppc64le" else "pytorch"
        pythons = sorted(v.variant["python"].split()[0] for v in variants)
        want_py = ["3.10.*", "3.11.*"] if target == "linux-ppc64le" else ["3.10.*", "3.11.*", "3.12.*", "3.13.*"]
        assert pythons == want_py, (target, pythons)
        strings = set()
        for v in variants:
            d = v.recipe.to_dict()
            req = d["requirements"]
            b, h, r = names(req.get("build", [])), names(req["host"]), names(req.get("run", []))
            sub = target
            assert f"gxx_{sub}" in b and f"sysroot_{sub}" in b and "cmake" in b and "ninja" in b, b
            assert ("cross-python_" + target in b) == cross, (target, build, b)
            assert ("python" in b) == cross and (torch_pkg in b) == cross, (target, build, b)
            assert h == ["python", "pip", "scikit-build-core", torch_pkg], h
            # bare torch in host: the version comes from the variant (pytorch key) / the channel
            assert [x for x in req["host"] if names([x])[0] == torch_pkg] == [torch_pkg], req["host"]
            if target == "linux-ppc64le":
                # Open-CE's pytorch-base has no run_exports: explicit pin_compatible, minor pinned
                pins = [x for x in req["run"] if isinstance(x, dict)]
                assert pins and pins[0]["pin_compatible"]["name"] == "pytorch-base", req["run"]
                assert pins[0]["pin_compatible"]["upper_bound"] == "x.x", pins
                assert "pytorch" not in v.variant
            else:
                assert r == ["python"], r
                assert v.variant["pytorch"] == "2.12", v.variant  # the pinning's minor selects the host pytorch
            assert v.variant["c_stdlib_version"] == "2.17" and v.variant["cxx_compiler_version"] == "15", v.variant
            tests = d["tests"]
            assert tests[0]["python"]["imports"] == ["w8a8_cpu", "w8a8_cpu.nn"], tests
            assert tests[1]["script"]["env"]["W8A8_EXPECTED_ARCH"] == ARCH_OF[target], tests
            assert any("--pyargs w8a8_cpu.tests" in c for c in tests[1]["script"]["content"]), tests
            assert d["build"]["string"].startswith("py3") and d["build"]["string"].endswith("_0"), d["build"]
            strings.add(d["build"]["string"])
        assert len(strings) == len(variants), strings  # one distinct build string per python
        if target != "linux-ppc64le":
            # the pytorch pin is part of the variant hash: another pytorch minor is another build
            other = render(target, build, "pytorch:\n  - '2.11'\n")
            assert {v.recipe.build.string for v in other}.isdisjoint(strings)
        log(f"render {target} (build {build}): {len(variants)} variants {pythons}, build={b} host={h} run={req.get('run')}")
    SUMMARY.append("render: linux-64, linux-aarch64 (native+cross), linux-ppc64le (native+cross): all assertions OK")


# ------------------------------------------------------------------------------------------------ 2. build
def make_venv(path: Path, packages: list[str], key: str) -> Path:
    stamp = path / ".w8a8-stamp"
    if stamp.exists() and stamp.read_text() == key:
        return path
    shutil.rmtree(path, ignore_errors=True)
    venv.EnvBuilder(with_pip=True, symlinks=True).create(path)
    if packages:
        run([path / "bin" / "python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *packages])
    stamp.write_text(key)
    return path


def snapshot(prefix: Path) -> set[str]:
    out = set()
    for dirpath, dirnames, filenames in os.walk(prefix):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            out.add(os.path.relpath(os.path.join(dirpath, name), prefix))
    return out


def stage_source(rendered, dest: Path) -> None:
    """The recipe's source (path: .. + filter), copied like rattler-build does into the work dir."""
    src = rendered.recipe.to_dict()["source"][0]
    base = (RECIPE / src["path"]).resolve()
    filt = src.get("filter", {})
    include = filt.get("include", filt) if isinstance(filt, dict) else filt
    shutil.rmtree(dest, ignore_errors=True)
    for dirpath, dirnames, filenames in os.walk(base):
        rel_dir = os.path.relpath(dirpath, base)
        dirnames[:] = [d for d in dirnames if not (rel_dir == "." and d in ("build", ".git"))]
        for f in filenames:
            rel = os.path.normpath(os.path.join(rel_dir, f))
            if any(fnmatch.fnmatch(rel, pat) or (pat.endswith("/**") and rel.startswith(pat[:-2])) for pat in include):
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(base / rel, dest / rel)


def run_exports_pin(name: str, version: str) -> str:
    """What the host package's run_exports add to run: (pin_subpackage(name, upper_bound='x.x')), as
    conda-forge's python and pytorch packages declare. The exports themselves live in the channel's packages
    (unreachable here), so the pin is computed from the staged host version."""
    major, minor = (int(x) for x in version.split(".")[:2])
    return f"{name} >={major}.{minor},<{major}.{minor + 1}.0a0"


def build_package(target: str, rendered, prefix: Path, env_extra: dict, torch_version: str,
                  torch_pkg: str = "pytorch") -> Path:
    from rattler_build import ArchiveType, assemble_package

    d = rendered.recipe.to_dict()
    work = W / target
    src = work / "src"
    stage_source(rendered, src)
    before = snapshot(prefix)
    env = dict(os.environ, PREFIX=str(prefix), SRC_DIR=str(src), RECIPE_DIR=str(RECIPE),
               PYTHON=str(prefix / "bin" / "python"), SP_DIR=str(prefix / "lib" / f"python{PYVER}" / "site-packages"),
               PKG_NAME=d["package"]["name"], PKG_VERSION=d["package"]["version"], PKG_BUILDNUM=str(d["build"]["number"]),
               CPU_COUNT=str(os.cpu_count() or 2), PIP_NO_INDEX="1", PIP_NO_BUILD_ISOLATION="1",
               PATH=f"{prefix / 'bin'}{os.pathsep}{os.environ['PATH']}", **env_extra)
    t = time.time()
    with open(work / "build.log", "w") as logf:
        p = subprocess.run(["bash", str(RECIPE / d["build"]["script"])], cwd=src, env=env, stdout=logf,
                           stderr=subprocess.STDOUT)
    text = (work / "build.log").read_text()
    if p.returncode:
        print(text[-6000:])
        raise SystemExit(f"conda-verify: build.sh failed for {target} (log: {work / 'build.log'})")
    ctest = [ln for ln in text.splitlines() if "tests passed" in ln or "kernel tests built nowhere" in ln]
    log(f"build.sh {target}: {time.time() - t:.0f} s; {ctest}")
    new = sorted(snapshot(prefix) - before)
    # only what the package installed; pip's byproducts for other packages are not ours
    new = [f for f in new if "w8a8" in f.split(os.sep)[-1] or "w8a8_cpu" in f or f.startswith("bin/w8a8-cpu")]
    files = work / "files"
    shutil.rmtree(files, ignore_errors=True)
    for rel in new:
        (files / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(prefix / rel, files / rel, follow_symlinks=False)
    for rel in sorted(new, reverse=True):  # restore the staged host env (so tests see only the installed copy)
        (prefix / rel).unlink()
    for dirpath, dirnames, _ in os.walk(prefix, topdown=False):
        if "w8a8" in dirpath and not os.listdir(dirpath):
            os.rmdir(dirpath)
    assert any(f.endswith(".so") and "libw8a8_cpu_ops" in f for f in new), new
    assert any(f.endswith("w8a8_cpu/tests/test_smoke.py") for f in new), new

    # metadata from the rendered recipe; run deps = rendered run + the run_exports of python / pytorch in host
    depends = []
    for r in d["requirements"].get("run", []):
        if isinstance(r, dict) and "pin_compatible" in r:
            depends.append(run_exports_pin(r["pin_compatible"]["name"], torch_version))
        elif r == "python":
            depends += [run_exports_pin("python", PYVER), f"python_abi {PYVER}.* *_cp{PYVER.replace('.', '')}"]
        else:
            depends.append(r)
    if torch_pkg in names(d["requirements"]["host"]) and not any(x.startswith(torch_pkg + " ") for x in depends):
        depends.append(run_exports_pin(torch_pkg, torch_version))
    about = d["about"]
    out_dir = W / "channel" / target
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob(f"{d['package']['name']}-*"):
        old.unlink()
    out = assemble_package(
        name=d["package"]["name"], version=str(d["package"]["version"]), target_platform=target,
        build_string=d["build"]["string"], build_number=d["build"]["number"], output_dir=out_dir, files_dir=files,
        license=about.get("license"), summary=about.get("summary"), description=about.get("description"),
        license_files=[src / f for f in about.get("license_file", [])], depends=depends, recipe_dir=RECIPE,
        archive_type=ArchiveType.Conda)
    log(f"packed {out.path.name} ({out.path.stat().st_size / 1024:.0f} KiB, {len(new)} files) depends={depends}")
    SUMMARY.append(f"build {target}: {out.path.relative_to(ROOT)} {out.path.stat().st_size / 1024:.0f} KiB, "
                   f"{len(new)} files, depends={depends}; {ctest[:1]}")
    return out.path


# ------------------------------------------------------------------------------------------------ 3. install + test
def install_from_channel(target: str, pkg: Path) -> Path:
    import rattler
    from rattler.index import index_fs

    channel_dir = W / "channel"
    (channel_dir / "noarch").mkdir(parents=True, exist_ok=True)
    asyncio.run(index_fs(channel_dir, target_platform=rattler.Platform(target), force=True))
    repodata = channel_dir / target / "repodata.json"
    channel = rattler.Channel(channel_dir.as_uri())
    sparse = rattler.SparseRepoData(channel, target, repodata)
    records = [r for r in sparse.load_records("w8a8-cpu") if r.file_name == pkg.name]
    assert len(records) == 1, records
    rec = records[0]
    log(f"indexed {channel.base_url if hasattr(channel, 'base_url') else channel_dir}: {rec.name} {rec.version} "
        f"{rec.build} subdir={rec.subdir} depends={rec.depends}")
    # Only our package: its dependencies (python, pytorch, python_abi) live on conda-forge, which cannot be
    # solved offline; the tests take python/torch from the staged environment instead.
    prefix = W / target / "installed"
    shutil.rmtree(prefix, ignore_errors=True)
    asyncio.run(rattler.install([rec], target_prefix=prefix, cache_dir=W / "pkgs-cache", platform=rattler.Platform(target),
                                show_progress=False, execute_link_scripts=False))
    assert (prefix / "conda-meta").is_dir()
    return prefix


def run_recipe_tests(target: str, rendered, installed: Path, python_bin: Path, extra_pythonpath: list[str],
                     env_extra: dict | None = None) -> None:
    """The rendered recipe's tests, command for command, in a temp dir (so no source tree is importable)."""
    tests = rendered.recipe.to_dict()["tests"]
    sp = installed / "lib" / f"python{PYVER}" / "site-packages"
    env = dict(os.environ, PATH=f"{python_bin}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=os.pathsep.join([str(sp), *extra_pythonpath]), PYTHONDONTWRITEBYTECODE="1",
               **(env_extra or {}))
    cwd = W / target / "test-cwd"
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir(parents=True)
    commands = [f"python -c \"import w8a8_cpu, sys; f = w8a8_cpu.__file__; print(f); "
                f"assert f.startswith('{installed}'), f\""]
    for t in tests:
        if "python" in t:
            commands += [f"python -c 'import {m}'" for m in t["python"]["imports"]]
        if "script" in t:
            env.update(t["script"].get("env", {}))
            commands += t["script"]["content"]
    n_pytest = ""
    for c in commands:
        t = time.time()
        p = subprocess.run(["bash", "-ec", c], cwd=cwd, env=env, capture_output=True, text=True)
        out = (p.stdout + p.stderr).strip()
        log(f"test {target}: {c[:100]}{'...' if len(c) > 100 else ''} -> rc {p.returncode} ({time.time() - t:.0f} s)")
        print("    " + "\n    ".join(out.splitlines()[-6:]), flush=True)
        if p.returncode:
            raise SystemExit(f"conda-verify: recipe test failed for {target}: {c}")
        if "pytest" in c:
            n_pytest = out.splitlines()[-1]
    SUMMARY.append(f"tests {target}: {len(commands)} commands OK (installed copy {installed.relative_to(ROOT)}); "
                   f"pytest: {n_pytest}")


def step_linux64() -> None:
    variant = f"python:\n  - {PYVER}.* *_cpython\nis_python_min:\n  - false\npytorch:\n  - '2.13'\n"
    rendered = render("linux-64", "linux-64", variant)
    assert len(rendered) == 1
    prefix = make_venv(W / "linux-64" / "prefix", [TORCH_X86, *HOST_PIP], key=f"{TORCH_X86} {HOST_PIP}")
    torch_version = subprocess.check_output([prefix / "bin" / "python", "-c", "import torch; print(torch.__version__)"],
                                            text=True).strip()
    pkg = build_package("linux-64", rendered[0], prefix, {
        "target_platform": "linux-64", "build_platform": "linux-64",
        "CMAKE_ARGS": f"-DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX={prefix} -DCMAKE_INSTALL_LIBDIR=lib"},
        torch_version)
    installed = install_from_channel("linux-64", pkg)
    # test requirements (pytest) go into the staged env, which provides python + torch to the tests
    run([prefix / "bin" / "python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "pytest", "numpy"])
    run_recipe_tests("linux-64", rendered[0], installed, prefix / "bin", [])


def step_aarch64(require: bool) -> None:
    why = []
    for stamp in ("rootfs", "site"):
        if not (EMU / f".stamp-{stamp}").exists():
            why.append(f"{EMU.relative_to(ROOT)}/.stamp-{stamp} missing")
    for tool in ("aarch64-linux-gnu-g++", "aarch64-linux-gnu-gcc", "qemu-aarch64"):
        if not shutil.which(tool):
            why.append(f"{tool} not installed")
    emu_py = EMU / "rootfs" / "usr" / "bin" / f"python{PYVER}"
    if not why and not emu_py.exists():
        why.append(f"{emu_py} missing (the emulated python must match the host python {PYVER})")
    if why:
        msg = "SKIPPED cross linux-aarch64: " + "; ".join(why) + \
              " (build the cache with: bash ci/emulate-python aarch64 max python -c pass)"
        log(msg)
        SUMMARY.append(msg)
        if require:
            raise SystemExit(msg)
        return
    site = EMU / "site"
    torch_version = json.loads(subprocess.check_output(
        [sys.executable, "-c", "import json,sys,glob; d=glob.glob(sys.argv[1]+'/torch-*.dist-info')[0]; "
         "print(json.dumps(d.split('torch-')[1].split('.dist-info')[0]))", str(site)], text=True))
    variant = (f"python:\n  - {PYVER}.* *_cpython\nis_python_min:\n  - false\n"
               f"pytorch:\n  - '{'.'.join(torch_version.split('.')[:2])}'\n")
    rendered = render("linux-aarch64", "linux-64", variant)
    assert len(rendered) == 1
    # The staged cross $PREFIX: like cross-python, a build-arch python whose site-packages is the target prefix's;
    # host requirements: scikit-build-core + pip (noarch) and the target's (aarch64) torch.
    prefix = make_venv(W / "linux-aarch64" / "prefix", HOST_PIP, key=f"{HOST_PIP} {torch_version}")
    sp = prefix / "lib" / f"python{PYVER}" / "site-packages"
    if not (sp / "torch").exists():
        (sp / "torch").symlink_to(site / "torch")
    qemu = shutil.which("qemu-aarch64")
    sysroot = "/usr/aarch64-linux-gnu"
    pkg = build_package("linux-aarch64", rendered[0], prefix, {
        "target_platform": "linux-aarch64", "build_platform": "linux-64", "CONDA_BUILD_CROSS_COMPILATION": "1",
        "CC": "aarch64-linux-gnu-gcc", "CXX": "aarch64-linux-gnu-g++",
        "CROSSCOMPILING_EMULATOR": qemu, "QEMU_LD_PREFIX": sysroot, "QEMU_CPU": "max",
        # what conda-forge's compiler activation puts in CMAKE_ARGS for a cross build
        "CMAKE_ARGS": f"-DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX={prefix} -DCMAKE_INSTALL_LIBDIR=lib "
                      f"-DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64 "
                      f"-DCMAKE_C_COMPILER=aarch64-linux-gnu-gcc -DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++"},
        torch_version)
    so = next((W / "linux-aarch64" / "files").rglob("libw8a8_cpu_ops*.so"))
    machine = subprocess.check_output(["file", "-b", so], text=True) if shutil.which("file") else ""
    assert not machine or "aarch64" in machine, machine
    installed = install_from_channel("linux-aarch64", pkg)
    # `python` for the tests: the rootfs' aarch64 CPython under qemu-user (as ci/emulate-python runs it)
    wrap = W / "linux-aarch64" / "qemu-bin"
    wrap.mkdir(parents=True, exist_ok=True)
    (wrap / "python").write_text(f'#!/bin/sh\nexec "{qemu}" "{emu_py}" "$@"\n')
    (wrap / "python").chmod(0o755)
    run_recipe_tests("linux-aarch64", rendered[0], installed, wrap, [str(site)],
                     {"QEMU_LD_PREFIX": str(EMU / "rootfs"), "QEMU_CPU": "max"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skip-aarch64", action="store_true", help="skip step 4 (cross linux-aarch64)")
    ap.add_argument("--require-aarch64", action="store_true", help="fail instead of skipping step 4")
    args = ap.parse_args()
    W.mkdir(parents=True, exist_ok=True)
    ensure_tools()
    t = time.time(); step_render(); log(f"step 1 render: {time.time() - t:.1f} s")
    t = time.time(); step_linux64(); log(f"steps 2-3 linux-64: {time.time() - t:.1f} s")
    if args.skip_aarch64:
        SUMMARY.append("SKIPPED cross linux-aarch64 (--skip-aarch64)")
    else:
        t = time.time(); step_aarch64(args.require_aarch64); log(f"step 4 linux-aarch64: {time.time() - t:.1f} s")
    print("\n== conda-verify summary ==")
    for line in SUMMARY:
        print(" - " + line)
    print(f"total {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
