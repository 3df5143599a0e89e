"""The hostile-input suite: every surface that reads what a user or a file gives it (packed blobs, checkpoint
directories, the CLI commands, the Decoder, the model cache), fed generated hostile cases (tests/hostile/surfaces.py,
deterministic seeds). Each batch of cases runs in a child process with an address-space limit and a time limit; a case
passes with a ValueError naming its input or the exact (else finite) result; anything else, a crash or a hang is a
finding. W8A8_CPU_HOSTILE_CASES=N runs N cases per surface, SURFACE=N,... those of the surfaces named (default: each
surface's CI count, < 5 min in all);
W8A8_CPU_HOSTILE_FIRST the first seed. docs/SECURITY.md says what each surface promises. The vllm surface runs where
vLLM imports (ci/vllm-env.sh's venv; W8A8_CPU_TEST_VLLM=1 makes a missing vLLM a failure)."""
import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import python_command
from vllm_served import require_vllm

pytestmark = pytest.mark.slow_under_emulation

HERE = Path(__file__).resolve().parent
CI_CASES = {"blob": 300, "checkpoint": 60, "decoder": 60, "layer_op": 300, "cache": 40, "cli": 6,
            "vllm": 20}  # by default
BATCH = {"blob": 500, "checkpoint": 100, "decoder": 100, "layer_op": 1000, "cache": 100, "cli": 5,
         "vllm": 100}  # per child (vllm: an engine a case, started in the child's own process)
MEMORY_LIMIT = 8 << 30  # address space of a child (torch maps ~3 GB at import, vLLM with its KV cache ~3.2 GB)
SECONDS_PER_CASE = {"vllm": 60}  # else 10
SECONDS_TO_START = {"vllm": 300}  # else 60; vllm: its import, six tiny checkpoints, the first engine (~40 s quiet)


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
    if surface == "vllm":
        require_vllm()
    count = _cases(os.environ.get("W8A8_CPU_HOSTILE_CASES", ""), surface)
    first = int(os.environ.get("W8A8_CPU_HOSTILE_FIRST", "0"))
    counts, findings, details = {}, [], {}
    for start in range(first, first + count, BATCH[surface]):
        n = min(BATCH[surface], first + count - start)
        workdir = tmp_path / f"batch{start}"
        workdir.mkdir()
        env = {**os.environ, "TMPDIR": str(workdir), "PYTHONPATH": os.pathsep.join(sys.path)}
        try:
            r = subprocess.run([*python_command(), str(HERE / "child.py"), surface, str(start), str(n), str(workdir)],
                               capture_output=True, text=True, env=env, preexec_fn=_limits,
                               timeout=SECONDS_TO_START.get(surface, 60) + SECONDS_PER_CASE.get(surface, 10) * n)
            lines, failure = r.stdout.splitlines(), None if r.returncode == 0 else f"exit status {r.returncode}"
        except subprocess.TimeoutExpired as e:
            lines, failure = (e.stdout or b"").decode().splitlines(), "hang (time limit)"
        done = [json.loads(line) for line in lines if line.startswith("{")]
        for case in done:
            counts[case["verdict"]] = counts.get(case["verdict"], 0) + 1
            for field in ("kind", "by", "edits"):  # vllm: the kind, who refused, each edit (its values left out)
                for detail in filter(None, [case[field]] if isinstance(case.get(field), str) else case.get(field, [])):
                    key = f"{field} {re.sub(r'[(].*', '', detail)}"
                    details[key] = details.get(key, 0) + 1
            if case["verdict"] == "finding":
                findings.append(case)
        if failure is not None or len(done) != n:
            stderr = "" if failure == "hang (time limit)" else r.stderr[-2000:]
            findings.append({"seed": start + len(done), "verdict": "finding",
                             "why": f"{failure or 'missing output'}: {stderr}"})
    print(f"hostile {surface}: {count} cases from seed {first}: {counts}")
    for key, n in sorted(details.items()):
        print(f"  {n:6d}  {key}")
    assert not findings, findings[:5]
