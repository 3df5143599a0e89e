"""The shared model cache (w8a8_cpu.llm.cache) with odd files where it expects its own: links, FIFOs, /dev/zero,
truncated or missing files, folders left by interrupted builders, folders of other installations. Each case is
bounded by an alarm, so a regression that blocks (a FIFO opened for reading) fails instead of hanging the suite."""
import contextlib
import fcntl
import json
import os
import re
import stat
import time

import pytest

from conftest import deadline_fixture
from w8a8_cpu.llm import cache

KEY = {"format": 1, "source": "abc"}
REQUIRED = ("config.json", "model.safetensors")


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("W8A8_CPU_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


deadline = deadline_fixture(20, "the cache blocked")


class Builder:
    """build(staging): writes the required files (model.safetensors of `size` bytes) and whatever `extra(staging)`
    adds; counts its calls."""

    def __init__(self, files=REQUIRED, size=100, extra=None):
        self.files, self.size, self.extra, self.calls = files, size, extra, 0

    def __call__(self, staging):
        self.calls += 1
        for name in self.files:
            (staging / name).write_bytes(b"x" * (self.size if name == "model.safetensors" else 2))
        if self.extra is not None:
            self.extra(staging)


def ensure(builder, key=KEY):
    return cache.ensure("model", key, REQUIRED, builder, "building")


def test_published_whole_readable_by_all_and_reused(root):
    builder = Builder()
    folder = ensure(builder)
    assert folder.parent == root and folder.name == cache.folder_name("model", KEY)
    assert sorted(p.name for p in folder.iterdir()) == sorted([*REQUIRED, cache.MARKER])
    assert all((p.stat().st_mode & 0o777) == 0o644 for p in folder.iterdir())
    assert (folder.stat().st_mode & 0o777) == 0o755
    marker = json.loads((folder / cache.MARKER).read_text())
    assert marker == {"key": KEY, "files": {"config.json": 2, "model.safetensors": 100}}
    assert ensure(builder) == folder and builder.calls == 1
    assert [p.name for p in root.iterdir() if p.is_dir()] == [folder.name], "no staging folder left"


@pytest.mark.parametrize("damage", ["truncated", "missing", "marker FIFO", "marker /dev/zero", "marker deep",
                                    "marker other key", "marker NUL name", "marker surrogate name"])
def test_damaged_folder_is_rebuilt_once(root, damage):
    builder = Builder()
    folder = ensure(builder)
    if damage == "truncated":
        os.truncate(folder / "model.safetensors", 10)
    elif damage == "missing":
        (folder / "config.json").unlink()
    else:
        (folder / cache.MARKER).unlink()
        if damage == "marker FIFO":
            os.mkfifo(folder / cache.MARKER)
        elif damage == "marker /dev/zero":
            os.symlink("/dev/zero", folder / cache.MARKER)
        elif damage == "marker deep":
            (folder / cache.MARKER).write_text("[" * 30000 + "]" * 30000)
        elif damage.endswith(" name"):  # names the file system refuses (os.lstat: ValueError, not OSError)
            name = "a\u0000b" if damage == "marker NUL name" else "a\ud800b"  # (\udc80 is a valid byte there)
            files = {"config.json": 2, "model.safetensors": 100, name: 1}
            (folder / cache.MARKER).write_text(json.dumps({"key": KEY, "files": files}))
        else:
            (folder / cache.MARKER).write_text(json.dumps({"key": {"format": 0}, "files": {}}))
    assert not cache.is_complete(folder, KEY, REQUIRED)
    assert ensure(builder) == folder and builder.calls == 2
    assert cache.is_complete(folder, KEY, REQUIRED)


def test_builder_that_leaves_files_out_is_named(root):
    with pytest.raises(ValueError, match=r"model-[0-9a-f]{16}: still incomplete after a rebuild .*model.safetensors"):
        ensure(Builder(files=("config.json",)))


def test_interrupted_builder_leaves_nothing_behind(root):
    def dies(staging):
        (staging / "model.safetensors").write_bytes(b"x" * 1000)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ensure(dies)
    assert [p.name for p in root.iterdir() if p.is_dir()] == []
    # a builder killed outright (no finally) leaves its staging folder: the next build sweeps it, under the lock
    killed = root / ".staging-model-x.abc"
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"x" * 1000)
    ensure(Builder())
    assert not killed.exists()


