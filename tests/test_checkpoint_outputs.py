"""save_compressed's output directory holding what a user's directory may hold (links into a source model or a hub
snapshot's blobs, FIFOs, folders, an earlier checkpoint), the quantize command on a hub snapshot, and round trips
that the writer and reader must agree on (static activations of fused models, a lm_head tied by hand, shards holding
tensors their index does not list). Every case is bounded by an alarm, so a write that blocks fails instead of
hanging the suite."""
import copy
import json
import os
import struct
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import deadline_fixture, python_command
from w8a8_cpu.nn import W8A8Linear, W8A8LinearSlice, quantize_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built from configs; nothing may be downloaded
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from w8a8_cpu.llm.checkpoint import INDEX_FILE, SINGLE_FILE, load_quantized, save_compressed  # noqa: E402
from w8a8_cpu.quant.static_activations import calibrate_static_activations  # noqa: E402
from tiny_models import logits, tiny_causal_lm, token_ids  # noqa: E402

VOCAB = 300
Q_PROJ = "model.layers.0.self_attn.q_proj"


deadline = deadline_fixture(120)


def tiny(tied=True):
    return tiny_causal_lm(tied=tied, dtype=torch.float32, vocab_size=VOCAB)


def contents(directory: Path) -> dict:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def quantized():
    return quantize_model(tiny(), skip=["lm_head"])


# ---- static activations of fused models ----------------------------------------------------------------------

@pytest.mark.parametrize("symmetric", [True, False])
def test_static_calibration_leaves_fused_layers_dynamic_and_round_trips(symmetric, tmp_path):
    model = quantize_model(tiny(), skip=["lm_head"], fuse=True)
    calibration = token_ids(VOCAB, (1, 32), seed=1)
    made_static = calibrate_static_activations(model, calibration, symmetric=symmetric)
    behind_slices = [name for name, m in model.named_modules() if isinstance(m, W8A8LinearSlice)]
    assert behind_slices and not any(name.endswith(".fused") for name in made_static)
    assert all(m.fused.input_scale is None for m in model.modules() if isinstance(m, W8A8LinearSlice))
    assert "model.layers.0.self_attn.o_proj" in made_static and "model.layers.0.mlp.down_proj" in made_static
    save_compressed(model, tmp_path)
    for fuse in (True, False):
        assert torch.equal(logits(load_quantized(tmp_path, fuse=fuse)), logits(model))


# ---- what the output directory holds ----------------------------------------------------------------------------

def float_source(directory: Path) -> Path:
    tiny().save_pretrained(directory)
    (directory / "tokenizer_config.json").write_text('{"model_max_length": 128}')
    (directory / "special_tokens_map.json").write_text('{"bos_token": "<s>"}')
    return directory


def test_links_in_the_output_are_replaced_not_written_through(quantized, tmp_path):
    source = float_source(tmp_path / "source")
    before = contents(source)
    out = tmp_path / "out"
    out.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out / name).symlink_to(source / name)  # tokenizer links to the very files copied: once SameFileError
    (out / "README.md").symlink_to(source / "config.json")
    (out / SINGLE_FILE).symlink_to(source / SINGLE_FILE)
    save_compressed(quantized, out, tokenizer=str(source))
    assert contents(source) == before
    assert [p.name for p in out.iterdir() if p.is_symlink()] == ["README.md"]  # not written: the caller's, left
    assert (out / "tokenizer_config.json").read_bytes() == before["tokenizer_config.json"]
    assert "quantization_config" in json.loads((out / "config.json").read_text())
    assert all((p.stat().st_mode & 0o777) == 0o644 for p in out.iterdir() if not p.is_symlink())
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no staging folder left
    assert torch.equal(logits(load_quantized(out)), logits(quantized))


def test_fifo_at_an_output_name_is_replaced_without_blocking(quantized, tmp_path):
    os.mkfifo(tmp_path / "config.json")
    save_compressed(quantized, tmp_path)
    assert (tmp_path / "config.json").is_file()
    assert torch.equal(logits(load_quantized(tmp_path)), logits(quantized))


