"""Packed weights are untrusted input (a blob may come from a file, a pickle, another machine): every malformed,
truncated, misaligned or corrupted blob must give a ValueError or the exact result, never a crash, an
over-read or a wrong number. Format: docs/ARCHITECTURE.md, "Packed weight blob".

Run as a script (`python tests/test_packed_weight_safety.py --fuzz N`) it is the seeded mutation fuzzer that
test_fuzz_packed_weights runs in a child process, so that a crash fails the test loudly instead of killing pytest.
"""
import os
import random
import re
import struct
import subprocess
import sys
import time

import pytest
import torch

import w8a8_cpu
from w8a8_cpu import reference

# ---- the blob format (little-endian on every supported arch) ---------------------------------------------------
HEADER = 64
OFF_VERSION, OFF_SCALES, OFF_RESERVED, OFF_NR, OFF_KR, OFF_SCHEME, OFF_GROUP = 8, 10, 11, 12, 13, 14, 15
OFF_N, OFF_K, OFF_NP, OFF_KP, OFF_NAME, OFF_CRC = 16, 24, 32, 40, 48, 60
NAME_BYTES = 12
VERSION = 5
FIELDS = {"version": (OFF_VERSION, "<H"), "scale_storage": (OFF_SCALES, "<B"), "reserved": (OFF_RESERVED, "<B"),
          "nr": (OFF_NR, "<B"), "kr": (OFF_KR, "<B"), "scheme": (OFF_SCHEME, "<B"), "group_log2": (OFF_GROUP, "<B"),
          "n": (OFF_N, "<q"), "k": (OFF_K, "<q"), "n_padded": (OFF_NP, "<q"), "k_padded": (OFF_KP, "<q")}


