"""Bytes numbat derives from a model file and keeps in NUMBAT_HOME, so that the next load maps
them instead of computing them again: the weights repacked for the VNNI kernels (quant.packed).
Repacking a 0.5b file takes ~1 s of every start and faults in a fresh 395 MB buffer; mapping
the kept copy takes milliseconds, and the weights stay memory-mapped, as the file's are. And
the tokenizer's string arrays as an earlier load decoded and validated them (runner.model):
marshal reads them back in a fifth of the time the GGUF walk takes; and its merge table.

An entry is named by what it was made from: the model file's path, size, mtime and inode, and
a key from its maker (the layout and the code that wrote it). A changed or removed model file,
or new packing code, makes a new name; entries whose file is gone or changed are deleted when
a new entry is written (with the older entries of the same kind and path), and `numbat rm`
deletes a model's entries. An entry is written to a temporary name and renamed, so a killed
process never leaves half of one; one whose size or header does not match is ignored (and
replaced). Only files of MIN_BYTES or more are kept: small files repack in no time, and
tests' throwaway files would pile up.
"""
from __future__ import annotations

import hashlib
import json
import marshal
import os
import tempfile
import time
from pathlib import Path

import numpy as np

MAGIC = b"NUMBATD1"
HEADER = 4096           # the data starts on a page: the kernels read it with aligned vectors
MIN_BYTES = 32 << 20
STALE_TMP = 3600        # seconds after which a temporary file is a killed writer's


def _dir() -> Path:
    from models.catalog import home
    return home() / "derived"


def _tag(real: str) -> str:
    """A name part shared by every entry made from the file at this path."""
    return hashlib.sha256(real.encode("utf-8", "surrogatepass")).hexdigest()[:12]


def _identity(real) -> list | None:
    """What must still hold of the file at real for an entry made from it to be used."""
    if not isinstance(real, str):
        return None
    try:
        st = os.stat(real)
    except (OSError, ValueError):
        return None
    return [real, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]


def _entry(src: Path, kind: str, key: str) -> tuple[Path, list, str]:
    real = os.path.realpath(src)
    ident = _identity(real)
    if ident is None:
        raise OSError(f"{src}: cannot stat")
    full = hashlib.sha256(f"{kind}\n{json.dumps(ident)}\n{key}".encode()).hexdigest()
    return _dir() / f"{kind}-{_tag(real)}-{full[:24]}.bin", ident, full


def _header(path: Path) -> dict | None:
    try:
        with open(path, "rb") as fh:
            head = fh.read(HEADER)
        if len(head) < HEADER or not head.startswith(MAGIC):
            return None
        d = json.loads(head[len(MAGIC):].rstrip(b"\0"))
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None


def load(src: Path, kind: str, key: str, nbytes: int) -> np.ndarray | None:
    """The kept bytes for (src, kind, key), mapped copy-on-write (a writable view, as the
    kernels' compiled signatures take; nothing writes to it), or None."""
    if nbytes < MIN_BYTES:
        return None
    try:
        path, _, full = _entry(src, kind, key)
        if path.stat().st_size != HEADER + nbytes or (_header(path) or {}).get("key") != full:
            return None
        return np.memmap(path, np.uint8, "c", offset=HEADER, shape=(nbytes,))
    except (OSError, ValueError):
        return None


class Made:
    """A new entry being written in place: array (nbytes, writable) maps a temporary file;
    commit() renames it onto the entry's name when array holds the data."""

    def __init__(self, array: np.ndarray, tmp: str, path: Path):
        self.array, self._tmp, self._path = array, tmp, path

    def commit(self) -> None:
        try:
            os.replace(self._tmp, self._path)
        except OSError:         # best effort, as save; the mapping stays valid either way
            try:
                os.unlink(self._tmp)
            except OSError:
                pass