@pytest.mark.parametrize("name", ["config.json", SINGLE_FILE, "generation_config.json",
                                  "model-00002-of-00003.safetensors"])
def test_folder_at_an_output_name_refused_naming_it_and_nothing_removed(quantized, tmp_path, name):
    save_compressed(quantized, tmp_path)
    target = tmp_path / name
    if target.exists():
        target.unlink()
    target.mkdir()
    before = contents(tmp_path)
    with pytest.raises(ValueError, match=f"{name}: is a directory where the checkpoint writes a file"):
        save_compressed(quantized, tmp_path)
    assert contents(tmp_path) == before and target.is_dir()


def test_unwritable_directory_is_a_value_error_naming_it(quantized, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="file.*cannot be written"):
        save_compressed(quantized, tmp_path / "file" / "out")


def hub_snapshot(directory: Path, source: Path, linked) -> Path:
    """A Hugging Face hub cache entry of `source`: blobs/<hash> and snapshots/rev/<name> -> ../../blobs/<hash> for
    the names in `linked`; the others copied as regular files."""
    (directory / "blobs").mkdir(parents=True)
    snapshot = directory / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    for i, path in enumerate(sorted(source.iterdir())):
        if path.name in linked:
            (directory / "blobs" / f"blob{i}").write_bytes(path.read_bytes())
            (snapshot / path.name).symlink_to(f"../../blobs/blob{i}")
        else:
            (snapshot / path.name).write_bytes(path.read_bytes())
    return snapshot


def test_tokenizer_files_of_a_hub_snapshot_are_copied_whole(quantized, tmp_path):
    source = float_source(tmp_path / "source")
    snapshot = hub_snapshot(tmp_path / "hub", source, linked={"tokenizer_config.json", "config.json"})
    save_compressed(quantized, tmp_path / "out", tokenizer=str(snapshot))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):  # a link and a regular file
        copied = tmp_path / "out" / name
        assert copied.is_file() and not copied.is_symlink()
        assert copied.read_bytes() == (source / name).read_bytes()


@pytest.mark.parametrize("odd", ["FIFO", "folder", "dangling link"])
def test_tokenizer_entry_that_is_no_file_refused_naming_it(quantized, tmp_path, odd):
    source = float_source(tmp_path / "source")
    entry = source / "tokenizer.json"
    {"FIFO": lambda: os.mkfifo(entry), "folder": entry.mkdir,
     "dangling link": lambda: entry.symlink_to(tmp_path / "absent")}[odd]()
    with pytest.raises(ValueError, match="tokenizer.json: (is not a regular file|cannot be opened)"):
        save_compressed(quantized, tmp_path / "out", tokenizer=str(source))


def test_resave_removes_the_earlier_checkpoints_tokenizer_files(quantized, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    for directory, files in ((first, {"tokenizer_config.json": '{"model": "A"}', "chat_template.jinja": "A",
                                      "added_tokens.json": '{"<a>": 299}'}),
                             (second, {"tokenizer_config.json": '{"model": "B"}'})):
        directory.mkdir()
        for name, text in files.items():
            (directory / name).write_text(text)
    out = tmp_path / "out"
    save_compressed(quantized, out, tokenizer=str(first), max_shard_bytes=20_000)
    (out / "notes.txt").write_text("the caller's")
    save_compressed(quantized, out, tokenizer=str(second))
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "generation_config.json", SINGLE_FILE,
                                                            "tokenizer_config.json", "notes.txt"])
    assert (out / "tokenizer_config.json").read_text() == '{"model": "B"}'


def test_save_without_a_tokenizer_keeps_the_one_the_caller_saved(quantized, tmp_path):
    """tokenizer.save_pretrained(out), then save_compressed(model, out): the first version of the stale-file removal
    deleted the tokenizer (and a README, any chat templates), silently."""
    out = tmp_path / "out"
    out.mkdir()
    mine = {"tokenizer.json": "{}", "tokenizer_config.json": "{}", "README.md": "mine"}
    for name, text in mine.items():
        (out / name).write_text(text)
    (out / "additional_chat_templates").mkdir()
    save_compressed(quantized, out)
    assert all((out / name).read_text() == text for name, text in mine.items())
    assert (out / "additional_chat_templates").is_dir() and (out / SINGLE_FILE).is_file()


