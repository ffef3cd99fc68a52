"""One writer per results folder: a command that writes a results folder (``forge-bench sweep``,
``convergence``, ``fidelity``, ``kernel``, ``cell``) holds an exclusive lock on ``OUT/.forge-bench.lock``
for its whole life, and a second command into the same folder exits 2 in one line naming the first.

Why: two ``sweep --resume`` into one folder each plan the same missing cells and run them at once;
the later row and attempt logs silently replace the earlier, and every cell measured while both
competed for the cores reads ``ok``.

How: ``flock(2)`` on the lock file. The kernel drops the lock when its process ends however it ends
(``kill -9`` included), so a killed sweep never leaves the folder stuck: the next command takes the
lock and overwrites the dead owner's line. The file holds the owner's pid, host, start time and
command line, for the refusal. The holder removes the file when it lets go; a process that opened
the old file just before (and then locked a file no longer in the folder) sees that its inode is not
the folder's and tries again. The lock is advisory: it keeps forge-bench commands apart, not other
programs. On a system without ``fcntl`` (not POSIX) there is no lock.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import shlex
import socket
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock
    fcntl = None

LOCK_NAME = ".forge-bench.lock"


class FolderLockError(ValueError):
    """The folder is held by another command, or cannot be written (one line)."""


def _command_line() -> str:
    """This process's command as a user typed it (``forge-bench sweep ...``), for the refusal."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(("forge_bench/cli.py", "forge-bench")):
        argv[0] = "forge-bench"
    return shlex.join(argv)


def describe(owner: dict[str, Any]) -> str:
    """``pid 123 on host, since 2026-01-01T00:00:00Z: forge-bench sweep --out X`` (what is known)."""
    if not owner:
        return "another forge-bench command (its lock file names no owner yet)"
    where = f"pid {owner.get('pid', '?')} on {owner.get('host', '?')}"
    since = f", since {owner['started_at']}" if owner.get("started_at") else ""
    command = f": {owner['command']}" if owner.get("command") else ""
    return where + since + command


def read_owner(folder: Path) -> dict[str, Any]:
    """The owner line of ``folder``'s lock file ({} when there is none or it does not read)."""
    try:
        data = json.loads((Path(folder) / LOCK_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class FolderLock:
    """A held lock on one folder; ``release()`` lets go and removes the lock file."""

    def __init__(self, folder: Path, fd: Optional[int], created: bool = False):
        self.folder = folder
        self.path = folder / LOCK_NAME
        self.created = created      # the folder did not exist before: removed again when left empty
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    self.path.unlink()
            except OSError:
                pass
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        if self.created:
            try:
                self.folder.rmdir()        # only when empty: a command refused before writing leaves no folder
            except OSError:
                pass
            self.created = False


def _unwritable(folder: Path, exc: OSError) -> FolderLockError:
    return FolderLockError(f"{folder}: cannot write into this results folder ({exc.strerror or exc})")


def acquire(folder: str | Path) -> FolderLock:
    """Create ``folder`` if needed and lock it for this process; ``FolderLockError`` (one line) when
    another process holds it, or when the folder cannot be created or written."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise FolderLockError(f"{folder}: exists and is not a folder")
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _unwritable(folder, exc) from None
    if fcntl is None:  # pragma: no cover - not POSIX
        return FolderLock(folder, None, created)
    path = folder / LOCK_NAME
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            if created:
                FolderLock(folder, None, created).release()
            raise _unwritable(folder, exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FolderLockError(f"{folder} is in use by {describe(read_owner(folder))}; wait for it to end "
                                  f"or use another folder") from None
        except OSError as exc:
            os.close(fd)
            raise FolderLockError(f"{folder}: cannot lock this results folder ({exc.strerror or exc})") from None
        try:
            current = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)          # its holder removed the file between our open and our lock: again
    owner = {"pid": os.getpid(), "host": socket.gethostname(),
             "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
             "command": _command_line()}
    os.ftruncate(fd, 0)
    os.write(fd, (json.dumps(owner) + "\n").encode())
    return FolderLock(folder, fd, created)


@contextmanager
def holding(folder: str | Path) -> Iterator[FolderLock]:
    """``acquire(folder)`` for the ``with`` block."""
    lock = acquire(folder)
    try:
        yield lock
    finally:
        lock.release()


def held_by(folder: str | Path, pid: int) -> bool:
    """Whether process ``pid`` of this host holds ``folder`` now (a child of that process writes there
    under its parent's lock: a study's run started with ``convergence --gpus``)."""
    owner = read_owner(Path(folder))
    return owner.get("pid") == pid and owner.get("host") == socket.gethostname() and _locked(Path(folder))


def _locked(folder: Path) -> bool:
    """Whether some process holds ``folder``'s lock now (a lock tried and let go)."""
    if fcntl is None:  # pragma: no cover - not POSIX
        return False
    try:
        fd = os.open(folder / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


__all__ = ["FolderLock", "FolderLockError", "LOCK_NAME", "acquire", "describe", "held_by", "holding", "read_owner"]
