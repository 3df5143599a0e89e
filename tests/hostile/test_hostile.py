"""The hostile-input suite: every surface that reads what a user or a file gives it (packed blobs, checkpoint
directories, the CLI commands, the Decoder, the model cache), fed generated hostile cases (tests/hostile/surfaces.py,
deterministic seeds). Each batch of cases runs in a child process with an address-space limit and a time limit; a case
passes with a ValueError naming its input or the exact (else finite) result; anything else, a crash or a hang is a
finding. W8A8_CPU_HOSTILE_CASES=N runs N cases per surface, SURFACE=N,... those of the surfaces named (default: each
surface's CI count, < 5 min in all);
W8A8_CPU_HOSTILE_FIRST the first seed. docs/SECURITY.md says what each surface promises."""
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import python_command

pytestmark = pytest.mark.slow_under_emulation

HERE = Path(__file__).resolve().parent
CI_CASES = {"blob": 300, "checkpoint": 60, "decoder": 60, "layer_op": 300, "cache": 40, "cli": 6}  # by default
BATCH = {"blob": 500, "checkpoint": 100, "decoder": 100, "layer_op": 1000, "cache": 100, "cli": 5}  # per child
MEMORY_LIMIT = 8 << 30  # address space of a child (torch maps ~3 GB at import)
SECONDS_PER_CASE = 10


def _cases(setting: str, surface: str) -> int:
    """W8A8_CPU_HOSTILE_CASES: N (every surface), or SURFACE=N,... (the surfaces named; the others their CI count)."""
    if setting.strip().isdigit():
        return int(setting)
    counts = dict(item.split("=", 1) for item in setting.replace(" ", "").split(",") if "=" in item)
    return int(counts.get(surface, CI_CASES[surface]))


def _limits():
    if "libasan" not in os.environ.get("LD_PRELOAD", ""):  # ASan reserves terabytes of shadow address space
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    os.setsid()


@pytest.mark.parametrize("surface", sorted(CI_CASES))
def test_hostile_cases(surface, tmp_path):
    if surface == "checkpoint" or surface == "decoder":
        pytest.importorskip("transformers")
    count = _cases(os.environ.get("W8A8_CPU_HOSTILE_CASES", ""), surface)
    first = int(os.environ.get("W8A8_CPU_HOSTILE_FIRST", "0"))
    counts, findings = {}, []
    for start in range(first, first + count, BATCH[surface]):
        n = min(BATCH[surface], first + count - start)
        workdir = tmp_path / f"batch{start}"
        workdir.mkdir()
        env = {**os.environ, "TMPDIR": str(workdir), "PYTHONPATH": os.pathsep.join(sys.path)}
        try:
            r = subprocess.run([*python_command(), str(HERE / "child.py"), surface, str(start), str(n), str(workdir)],
                               capture_output=True, text=True, env=env, preexec_fn=_limits,
                               timeout=60 + SECONDS_PER_CASE * n)
            lines, failure = r.stdout.splitlines(), None if r.returncode == 0 else f"exit status {r.returncode}"
        except subprocess.TimeoutExpired as e:
            lines, failure = (e.stdout or b"").decode().splitlines(), "hang (time limit)"
        done = [json.loads(line) for line in lines if line.startswith("{")]
        for case in done:
            counts[case["verdict"]] = counts.get(case["verdict"], 0) + 1
            if case["verdict"] == "finding":
                findings.append(case)
        if failure is not None or len(done) != n:
            stderr = "" if failure == "hang (time limit)" else r.stderr[-2000:]
            findings.append({"seed": start + len(done), "verdict": "finding",
                             "why": f"{failure or 'missing output'}: {stderr}"})
    print(f"hostile {surface}: {count} cases from seed {first}: {counts}")
    assert not findings, findings[:5]
