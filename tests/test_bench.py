"""python -m w8a8_cpu bench --quick: the benchmark suite runs end to end and writes well-formed JSON (and a plot when
matplotlib is importable; under CI=true it must be); benchmarks/targets.py and benchmarks/linear.py turn a run into
the project's targets. Structure and positivity only: timings are never asserted (shared, noisy machines)."""
import importlib.util
import json
import math
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import python_command
from w8a8_cpu.cli.read_limit import MAX_RING_BYTES, ReadRing, _cache_size_bytes, ring_windows
from w8a8_cpu.cli.timing import interleaved

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

pytestmark = pytest.mark.slow_under_emulation


def _positive(value):
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("way", ["plain", "prefetch", "nta"])
def test_read_probe_reads_every_byte(way, threads):
    """bench's read limit reads the whole buffer: its checksum is the xor of every 8-byte word, whatever the way and
    the thread count."""
    buffer = torch.randint(0, 256, (256 * 37,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    expected = int(np.bitwise_xor.reduce(buffer.numpy().view(np.uint64)).view(np.int64))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.ops.w8a8_cpu._read_probe(buffer, way) == expected
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("buffer, way, message", [
    (torch.zeros(512, dtype=torch.uint8), "fast", "way must be"),
    (torch.zeros(300, dtype=torch.uint8), "plain", "multiple of 256"),
    (torch.zeros(0, dtype=torch.uint8), "plain", "positive multiple"),
    (torch.zeros(128, dtype=torch.int32), "plain", "uint8"),
    (torch.zeros(2, 256, dtype=torch.uint8), "plain", "1-D"),
])
def test_read_probe_refuses(buffer, way, message):
    with pytest.raises(ValueError, match=message):
        torch.ops.w8a8_cpu._read_probe(buffer, way)


def test_bench_quick_json_and_plot(tmp_path):
    out = tmp_path / "out.json"
    argv = [*python_command(), "-m", "w8a8_cpu", "bench", "--quick", "--no-progress", "--json", str(out)]
    have_mpl = importlib.util.find_spec("matplotlib") is not None
    if not have_mpl and os.environ.get("CI"):  # as test_demo: CI installs the optional part instead of skipping it
        pytest.fail("CI must install matplotlib (the bench extra) for the --plot part of this test")
    if have_mpl:
        argv += ["--plot", str(tmp_path / "out.png")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "targets" not in proc.stdout  # the packaged bench prints results only: targets are benchmarks/'
    result = json.loads(out.read_text())

    assert result["quick"] is True and result["threads"] >= 1 and result["reps"] >= 1
    assert _positive(result["read_bandwidth_gbs"])
    assert result["linear"], "quick mode runs at least one linear case"
    for case in result["linear"]:
        assert {"shape", "m", "n", "k", "phase", "results", "speedup"} <= set(case)
        assert "w8a8_cpu" in case["results"] and "torch fp32" in case["results"]
        for cand, r in case["results"].items():
            assert all(_positive(r[key]) for key in ("ms", "gops", "weight_gbs", "weight_bytes")), (cand, r)
        assert set(case["speedup"]) == set(case["results"]) - {"w8a8_cpu", "w8a8_cpu stack", "W4A8 stack"}
        assert all(_positive(v) for v in case["speedup"].values())
        # --quick runs decode M only: each has the same rounds' reads, which are no candidates of their own, and a
        # limit that is the best of them and of every baseline's bytes per second
        assert _positive(case["read_gbs"]) and not any(c.startswith("read ") for c in case["results"])
        assert case["read_way"] in ("read plain", "read prefetch", "read nta")
        peers = [r["weight_gbs"] for c, r in case["results"].items() if c in case["speedup"] and "w8a8_cpu" not in c]
        assert case["limit_gbs"] == max([case["read_gbs"]] + peers)
        assert case["decode_efficiency"] == pytest.approx(case["results"]["w8a8_cpu"]["weight_gbs"] / case["limit_gbs"])
        # and ours as a model's decode runs it: distinct copies back to back, timed per layer (no speedup of its own)
        stack = case["results"]["w8a8_cpu stack"]
        assert case["stack_copies"] >= 2 and case["stack_copies"] * case["n"] * case["k"] >= 64 << 20
        assert stack["rel_error"] == case["results"]["w8a8_cpu"]["rel_error"]
        assert case["stack_decode_efficiency"] == pytest.approx(stack["weight_gbs"] / case["limit_gbs"])
        assert case["w4a8_stack_decode_efficiency"] == pytest.approx(
            case["results"]["W4A8 stack"]["weight_gbs"] / case["limit_gbs"])
    assert result["overhead_us"] and all(_positive(v) for v in result["overhead_us"].values())
    assert result["moe"]
    for case in result["moe"]:
        assert all(_positive(v) for v in case["ms"].values()) and all(_positive(v) for v in case["speedup"].values())
    assert "targets" not in result
    targets = subprocess.run([*python_command(), str(BENCHMARKS / "targets.py"), str(out)], capture_output=True,
                             text=True, timeout=300)
    assert targets.returncode == 0, targets.stdout + targets.stderr
    _check_targets_block(targets.stdout, measured=True)
    if have_mpl:
        png = (tmp_path / "out.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


def _check_targets_block(stdout, measured):
    """benchmarks/targets.py's block: a header, then one PASS / FAIL / n/a line per target (some measured)."""
    after = stdout[stdout.index("targets (from this run; not asserted):"):].splitlines()[1:]
    lines = after[:next((i for i, line in enumerate(after) if not line.startswith("  ")), len(after))]
    assert lines and all(line.split()[0] in ("PASS", "FAIL", "n/a") for line in lines), stdout
    assert any(line.split()[0] != "n/a" for line in lines) == measured, stdout


def test_linear_script_adds_the_targets_to_each_run(tmp_path):
    """benchmarks/linear.py: the packaged suite, then each run's targets, printed and in its JSON (here the cheapest
    run: the read reference and the per-call overhead only)."""
    out = tmp_path / "run.json"
    argv = [*python_command(), str(BENCHMARKS / "linear.py"), "--no-linear", "--no-moe", "--reps", "1", "--warmup", "0",
            "--quick", "--no-progress", "--json", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check_targets_block(proc.stdout, measured=True)  # the per-call overhead target
    result = json.loads(out.read_text())
    assert result["targets"]
    for target in result["targets"]:
        assert {"name", "value", "goal", "pass"} <= set(target)
        assert target["value"] is None or _positive(target["value"])
        assert target["pass"] in (True, False, None)


def test_bench_threads_sweep_busy_and_error_column(tmp_path):
    """--threads 1 2 --busy: one run per thread count under a competing spinning process (killed afterwards), every
    candidate's error against the fp64 product, ONNX Runtime among the candidates when it is installed; W4A8 in
    groups of 128 (--w4a8-group-size), its bytes counted as such."""
    out = tmp_path / "sweep.json"
    argv = [*python_command(), "-m", "w8a8_cpu", "bench", "--threads", "1", "2", "--busy", "--shapes", "576x576",
            "--m", "1", "--no-moe", "--reps", "2", "--warmup", "1", "--no-progress", "--json", str(out),
            "--w4a8-group-size", "128"]
    # In a process group of its own, which the busy process inherits: one that outlives the bench is found by group
    # (not by its command line, which another process on the machine may share) and killed with it.
    bench = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = bench.communicate(timeout=900)
    finally:
        try:
            os.killpg(bench.pid, signal.SIGKILL)
            outlived = True
        except ProcessLookupError:  # the group is empty: the bench and everything it started have exited
            outlived = False
    assert bench.returncode == 0, stdout + stderr
    assert not outlived, "the busy process outlived the bench"
    assert "busy: a competing process spins on CPU" in stdout
    runs = json.loads(out.read_text())["sweep"]
    assert [r["threads"] for r in runs] == [1, 2] and all(r["busy_cpu"] is not None for r in runs)
    have_ort = importlib.util.find_spec("onnxruntime") is not None and importlib.util.find_spec("onnx") is not None
    for run in runs:
        (case,) = run["linear"]
        errors = {cand: r["rel_error"] for cand, r in case["results"].items()}
        assert errors["torch fp32"] < 1e-5 and 1e-3 < errors["w8a8_cpu"] < 3e-2, errors
        # 576 / 128: 4 whole groups and a part; nibbles, an fp16 scale per group and channel, a float per channel
        assert run["w4a8_group_size"] == 128 and errors["w8a8_cpu W4A8"] < 0.15, errors
        assert case["results"]["w8a8_cpu W4A8"]["weight_bytes"] == 576 * 576 // 2 + 2 * 576 * 5 + 4 * 576
        assert ("onnxruntime rr" in errors) == have_ort


def test_bench_plot_without_matplotlib_says_how(tmp_path):
    """--plot with matplotlib hidden: exit 2 before the run, naming the bench extra."""
    code = ("import sys; sys.modules['matplotlib'] = None; from w8a8_cpu.__main__ import main; "
            f"sys.exit(main(['bench', '--quick', '--plot', {str(tmp_path / 'x.png')!r}]))")
    proc = subprocess.run([*python_command(), "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "w8a8-cpu[bench]" in proc.stderr, proc.stdout + proc.stderr


def test_bench_listed_in_help():
    proc = subprocess.run([*python_command(), "-m", "w8a8_cpu", "--help"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "bench" in proc.stdout and "check" in proc.stdout and "demo" in proc.stdout


def test_a_peer_that_refuses_is_a_reason_not_the_end_of_the_bench(monkeypatch):
    """An installed ONNX Runtime that refuses its model (one machine's onnx 1.23 wrote IR version 14 for its ONNX
    Runtime 1.30, and the whole bench stopped) leaves its rows out with the first line of the refusal as the reason;
    every other candidate is built and measured."""
    import torch

    from w8a8_cpu.cli import bench

    def refuse(w, reduce_range, threads):
        raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : Unsupported model IR version: 14, max supported IR "
                           "version: 13\n  onnxruntime::Model::Model(...) at model.cc:202")

    monkeypatch.setattr(bench, "ort_linear", refuse)
    errors = {}
    make, _, _ = bench.linear_candidates(64, 128, torch.Generator().manual_seed(0), errors, 0, 32)
    fns, errs = make(1)
    reason = ("RuntimeError: [ONNXRuntimeError] : 1 : FAIL : Unsupported model IR version: 14, max supported IR "
              "version: 13")
    assert errors[bench.ORT] == errors[bench.ORT_RR] == reason
    assert bench.ORT not in fns and bench.ORT_RR not in fns
    assert {bench.OURS, bench.W4A8, bench.FP32} <= set(fns) and 1e-3 < errs[bench.OURS] < 3e-2, errs


def test_interleaved_rounds_vary_their_order():
    """Every round times every candidate once, each round in its own order, so no candidate always follows the same
    one (the one after the slowest starts cold: in a fixed order the read reference always handed its cold caches to
    the first GEMV row)."""
    calls = []
    candidates = {name: (lambda name=name: calls.append(name)) for name in "abcde"}
    values = interleaved(candidates, rounds=8, warmup=1)
    assert {name: len(v) for name, v in values.items()} == {name: 8 for name in "abcde"}
    assert calls[:5] == list("abcde")  # the warm-up round
    rounds = [calls[i:i + 5] for i in range(5, len(calls), 5)]
    assert all(sorted(r) == list("abcde") for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1
    assert len({r[r.index("e") + 1] for r in rounds if r[-1] != "e"}) > 1, "'e' is followed by different candidates"
    calls.clear()
    interleaved(candidates, rounds=8, warmup=0)
    assert [calls[i:i + 5] for i in range(0, len(calls), 5)] == rounds, "the same orders on every run"


@pytest.mark.parametrize("text, expected", [("307200K", 300 << 20), ("32M", 32 << 20), ("1G", 1 << 30),
                                            ("512\n", 512), ("", 0), ("big", 0), ("12Q", 0)])
def test_cache_size_text(text, expected):
    assert _cache_size_bytes(text) == expected


def test_read_ring_windows_come_back_after_three_caches():
    """Each read of the ring takes the next window, so a window is read again only after all the others: at least
    three last-level caches of other bytes, never what the last reads left in the cache; a reported cache too large to
    be true does not make bench allocate past MAX_RING_BYTES."""
    window = 256 * 1024
    ring = ReadRing(window, cache_bytes=600 * 1024)
    assert ring.windows == 9 and (ring.windows - 1) * window >= 3 * 600 * 1024
    seed = torch.Generator().manual_seed(5)
    ring.ring.copy_(torch.randint(0, 256, ring.ring.shape, dtype=torch.uint8, generator=seed))
    probe = torch.ops.w8a8_cpu._read_probe
    expected = [probe(ring.ring[w * window:(w + 1) * window], "nta") for w in range(ring.windows)]
    assert len(set(expected)) == ring.windows  # each window's checksum its own
    read = ring.reader("nta")
    assert [read() for _ in range(2 * ring.windows)] == expected * 2
    assert ring_windows(window, 0) == 2
    assert ring_windows(window, 1 << 40) * window == MAX_RING_BYTES
    assert ring_windows(256 << 20, 300 << 20) == 5  # the Xeon here: 1280 MiB, each window after 1 GiB of others
