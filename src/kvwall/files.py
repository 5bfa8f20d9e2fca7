"""The user's files: output paths checked before any long work, and every write atomic.

A write goes to a unique temporary name in the target folder (two processes writing the same
file never share a temporary), is flushed to disk, then renamed over the target; the temporary
is removed on any failure, so a target is either the old file or the whole new one.
Any layer may use this module (like units.py and errors.py): it imports nothing of kvwall's
but the error type.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from kvwall.errors import KvwallError

PLOT_EXTS = (".png", ".pdf", ".svg")  # what kvwall's plots write (matplotlib picks the format from the name)
PROBE_PREFIX = ".kvwall-probe-"  # the file that shows a folder takes new files, removed at once


def home() -> Path:
    """kvwall's own folder for what it keeps between runs (the `local` profile, cached recall results, a
    fitted efficiency table): $KVWALL_HOME (``~`` expanded), else ~/.cache/kvwall."""
    env = os.environ.get("KVWALL_HOME")
    if env:
        return user_path(env, "KVWALL_HOME")
    try:
        return Path.home() / ".cache" / "kvwall"
    except RuntimeError:  # no $HOME and no password entry for this user (a container's bare uid)
        raise KvwallError("cannot determine your home directory for kvwall's files (~/.cache/kvwall); "
                          "set KVWALL_HOME to a writable folder") from None


def user_path(text: str | os.PathLike, option: str) -> Path:
    """``text`` with ``~`` expanded; one clear line for an empty path or an unknown ``~user``."""
    raw = os.fspath(text)
    if not str(raw).strip():
        raise KvwallError(f"{option} is empty; give a path")
    path = Path(os.path.expanduser(raw))  # (Path.expanduser raises RuntimeError for an unknown user)
    if str(path).startswith("~"):  # os.path.expanduser leaves ~name alone when there is no such user
        user = str(path).split("/", 1)[0][1:]
        if not user:  # a bare ~ left alone: no $HOME and no password entry for this user
            raise KvwallError(f"{option} {raw}: cannot determine your home directory for '~'; give a full path")
        raise KvwallError(f"{option} {raw}: there is no user {user!r} on this machine for '~{user}'; "
                          "give a full path")
    return path


def check_output(path: str | os.PathLike, exts: tuple[str, ...] | None = None, *, option: str = "--out",
                 make_parents: bool = False, what: str = "") -> Path:
    """The file to write, checked now so that a bad path fails before minutes of work.

    Not a directory or other non-file, a known extension (``exts``), a parent folder that exists
    (or is made, with ``make_parents``) and accepts a new file. ``what`` names the file in messages."""
    path = user_path(path, option)
    if path.is_dir():
        raise KvwallError(f"{option} {path} is a directory; give a file path such as {path / _example(exts)}")
    if path.exists() and not path.is_file():
        raise KvwallError(f"{option} {path} exists and is not a regular file; give another path")
    if exts is not None and path.suffix.lower() not in exts:
        given = f"extension {path.suffix!r}" if path.suffix else "no extension"
        raise KvwallError(f"{option} {path} has {given}; give a name ending in {_or(exts)}")
    _check_folder(path.parent, make_parents, f"cannot write {what + ' to ' if what else ''}{path}")
    return path


MAX_OURS_BYTES = 1 << 24  # a file kvwall may replace is small JSON (a profile ~20 KB); a larger one is not ours


def refuse_unless_ours(path: Path, ours: Callable[[Any], bool], kind: str, option: str = "--out",
                       own: Callable[[], Path] | None = None) -> None:
    """Refuse to replace an existing file unless it is one kvwall wrote: ``ours`` of its JSON is true, or it is
    kvwall's own file ``own()`` (in kvwall's home: replaced whatever it holds, as a damaged one must be).

    The idea of report's marker (report/build.py): kvwall writes over its own files only, so that a slip such as
    ``--out notes.txt`` never costs the user a file. ``kind`` names what it must be ("a kvwall device profile")."""
    if not path.is_file() or _is_own(path, own) or _holds(path, ours):
        return
    raise KvwallError(f"{option} {path} exists and is not {kind}; give a new path, or that of {kind} "
                      "to replace (kvwall never overwrites a file it did not write)")


def _is_own(path: Path, own: Callable[[], Path] | None) -> bool:
    if own is None:
        return False
    try:
        mine = own()
        return mine.is_file() and path.samefile(mine)
    except (KvwallError, OSError):  # no home to compare with (KVWALL_HOME unusable): `path` is not in it
        return False


def _holds(path: Path, ours: Callable[[Any], bool]) -> bool:
    try:
        if path.stat().st_size > MAX_OURS_BYTES:
            return False
        return bool(ours(json.loads(path.read_bytes().decode("utf-8"))))
    except (OSError, ValueError, RecursionError):  # unreadable, not UTF-8, not JSON: not ours
        return False


def check_folder(path: str | os.PathLike, option: str = "--out") -> Path:
    """An output folder: made when missing (with its parents), and able to take new files."""
    path = user_path(path, option)
    if path.exists() and not path.is_dir():
        raise KvwallError(f"{option} {path} is a file; give a folder")
    _check_folder(path, True, f"cannot write into {path}")
    return path


def _check_folder(folder: Path, make: bool, prefix: str) -> None:
    blocker = _file_above(folder)
    if blocker is not None:
        raise KvwallError(f"{prefix}: {blocker} is a file, not a folder; give a path inside a folder")
    if not folder.is_dir():
        if not make:
            raise KvwallError(f"{prefix}: the folder {folder} does not exist; create it or give another path")
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise KvwallError(f"{prefix}: cannot create the folder {folder} ({exc.strerror}); "
                              "give a writable path") from None
    _probe(folder, prefix)


def _file_above(folder: Path) -> Path | None:
    """The nearest existing ancestor of ``folder`` (or itself) when it is not a folder."""
    for p in (folder, *folder.parents):
        if p.exists():
            return None if p.is_dir() else p
    return None


def _probe(folder: Path, prefix: str) -> None:
    """Create and remove a file: the only test that also holds for root and for /proc-like folders."""
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=PROBE_PREFIX)
    except OSError as exc:
        raise KvwallError(f"{prefix}: the folder {folder} does not take new files ({exc.strerror}); "
                          "give a writable path") from None
    os.close(fd)
    os.unlink(tmp)


@contextmanager
def replacing(path: str | os.PathLike) -> Iterator[IO[bytes]]:
    """A binary file whose contents replace ``path`` atomically when the block ends without an error."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    except OSError as exc:
        raise KvwallError(f"cannot write {path} ({exc.strerror}); give a writable path") from None
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a written file gets the usual mode
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise KvwallError(f"cannot write {path} ({exc.strerror}); give a writable path") from None
        raise


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Replace ``path`` atomically with ``text`` (UTF-8)."""
    with replacing(path) as f:
        f.write(text.encode("utf-8"))
    return Path(path)


def read_user_text(path: str | os.PathLike, option: str, what: str) -> str:
    """The whole of a user's UTF-8 text file (a dataset). Opened without blocking and refused unless a regular
    file: a named pipe would block the open or read forever (`--dataset FIFO` hung), a device never end.
    ``what`` says what to give instead ("a UTF-8 JSONL file"); every problem is one line naming the option."""
    path = user_path(path, option)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise KvwallError(f"cannot read {option} {path} ({exc.strerror}); give {what}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a pipe, socket or device)"
            raise KvwallError(f"{option} {path} is {kind}; give {what}")
        with os.fdopen(fd, "rb") as f:
            fd = None  # f closes it
            return f.read().decode("utf-8")
    except OSError as exc:
        raise KvwallError(f"cannot read {option} {path} ({exc.strerror}); give {what}") from None
    except UnicodeDecodeError as exc:
        raise KvwallError(f"{option} {path} is not UTF-8 text (byte {exc.start}); give {what}") from None
    finally:
        if fd is not None:
            os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _example(exts: tuple[str, ...] | None) -> str:
    return "out" + (exts[0] if exts else ".json")


def _or(exts: tuple[str, ...]) -> str:
    return ", ".join(exts[:-1]) + f" or {exts[-1]}" if len(exts) > 1 else exts[0]
