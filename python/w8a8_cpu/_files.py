"""Files that come from outside (checkpoint configs and indexes, cache markers) and files written into folders that
may hold anything (checkpoint output directories): one rule for each.

Reading: opened without following a final symbolic link when asked and without blocking (a FIFO would hang a plain
open), a regular file required (not a FIFO, a device such as /dev/zero, or a directory), and at most max_bytes read
(larger is an error, never a partial read).

Writing: every file is written whole into a private staging folder beside its destination, then put in place by one
rename. What was at the destination is replaced, never opened: a symbolic link there (a copied Hugging Face snapshot
links its files into the blobs of the source model) is replaced, not written through, and a FIFO cannot block the
write; a directory there is refused. Written files are 0644 (a server often runs as another user).

Every failure is a ValueError naming the file."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Iterator, Union


def open_regular(path: Union[str, Path], flags: int = os.O_RDONLY, follow_links: bool = True) -> int:
    """A descriptor of the regular file at path (O_CREAT in flags creates it, mode 0644; nothing is ever truncated)."""
    flags |= os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_links:
            raise ValueError(f"{path}: is a symbolic link, where a plain file is expected (delete it)") from None
        raise ValueError(f"{path}: cannot be opened ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path}: is not a regular file (delete it)")
    return fd


def read_bounded(path: Union[str, Path], max_bytes: int, follow_links: bool = True) -> bytes:
    fd = open_regular(path, follow_links=follow_links)
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"{path}: larger than {max_bytes} bytes, more than such a file can need")
    return data


def read_json_object(path: Union[str, Path], max_bytes: int, follow_links: bool = True) -> dict:
    """The JSON object in the file; too deep nesting, integers beyond Python's digit limit, invalid UTF-8 or JSON,
    or a value that is not an object: ValueError naming the file."""
    data = read_bounded(path, max_bytes, follow_links)
    try:
        value = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, and int() beyond sys.get_int_max_str_digits
        raise ValueError(f"{path}: cannot be read as JSON ({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


@contextlib.contextmanager
def writing(path: Union[str, Path]) -> Iterator[None]:
    """Held while path is written: an OSError becomes a ValueError naming it."""
    try:
        yield
    except OSError as e:
        raise ValueError(f"{path}: cannot be written ({e.strerror or e})") from None


@contextlib.contextmanager
def staging_folder(directory: Path) -> Iterator[Path]:
    """A new folder of our own in directory (on its filesystem, so that publish is one rename), removed on exit."""
    with writing(directory):
        stage = Path(tempfile.mkdtemp(prefix=".w8a8_cpu-staging-", dir=directory))
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def publish(staged: Path, path: Path) -> None:
    """Put the staged file (or folder) in path's directory at path by one rename, readable by every user: an entry
    there that is not a directory is replaced (a link is not followed), a directory raises ValueError naming it."""
    with writing(path):
        os.chmod(staged, 0o755 if staged.is_dir() else 0o644)  # a folder: a tokenizer's chat templates
        os.replace(staged, path)  # rename(2) onto a directory fails (EISDIR): nothing is lost


def write_file(path: Path, data: bytes) -> None:
    """A new regular file at path holding data (staged, then published)."""
    with staging_folder(path.parent) as stage, writing(path):
        (stage / path.name).write_bytes(data)
        publish(stage / path.name, path)
