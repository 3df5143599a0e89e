"""A model cache that several installations, processes and ranks can share: content-addressed folders, published whole.

What is cached (the dequantized SmolLM2 checkpoint, its CTranslate2 conversion) is expensive to build (~1 min) and
read by every process that runs the main job, the tests or the bench, possibly from several virtual environments at
once. So:

- A folder's name is a digest of everything its content depends on (the key: source file size and hash, format,
  library major versions). Two installations that need different content use different folders; the same content is
  built once and shared. A folder is never rebuilt in place, so nobody deletes what another process is reading.
- A builder writes into a staging folder, writes the completeness marker last (the key and every file's size), and
  publishes by one rename. Builders take one exclusive lock per cache root, so a first use by many ranks builds once;
  under that lock, staging folders are leftovers of interrupted builders and are removed.
- A reader checks completeness (marker equal to the key, every listed file a regular file of the listed size, the
  required files present) before use and holds a shared lock on the folder while loading. A damaged folder is moved
  aside and rebuilt once; if the rebuilt one is still incomplete, the error names the folder to delete.
- Folders of other keys not used (read or built) for STALE_DAYS are swept under the build lock, unless in use.
- Every file of the cache is opened without following links and without blocking, must be a regular file, and the
  marker's size is bounded: a FIFO, a /dev/zero link or a symlinked lock neither hangs nor truncates anything.
- A cache root may be writable by other users (W8A8_CPU_CACHE=/tmp/shared): a folder's name and marker follow from
  its key, so another user could plant one. A folder is used only when owned by this user or root and not writable
  by group or others; another's (or a root user's reading a mounted user cache) is left alone and this user builds
  its own copy beside it (the name + "-uid<uid>"). A marker or listed file that fails the same test is a ValueError
  naming it. Lock files are opened read-only (flock needs no more), so a user can lock the lock files another user
  created.

The cache root is $W8A8_CPU_CACHE, else $XDG_CACHE_HOME/w8a8_cpu, else ~/.cache/w8a8_cpu. The test suite sets its own
(tests/conftest.py), so a user's cache and the tests never see each other."""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

from .._files import open_regular, read_json_object

MARKER = "w8a8_cpu_cache.json"  # written last: a folder without a valid one is incomplete
_MAX_MARKER_BYTES = 1 << 16
_BUILD_LOCK = ".build.lock"
_STAGING = ".staging-"
STALE_DAYS = 30  # a folder of another key unused this long is swept