def test_saving_into_the_tokenizer_source_keeps_its_files(quantized, tmp_path):
    float_source(tmp_path)
    tokenizer_config = (tmp_path / "tokenizer_config.json").read_bytes()
    save_compressed(quantized, tmp_path, tokenizer=str(tmp_path))
    assert (tmp_path / "tokenizer_config.json").read_bytes() == tokenizer_config



class _Killed(BaseException):
    """A kill, simulated: nothing of the writer's own error handling catches it."""


def test_killed_resave_leaves_the_old_checkpoint_or_the_new_one_never_a_mix(quantized, tmp_path, monkeypatch):
    """Issue 50 point 7: a resave killed at each of its steps in `directory` (each removal of an earlier file, each
    rename putting a file in place) leaves the old checkpoint whole, the new one whole, or no config.json, which every
    reader (load_quantized, vLLM, transformers) requires first: never a checkpoint that loads without its tokenizer
    (the first version published config.json and the weights before the tokenizer files)."""
    sources = {}
    for name, files in (("old", {"tokenizer_config.json": '{"model": "old"}', "chat_template.jinja": "old"}),
                        ("new", {"tokenizer_config.json": '{"model": "new"}', "special_tokens_map.json": "{}"})):
        sources[name] = tmp_path / name
        sources[name].mkdir()
        for file_name, text in files.items():
            (sources[name] / file_name).write_text(text)
    models = {"old": quantized, "new": copy.deepcopy(quantized)}
    with torch.no_grad():
        models["new"].model.norm.weight.mul_(2)
    expected = {}
    for name, shards in (("old", 20_000), ("new", None)):  # each save's files, on their own
        save_compressed(models[name], tmp_path / f"{name}-alone", tokenizer=str(sources[name]), max_shard_bytes=shards)
        expected[name] = (contents(tmp_path / f"{name}-alone"), logits(models[name]))

    steps, real_replace, real_unlink = [], os.replace, Path.unlink

    def step(kill_at, real):
        def counted(*args, **kwargs):
            if len(steps) == kill_at:
                raise _Killed()
            steps.append(args[0])
            return real(*args, **kwargs)
        return counted

    count = None
    kill_at = 0
    while count is None or kill_at <= count:
        out = tmp_path / f"out{kill_at}"
        save_compressed(models["old"], out, tokenizer=str(sources["old"]), max_shard_bytes=20_000)
        steps.clear()
        monkeypatch.setattr(os, "replace", step(kill_at, real_replace))
        monkeypatch.setattr(Path, "unlink", step(kill_at, real_unlink))
        try:
            save_compressed(models["new"], out, tokenizer=str(sources["new"]))
            count = len(steps)  # a save not killed: how many steps there are
        except _Killed:
            pass
        monkeypatch.undo()
        if (out / "config.json").exists():
            state = "new" if contents(out) == expected["new"][0] else "old"
            assert contents(out) == expected[state][0], f"killed at step {kill_at}: a mix"
            assert torch.equal(logits(load_quantized(out)), expected[state][1])
        else:
            with pytest.raises(ValueError, match="no config.json; not a checkpoint directory, or a save into it was "
                                                 "interrupted"):
                load_quantized(out)
        kill_at += 1
    assert count and kill_at == count + 1

# ---- the quantize command ---------------------------------------------------------------------------------------

