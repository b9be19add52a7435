"""The output commit protocol: how a bema writer puts folders into OUT so that nothing is ever lost.

A writer holds OUT's lock for its whole run, builds its new entries (run folders,
checkpoint folders, state) complete in a private temp folder inside OUT, writes a journal
(the commit point) and then installs them by renames only; manifest.json is replaced last.
A process killed at any instant leaves every entry either old and whole or new and whole
(docs/design.md, "Committing outputs", walks through each crash case); the next writer on OUT
finishes a journaled commit and removes dead writers' temp folders.

    with OutputTransaction(out) as txn:         # lock OUT, recover dead writers, make txn.tmp
        ... write txn.tmp / "bema-k0.5-e0.2" / "checkpoint-30" / ...
        txn.commit(["bema-k0.5-e0.2"], manifest=doc, interim_manifest=doc_without_replaced)

Entries are paths relative to OUT and may be nested: follow mode adds one checkpoint to an
existing run with `txn.commit(["bema-k0.5-e0.2/checkpoint-50", ".bema-state"], manifest=doc)`
after writing `txn.tmp/bema-k0.5-e0.2/checkpoint-50/` and `txn.tmp/.bema-state/` (folders or
files; a missing parent in OUT is created; an existing entry is swapped out and deleted only
after the commit). `interim_manifest` is written before the swap when the final manifest
drops something the current one lists, so that manifest.json never names what is not on disk.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import shutil
import stat
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bema_cli import signals
from bema_cli.errors import OutputError

LOCK_NAME = ".bema-lock"  # holds the writer's pid; flock'ed while the writer lives
TMP_PREFIX = ".bema-tmp-"  # one per writer: staged entries, the journal, swapped-out entries
JOURNAL = ".bema-commit.json"  # inside the temp folder: its presence is the commit point
STAGED_MANIFEST = ".bema-manifest.json"  # inside the temp folder until it replaces OUT/manifest.json
ASIDE = ".bema-aside"  # inside the temp folder: old entries moved out of the way
MANIFEST = "manifest.json"
PAUSE_ENV = "BEMA_TEST_COMMIT_PAUSE"  # tests only: seconds to sleep after each rename of a commit


class OutputTransaction:
    """Exclusive write access to OUT: a lock, crash recovery, one temp folder, an atomic commit."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.tmp = self.out / f"{TMP_PREFIX}{uuid.uuid4().hex[:12]}"
        self.recovered: list[str] = []  # dead writers' temp folders found (and cleaned) on entry
        self._created = False
        self._lock_fd: int | None = None

    def __enter__(self) -> OutputTransaction:
        # Signals wait while the lock is taken and the folders are set up or cleaned, so that no
        # lock file or temp folder is ever left behind by a handled SIGINT/SIGTERM/SIGHUP.
        try:
            with signals.deferred():
                self._created = not self.out.exists()
                try:
                    self.out.mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    raise OutputError(
                        f"{self.out}: cannot write the output directory ({exc.strerror or exc})"
                    ) from None
                self._lock_fd = _lock(self.out)
                self.recovered = recover(self.out)
                self.tmp.mkdir()
        except BaseException:
            self.__exit__(None, None, None)  # __exit__ is not called when __enter__ raises
            raise
        return self

    def commit(
        self, entries: list[str], manifest: dict | None = None, interim_manifest: dict | None = None
    ) -> None:
        """Install txn.tmp/<entry> as OUT/<entry> for every entry, then manifest.json; all or nothing."""
        for entry in entries:
            if not plain_entry(entry):
                raise ValueError(f"commit entry {entry!r} must be a plain path relative to OUT")
        self._carry_users_files(entries)
        with signals.deferred():
            if manifest is not None:  # no rename of its own: the journal's directory fsync covers it
                write_synced(self.tmp / STAGED_MANIFEST, _json_bytes(manifest), shown=self.out / MANIFEST)
            journal = []
            for entry in entries:
                st = os.lstat(self.tmp / entry)
                journal.append({"path": entry, "dev": st.st_dev, "ino": st.st_ino})
            _write_atomic(self.tmp / JOURNAL, _json_bytes({"entries": journal, "pid": os.getpid()}))
            if interim_manifest is not None and (self.out / MANIFEST).exists():
                _write_atomic(self.out / MANIFEST, _json_bytes(interim_manifest))
            _roll_forward(self.out, self.tmp)

    def _carry_users_files(self, entries: list[str]) -> None:
        """An entry replacing a folder in OUT takes along the files bema did not write there (a user's
        notes in a run or checkpoint folder): --overwrite replaces bema's outputs, nothing else."""
        from bema_cli import output
        from bema_cli.io.aux_files import carry, users_files

        for entry in entries:
            old, new = self.out / entry, self.tmp / entry
            if entry.startswith(".bema"):  # bema's own state: nothing of the user's lives there
                continue
            if old.is_dir() and not old.is_symlink() and new.is_dir():
                theirs = users_files(old)
                if theirs:
                    carry(old, new, theirs)
                    output.log(
                        f"{old}: kept {len(theirs)} file(s) bema did not write: {', '.join(theirs[:5])}"
                        + (" ..." if len(theirs) > 5 else "")
                    )

    def __exit__(self, exc_type, exc, tb) -> None:
        with signals.deferred():
            try:
                if (self.tmp / JOURNAL).exists():  # interrupted after the commit point: finish it
                    _roll_forward(self.out, self.tmp)
                shutil.rmtree(self.tmp, ignore_errors=True)
            finally:
                self._release()

    def _release(self) -> None:
        if self._lock_fd is not None:
            _unlock(self.out, self._lock_fd)
            self._lock_fd = None
        if self._created:
            try:
                self.out.rmdir()  # only if this run created OUT and left it empty
            except OSError:
                pass