def root() -> Path:
    return Path(os.environ.get("W8A8_CPU_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "w8a8_cpu"))


def folder_name(prefix: str, key: dict) -> str:
    """`prefix`-<digest of key>: the folder that holds exactly the content `key` describes."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return f"{prefix}-{digest}"


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes (the source of what is cached: its content, not its mtime, decides the key); hashed
    once per process while the file's size, mtime and inode stay the same."""
    info = os.stat(path)
    return _digest(str(path), info.st_size, info.st_mtime_ns, info.st_ino)


@functools.lru_cache(maxsize=8)
def _digest(path: str, size: int, mtime_ns: int, inode: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _open_lock(path: Path) -> int:
    """A read-only descriptor of the lock file at path, created (0644) if missing. Without O_CREAT when it exists:
    Linux's protected_regular refuses O_CREAT on another user's file in a sticky folder (a shared root in /tmp)."""
    created = not os.path.lexists(path)
    fd = open_regular(path, os.O_RDONLY | (os.O_CREAT if created else 0), follow_links=False)
    if created:
        with contextlib.suppress(OSError):  # another user created it first: theirs, as it is
            os.fchmod(fd, 0o644)  # lockable by every user of a shared cache, whatever the umask
    return fd


@contextlib.contextmanager
def _locked(path: Path, mode: int, waiting: Optional[Callable[[], None]] = None) -> Iterator[None]:
    fd = _open_lock(path)
    try:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting is not None:
                waiting()
            fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # releases the lock


def _checked_root(where: Path) -> Path:
    """The cache root, created if missing; a root that is a link (not followed: whoever can change it chooses what
    is loaded) or not a directory raises ValueError naming it."""
    if where.is_symlink():
        raise ValueError(f"{where}: the cache root is a symbolic link (to {os.readlink(where)!r}), which the cache does "
                         f"not follow; set W8A8_CPU_CACHE to the directory itself")
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{where}: the cache root cannot be created ({e.strerror}); set W8A8_CPU_CACHE to a "
                         f"writable directory") from None
    if where.is_symlink() or not where.is_dir():
        raise ValueError(f"{where}: the cache root is not a directory")
    return where


def _distrust(info: os.stat_result) -> Optional[str]:
    """Why an entry cannot be trusted (None when it can): only this user or root, and nobody else afterwards (no
    group or other write bit), can have written what this process is about to load."""
    if info.st_uid not in (os.getuid(), 0):
        return f"owned by uid {info.st_uid}, neither this user nor root"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by other users (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _check_trusted(path: Path, info: os.stat_result) -> None:
    problem = _distrust(info)
    if problem is not None:
        raise ValueError(f"{path}: {problem}, so its content cannot be trusted; set W8A8_CPU_CACHE to a folder only "
                         f"you can write (a file system without Unix permissions shows every file writable by all)")


def folder(prefix: str, key: dict) -> Path:
    """Where ensure(prefix, key, ...) keeps its folder for this user (_own_folder)."""
    return _own_folder(root(), folder_name(prefix, key))


def _own_folder(base: Path, name: str) -> Path:
    """The cache folder `name` for this process: base / name, unless the entry there is another user's (planted or
    not) or a folder writable by others (_distrust), then this user's own base / (name + "-uid<uid>"), built beside
    it. (This user's own link or file there is named by ensure: a link's mode bits say nothing.)"""
    with contextlib.suppress(OSError):
        info = os.lstat(base / name)
        if info.st_uid not in (os.getuid(), 0) or (stat.S_ISDIR(info.st_mode) and _distrust(info) is not None):
            return base / f"{name}-uid{os.getuid()}"
    return base / name


def read_marker(folder: Path) -> Optional[dict]:
    """The folder's completeness marker, or None when it is missing, a link, not a regular file, too large or not a
    JSON object."""
    try:
        return read_json_object(folder / MARKER, _MAX_MARKER_BYTES, follow_links=False)
    except ValueError:
        return None


def is_complete(folder: Path, key: dict, required: Iterable[str]) -> bool:
    """Whether folder is a published cache folder of `key`: a real directory, its marker equal to the key, every
    file the marker lists a regular file of the listed size, and every `required` file among them. The folder, its
    marker and every listed file must be trusted (_check_trusted), else ValueError naming the first that is not."""
    try:
        info = os.lstat(folder)
    except OSError:
        return False
    if not stat.S_ISDIR(info.st_mode):
        return False
    _check_trusted(folder, info)  # before the marker: a planted folder is named even without one
    with contextlib.suppress(OSError):
        info = os.lstat(folder / MARKER)
        if stat.S_ISREG(info.st_mode):  # a link or FIFO is not read: the folder is incomplete, rebuilt
            _check_trusted(folder / MARKER, info)
    marker = read_marker(folder)
    if marker is None or marker.get("key") != key or not isinstance(marker.get("files"), dict):
        return False
    files = marker["files"]
    if not set(required) <= set(files):
        return False
    for name, size in files.items():
        if not isinstance(name, str) or "/" in name or name in (".", "..") or not isinstance(size, int):
            return False
        try:
            info = os.lstat(folder / name)
        except (OSError, ValueError):  # ValueError: a name no file can have (a NUL, a lone high surrogate)
            return False
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            return False
        _check_trusted(folder / name, info)
    return True


@contextlib.contextmanager
def in_use(folder: Path) -> Iterator[None]:
    """Held while a reader loads from folder: the sweep skips a folder in use. Marks the folder as used now."""
    with _locked(folder.parent / f".{folder.name}.lock", fcntl.LOCK_SH):
        with contextlib.suppress(OSError):
            os.utime(folder)
        yield


def ensure(prefix: str, key: dict, required: Iterable[str], build: Callable[[Path], None], what: str,
           progress=None) -> Path:
    """The complete cache folder of `key` under the cache root, built by build(staging folder) if missing (one
    builder per root at a time; the marker written last, then one rename). A damaged folder is rebuilt once."""
    required = tuple(required)
    base = _checked_root(root())
    target = _own_folder(base, folder_name(prefix, key))
    if is_complete(target, key, required):
        return target
    note = (lambda text: progress.note(text)) if progress is not None else (lambda text: None)
    with _locked(base / _BUILD_LOCK, fcntl.LOCK_EX,
                 waiting=lambda: note(f"waiting for another process that is building in {base}")):
        if is_complete(target, key, required):  # whoever held the lock before us may have built it
            return target
        _sweep(base, keep=target)
        if target.is_symlink() or (target.exists() and not target.is_dir()):
            raise ValueError(f"{target}: is not a cache folder (a link or a file); delete it")
        if target.exists():  # damaged (a file truncated or removed since): set aside, rebuilt below
            note(f"{target} is incomplete; rebuilding it")
            _remove(target)
        note(f"first use: {what} into {target} (once)")
        staging = Path(tempfile.mkdtemp(prefix=_STAGING + target.name + ".", dir=base))
        try:
            build(staging)
            files = {p.name: p.lstat().st_size for p in sorted(staging.iterdir())
                     if p.is_file() and not p.is_symlink()}
            (staging / MARKER).write_text(json.dumps({"key": key, "files": files}, sort_keys=True))
            for p in staging.iterdir():  # readable by every user of a shared cache (mkdtemp made it 0700)
                if not p.is_symlink():  # a link's target is not the cache's to change
                    p.chmod(0o755 if p.is_dir() else 0o644)
            staging.chmod(0o755)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if not is_complete(target, key, required):
            raise ValueError(f"{target}: still incomplete after a rebuild (the builder did not write "
                             f"{', '.join(required)}); delete the folder and check the disk")
    return target


def _remove(folder: Path) -> None:
    """Rename aside, then delete (a reader never sees a half-deleted folder under the published name)."""
    aside = folder.parent / f"{_STAGING}removed.{folder.name}.{os.getpid()}.{time.monotonic_ns()}"
    folder.rename(aside)
    shutil.rmtree(aside, ignore_errors=True)


def _sweep(base: Path, keep: Path) -> None:
    """Under the build lock: staging folders (builders that died; live ones would hold the lock) and folders not
    used for STALE_DAYS and not in use now are removed."""
    now = time.time()
    for entry in base.iterdir():
        if entry == keep or entry.is_symlink() or not entry.is_dir():
            continue
        if entry.name.startswith(_STAGING):
            shutil.rmtree(entry, ignore_errors=True)
            continue
        if read_marker(entry) is None or now - entry.stat().st_mtime < STALE_DAYS * 86400:
            continue  # not a cache folder of ours (no marker), or used recently
        try:
            fd = _open_lock(base / f".{entry.name}.lock")
        except ValueError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _remove(entry)
        except BlockingIOError:
            pass  # a reader is loading from it
        except PermissionError:
            pass  # another user's folder in a shared root (sticky): not ours to remove
        finally:
            os.close(fd)