def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli, reflected, init and final xor 0xffffffff), written independently of the C++ one."""
    c, t = 0xFFFFFFFF, _CRC_TABLE
    for b in data:
        c = t[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def raw_bytes(t: torch.Tensor) -> bytearray:
    return bytearray(t.contiguous().numpy().tobytes())


def as_tensor(b: bytes, offset: int = 0) -> torch.Tensor:
    """The bytes as a 1-D uint8 tensor starting `offset` bytes into its storage (odd offsets misalign it)."""
    storage = torch.zeros(len(b) + offset, dtype=torch.uint8)
    if b:
        storage[offset:] = torch.frombuffer(bytearray(b), dtype=torch.uint8)
    return storage[offset:]


def get(b: bytes, field: str) -> int:
    off, fmt = FIELDS[field]
    return struct.unpack_from(fmt, b, off)[0]


def put(b: bytearray, field: str, value: int) -> bytearray:
    off, fmt = FIELDS[field]
    size = struct.calcsize(fmt)
    b[off:off + size] = (value % (1 << (8 * size))).to_bytes(size, "little")
    return b


def seal(b: bytearray) -> bytearray:
    """Recompute the checksum, as an adversary editing a blob would: what remains must be caught by validation."""
    struct.pack_into("<I", b, OFF_CRC, crc32c(bytes(b[:OFF_CRC]) + bytes(b[HEADER:])))
    return b


def col_sums_offset(b: bytes) -> int:
    return HEADER + get(b, "n_padded") * get(b, "k_padded")


def encode(w: torch.Tensor, nr: int, kr: int, name: bytes = b"ref") -> bytearray:
    """An int8 [N, K] weight as a sealed blob in any panel layout, written from the documented format alone."""
    n, k = w.shape
    n_padded, k_padded = -(-n // nr) * nr, -(-k // kr) * kr
    wp = torch.zeros(n_padded, k_padded, dtype=torch.int8)
    wp[:n, :k] = w
    panels = wp.reshape(n_padded // nr, nr, k_padded // kr, kr).permute(0, 2, 1, 3)  # panel[k / kr][n % nr][k % kr]
    header = b"W8A8PKW\0" + struct.pack("<HBBBBBBqqqq", VERSION, 0, 0, nr, kr, 0, 0, n, k, n_padded, k_padded)
    header += name.ljust(NAME_BYTES, b"\0") + bytes(4)
    sums = wp.sum(dim=1, dtype=torch.int32)
    return seal(bytearray(header + panels.contiguous().numpy().tobytes() + sums.numpy().tobytes()))


def decode(b: bytes) -> torch.Tensor:
    """The int8 [N, K] weight a (valid) blob describes."""
    nr, kr, n, k, n_padded, k_padded = (get(b, f) for f in ("nr", "kr", "n", "k", "n_padded", "k_padded"))
    panels = torch.frombuffer(bytearray(b[HEADER:HEADER + n_padded * k_padded]), dtype=torch.int8)
    w = panels.reshape(n_padded // nr, k_padded // kr, nr, kr).permute(0, 2, 1, 3).reshape(n_padded, k_padded)
    return w[:n, :k].contiguous()


# ---- fixtures ----------------------------------------------------------------------------------------------------
def linear_case(gen, n=37, k=90, m=3):
    w_q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    w_scale = torch.rand(n, generator=gen) * 0.02 + 1e-3
    x = torch.randn(m, k, generator=gen)
    x_q, x_scale = reference.per_token_quant_int8(x)
    return w_q, w_scale, x, x_q, x_scale


def mm(x_q, blob, x_scale, w_scale):
    return w8a8_cpu.int8_scaled_mm(x_q, blob, x_scale, w_scale, None, torch.float32)


def moe_case(gen, m=5, h=32, inter=16, experts=3, topk=2):
    return dict(hidden=torch.randn(m, h, generator=gen),
                w13=torch.randint(-127, 128, (experts, 2 * inter, h), dtype=torch.int8, generator=gen),
                w2=torch.randint(-127, 128, (experts, h, inter), dtype=torch.int8, generator=gen),
                w13_scale=torch.rand(experts, 2 * inter, generator=gen) * 2e-3 + 1e-4,
                w2_scale=torch.rand(experts, h, generator=gen) * 2e-3 + 1e-4,
                topk_weights=torch.rand(m, topk, generator=gen),
                topk_ids=torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(m)]))


def moe(a, w13, w2):
    return w8a8_cpu.fused_experts(a["hidden"], w13, w2, a["topk_weights"], a["topk_ids"], a["w13_scale"],
                                  a["w2_scale"])


def experts_tensor(rows, offset=0):
    """[E, bytes] packed experts from per-expert blobs (bytes), optionally at an odd storage offset."""
    flat = as_tensor(b"".join(rows), offset)
    return flat.view(len(rows), len(rows[0]))


# ---- the format ----------------------------------------------------------------------------------------------------
def test_crc32c_check_value():
    assert crc32c(b"123456789") == 0xE3069283  # the standard CRC-32C check value
    assert crc32c(b"") == 0


def test_blob_header_version_name_and_checksum(variant, gen):
    blob = raw_bytes(w8a8_cpu.pack_weight(linear_case(gen)[0]))
    assert blob[:8] == b"W8A8PKW\0" and get(blob, "version") == VERSION
    name = bytes(blob[OFF_NAME:OFF_NAME + NAME_BYTES])
    assert name.rstrip(b"\0").decode() == variant and name.endswith(b"\0")
    assert struct.unpack_from("<I", blob, OFF_CRC)[0] == crc32c(bytes(blob[:OFF_CRC]) + bytes(blob[HEADER:]))


def test_blob_bytes_match_the_documented_format(variant, gen):
    # encode() above is written from docs/ARCHITECTURE.md alone, checksum included: this pins every byte.
    w_q = linear_case(gen)[0]
    info = w8a8_cpu.info()
    assert raw_bytes(w8a8_cpu.pack_weight(w_q)) == encode(w_q, info["panel_width"], info["panel_depth"],
                                                           variant.encode())


@pytest.mark.parametrize("nr,kr", [(1, 1), (3, 5), (16, 8), (64, 64)])
def test_reference_variant_reads_any_valid_layout_exactly(gen, nr, kr):
    # The checks reject what is inconsistent, not what is unusual: a valid blob in any layout is read exactly.
    w_q, w_scale, _, x_q, x_scale = linear_case(gen)
    with w8a8_cpu.use_variant("ref"):
        got = mm(x_q, as_tensor(encode(w_q, nr, kr)), x_scale, w_scale)
    assert torch.equal(got, reference.int8_scaled_mm(x_q, w_q, x_scale, w_scale, None, torch.float32))


# ---- finding 1: the packed_by name is bounded ------------------------------------------------------------------------
@pytest.mark.parametrize("name", [b"A" * NAME_BYTES, b"ref\x01\0", b"\xff\xfe\0", b"\0ref"],
                         ids=["unterminated", "control-char", "non-ascii", "empty"])
@pytest.mark.parametrize("other_layout", [False, True], ids=["same-layout", "other-layout"])
def test_bad_packed_by_name_is_rejected(variant, gen, name, other_layout):
    # Before: an unterminated name was printed with strlen (reading past the 16-byte field, and past the tensor
    # when the body had no zero byte) in the layout-mismatch message, and accepted otherwise.
    w_q, w_scale, _, x_q, x_scale = linear_case(gen, k=96)  # K = 96: a valid k_padded for kr = 4 and 8
    blob = raw_bytes(w8a8_cpu.pack_weight(w_q))
    body = bytes(range(1, 256)) * (len(blob) // 255 + 1)
    blob[HEADER:] = body[:len(blob) - HEADER]  # no zero byte after the name for strlen to stop at
    blob[OFF_NAME:OFF_NAME + NAME_BYTES] = name.ljust(NAME_BYTES, b"\0")
    if other_layout:
        put(blob, "kr", 8 if get(blob, "kr") != 8 else 4)
    with pytest.raises(ValueError, match=r"^w: packed weight header: packed_by") as e:
        mm(x_q, as_tensor(seal(blob)), x_scale, w_scale)
    assert "AAAAAAAAAAAAA" not in str(e.value) and len(str(e.value)) < 300


def test_fused_experts_bad_name_is_value_error(gen):
    # Before: expert 1's unterminated name reached the "pack all experts with one variant" message as raw bytes,
    # and Python raised UnicodeDecodeError instead of ValueError.
    a = moe_case(gen, h=64)
    w13, w2 = w8a8_cpu.pack_moe_weights(a["w13"], a["w2"])
    rows = [raw_bytes(r) for r in w13]
    rows[1][OFF_NAME:OFF_NAME + NAME_BYTES] = b"\xff" * NAME_BYTES
    put(rows[1], "kr", 8 if get(rows[1], "kr") != 8 else 4)
    rows[1][HEADER:] = b"\x80" * (len(rows[1]) - HEADER)
    with pytest.raises(ValueError, match=r"^w13: packed weight header: packed_by"):
        moe(a, experts_tensor([bytes(seal(r)) for r in rows]), w2)


# ---- finding 2: header sizes cannot overflow -----------------------------------------------------------------------
def overflow_blob(n=1 << 58, k=60):
    """A 64-byte blob whose 64 + n_padded * k_padded + 4 * n_padded wraps around to 64 in int64 arithmetic."""
    b = bytearray(HEADER)
    b[:8] = b"W8A8PKW\0"
    for field, value in dict(version=VERSION, nr=1, kr=1, n=n, k=k, n_padded=n, k_padded=k).items():
        put(b, field, value)
    b[OFF_NAME:OFF_NAME + 4] = b"ref\0"
    return seal(b)


def test_size_overflow_is_rejected(variant, gen):
    # Before: the blob passed view_packed_weight (signed overflow) and only the w_scale shape check stopped the op;
    # the torch-free API read out of bounds.
    blob = as_tensor(overflow_blob())
    x_q = torch.zeros(1, 60, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"^w: packed weight header"):
        mm(x_q, blob, torch.ones(1, 1), torch.ones(1))
    a = moe_case(gen, h=60, inter=30, experts=1, topk=1)
    a["topk_ids"] = torch.zeros(5, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"^w13: packed weight header"):
        moe(a, blob.view(1, HEADER), a["w2"])


@pytest.mark.parametrize("field,value", [("n", 1 << 62), ("n", -16), ("n", 0), ("k", 1 << 17), ("k", -4),
                                         ("nr", 0), ("kr", 0), ("nr", 255), ("kr", 65), ("scheme", 3), ("group_log2", 4),
                                         ("group_log2", 17), ("n_padded", 1 << 63),
                                         ("k_padded", -92), ("scale_storage", 1), ("scale_storage", 2),
                                         ("reserved", 1)])
def test_out_of_range_header_field_is_rejected(variant, gen, field, value):
    w_q, w_scale, _, x_q, x_scale = linear_case(gen)
    blob = put(raw_bytes(w8a8_cpu.pack_weight(w_q)), field, value)
    with pytest.raises(ValueError, match=r"^w: packed weight header"):
        mm(x_q, as_tensor(seal(blob)), x_scale, w_scale)


# ---- finding 3: any storage offset ---------------------------------------------------------------------------------
@pytest.mark.parametrize("offset", [1, 2, 3, 5])
def test_blob_at_odd_storage_offset_is_exact(variant, gen, offset):
    # The header is copied out and the channel sums are read bytewise, so a blob at any byte offset (e.g. a slice of
    # a larger uint8 buffer, blob_storage[1:]) is read without a misaligned access (the C++ runner checks this
    # under UBSan); the result is the exact one.
    w_q, w_scale, x, x_q, x_scale = linear_case(gen)
    blob = w8a8_cpu.pack_weight(w_q)
    moved = as_tensor(raw_bytes(blob), offset)
    assert moved.data_ptr() % 4 != 0 or offset % 4 == 0
    assert torch.equal(mm(x_q, moved, x_scale, w_scale), reference.int8_scaled_mm(x_q, w_q, x_scale, w_scale, None,
                                                                                 torch.float32))
    assert torch.equal(w8a8_cpu.int8_scaled_mm_with_quant(x, moved, w_scale),
                       w8a8_cpu.int8_scaled_mm_with_quant(x, blob, w_scale))
    a = moe_case(gen)
    w13, w2 = w8a8_cpu.pack_moe_weights(a["w13"], a["w2"])
    got = moe(a, experts_tensor([bytes(raw_bytes(r)) for r in w13], offset),
              experts_tensor([bytes(raw_bytes(r)) for r in w2], offset))
    assert torch.equal(got, moe(a, w13, w2))


# ---- finding 4: integrity ------------------------------------------------------------------------------------------
def test_corrupted_body_byte_is_rejected(variant, gen):
    # Before: one flipped weight byte gave wrong numbers without an error.
    w_q, w_scale, _, x_q, x_scale = linear_case(gen)
    blob = raw_bytes(w8a8_cpu.pack_weight(w_q))
    blob[HEADER + 100] ^= 0x40
    with pytest.raises(ValueError, match=r"^w: packed weight checksum mismatch.*re-pack"):
        mm(x_q, as_tensor(blob), x_scale, w_scale)


@pytest.mark.parametrize("sealed", [False, True], ids=["unsealed", "resealed"])
def test_kr_edit_is_rejected_by_reference_variant(gen, sealed):
    # Before: kr 4 -> 5 (K = 20 is a multiple of both, so sizes stay consistent) made `ref`, which reads any layout,
    # compute with a scrambled weight (max abs diff ~1000) without an error.
    w_q, w_scale, _, x_q, x_scale = linear_case(gen, n=16, k=20)
    with w8a8_cpu.use_variant("ref"):
        blob = put(raw_bytes(w8a8_cpu.pack_weight(w_q)), "kr", 5)
        with pytest.raises(ValueError, match="checksum mismatch" if not sealed else "channel sums"):
            mm(x_q, as_tensor(seal(blob) if sealed else blob), x_scale, w_scale)


def test_resealed_channel_sum_edit_is_rejected(variant, gen):
    # The VNNI / ppc64 tiles subtract 128 * the stored channel sum: a resealed edit would shift a whole column.
    w_q, w_scale, _, x_q, x_scale = linear_case(gen)
    blob = raw_bytes(w8a8_cpu.pack_weight(w_q))
    at = col_sums_offset(blob) + 4 * 3
    struct.pack_into("<i", blob, at, struct.unpack_from("<i", blob, at)[0] + 1)
    with pytest.raises(ValueError, match=r"^w: packed weight channel sums do not match its panels \(channel 3\)"):
        mm(x_q, as_tensor(seal(blob)), x_scale, w_scale)


def test_resealed_nonzero_padding_is_rejected(variant, gen):
    # K = 90 pads to 92 (kr = 4) or 96 (kr = 8): channel 0's k = 91 is padding. Set it, and its channel sum, so that
    # the sums agree and only the padding check can object.
    w_q, w_scale, _, x_q, x_scale = linear_case(gen)
    blob = raw_bytes(w8a8_cpu.pack_weight(w_q))
    nr, kr, kp = get(blob, "nr"), get(blob, "kr"), get(blob, "k_padded")
    blob[HEADER + (91 // kr) * nr * kr + 91 % kr] = 5
    at = col_sums_offset(blob)
    struct.pack_into("<i", blob, at, struct.unpack_from("<i", blob, at)[0] + 5)
    assert kp > 91
    with pytest.raises(ValueError, match=r"^w: packed weight padding is not zero"):
        mm(x_q, as_tensor(seal(blob)), x_scale, w_scale)


@pytest.mark.parametrize("version", [2, 4])
def test_old_format_version_is_rejected_with_repack_hint(gen, version):
    # versions up to 4 held a uint32 version where version 5 holds a uint16 one, the scale storage and a reserved byte
    w_q, w_scale, _, x_q, x_scale = linear_case(gen)
    blob = raw_bytes(w8a8_cpu.pack_weight(w_q))
    struct.pack_into("<I", blob, OFF_VERSION, version)
    with pytest.raises(ValueError, match=rf"^w: packed weight format version {version} is not supported.*re-pack"):
        mm(x_q, as_tensor(seal(blob)), x_scale, w_scale)


def test_in_place_edit_after_first_use_is_caught(variant, gen):
    # Verification is cached per tensor and torch version counter: an in-place edit bumps the counter.
    w_q, w_scale, _, x_q, x_scale = linear_case(gen)
    blob = w8a8_cpu.pack_weight(w_q)
    want = mm(x_q, blob, x_scale, w_scale)
    assert torch.equal(mm(x_q, blob, x_scale, w_scale), want)
    blob[HEADER + 7] ^= 1
    with pytest.raises(ValueError, match="checksum mismatch"):
        mm(x_q, blob, x_scale, w_scale)
    blob[HEADER + 7] ^= 1
    assert torch.equal(mm(x_q, blob, x_scale, w_scale), want)
    a = moe_case(gen)
    w13, w2 = w8a8_cpu.pack_moe_weights(a["w13"], a["w2"])
    want = moe(a, w13, w2)
    w2[2, HEADER + 3] ^= 1
    with pytest.raises(ValueError, match=r"^w2 \(expert 2\): packed weight checksum mismatch"):
        moe(a, w13, w2)
    w2[2, HEADER + 3] ^= 1
    assert torch.equal(moe(a, w13, w2), want)


def _flip_file_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 1]))


@pytest.mark.parametrize("mapping", ["from_file shared", "torch.load mmap"])
def test_file_backed_blob_rewritten_by_another_writer_is_caught(gen, tmp_path, mapping):
    """A blob mapped from a file can change under the mapping (another process rewrites the file; no version counter
    sees it): such blobs are verified on every call, so the change is a ValueError, never a silently wrong result."""
    w_q, w_scale, _, x_q, x_scale = linear_case(gen)
    blob = w8a8_cpu.pack_weight(w_q)
    want = mm(x_q, blob, x_scale, w_scale)
    path = tmp_path / "blob.bin"
    if mapping == "from_file shared":
        blob.numpy().tofile(path)
        mapped, offset = torch.from_file(str(path), shared=True, size=blob.numel(), dtype=torch.uint8), 0
    else:
        torch.save({"blob": blob}, path)
        mapped = torch.load(path, mmap=True)["blob"]
        offset = path.read_bytes().find(blob.numpy().tobytes())  # where the record's bytes sit in the archive
        assert offset > 0
    assert torch.equal(mm(x_q, mapped, x_scale, w_scale), want)
    _flip_file_byte(path, offset + HEADER + 7)
    with pytest.raises(ValueError, match="checksum mismatch"):
        mm(x_q, mapped, x_scale, w_scale)
    _flip_file_byte(path, offset + HEADER + 7)
    assert torch.equal(mm(x_q, mapped, x_scale, w_scale), want)


def test_verify_packed_weight_op(gen):
    # For Python code that reads blob bytes itself (unpack_weight): the ops' checks without a matmul.
    blob = w8a8_cpu.pack_weight(linear_case(gen)[0])
    torch.ops.w8a8_cpu._verify_packed_weight(blob)
    torch.ops.w8a8_cpu._verify_packed_weight(as_tensor(raw_bytes(blob), 3))
    bad = raw_bytes(blob)
    bad[HEADER + 1] ^= 1
    with pytest.raises(ValueError, match=r"^blob: packed weight checksum mismatch"):
        torch.ops.w8a8_cpu._verify_packed_weight(as_tensor(bad))
    with pytest.raises(ValueError, match=r"^blob: packed weight header"):
        torch.ops.w8a8_cpu._verify_packed_weight(as_tensor(overflow_blob()))
    with pytest.raises(ValueError, match=r"^blob: expected a contiguous 1-D uint8"):
        torch.ops.w8a8_cpu._verify_packed_weight(blob.view(torch.int8))


# ---- driver scratch kept between calls ------------------------------------------------------------------------------
SCRATCH_CHILD = """
import threading, time, torch, w8a8_cpu
torch.set_num_threads(1)
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
# int8_scaled_mm with M = 14000, K = 4096 needs ~58 MB of scratch (packed int8 A rows), per calling thread: above
# glibc's largest mmap threshold (32 MiB), so a freed buffer goes back to the OS and RSS shows it.
x_q = torch.randint(-127, 128, (14000, 4096), dtype=torch.int8)
x_scale = torch.ones(14000, 1)
w, w_scale = w8a8_cpu.pack_weight(torch.randint(-127, 128, (16, 4096), dtype=torch.int8)), torch.ones(16)
w8a8_cpu.int8_scaled_mm(x_q[:1], w, x_scale[:1], w_scale)
base = rss_mib()
called, leave = threading.Barrier(9), threading.Event()
def work():
    w8a8_cpu.int8_scaled_mm(x_q, w, x_scale, w_scale)
    called.wait()
    leave.wait()
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads:
    t.start()