def word_level_source(directory: Path) -> Path:
    """A tiny float Llama with an offline word-level tokenizer of the bundled calibration text's words."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    import w8a8_cpu.cli.quantize as command

    words = [w for w, _ in Counter(command.CALIBRATION_TEXT.read_text().split()).most_common(VOCAB - 3)]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                         eos_token="</s>").save_pretrained(directory)
    tiny().save_pretrained(directory)
    return directory


def quantize(source, out):
    return subprocess.run([*python_command(), "-m", "w8a8_cpu", "quantize", str(source), str(out), "--smoothquant",
                           "none", "--calibration-tokens", "64", "--held-out-tokens", "64", "--no-progress"],
                          capture_output=True, text=True, timeout=100,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})


@pytest.mark.slow_under_emulation  # two child pythons (each re-imports torch under qemu)
def test_quantize_command_on_a_hub_snapshot_and_into_an_odd_directory(tmp_path):
    source = word_level_source(tmp_path / "source")
    snapshot = hub_snapshot(tmp_path / "hub", source, linked={p.name for p in source.iterdir()})
    before = contents(tmp_path / "hub" / "blobs")
    r = quantize(snapshot, tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert {"tokenizer.json", "tokenizer_config.json", "README.md"} <= {p.name for p in (tmp_path / "out").iterdir()}
    assert isinstance(load_quantized(tmp_path / "out").model.layers[0].mlp.down_proj, W8A8Linear)
    assert contents(tmp_path / "hub" / "blobs") == before
    (tmp_path / "odd" / SINGLE_FILE).mkdir(parents=True)
    r = quantize(snapshot, tmp_path / "odd")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"{SINGLE_FILE}: is a directory where the checkpoint writes a file" in r.stderr


# ---- what the writer and reader must agree on -------------------------------------------------------------------

def test_lm_head_tied_by_hand_without_the_config_is_written_and_loads(tmp_path):
    model = tiny(tied=False)
    model.lm_head.weight = model.model.embed_tokens.weight
    quantized = quantize_model(model, skip=["lm_head"])
    save_compressed(quantized, tmp_path)
    assert torch.equal(load_file(tmp_path / SINGLE_FILE)["lm_head.weight"], model.model.embed_tokens.weight)
    assert torch.equal(logits(load_quantized(tmp_path)), logits(quantized))


def test_tied_lm_head_is_still_written_once(quantized, tmp_path):
    save_compressed(quantized, tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / SINGLE_FILE)


def test_int8_embedding_with_a_float_tied_lm_head_refused_with_its_own_advice(tmp_path):
    model = quantize_model(tiny(), skip=[], quantize_embedding=True)
    model.lm_head = torch.nn.Linear(64, VOCAB, bias=False)  # float beside the int8 table (quantize_model refuses it)
    with pytest.raises(ValueError, match=r"an int8 embedding table .* without skipping lm_head .* or with "
                                         r"quantize_embedding=False"):
        save_compressed(model, tmp_path)


@pytest.mark.parametrize("stray", ["unlisted", "listed elsewhere"])
def test_shard_holding_tensors_its_index_does_not_map_to_it_refused(quantized, tmp_path, stray):
    save_compressed(quantized, tmp_path, max_shard_bytes=20_000)
    weight_map = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]
    other = sorted(set(weight_map.values()) - {weight_map[f"{Q_PROJ}.weight"]})[0]
    tensors = load_file(tmp_path / other)
    key = f"{Q_PROJ}.input_scale" if stray == "unlisted" else f"{Q_PROJ}.weight"
    tensors[key] = torch.ones(1) if stray == "unlisted" else torch.zeros(64, 64, dtype=torch.int8)
    save_file(tensors, tmp_path / other, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{other}: holds tensors that {INDEX_FILE} does not map to it: '{key}'"):
        load_quantized(tmp_path)


def test_shape_of_many_dimensions_echoed_bounded(quantized, tmp_path):
    save_compressed(quantized, tmp_path)
    path = tmp_path / SINGLE_FILE
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    header["model.norm.weight"]["shape"] = [64] + [1] * 100_000
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + size:])
    with pytest.raises(ValueError, match=r"'model.norm.weight' is F32 \[64, 1, 1.*\.\.\.; expected") as error:
        load_quantized(tmp_path)
    assert len(str(error.value)) < 400