@pytest.mark.parametrize("odd", ["symlink to a file", "FIFO"])
def test_odd_build_lock_refused_without_harm(root, odd, tmp_path):
    root.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    lock = root / ".build.lock"
    if odd == "FIFO":
        os.mkfifo(lock)
    else:
        os.symlink(victim, lock)
    message = "is not a regular file" if odd == "FIFO" else "is a symbolic link"
    with pytest.raises(ValueError, match=rf"\.build\.lock: {message}"):
        ensure(Builder())
    assert victim.read_text() == "keep me"


@pytest.mark.parametrize("odd", ["file", "symlink"])
def test_target_that_is_not_a_folder_is_named(root, odd, tmp_path):
    root.mkdir()
    target = root / cache.folder_name("model", KEY)
    if odd == "file":
        target.write_text("not a folder")
    else:
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        target.symlink_to(elsewhere)
    with pytest.raises(ValueError, match=rf"{target.name}: is not a cache folder \(a link or a file\); delete it"):
        ensure(Builder())
    assert target.is_symlink() or target.read_text() == "not a folder"


def test_cache_root_that_is_a_file_is_named(root):
    root.write_text("x")
    with pytest.raises(ValueError, match="the cache root"):
        ensure(Builder())


@pytest.mark.parametrize("target", ["folder", "nothing"])
def test_cache_root_that_is_a_link_is_named_a_link(root, target, tmp_path):
    """A link is not followed (who can change it would choose what is loaded): said so, also when it dangles (it was
    'is not a directory' for a link to a folder, 'cannot be created (File exists)' for a dangling one)."""
    (tmp_path / "folder").mkdir()
    root.symlink_to(tmp_path / target)
    message = f"cache: the cache root is a symbolic link (to '{tmp_path / target}'), which the cache does not follow"
    with pytest.raises(ValueError, match=re.escape(message + "; set W8A8_CPU_CACHE to the directory itself")):
        ensure(Builder())


def test_other_installations_folders_kept_until_stale_and_unused(root):
    """Another key is another installation's content: kept while recently used, swept when unused for STALE_DAYS,
    but never while a reader holds it."""
    other, busy, recent = ({"format": 1, "source": s} for s in ("old", "busy", "new"))
    folders = {name: ensure(Builder(), key) for name, key in (("old", other), ("busy", busy), ("recent", recent))}
    long_ago = time.time() - (cache.STALE_DAYS + 1) * 86400
    for name in ("old", "busy"):
        os.utime(folders[name], (long_ago, long_ago))
    with cache.in_use(folders["busy"]):
        os.utime(folders["busy"], (long_ago, long_ago))  # in_use marks it used: make it look stale anyway
        ensure(Builder())  # a build sweeps
    assert not folders["old"].exists()
    assert cache.is_complete(folders["busy"], busy, REQUIRED) and cache.is_complete(folders["recent"], recent, REQUIRED)


def test_reader_lock_is_shared_and_blocks_the_sweep_only(root):
    folder = ensure(Builder())
    lock = root / f".{folder.name}.lock"
    with cache.in_use(folder), cache.in_use(folder):  # readers share it
        fd = os.open(lock, os.O_RDWR)
        with contextlib.closing(os.fdopen(fd)), pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

# ---- a root other users can write to (W8A8_CPU_CACHE=/tmp/shared): a folder planted under the name a key gives, or
# left writable by others, is refused naming it; what a builder leaves (links, folders) is published without touching
# anything outside the cache; lock files are opened read-only, so that other users can lock them