called.wait()
alive = rss_mib() - base
leave.set()
for t in threads:
    t.join()
for _ in range(50):  # join() returns before the OS thread has run its thread_local destructors
    if rss_mib() - base < 32:
        break
    time.sleep(0.1)
print(f"scratch: alive {alive:.0f} exited {rss_mib() - base:.0f}")
"""


@pytest.mark.slow_under_emulation
@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                    reason="ASan keeps freed memory in its quarantine, so RSS does not show what is retained")
def test_scratch_kept_across_threads_is_bounded_and_freed_on_exit():
    # Each calling thread keeps its scratch buffer for its next call. Before, every thread kept up to 256 MiB
    # (8 threads here: ~450 MiB); now all threads together keep at most 256 MiB, and a thread's buffer goes with it.
    from conftest import python_command

    proc = subprocess.run(python_command() + ["-c", SCRATCH_CHILD], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    alive, exited = (float(v) for v in re.search(r"scratch: alive (\S+) exited (\S+)", proc.stdout).groups())
    assert alive < 256 + 48, f"threads alive keep {alive:.0f} MiB of scratch"
    assert exited < 32, f"{exited:.0f} MiB still held after the threads exited"


# ---- finding 5: the fuzzer -----------------------------------------------------------------------------------------
INTERESTING = [0, 1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 63, 64, 65, 255, 256, 65535, (1 << 17) - 1, 1 << 17, (1 << 31) - 1,
               1 << 31, 1 << 32, 1 << 58, 1 << 62, (1 << 63) - 1, -1, -2, -(1 << 63)]


LAYOUTS = [(16, 4), (16, 4), (16, 8), (1, 1), (3, 5), (8, 2), (64, 64), (65, 4), (16, 65)]


def mutate(rng, blob: bytearray, allow_resize=True):
    """One random mutation of a valid blob; returns (bytes, storage offset, description). Most are resealed, so
    that the structural and channel-sum checks are reached, not only the checksum."""
    b = bytearray(blob)
    kinds = ["field", "field", "name", "body", "body", "col_sums", "header_bytes", "offset"]
    kind = rng.choice(kinds + (["field+resize", "truncate", "extend", "relayout"] if allow_resize else []))
    sealed = rng.random() < 0.7
    offset = 0
    if kind.startswith("field"):
        field = rng.choice(list(FIELDS))
        old = get(b, field)
        value = rng.choice(INTERESTING + [old + 1, old - 1, old * 2, old // 2, old + 16, old - 16,
                                          rng.getrandbits(64) - (1 << 63)])
        put(b, field, value)
        desc = f"{field} {old} -> {value}"
        if kind == "field+resize":  # make the total size agree with the edited header, when it is small
            want = HEADER + get(b, "n_padded") * get(b, "k_padded") + 4 * get(b, "n_padded")
            if 0 <= want <= 1 << 20:
                b = b[:want] + bytearray(max(0, want - len(b)))
                desc += f", resized to {want}"
    elif kind == "name":
        for _ in range(rng.randint(1, 4)):
            b[OFF_NAME + rng.randrange(NAME_BYTES)] = rng.randrange(256)
        desc = f"name {bytes(b[OFF_NAME:OFF_NAME + NAME_BYTES])!r}"
    elif kind in ("body", "col_sums"):
        lo = col_sums_offset(blob) if kind == "col_sums" else HEADER
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(lo, len(b))] ^= 1 << rng.randrange(8) if rng.random() < 0.5 else rng.randrange(1, 256)
        desc = kind
    elif kind == "header_bytes":
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(HEADER)] = rng.randrange(256)
        desc = "header bytes"
    elif kind == "truncate":
        b = b[:rng.choice([0, 1, 8, 63, 64, 65, len(b) - 1, len(b) - 4, rng.randrange(len(b))])]
        desc = f"truncated to {len(b)}"
    elif kind == "extend":
        b += bytearray(rng.randrange(256) for _ in range(rng.choice([1, 3, 4, 64, rng.randrange(1, 200)])))
        desc = f"extended to {len(b)}"
    elif kind == "relayout":  # the same weight, validly packed in another panel layout: ref reads it exactly
        nr, kr = rng.choice(LAYOUTS)
        b, sealed = encode(decode(b), nr, kr), False
        desc = f"re-packed as {nr}x{kr}"
    else:
        offset, sealed = rng.randrange(1, 8), False
        desc = f"storage offset {offset}"
    if sealed and len(b) >= HEADER:
        seal(b)
    return bytes(b), offset, desc + (" (resealed)" if sealed and len(b) >= HEADER else "")


def fuzz(cases: int, seed: int = 20260405) -> dict:
    """cases mutations spread over int8_scaled_mm, int8_scaled_mm_with_quant and fused_experts on every runnable
    variant; each must give ValueError or the unmutated (= exact reference) result, bit for bit."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    counts = {"cases": 0, "value_errors": 0, "exact": 0, "failures": 0}
    variants = w8a8_cpu.info()["runnable_variants"]
    setups = []
    for v in variants:
        with w8a8_cpu.use_variant(v):
            for n, k in [(21, 30), (16, 8), (5, 3)]:
                w_q, w_scale, x, x_q, x_scale = linear_case(gen, n=n, k=k)
                blob = raw_bytes(w8a8_cpu.pack_weight(w_q))
                want = reference.int8_scaled_mm(x_q, w_q, x_scale, w_scale, None, torch.float32)
                assert torch.equal(mm(x_q, as_tensor(blob), x_scale, w_scale), want)
                want_q = w8a8_cpu.int8_scaled_mm_with_quant(x, w_q, w_scale)
                setups.append((v, "int8_scaled_mm", blob, lambda t, a=(x_q, x_scale, w_scale): mm(a[0], t, a[1], a[2]),
                               want))
                setups.append((v, "int8_scaled_mm_with_quant", blob,
                               lambda t, a=(x, w_scale): w8a8_cpu.int8_scaled_mm_with_quant(a[0], t, a[1]), want_q))
            a = moe_case(gen)
            w13, w2 = w8a8_cpu.pack_moe_weights(a["w13"], a["w2"])
            rows = {"w13": [raw_bytes(r) for r in w13], "w2": [raw_bytes(r) for r in w2]}
            setups.append((v, "fused_experts", rows, a, moe(a, w13, w2)))
    t0 = time.perf_counter()
    for i in range(cases):
        v, op, base, call, want = setups[i % len(setups)]
        if op == "fused_experts":  # mutate one expert of w13 or w2; length changes apply to every expert
            which = rng.choice(["w13", "w2"])
            rows = [bytes(r) for r in base[which]]
            e = rng.randrange(len(rows))
            rows[e], offset, desc = mutate(rng, base[which][e], allow_resize=False)
            if rng.random() < 0.1:  # every expert: one length change, or one re-packed layout
                cut = rng.choice([-1, 1, 4, 0])
                nr, kr = rng.choice(LAYOUTS)
                if cut:
                    rows = [r[:len(r) - cut] if cut > 0 else r + b"\0" for r in rows]
                else:  # from the unmutated experts: decode needs a valid blob
                    rows, offset = [bytes(encode(decode(r), nr, kr)) for r in base[which]], 0
                desc += f", every expert's length changed by {-cut}" if cut else f", every expert re-packed {nr}x{kr}"
            args = {which: experts_tensor(rows, offset)}
            other = "w2" if which == "w13" else "w13"
            args[other] = experts_tensor([bytes(r) for r in base[other]])
            desc = f"{which}[{e}]: {desc}"

            def run(_args=args, _a=call):
                return moe(_a, _args["w13"], _args["w2"])
        else:
            data, offset, desc = mutate(rng, base)

            def run(_t=as_tensor(data, offset), _call=call):
                return _call(_t)
        counts["cases"] += 1
        try:
            with w8a8_cpu.use_variant(v):
                got = run()
        except ValueError:
            counts["value_errors"] += 1
            continue
        except Exception as e:  # noqa: BLE001  (anything but ValueError is a finding)
            counts["failures"] += 1
            print(f"FAIL case {i} {v} {op} {desc}: {type(e).__name__}: {e}", flush=True)
            continue
        if torch.equal(got, want):
            counts["exact"] += 1
        else:
            counts["failures"] += 1
            print(f"FAIL case {i} {v} {op} {desc}: wrong result, max abs diff "
                  f"{(got.float() - want.float()).abs().max().item()}", flush=True)
    counts["seconds"] = round(time.perf_counter() - t0, 2)
    return counts


