"""python -m w8a8_cpu bench llm without the real model (that run takes minutes): its options and their errors, the
table, the CTranslate2 conversion cache with a fake converter, and the interleaved measurement with fake engines
and with a tiny random Llama. State lives under tmp_path ($W8A8_CPU_CACHE)."""
import json
import shutil
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from w8a8_cpu.cli import _parsers, bench_llm, main
from w8a8_cpu.cli.baselines import ctranslate2_int8
from w8a8_cpu.llm.cache import MARKER
from w8a8_cpu.cli.timing import Progress
from w8a8_cpu.llm import smollm2
from tiny_models import tiny_causal_lm

QUIET = Progress(1, enabled=False)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("W8A8_CPU_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# --------------------------------------------------------------------------------------------------- options

def test_bench_llm_is_a_mode_of_bench():
    parser = _parsers()[0]
    args = parser.parse_args(["bench", "llm", "--threads", "1", "2", "--new-tokens", "8", "--prefill-tokens", "32",
                              "--rounds", "2", "--json", "x.json", "--no-progress"])
    assert (args.command, args.bench_mode, args.threads, args.new_tokens, args.prefill_tokens, args.rounds,
            args.json, args.no_progress) == ("bench", "llm", [1, 2], 8, 32, 2, "x.json", True)
    defaults = parser.parse_args(["bench", "llm"])
    assert (defaults.threads, defaults.new_tokens, defaults.prefill_tokens, defaults.rounds, defaults.context) == \
        ([1, 2], 64, 512, 3, None)
    assert parser.parse_args(["bench", "llm", "--context", "1000"]).context == 1000
    assert defaults.kv_cache == ["fp32"]
    kv_caches = ["fp32", "fp16", "int8"]
    assert parser.parse_args(["bench", "llm", "--kv-cache", *kv_caches]).kv_cache == kv_caches
    suite = parser.parse_args(["bench", "--quick", "--threads", "1", "2", "--shapes", "smollm2", "--no-moe"])
    assert suite.bench_mode is None and suite.quick and suite.threads == [1, 2]  # the suite's options as before


def test_help_lists_bench_llm(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "python -m w8a8_cpu bench llm" in out and "--prefill-tokens" in out and "CTranslate2" in out


@pytest.mark.parametrize("argv, message", [
    (["--threads", "0"], "expected a positive integer, got 0"),
    (["--new-tokens", "0"], "expected a positive integer"),
    (["--prefill-tokens", "-1"], "expected a positive integer, got -1"),
    (["--rounds", "0"], "expected a positive integer"),
    (["--threads", "x"], "expected a positive integer, got 'x'"),
    (["--json", "/nonexistent-w8a8-dir/out.json"], "does not exist"),
    (["--context", "0"], "expected a positive integer, got 0"),
    (["--context", "100", "--new-tokens", "1"], "--new-tokens of at least 2"),
    (["--kv-cache", "q8_0"], "invalid choice: 'q8_0'"),
])
def test_bad_options_stop_before_any_work(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(smollm2, "load", lambda *a: pytest.fail("the model was loaded despite a bad option"))
    with pytest.raises(SystemExit) as stop:
        main(["bench", "llm", *argv])
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_a_context_beyond_the_models_positions_stops_before_the_engines(capsys, monkeypatch):
    model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=2048))
    monkeypatch.setattr(smollm2, "available", lambda: True)
    monkeypatch.setattr(smollm2, "load", lambda progress: (model, lambda text: {"input_ids": list(range(5000))}))
    monkeypatch.setattr(bench_llm, "build_engines", lambda *a: pytest.fail("the engines were built"))
    assert main(["bench", "llm", "--context", "2000", "--new-tokens", "64", "--no-progress"]) == 2
    assert "a 2000-token prompt and 64 new tokens exceed the model's 2048 positions" in capsys.readouterr().err


def test_without_the_model_it_says_how(capsys, monkeypatch):
    monkeypatch.setattr(smollm2, "available", lambda: False)
    assert main(["bench", "llm", "--no-progress"]) == 2
    assert smollm2.INSTALL_HINT in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------- table

def _result(threads, tokens_per_s, prefill_s, agreement, with_peer=True):
    engines = {}
    for name, tps, pre, agree in zip(bench_llm.ENGINES, tokens_per_s, prefill_s, agreement):
        if name == bench_llm.CT2 and not with_peer:
            continue
        engines[name] = {"decode_tokens_per_s": tps, "prefill_s": pre, "greedy_equal_prefix": agree,
                         "decode_vs_llama_cpp": tps / bench_llm.LLAMA_CPP_DECODE_TOKENS_PER_S}
    if with_peer:
        peer = engines[bench_llm.CT2]
        for r in engines.values():
            r["decode_vs_ctranslate2"] = r["decode_tokens_per_s"] / peer["decode_tokens_per_s"]
            r["prefill_vs_ctranslate2"] = peer["prefill_s"] / r["prefill_s"]
    return {"threads": threads, "engines": engines}


def test_table_rows_ratios_and_reference_line():
    run = _result(2, [12.5, 20.0, 28.0, 60.0, 50.0], [1.5, 1.0, 1.2, 0.8, 0.6], [64, 3, 8, 8, 4])
    lines = bench_llm.format_table(run, 64, {})
    assert lines[0] == "2 threads:"
    header, rows, reference = lines[1], lines[2:-1], lines[-1]
    for column, _ in bench_llm.COLUMNS:
        assert column in header
    assert len({len(line) for line in [header, *rows]}) == 1, "columns line up"
    fields = {row[:2 + bench_llm.NAME_WIDTH].strip(): row[2 + bench_llm.NAME_WIDTH:].split() for row in rows}
    assert list(fields) == list(bench_llm.ENGINES)
    assert fields["fp32"] == ["12.5", "1.500", "64/64", "x0.25", "x0.40", "x0.17"]
    assert fields["W8A8 fast path"] == ["60.0", "0.800", "8/64", "x1.20", "x0.75", "x0.80"]
    assert fields["CTranslate2 int8"] == ["50.0", "0.600", "4/64", "x1.00", "x1.00", "x0.67"]
    # llama.cpp: its published decode rate, its ratio to CTranslate2, nothing measured
    assert reference.split() == ["llama.cpp*", "75.0", "x1.50", "x1.00"]


def test_table_without_the_peer_and_with_engines_not_run():
    run = _result(1, [10.0, 15.0, 20.0], [2.0, 1.5, 1.2], [64, 2, 5], with_peer=False)
    unavailable = {bench_llm.FAST: "w8a8_cpu.llm.decoder not importable (nope)",
                   bench_llm.CT2: "No module named 'ctranslate2' (pip install 'w8a8-cpu[bench]')"}
    lines = bench_llm.format_table(run, 64, unavailable)
    assert lines[0] == "1 thread:"
    assert lines[2].split()[1:] == ["10.0", "2.000", "64/64", "x0.13"]  # no CTranslate2 ratios
    assert any(line.split()[:5] == ["W8A8", "fast", "path", "not", "run:"] for line in lines)
    assert any("CTranslate2 int8" in line and "w8a8-cpu[bench]" in line for line in lines)
    assert lines[-1].split() == ["llama.cpp*", "75.0", "x1.00"]


def test_report_labels_llama_cpp_as_not_measured(capsys):
    run = _result(1, [12.5, 20.0, 28.0, 60.0, 50.0], [1.5, 1.0, 1.2, 0.8, 0.6], [64, 3, 8, 8, 4])
    bench_llm.print_report({"model": "SmolLM2", "variant": "avx2", "torch": "2.13.0", "ctranslate2": "4.8.5",
                            "new_tokens": 64, "prefill_tokens": 512, "prompt_tokens": 41, "prefill_text": "GPL-3",
                            "rounds": 3, "warmup_rounds": 1, "unavailable": {}, "runs": [run]})
    out = capsys.readouterr().out
    assert "NOT measured here" in out and "75 tok/s" in out and "median of 3 interleaved rounds" in out


# --------------------------------------------------------------------------------------------------- CTranslate2 cache

class FakeConverter:
    """ctranslate2.converters.TransformersConverter's interface; writes a model file, or part of one and fails."""
    calls = []
    fail = False

    def __init__(self, source):
        self.source = source

    def convert(self, output_dir, quantization=None, force=False):
        FakeConverter.calls.append((self.source, output_dir, quantization))
        assert force or not Path(output_dir).exists()
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        (Path(output_dir) / "model.bin").write_text("half" if FakeConverter.fail else "int8 weights")
        if FakeConverter.fail:
            raise RuntimeError("converter died")
        (Path(output_dir) / "config.json").write_text("{}")
        return output_dir


@pytest.fixture
def fake_ctranslate2(monkeypatch, cache):
    module = types.ModuleType("ctranslate2")
    module.__version__ = "9.9.9"
    module.converters = types.ModuleType("ctranslate2.converters")
    module.converters.TransformersConverter = FakeConverter
    monkeypatch.setitem(sys.modules, "ctranslate2", module)
    monkeypatch.setitem(sys.modules, "ctranslate2.converters", module.converters)
    FakeConverter.calls, FakeConverter.fail = [], False
    source = cache / "smollm2-135m-instruct"
    source.mkdir(parents=True)
    (source / "w8a8_cpu_cache.json").write_text('{"format": 2}')
    return source


def _folders(parent):
    return sorted(p.name for p in parent.iterdir() if p.is_dir())


def test_ctranslate2_conversion_is_cached_by_version_and_source(fake_ctranslate2):
    source = fake_ctranslate2
    target = ctranslate2_int8(source)
    assert target.parent == source.parent and target.name.startswith("smollm2-135m-instruct-ctranslate2-int8-")
    assert (target / "model.bin").read_text() == "int8 weights"
    marker = json.loads((target / MARKER).read_text())
    assert marker["key"] == {"ctranslate2": "9.9.9", "quantization": "int8", "source": source.name}
    assert [(s, q) for s, _, q in FakeConverter.calls] == [(str(source), "int8")]
    assert FakeConverter.calls[0][1] != str(target), "converted under a temporary name, then renamed"
    assert _folders(source.parent) == sorted([source.name, target.name]), "no staging folder left behind"
    assert ctranslate2_int8(source) == target and len(FakeConverter.calls) == 1  # cached
    other = source.parent / "smollm2-135m-instruct-0123"  # another float cache (another GGUF): its own conversion
    shutil.copytree(source, other)
    assert ctranslate2_int8(other) != target and len(FakeConverter.calls) == 2
    assert (target / "model.bin").read_text() == "int8 weights", "the first conversion is left as it was"


def test_ctranslate2_conversion_never_publishes_half_a_model(fake_ctranslate2):
    source = fake_ctranslate2
    FakeConverter.fail = True
    with pytest.raises(RuntimeError, match="converter died"):
        ctranslate2_int8(source)
    assert _folders(source.parent) == [source.name], "neither the target nor the staging folder exists"
    FakeConverter.fail = False
    target = ctranslate2_int8(source)
    (target / "model.bin").write_text("trunc")  # damaged since: not the size its marker lists, so rebuilt
    assert ctranslate2_int8(source) == target and (target / "model.bin").read_text() == "int8 weights"
    assert len(FakeConverter.calls) == 3


# --------------------------------------------------------------------------------------------------- measurement

def fake_engine(name, tokens, log):
    """greedy returns `tokens` (as a tensor, like some engines do); every call logged with torch's thread count."""

    def greedy(prompt_ids, new_tokens):
        log.append(("decode", name, torch.get_num_threads(), torch.is_inference_mode_enabled()))
        return torch.tensor(tokens[:new_tokens])

    def prefill(ids):
        log.append(("prefill", name, torch.get_num_threads(), ids.numel()))
        return torch.zeros(8)

    return bench_llm.Engine(greedy=greedy, prefill=prefill)


def test_sweep_interleaves_engines_and_thread_counts():
    log, built = [], []
    reference = list(range(100, 108))
    tokens = {bench_llm.FP32: reference, bench_llm.EAGER: reference[:3] + [0] * 5, bench_llm.CT2: [7] * 8}

    def engines_for(threads):
        built.append((threads, torch.get_num_threads()))
        return {name: fake_engine(name, t, log) for name, t in tokens.items()}

    before = torch.get_num_threads()
    runs = bench_llm.sweep(engines_for, [1, 2], torch.arange(5), torch.arange(16), new_tokens=8, rounds=2,
                           progress=QUIET)
    assert torch.get_num_threads() == before
    assert built == [(1, 1), (2, 2)], "torch's thread count is set before the engines are made"
    assert [r["threads"] for r in runs] == [1, 2]
    names = list(tokens)
    calls = 1 + 2  # warm-up round + timed rounds, every engine once per round
    per_round = 2 * len(names)  # every engine at both thread counts
    assert [sorted((e[2], e[1]) for e in log[i:i + per_round]) for i in range(0, len(log), per_round)] == \
        [sorted((t, n) for t in (1, 2) for n in names)] * (2 * calls), \
        "a round runs every engine at every thread count, torch's count set for each call"
    for threads, run in zip([1, 2], runs):
        mine = [entry for entry in log if entry[2] == threads]
        assert [e[0] for e in mine] == ["decode"] * len(names) * calls + ["prefill"] * len(names) * calls
        rounds_run = [sorted(e[1] for e in mine[i:i + len(names)]) for i in range(0, len(mine), len(names))]
        assert rounds_run == [sorted(names)] * (2 * calls), "round r runs every engine once before round r + 1"
        assert all(e[3] is True for e in mine if e[0] == "decode"), "timed under inference_mode"
        assert all(e[3] == 16 for e in mine if e[0] == "prefill")
        engines = run["engines"]
        assert list(engines) == names
        for r in engines.values():
            assert r["decode_tokens_per_s"] > 0 and r["prefill_s"] > 0
            assert len(r["decode_s_rounds"]) == len(r["prefill_s_rounds"]) == 2
            assert r["decode_vs_llama_cpp"] == pytest.approx(
                r["decode_tokens_per_s"] / bench_llm.LLAMA_CPP_DECODE_TOKENS_PER_S)
            assert all(isinstance(t, int) for t in r["tokens"]) and len(r["tokens"]) == 8
        assert [engines[n]["greedy_equal_prefix"] for n in names] == [8, 3, 0]
        assert engines[bench_llm.CT2]["decode_vs_ctranslate2"] == engines[bench_llm.CT2]["prefill_vs_ctranslate2"] == 1
        eager = engines[bench_llm.EAGER]
        assert eager["prefill_vs_ctranslate2"] == pytest.approx(engines[bench_llm.CT2]["prefill_s"] / eager["prefill_s"])
    json.dumps(runs)  # --json writes them as they are


def test_decode_after_a_context_is_timed_without_the_prompts_prefill():
    """--context: decode is the tokens after the first over the median of the rounds' times from the first new token
    to the last as the engine reports them (its prompt's prefill, here 5x the tokens' time, not counted); no
    llama.cpp ratio, column or line (its figure is a short prompt's). An engine not reporting every token is an
    error, never a rate."""
    log, seconds_per_token = [], {bench_llm.FP32: 0.02, bench_llm.CT2: 0.01}

    def streaming_engine(name, reported=lambda token: True):
        inner = fake_engine(name, list(range(8)), log)

        def greedy(ids, n, on_token=None):
            time.sleep(0.2)  # the prompt's prefill
            tokens = inner.greedy(ids, n).tolist()
            for token in tokens:
                if token:
                    time.sleep(seconds_per_token[name])
                if on_token is not None and reported(token):
                    on_token(token)
            return tokens
        return bench_llm.Engine(greedy=greedy, prefill=inner.prefill)

    engines = {name: streaming_engine(name) for name in seconds_per_token}
    (run,) = bench_llm.sweep(lambda threads: engines, [1], torch.arange(300), torch.arange(16), new_tokens=8,
                             rounds=3, progress=QUIET, without_prefill=True)
    assert len([e for e in log if e[0] == "decode"]) == len(engines) * (1 + 3), "one generation per engine and round"
    for name, r in run["engines"].items():
        after_first = r["after_first_token_s_rounds"]
        assert len(after_first) == 3 and r["decode_tokens_per_s"] == pytest.approx(7 / sorted(after_first)[1])
        assert r["decode_tokens_per_s"] == pytest.approx(1 / seconds_per_token[name], rel=0.3)
        assert r["decode_vs_llama_cpp"] is None and r["tokens"] == list(range(8))
    assert run["engines"][bench_llm.FP32]["decode_vs_ctranslate2"] == pytest.approx(
        run["engines"][bench_llm.FP32]["decode_tokens_per_s"] / run["engines"][bench_llm.CT2]["decode_tokens_per_s"])
    lines = bench_llm.format_table(run, 8, {})
    assert not any("llama.cpp" in line for line in lines)
    assert len({len(line) for line in lines[1:]}) == 1, "columns line up"

    engines[bench_llm.CT2] = streaming_engine(bench_llm.CT2, reported=lambda token: token != 3)
    with pytest.raises(RuntimeError, match="CTranslate2 int8 reported 7 of its 8 tokens as chosen"):
        bench_llm.sweep(lambda threads: engines, [1], torch.arange(300), torch.arange(16), new_tokens=8, rounds=1,
                        progress=QUIET, without_prefill=True)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        bench_llm.measure({1: engines}, torch.arange(5), torch.arange(16), 1, 1, QUIET, without_prefill=True)


def test_an_engine_stopping_early_is_an_error():
    log = []
    engines = {bench_llm.FP32: fake_engine(bench_llm.FP32, [1] * 3, log)}
    with pytest.raises(RuntimeError, match="generated 3 tokens instead of 8"):
        bench_llm.measure({1: engines}, torch.arange(5), torch.arange(16), 8, 1, QUIET)


@pytest.mark.slow_under_emulation  # transformers' import and generate loop under qemu
def test_tiny_llama_engines_without_the_peer(monkeypatch):
    """build_engines + sweep on a tiny random Llama: the transformers engines and the fast path (the Decoder over a
    W8A8 model of its own, int8 output layer, fused) really generate and prefill; a missing ctranslate2 is a row
    not run, with its reason."""
    model = tiny_causal_lm(tied=True, intermediate_size=128, max_position_embeddings=128)
    monkeypatch.setitem(sys.modules, "ctranslate2", None)
    unavailable = {}
    engines, ct2_dir = bench_llm.build_engines(model, QUIET, unavailable, kv_caches=["fp32", "int8"])
    assert ct2_dir is None and "w8a8-cpu[bench]" in unavailable[bench_llm.CT2]
    assert bench_llm.FAST not in unavailable
    int8 = bench_llm.fast_path_name("int8")
    assert list(engines) == [name for name in bench_llm.ENGINES if name not in unavailable] + [int8]
    assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear, "the fp32 model stays float"
    (run,) = bench_llm.sweep(lambda threads: engines, [1], torch.arange(1, 9), torch.arange(1, 33), new_tokens=6,
                             rounds=1, progress=QUIET)
    assert run["engines"][bench_llm.FP32]["greedy_equal_prefix"] == 6
    assert all(len(r["tokens"]) == 6 and r["prefill_s"] > 0 for r in run["engines"].values())
    assert "decode_vs_ctranslate2" not in run["engines"][bench_llm.FP32]
    # the KV bytes at the prompt's and new tokens' positions (8 + 6): layers, K and V, KV heads, head_dim 16
    fp32_bytes = 2 * 2 * 14 * 2 * 16 * 4
    assert run["engines"][bench_llm.FAST]["kv_bytes"] == fp32_bytes and run["engines"][bench_llm.FP32]["kv_bytes"] is None
    assert run["engines"][int8]["kv_bytes"] == fp32_bytes * (16 + 4) // 64
    table = bench_llm.format_table(run, 6, unavailable)
    assert table[-1].split() == ["llama.cpp*", "75.0", "x1.00"]
    assert "W8A8 fast path, int8 KV 0.0 MiB (x0.312 of fp32)" in table[-2]
    # --engines fast ct2: only those rows are built (ctranslate2 missing: its reason); fp32, ao, eager not at all
    unavailable = {}
    engines, _ = bench_llm.build_engines(model, QUIET, unavailable, ["fp16"], [bench_llm.FAST, bench_llm.CT2])
    assert list(engines) == [bench_llm.fast_path_name("fp16")] and list(unavailable) == [bench_llm.CT2]


# --------------------------------------------------------------------------------------------------- llama.cpp peer

FAKE_QUANTIZE = """#!{python}
import shutil, sys
assert sys.argv[1:2] == ["--allow-requantize"] and sys.argv[4] == "Q8_0", sys.argv
shutil.copyfile(sys.argv[2], sys.argv[3])
"""
# llama-bench -m F -t T -r R -o json -ctk K -ctv K [-fa 1] then -p 512 -n 64 -pg 41,64 or -p 0 -n 64 -d DEPTH: a test
# per (n_prompt, n_gen), samples in ns; the times scale with the thread count, the depth (per 1024) and the cache type
# (q8_0 1.25x) so that each run's numbers are its own
FAKE_LLAMA_BENCH = """#!{python}
import json, sys
a = dict(zip(sys.argv[1::2], sys.argv[2::2]))
t, n, r = int(a["-t"]), int(a["-n"]), int(a["-r"])
assert a["-ctv"] == a["-ctk"] and ("-fa" in a) == (a["-ctk"] == "q8_0"), sys.argv
slow = {{"f16": 1.0, "q8_0": 1.25}}[a["-ctk"]]
if "-d" in a:
    assert a["-p"] == "0" and "-pg" not in a, sys.argv
    tests = [(0, n, 0.8 * int(a["-d"]) / 1024)]
else:
    tests = [(int(a["-p"]), 0, 2.0), (0, n, 0.8), (int(a["-pg"].split(",")[0]), n, 1.0)]
print(json.dumps([{{"n_prompt": np, "n_gen": ng, "samples_ns": [s * slow * 1e9 / t] * (r - 1) + [99e9]}}
                  for np, ng, s in tests]))
"""


def test_llama_cpp_script_times_the_q8_0_model_in_bench_llm_units(tmp_path, cache, capsys):
    """benchmarks/llama_cpp_peer.py with stand-in llama-quantize / llama-bench: the Q8_0 file made once into the cache,
    llama-bench's medians turned into bench llm's decode (prompt prefill included), generation and prefill, and the
    ratios of a bench llm JSON's rows to them."""
    if not smollm2.available():
        pytest.skip(smollm2.INSTALL_HINT)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import llama_cpp_peer
    finally:
        sys.path.pop(0)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("llama-quantize", FAKE_QUANTIZE), ("llama-bench", FAKE_LLAMA_BENCH)):
        (bin_dir / name).write_text(text.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    ours = tmp_path / "ours.json"
    engines = {bench_llm.FAST: {"decode_tokens_per_s": 128.0, "prefill_s": 1.0},
               bench_llm.CT2: {"decode_tokens_per_s": 32.0, "prefill_s": 4.0}}
    ours.write_text(json.dumps({"prompt_tokens": 41, "new_tokens": 64, "prefill_tokens": 512,
                                "runs": [{"threads": 1, "engines": engines}, {"threads": 2, "engines": engines}]}))
    out = tmp_path / "llama.json"
    argv = ["--bin", str(bin_dir), "--threads", "1", "2", "--rounds", "3", "--ours", str(ours), "--json", str(out)]
    assert llama_cpp_peer.main(argv) == 0
    result = json.loads(out.read_text())
    made = sorted((cache / "llama.cpp").glob("*.Q8_0.gguf"))
    assert len(made) == 1 and made[0].stat().st_size == smollm2.gguf_path().stat().st_size  # the stand-in copies
    assert (result["prompt_tokens"], result["new_tokens"], result["prefill_tokens"]) == (41, 64, 512)
    for run, threads in zip(result["runs"], (1, 2)):
        peer = run["llama.cpp Q8_0"]
        # medians: the one slow sample of each test is ignored
        assert peer["decode_tokens_per_s"] == pytest.approx(64 * threads)
        assert peer["generation_tokens_per_s"] == pytest.approx(80 * threads)
        assert peer["prefill_s"] == pytest.approx(2.0 / threads)
        assert run[bench_llm.FAST]["decode_vs_llama_cpp"] == pytest.approx(2.0 / threads)
        assert run[bench_llm.FAST]["prefill_vs_llama_cpp"] == pytest.approx(2.0 / threads)
        assert run[bench_llm.CT2]["decode_vs_llama_cpp"] == pytest.approx(0.5 / threads)
    printed = capsys.readouterr().out
    assert "llama.cpp Q8_0" in printed and "faster than llama.cpp" in printed
    assert llama_cpp_peer.main(["--bin", str(tmp_path)]) == 2  # no llama-bench there: one line, exit 2
    assert "no executable llama-bench" in capsys.readouterr().err
    # a --context result: llama-bench's generation at that depth for each KV cache type, beside every fast path row,
    # the ratios to llama.cpp's default (f16 KV): issue 51's table
    int8 = bench_llm.fast_path_name("int8")
    ours.write_text(json.dumps({"prompt_tokens": 2048, "new_tokens": 64, "prefill_tokens": 512, "context": 2048,
                                "runs": [{"threads": 2, "engines": {**engines, int8: {"decode_tokens_per_s": 160.0,
                                                                                       "prefill_s": 1.0}}}]}))
    argv = ["--bin", str(bin_dir), "--threads", "2", "--rounds", "3", "--kv-cache", "f16", "q8_0", "--ours", str(ours),
            "--json", str(out)]
    assert llama_cpp_peer.main(argv) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run[llama_cpp_peer.PEER]["decode_tokens_per_s"] == pytest.approx(64 / (0.8 * 2 / 2))
    assert run[llama_cpp_peer.peer_name("q8_0")]["decode_tokens_per_s"] == pytest.approx(64 / (0.8 * 2 * 1.25 / 2))
    assert run[bench_llm.FAST]["decode_vs_llama_cpp"] == pytest.approx(128 / 80)
    assert run[int8]["decode_vs_llama_cpp"] == pytest.approx(160 / 80)
    assert "2048 tokens of context" in capsys.readouterr().out
    assert llama_cpp_peer.main(argv + ["--context", "1024"]) == 2  # not the context of --ours
    assert "is a bench llm run with --context 2048" in capsys.readouterr().err
    for not_a_result in ({"runs": []}, [], "runs"):  # files that are no bench llm result: one line, exit 2
        ours.write_text(json.dumps(not_a_result))
        assert llama_cpp_peer.main(["--bin", str(bin_dir), "--ours", str(ours)]) == 2
        assert "not a bench llm --json result" in capsys.readouterr().err