def create(src: Path, kind: str, key: str, nbytes: int) -> Made | None:
    """A mapped entry of nbytes to fill, or None (too small, an unwritable or full NUMBAT_HOME,
    no posix_fallocate): then fill memory of your own and save() it. Filling the file's
    pages in place costs a tenth of an anonymous buffer's faults and the write() after
    (250 MB: 0.1-0.16 against 0.9-1.8 s in a fresh process); its blocks are allocated first,
    so a full disk fails here, not with a SIGBUS while the mapping is written."""
    if nbytes < MIN_BYTES or not hasattr(os, "posix_fallocate"):
        return None
    import mmap
    try:
        path, head = _make_room(src, kind, key)
        if path is None:
            return None
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, HEADER + nbytes)
        os.fchmod(fd, 0o644)
        m = mmap.mmap(fd, HEADER + nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except (OSError, ValueError):
        os.close(fd)
        os.unlink(tmp)
        return None
    os.close(fd)            # the mapping keeps the file
    m[:HEADER] = head
    return Made(np.frombuffer(m, np.uint8, nbytes, HEADER), tmp, path)


def save(src: Path, kind: str, key: str, data: np.ndarray, min_bytes: int | None = None) -> None:
    """Keep data for the next load. Best effort: an unwritable or full NUMBAT_HOME only means
    the work is done again next time."""
    if data.nbytes < (MIN_BYTES if min_bytes is None else min_bytes):
        return
    try:
        path, head = _make_room(src, kind, key)
        if path is not None:
            write_atomic(path, head, memoryview(np.ascontiguousarray(data)).cast("B"))
    except OSError:
        pass


def _make_room(src: Path, kind: str, key: str) -> tuple[Path | None, bytes]:
    """The path and HEADER bytes of a new entry, its directory made, stale entries collected
    and this kind's older entries for src deleted; (None, b"") for a path too long for the
    header (not worth a larger one). Raises OSError."""
    path, ident, full = _entry(src, kind, key)
    head = MAGIC + json.dumps({"key": full, "source": ident}).encode()
    if len(head) > HEADER:
        return None, b""
    path.parent.mkdir(parents=True, exist_ok=True)
    _collect(path.parent)
    for old in path.parent.glob(path.name[:path.name.rindex("-") + 1] + "*.bin"):
        old.unlink(missing_ok=True)     # one entry per kind and model: older code's
    return path, head.ljust(HEADER, b"\0")


def load_value(src: Path, kind: str, key: str):
    """A value keep_value kept for (src, kind, key), or None."""
    try:
        path, _, full = _entry(src, kind, key)
        if path.stat().st_size <= HEADER or (_header(path) or {}).get("key") != full:
            return None
        with open(path, "rb") as fh:
            fh.seek(HEADER)
            return marshal.loads(fh.read())
    except (OSError, ValueError, EOFError, TypeError):
        return None


def keep_value(src: Path, kind: str, key: str, value) -> None:
    """Keep a value of plain types (str, int, list, dict, ...: marshal's, which builds no
    objects of other kinds) made from the model file at src, if that file is large enough to
    be worth it. Best effort, as save."""
    try:
        if os.stat(src).st_size >= MIN_BYTES:
            save(src, kind, key, np.frombuffer(marshal.dumps(value), np.uint8), min_bytes=0)
    except (OSError, ValueError):
        pass


def write_atomic(path: Path, *parts) -> None:
    """parts (bytes-like) written to a temporary file beside path, then renamed onto it: a
    reader never sees half a file, and a killed writer leaves only a *.tmp (collected)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            for part in parts:
                fh.write(part)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _collect(d: Path) -> None:
    """Delete entries whose model file is gone or changed, and killed writers' files."""
    now = time.time()
    for p in d.iterdir():
        try:
            if p.suffix == ".tmp":
                if now - p.stat().st_mtime > STALE_TMP:
                    p.unlink()
                continue
            head = _header(p)
            src = (head or {}).get("source")
            if not isinstance(src, list) or not src or _identity(src[0]) != src:
                p.unlink()
        except OSError:
            pass


def forget(src: Path) -> None:
    """Delete every entry made from the file at src (before the file itself is removed)."""
    d = _dir()
    if not d.is_dir():
        return
    for p in d.glob(f"*-{_tag(os.path.realpath(src))}-*"):
        p.unlink(missing_ok=True)