FUZZ_LINE = re.compile(r"^fuzz: cases (\d+) value_errors (\d+) exact (\d+) failures (\d+) seconds ([\d.]+)$", re.M)


def test_fuzz_packed_weights():
    from conftest import EMULATED, python_command

    cases = 300 if EMULATED else 4000
    proc = subprocess.run(python_command() + [__file__, "--fuzz", str(cases)], capture_output=True, text=True,
                          timeout=1200 if EMULATED else 120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"fuzzer exited with {proc.returncode} (a negative code is a signal):\n{out[-4000:]}"
    match = FUZZ_LINE.search(proc.stdout)
    assert match, out[-4000:]
    total, value_errors, exact, failures = (int(g) for g in match.groups()[:4])
    print(match.group(0))
    assert failures == 0 and total == cases and value_errors + exact == cases
    assert value_errors > cases // 2 and exact > 0  # both outcomes occur: the mutations reach the checks


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--fuzz":
        c = fuzz(int(sys.argv[2]))
        print(f"fuzz: cases {c['cases']} value_errors {c['value_errors']} exact {c['exact']} "
              f"failures {c['failures']} seconds {c['seconds']}", flush=True)
        sys.exit(1 if c["failures"] else 0)
    sys.exit("usage: test_packed_weight_safety.py --fuzz CASES")