def plain_entry(rel: str) -> bool:
    """A path bema may write or delete under OUT: relative, no "..", not empty, not our aside folder."""
    parts = Path(rel).parts
    return bool(parts) and not Path(rel).is_absolute() and ".." not in parts and not rel.startswith(ASIDE)


def _open_lock(path: Path) -> int:
    """Open (create) OUT/.bema-lock, never through a symlink and only as a plain file of ours.

    The lock is truncated and rewritten: a link or a second hard link planted there would make
    that truncate another file (a checkpoint, a shared file), so both are refused.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OutputError(
                f"{path}: is a symbolic link; bema never writes through links in OUT (remove it)"
            ) from None
        raise OutputError(f"{path}: cannot create the lock file ({exc.strerror or exc})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        os.close(fd)
        what = "not a regular file" if not stat.S_ISREG(st.st_mode) else "a hard link to another file"
        raise OutputError(f"{path}: is {what}; bema's lock file must be its own (remove it)")
    return fd


made_for_lock: list[Path] = []  # folders `locked` created: a command that fails removes those left empty


def remove_empty_made() -> None:
    """The folders `locked` made for a command that failed, when nothing landed in them."""
    for folder in reversed(made_for_lock):
        try:
            folder.rmdir()
        except OSError:
            pass


@contextmanager
def locked(folder: Path, name: str = LOCK_NAME, label: Path | None = None) -> Iterator[None]:
    """Hold `folder`/`name`'s lock for the block (made with its folder): `bema eval`, `sweep` and
    `ship` writing into one OUT (or DIR) at once, as stabilize does (OutputTransaction); a second
    writer is refused naming `label` (default `folder`)."""
    made_for_lock.extend(p for p in [*reversed(folder.parents), folder] if not p.exists())
    folder.mkdir(parents=True, exist_ok=True)
    fd = _lock(folder, name, label)
    try:
        yield
    finally:
        _unlock(folder, fd, name)


def _lock(out: Path, name: str = LOCK_NAME, label: Path | None = None) -> int:
    """flock OUT/.bema-lock (the kernel drops it when its holder dies), write our pid; refuse if held."""
    path = out / name
    while True:
        fd = _open_lock(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise OutputError(f"{path}: cannot lock ({exc.strerror or exc})") from None
            pid = _read_pid(path)
            who = f"bema process {pid}" if pid else "bema process"
            raise OutputError(
                f"{label or out}: another {who} is writing here (wait for it to finish or choose another --out)"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:  # else its holder removed the file between our open and flock: lock the new one
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)


def _unlock(out: Path, fd: int, name: str = LOCK_NAME) -> None:
    try:
        os.unlink(out / name)  # while still holding it (see the inode check in _lock)
    except OSError:
        pass
    os.close(fd)


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def recover(out: Path) -> list[str]:
    """Under the lock: finish the journaled commits of dead writers, delete their temp folders."""
    links = [p for p in out.glob(TMP_PREFIX + "*") if p.is_symlink()]
    if links:
        raise OutputError(
            f"{links[0]}: is a symbolic link; bema never deletes through links in OUT (remove it)"
        )
    found = sorted(p for p in out.glob(TMP_PREFIX + "*") if p.is_dir())
    for tmp in found:
        with signals.deferred():
            if (tmp / JOURNAL).exists():
                _roll_forward(out, tmp)
            shutil.rmtree(tmp, ignore_errors=True)
    return [p.name for p in found]


def _roll_forward(out: Path, tmp: Path) -> None:
    """Install each journaled entry that is not yet in place, then the manifest; idempotent.

    An entry is in place when OUT/<entry> is the very inode that was staged (renames keep
    inodes), so the journal tells every intermediate state apart whatever step was cut short.
    """
    try:
        journal = json.loads((tmp / JOURNAL).read_text())
        for e in journal["entries"]:
            if not plain_entry(e["path"]):
                raise ValueError(f"entry {e['path']!r} is not a path inside OUT")
            _check_no_link(out, Path(e["path"]).parent)
            _install(out / e["path"], tmp / e["path"], tmp / ASIDE / e["path"], (e["dev"], e["ino"]))
        if (tmp / STAGED_MANIFEST).exists():
            os.replace(tmp / STAGED_MANIFEST, out / MANIFEST)
            _pause()
        _fsync_dir(out)
        os.unlink(tmp / JOURNAL)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        where = getattr(exc, "filename", None) or tmp
        raise OutputError(
            f"{where}: cannot finish the commit journaled in {tmp} ({getattr(exc, 'strerror', None) or exc}); "
            f"fix the cause and rerun (the next bema run on this folder finishes it), or delete {tmp.name} to abandon it"
        ) from None


def _check_no_link(out: Path, rel: Path) -> None:
    """Every folder on the way from OUT to OUT/<rel> is a real folder: renames never go through a link."""
    for depth in range(1, len(rel.parts) + 1):
        folder = out.joinpath(*rel.parts[:depth])
        if folder.is_symlink():
            raise OSError(
                errno.ELOOP, "a symbolic link inside OUT (bema never writes through links)", str(folder)
            )


def _install(dst: Path, src: Path, aside: Path, staged: tuple[int, int]) -> None:
    if _identity(dst) == staged:
        return  # already in place
    if _identity(src) != staged:
        raise OSError(errno.ENOENT, "the staged entry is gone", str(src))
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir() and not src.is_symlink() and (dst.exists() or dst.is_symlink()):
        if _exchange(src, dst):  # one atomic step: OUT/<entry> is never missing
            _pause()
            return
        aside.parent.mkdir(parents=True, exist_ok=True)
        os.rename(dst, aside)  # old out of the way (deleted with the temp folder, after the commit)
        _pause()
    os.replace(src, dst)
    _pause()


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux renameat2(RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False  # e.g. NFS, older kernels: fall back to two renames
    raise OSError(err, os.strerror(err), str(b))


def _pause() -> None:
    delay = os.environ.get(PAUSE_ENV)
    if delay:
        time.sleep(float(delay))


def _json_bytes(doc: dict) -> bytes:
    from bema_cli.output import to_json

    return (to_json(doc) + "\n").encode()


def _write_atomic(path: Path, data: bytes) -> None:
    """Write a small file durably: a sibling temp file, fsync, rename over the target."""
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        write_synced(part, data, shown=path)
        os.replace(part, path)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_synced(path: Path, data: bytes, shown: Path | None = None, mode: str = "wb") -> None:
    """Write (or, mode "ab", append to) a file and fsync its data; its directory entry is made
    durable by the caller's next directory fsync (the staged manifest is only read once the journal,
    written after it, exists). A failure (a full disk) is an OutputError naming `shown` (the file as
    the user knows it)."""
    try:
        with open(path, mode) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise OutputError(f"{shown or path}: cannot write ({exc.strerror or exc})") from None


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_apart(out: Path, inputs: list[Path], may_contain: bool = False, flag: str = "--out") -> None:
    """Inputs are sacred: refuse an OUT that is, contains (unless `may_contain`: eval only adds its own
    results files) or lies inside an input (symlinks resolved). `flag` names the option in the error."""
    out = out.resolve()
    for path in inputs:
        real = Path(path).resolve()
        if out == real or out.is_relative_to(real):
            what = "is" if out == real else "lies inside"
            raise OutputError(
                f"{flag} {out}: {what} the input {real}; choose an output folder apart from the inputs"
            )
        if real.is_relative_to(out) and not may_contain:
            raise OutputError(
                f"{flag} {out}: contains the input {real}; choose an output folder apart from the inputs"
            )


def write_json_atomic(path: Path, doc: dict) -> None:
    """A small JSON record beside outputs (a sweep's motion.json): whole or not at all."""
    try:
        _write_atomic(Path(path), _json_bytes(doc))
    except OSError as exc:
        raise OutputError(f"{path}: cannot write ({exc.strerror})") from None
