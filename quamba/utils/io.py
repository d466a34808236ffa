"""Atomic writes: results and checkpoints appear whole or not at all."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_directory(target):
    """Yield a temporary directory beside ``target``; on success it replaces ``target``.

    On error the temporary directory is removed and an existing ``target`` is left untouched.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it owner-only; a saved model is not secret
    try:
        yield tmp
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old / target.name)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same directory and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it owner-only
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def check_directory_target(path, flag: str, writable: bool = True) -> None:
    """Raise a one-line QuambaError (naming ``flag``) unless ``path`` is, or can be made as, a
    directory: it must not be an existing file, nor lie under one, and (``writable``) its nearest
    existing ancestor must be writable. Checked before a run starts, so that a bad output
    directory fails before any work rather than with a traceback at the end of it."""
    from quamba.errors import QuambaError
    path = Path(path)
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if existing == path and not path.is_dir():
        raise QuambaError(f"{flag} {path} names an existing file, not a directory")
    if not existing.is_dir():
        raise QuambaError(f"{flag} {path}: {existing} is a file, not a directory")
    if writable and not os.access(existing, os.W_OK | os.X_OK):
        raise QuambaError(f"{flag} {path}: cannot write in {existing} (permission denied)")
