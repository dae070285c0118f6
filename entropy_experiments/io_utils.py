"""Atomic file and directory writes, shared by the run directory (`report`) and checkpoints (`checkpoint/writer.py`).

The one pattern: write to a temp name in the *same* directory (so the final rename never crosses a
file system), fsync, then `os.replace` / `os.rename` onto the final name, so that a reader — or a run
killed half way — never sees a partially written file where a good one was. Temp names are
`.<final name>.<random>.tmp` (files) and `.<final name>.<random>.tmp` / `.old` (directories), which
`is_temp_name` recognises so that stale ones can be cleaned up.

These helpers raise plain `OSError`; callers translate it into their own one-line errors.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "TMP_SUFFIX",
    "UMASK",
    "atomic_replace_dir",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_text",
    "default_mode",
    "fsync_dir",
    "is_temp_name",
]

TMP_SUFFIX = ".tmp"

# The process umask, read once at import (reading it means setting it, which is not thread safe).
# mkstemp / mkdtemp create private 0o600 / 0o700 entries; what we move into place should instead get
# the permissions any plain open / mkdir by the user's programs would give.
UMASK = os.umask(0o022)
os.umask(UMASK)


def default_mode(*, is_dir: bool) -> int:
    """Permissions a plain `open` (0o666) or `mkdir` (0o777) would give under the process umask."""
    return (0o777 if is_dir else 0o666) & ~UMASK


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """fsync a directory so that a rename inside it is durable; a no-op where that is unsupported."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def is_temp_name(name: str, finals: tuple[str, ...] | None = None) -> bool:
    """Whether `name` is a temp file name made by `atomic_write` (for one of `finals`, if given)."""
    if not (name.startswith(".") and name.endswith(TMP_SUFFIX)):
        return False
    return finals is None or any(name.startswith(f".{final}.") for final in finals)


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], object], *,
                 make_parents: bool = False) -> None:
    """Run `write(f)` on a binary temp file beside `path`, fsync it and `os.replace` it onto `path`.

    The file gets `default_mode(is_dir=False)` permissions. On any failure (KeyboardInterrupt
    included) the temp file is removed and `path` keeps its old content; the exception propagates.
    `make_parents` creates missing parent directories first.
    """
    path = Path(path)
    if make_parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp_name, default_mode(is_dir=False))
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, make_parents: bool = False) -> None:
    """Write `data` to `path` atomically (see `atomic_write`)."""
    atomic_write(path, lambda f: f.write(data), make_parents=make_parents)


def atomic_write_text(path: str | os.PathLike[str], text: str, *, make_parents: bool = False) -> None:
    """Write `text` as UTF-8 to `path` atomically (see `atomic_write`)."""
    atomic_write_bytes(path, text.encode("utf-8"), make_parents=make_parents)


def atomic_replace_dir(final: str | os.PathLike[str], fill: Callable[[Path], object]) -> None:
    """Call `fill(tmp_dir)` on a fresh temp directory beside `final`, then move it into place.

    An existing `final` is replaced: a directory cannot be renamed onto a non-empty one, so the old
    one is first moved aside into a `.old` temp directory and deleted after the swap. Parents are
    created; the new directory gets `default_mode(is_dir=True)` permissions. On any failure the temp
    directory is removed and the exception propagates.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=TMP_SUFFIX, dir=final.parent))
    try:
        fill(tmp)
        os.chmod(tmp, default_mode(is_dir=True))
        old = None
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".old", dir=final.parent))
            os.rename(final, old / final.name)
        os.rename(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(final.parent)
