"""Static throughput of the Arm and POWER micro-kernels: cross-compile each variant TU to assembly with the flags
its variants.cmake gives it, find every hot inner loop in the generated code (a loop whose body holds int8 MAC
instructions: sdot / smmla / smull(2) on Arm, vmsummbm / xvi8ger4(s)pp on POWER), and run llvm-mca on each loop
body for a few CPU models.

    python benchmarks/mca.py [--llvm-mca llvm-mca-19] [--json FILE] [--asm-dir DIR]

Per loop: MAC instructions and int8 MACs per iteration, llvm-mca cycles per iteration (steady state: total cycles /
iterations, and the block reciprocal throughput), MACs per cycle, and the peak of the same model: MACs per cycle
of a stream of independent MAC instructions of the loop's kind (so "% of peak" says how much of the MAC pipes
the loop keeps busy, load/address overhead and dependency chains included). Static estimates, no memory stalls.

Needs: g++-aarch64-linux-gnu, g++-powerpc64le-linux-gnu and an llvm-mca. Debian 12: `apt-get install llvm-19`
(llvm-mca-19, with Neoverse N1/V1/N2 and POWER9/POWER10 scheduling models). The default `llvm` package (14) runs
too, but its neoverse-n1/-v1 are the generic Cortex-A57-like model (identical numbers), so the newest llvm-mca-NN
on PATH is used unless --llvm-mca says otherwise. Reads csrc/, never writes it.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ARCHES = {
    "aarch64": {"cxx": "aarch64-linux-gnu-g++", "triple": "aarch64-linux-gnu",
                "cmake": "csrc/aarch64/variants.cmake",
                "cpus": {"neon": ["cortex-a72", "neoverse-n1", "neoverse-v1"],
                         "dotprod": ["neoverse-n1", "neoverse-v1"], "i8mm": ["neoverse-v1", "neoverse-n2"]},
                "mattr": "+dotprod,+i8mm"},
    "ppc64le": {"cxx": "powerpc64le-linux-gnu-g++", "triple": "powerpc64le-linux-gnu",
                "cmake": "csrc/ppc64/variants.cmake",
                "cpus": {"vsx": ["pwr9", "pwr10"], "mma": ["pwr10"]}, "mattr": ""},
}

# mnemonic -> (int8 MACs per instruction, synthetic peak stream: independent instructions for llvm-mca)
MAC_INSTRUCTIONS = {
    "sdot": (16, [f"sdot v{i}.4s, v28.16b, v29.16b" for i in range(24)]),
    "smmla": (32, [f"smmla v{i}.4s, v28.16b, v29.16b" for i in range(24)]),
    "smull": (8, [f"smull v{i}.8h, v28.8b, v29.8b" for i in range(24)]),
    "smull2": (8, [f"smull2 v{i}.8h, v28.16b, v29.16b" for i in range(24)]),
    "vmsummbm": (16, [f"vmsummbm {i}, 30, 31, {i}" for i in range(24)]),
    "xvi8ger4pp": (64, [f"xvi8ger4pp {i}, 32, 33" for i in range(8)]),
    "xvi8ger4spp": (64, [f"xvi8ger4spp {i}, 32, 33" for i in range(8)]),
}
BRANCH = re.compile(r"^\s*(b\.\w+|cbnz|cbz|tbnz|tbz|b|bne|bdnz|blt|bgt|ble|bge|beq)\s+(?:[\w]+,\s*)*(?:\d+,\s*)?(\.L\w+)\s*$")
LABEL = re.compile(r"^(\.?L?[\w.$]+):")


def parse_variants(cmake: Path) -> dict:
    """{variant: (flags, [sources])} from w8a8_cpu_add_variant(...) calls."""
    text = cmake.read_text()
    out = {}
    for m in re.finditer(r"w8a8_cpu_add_variant\((\w+)(.*?)\)", text, re.S):
        body = " ".join(line.split("#")[0] for line in m.group(2).splitlines())
        keyword = r"(?:\s+(?:SYMBOL|PRIORITY|USES|FLAGS|PROBE|SOURCES)\b|$)"
        flags = re.search(r"FLAGS\s+(.*?)" + keyword, body.strip())
        sources = re.search(r"SOURCES\s+(.*?)" + keyword, body.strip())
        out[m.group(1)] = (flags.group(1).split() if flags else [], sources.group(1).split() if sources else [])
    return out


def compile_asm(cxx: str, flags: list, source: Path, dest: Path) -> str:
    # -g only adds .loc lines (GCC emits the same code with and without it): they name each loop's source line
    cmd = [cxx, "-O3", "-g", "-std=c++17", "-ffp-contract=off", "-fno-trapping-math", "-fno-semantic-interposition",
           "-fPIC", "-DNDEBUG", *flags, f"-I{ROOT / 'csrc'}", "-S", "-o", str(dest), str(source)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return dest.read_text()


def demangle(names: list) -> dict:
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
        return dict(zip(names, out.splitlines()))
    except (OSError, subprocess.CalledProcessError):
        return {n: n for n in names}


def mnemonic(line: str) -> str:
    return line.split()[0] if line.split() else ""


def find_loops(asm: str) -> list:
    """Every backward-branch loop whose body contains MAC instructions: [{function, label, body, macs...}]."""
    lines = asm.splitlines()
    function, label_at, loops = "?", {}, []
    # .file N "name": .loc lines of csrc files only (an sdot inlined from arm_neon.h keeps the caller's line)
    own_files = {m.group(1) for m in re.finditer(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', asm, re.M)
                 if "csrc" in m.group(2) or not m.group(2).startswith("/")}
    for idx, raw in enumerate(lines):
        line = raw.split("//")[0].split("#")[0].rstrip() if not raw.lstrip().startswith("#") else ""
        m = LABEL.match(line)
        if m:
            name = m.group(1)
            if not name.startswith(".L") and not name.isdigit():
                function, label_at = name, {}
            label_at[name] = idx
            continue
        b = BRANCH.match(line)
        if not b or b.group(2) not in label_at:
            continue
        start = label_at[b.group(2)]
        body, src_lines, loc = [], {}, None
        for l in lines[start + 1:idx + 1]:
            l = l.split("//")[0].rstrip()
            s = l.strip()
            loc_m = re.match(r"\.loc\s+(\d+)\s+(\d+)", s)
            if loc_m and loc_m.group(1) in own_files:
                loc = int(loc_m.group(2))
            if mnemonic(s) in MAC_INSTRUCTIONS and loc is not None:
                src_lines[loc] = src_lines.get(loc, 0) + 1
            if not s or s.startswith(".") or LABEL.match(s) or s.startswith("#"):
                continue
            body.append(s)
        counts = {}
        for ins in body:
            op = mnemonic(ins)
            if op in MAC_INSTRUCTIONS:
                counts[op] = counts.get(op, 0) + 1
        if counts:
            loops.append({"function": function, "label": b.group(2), "body": body, "mac_instructions": counts,
                          "mac_source_lines": sorted(src_lines),
                          "macs_per_iter": sum(MAC_INSTRUCTIONS[op][0] * n for op, n in counts.items())})
    # an outer loop that contains an inner MAC loop is not a hot inner loop: keep innermost ones only
    inner = []
    for lp in loops:
        if not any(o is not lp and o["function"] == lp["function"] and len(o["body"]) < len(lp["body"])
                   and "\n".join(o["body"]) in "\n".join(lp["body"]) for o in loops):
            inner.append(lp)
    return inner


def run_mca(mca: str, triple: str, cpu: str, mattr: str, body: list, iterations: int = 300) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".s", delete=False) as f:
        f.write("\n".join(body) + "\n")
        path = f.name
    cmd = [mca, f"-mtriple={triple}", f"-mcpu={cpu}", *([f"-mattr={mattr}"] if mattr else []),
           f"-iterations={iterations}", path]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    Path(path).unlink()
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["llvm-mca failed"])[0]}
    total = int(re.search(r"Total Cycles:\s+(\d+)", proc.stdout).group(1))
    rthr = float(re.search(r"Block RThroughput:\s+([\d.]+)", proc.stdout).group(1))
    return {"cycles_per_iter": total / iterations, "block_rthroughput": rthr}


def peak(mca: str, triple: str, cpu: str, mattr: str, op: str) -> float:
    """MACs per cycle of a stream of independent `op` instructions under this llvm-mca model."""
    macs, stream = MAC_INSTRUCTIONS[op]
    r = run_mca(mca, triple, cpu, mattr, stream)
    return macs * len(stream) / r["cycles_per_iter"] if "cycles_per_iter" in r else float("nan")


def pick_mca(requested: str | None) -> str:
    if requested:
        return requested
    for name in ("llvm-mca-19", "llvm-mca-18", "llvm-mca-17", "llvm-mca-16", "llvm-mca-15", "llvm-mca", "llvm-mca-14"):
        if shutil.which(name):
            return name
    sys.exit("mca.py: no llvm-mca found: apt-get install llvm-19 (Debian 12), or pass --llvm-mca PATH")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llvm-mca", help="llvm-mca binary (default: newest llvm-mca-NN on PATH)")
    parser.add_argument("--json", metavar="FILE", help="write the table as JSON")
    parser.add_argument("--asm-dir", help="keep the generated assembly here")
    parser.add_argument("--arch", choices=list(ARCHES), action="append", help="only these (default both)")
    args = parser.parse_args(argv)
    mca = pick_mca(args.llvm_mca)
    version = subprocess.run([mca, "--version"], capture_output=True, text=True).stdout
    version = next((l.strip() for l in version.splitlines() if "version" in l.lower()), mca)
    asm_dir = Path(args.asm_dir or tempfile.mkdtemp(prefix="w8a8-mca-"))
    asm_dir.mkdir(parents=True, exist_ok=True)
    print(f"llvm-mca: {mca} ({version}); MACs = int8 multiply-accumulates; cycles/iter = llvm-mca steady state "
          f"(total cycles / iterations); peak = same model, independent stream of the loop's MAC instruction")
    header = (f"{'variant':<8} {'MAC source line(s), function':<44} {'cpu':<12} {'MAC instrs/iter':<20} {'MACs/iter':>9} "
              f"{'cyc/iter':>8} {'RThru':>6} {'MACs/cyc':>8} {'peak':>6} {'%peak':>6}")
    print(header)
    print("-" * len(header))
    rows = []
    for arch in args.arch or list(ARCHES):
        spec = ARCHES[arch]
        if not shutil.which(spec["cxx"]):
            print(f"{arch}: {spec['cxx']} not found (Debian: g++-{spec['triple'].replace('-linux-gnu', '')}"
                  f"-linux-gnu), skipped")
            continue
        for variant, (flags, sources) in parse_variants(ROOT / spec["cmake"]).items():
            cpus = spec["cpus"].get(variant, [])
            for src in sources:
                asm = compile_asm(spec["cxx"], flags, ROOT / src, asm_dir / f"{variant}.s")
                loops = find_loops(asm)
                names = demangle(sorted({lp["function"] for lp in loops}))
                for lp in loops:
                    fn = names.get(lp["function"], lp["function"])
                    fn = re.sub(r"w8a8_cpu::|\(anonymous namespace\)::", "", fn)
                    fn = re.sub(r"\(.*$", "", fn)
                    where = f"{Path(src).name}:{','.join(map(str, lp['mac_source_lines'])) or '?'} {fn}"
                    ops = ", ".join(f"{n} {op}" for op, n in sorted(lp["mac_instructions"].items()))
                    main_op = max(lp["mac_instructions"], key=lambda op: lp["mac_instructions"][op]
                                  * MAC_INSTRUCTIONS[op][0])
                    for cpu in cpus:
                        r = run_mca(mca, spec["triple"], cpu, spec["mattr"], lp["body"])
                        row = {"arch": arch, "variant": variant, "flags": flags, "function": fn, "label": lp["label"],
                               "source": f"{src}:{','.join(map(str, lp['mac_source_lines']))}",
                               "cpu": cpu, "instructions": len(lp["body"]), "mac_instructions": lp["mac_instructions"],
                               "macs_per_iter": lp["macs_per_iter"], **r}
                        if "cycles_per_iter" in r:
                            row["macs_per_cycle"] = lp["macs_per_iter"] / r["cycles_per_iter"]
                            row["peak_macs_per_cycle"] = peak(mca, spec["triple"], cpu, spec["mattr"], main_op)
                            row["fraction_of_peak"] = row["macs_per_cycle"] / row["peak_macs_per_cycle"]
                            print(f"{variant:<8} {where[:44]:<44} {cpu:<12} {ops:<20} "
                                  f"{lp['macs_per_iter']:>9} {r['cycles_per_iter']:>8.2f} {r['block_rthroughput']:>6.2f} "
                                  f"{row['macs_per_cycle']:>8.1f} {row['peak_macs_per_cycle']:>6.1f} "
                                  f"{100 * row['fraction_of_peak']:>5.0f}%")
                        else:
                            print(f"{variant:<8} {where[:44]:<44} {cpu:<12} {ops:<20} "
                                  f"{lp['macs_per_iter']:>9}  llvm-mca: {r['error']}")
                        rows.append(row)
    print(f"(assembly in {asm_dir})")
    if args.json:
        Path(args.json).write_text(json.dumps({"llvm_mca": version, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