def test_folder_of_another_user_is_left_alone_and_this_user_builds_its_own(root):
    """A folder under the name a key gives, owned by another user (planted in a shared root, or a user's cache that
    root reads through a mount) is neither loaded nor removed: this user builds its own copy beside it, once."""
    if os.getuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    planted = ensure(Builder())
    for path in (planted, *planted.iterdir()):  # as if another user had planted it, marker and all
        os.chown(path, 65534, 65534)
    builder = Builder()
    own = ensure(builder)
    assert own == planted.with_name(f"{planted.name}-uid0") and builder.calls == 1
    assert ensure(builder) == own and builder.calls == 1
    assert os.stat(planted).st_uid == 65534 and (planted / "model.safetensors").exists()


@pytest.mark.parametrize("what", ["folder", "marker", "model.safetensors"])
@pytest.mark.parametrize("mode", [0o020, 0o002])
def test_entries_writable_by_others_are_not_trusted(root, what, mode):
    """A folder writable by others is left alone (this user's own copy is built beside it); a marker or file
    writable by others in this user's folder is a ValueError naming it."""
    folder = ensure(Builder())
    path = folder if what == "folder" else folder / (cache.MARKER if what == "marker" else what)
    path.chmod(stat.S_IMODE(path.stat().st_mode) | mode)
    builder = Builder()
    if what == "folder":
        assert ensure(builder) == folder.with_name(f"{folder.name}-uid{os.getuid()}") and builder.calls == 1
    else:
        with pytest.raises(ValueError, match=rf"{path.name}: writable by other users \(mode \d+\), so its content "
                                             rf"cannot be trusted; set W8A8_CPU_CACHE to a folder only you can write"):
            ensure(builder)
        assert builder.calls == 0
    path.chmod(stat.S_IMODE(path.stat().st_mode) & ~mode)
    calls = builder.calls
    assert ensure(builder) == folder and builder.calls == calls  # the owner's own folder, used as it is


def test_links_and_folders_a_builder_leaves_are_published_without_harm(root, tmp_path):
    outside = tmp_path / "secret"
    outside.write_text("s")
    outside.chmod(0o600)

    def extra(staging):
        (staging / "source.gguf").symlink_to(outside)
        (staging / "sub").mkdir()
        (staging / "sub" / "f").write_text("x")

    folder = ensure(Builder(extra=extra))
    assert stat.S_IMODE(outside.stat().st_mode) == 0o600
    assert stat.S_IMODE((folder / "sub").stat().st_mode) == 0o755
    assert (folder / "sub" / "f").read_text() == "x"


def test_lock_files_opened_read_only_without_creating_an_existing_one(root, monkeypatch):
    folder = ensure(Builder())
    with cache.in_use(folder):  # creates the folder's lock
        pass
    opened = []
    real = cache.open_regular

    def spy(path, flags=os.O_RDONLY, follow_links=True):
        opened.append((os.path.basename(path), flags))
        return real(path, flags, follow_links)

    monkeypatch.setattr(cache, "open_regular", spy)
    with cache.in_use(folder), cache.in_use(folder):  # readers share it
        pass
    ensure(Builder(), key={"format": 2})  # takes the existing build lock
    locks = [(name, flags) for name, flags in opened if name.endswith(".lock")]
    assert {name for name, _ in locks} == {f".{folder.name}.lock", ".build.lock"}
    assert all(flags & os.O_ACCMODE == os.O_RDONLY and not flags & os.O_CREAT for _, flags in locks)


def test_new_lock_files_lockable_by_every_user_whatever_the_umask(root):
    previous = os.umask(0o077)
    try:
        folder = ensure(Builder())
        with cache.in_use(folder):
            pass
    finally:
        os.umask(previous)
    for name in (".build.lock", f".{folder.name}.lock"):
        assert stat.S_IMODE((root / name).stat().st_mode) == 0o644
