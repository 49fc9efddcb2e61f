"""models/derived.py: bytes derived from a model file (the repacked weights), kept in
NUMBAT_HOME and mapped by the next load instead of computed again."""
import os

import numpy as np
import pytest

from gguf import GGMLQuantizationType as T
from gguf_io import open_gguf
from gguf_io.config import config_from_gguf
from gguf_io.testing import write_tiny_model
from models import catalog, derived
from quant import packed


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBAT_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(derived, "MIN_BYTES", 0)     # the tiny files here are kept too
    return tmp_path / "home"


def entries(home):
    d = home / "derived"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def test_round_trip_and_invalidation(home, tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"model")
    data = np.arange(10000, dtype=np.uint32).view(np.uint8)
    assert derived.load(src, "repacked", "k", data.nbytes) is None
    derived.save(src, "repacked", "k", data)
    got = derived.load(src, "repacked", "k", data.nbytes)
    assert got is not None and np.array_equal(got, data) and got.flags.writeable
    assert derived.load(src, "repacked", "other key", data.nbytes) is None
    assert derived.load(src, "repacked", "k", data.nbytes + 1) is None      # not the size asked for

    os.utime(src, ns=(1, 1))            # the model file changed: its old entry is not used ...
    assert derived.load(src, "repacked", "k", data.nbytes) is None
    derived.save(src, "repacked", "k", data[:100])
    assert len(entries(home)) == 1      # ... and goes when the new one is written
    assert np.array_equal(derived.load(src, "repacked", "k", 100), data[:100])

    derived.forget(src)
    assert entries(home) == []


def test_entries_of_removed_files_and_killed_writers_are_collected(home, tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"a")
    b.write_bytes(b"b")
    derived.save(a, "repacked", "k", np.zeros(64, np.uint8))
    (home / "derived" / "x.bin.tmp").write_bytes(b"half")
    os.utime(home / "derived" / "x.bin.tmp", (0, 0))                # an hour old and more
    (home / "derived" / "junk.bin").write_bytes(b"no header")
    for i, body in enumerate((b"[1, 2]", b'{"source": [12345678901234567890]}', b'{"source": "x"}')):
        (home / "derived" / f"odd{i}.bin").write_bytes((derived.MAGIC + body).ljust(derived.HEADER, b"\0"))
    a.unlink()
    derived.save(b, "repacked", "k", np.ones(64, np.uint8))
    assert len(entries(home)) == 1 and derived.load(b, "repacked", "k", 64) is not None


def test_damaged_entry_is_ignored_and_replaced(home, tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"model")
    derived.save(src, "repacked", "k", np.ones(64, np.uint8))
    (entry,) = (home / "derived").iterdir()
    entry.write_bytes(entry.read_bytes()[:-1])          # truncated
    assert derived.load(src, "repacked", "k", 64) is None
    entry.write_bytes(b"\0" * (derived.HEADER + 64))    # no header
    assert derived.load(src, "repacked", "k", 64) is None
    derived.save(src, "repacked", "k", np.ones(64, np.uint8))
    assert np.array_equal(derived.load(src, "repacked", "k", 64), np.ones(64, np.uint8))


def test_unwritable_home_only_means_no_entry(tmp_path, monkeypatch):
    monkeypatch.setattr(derived, "MIN_BYTES", 0)
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    monkeypatch.setenv("NUMBAT_HOME", str(blocker / "home"))    # under a file: mkdir fails
    src = tmp_path / "m.gguf"
    src.write_bytes(b"model")
    derived.save(src, "repacked", "k", np.ones(64, np.uint8))
    assert derived.load(src, "repacked", "k", 64) is None


def test_small_files_are_not_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBAT_HOME", str(tmp_path / "home"))
    src = tmp_path / "m.gguf"
    src.write_bytes(b"model")
    derived.save(src, "repacked", "k", np.ones(derived.MIN_BYTES - 1, np.uint8))
    assert entries(tmp_path / "home") == []


@pytest.mark.skipif(not packed.enabled(), reason="repacking needs AVX512-VNNI (and NUMBAT_REPACK unset)")
def test_pack_file_maps_what_a_former_load_kept(home, tmp_path, monkeypatch):
    path = write_tiny_model(tmp_path / "q.gguf", "qwen2", n_embd=256, n_ff=512, n_head=4, n_head_kv=2,
                            weight_type=T.Q8_0)
    f = open_gguf(path)
    cfg = config_from_gguf(f)
    names = [n for n, t in f.tensors.items() if len(t.dims) == 2]
    groups = [tuple(f"blk.{i}.attn_{x}.weight" for x in "qkv") for i in range(cfg.n_layer)]
    fresh = packed.pack_file(f, names, groups)
    first = packed.pack_file(open_gguf(path), names, groups, derived)      # packs, and keeps
    # a draft's requantized copy: an entry of its own, which does not evict the file's
    draft = packed.pack_file(open_gguf(path), names, groups, derived, {T.Q8_0})
    calls = []
    monkeypatch.setattr(packed, "_repack", lambda *a: calls.append(a))
    kept = packed.pack_file(open_gguf(path), names, groups, derived)       # maps, packs nothing
    again = packed.pack_file(open_gguf(path), names, groups, derived, {T.Q8_0})
    assert calls == [] and len(entries(home)) == 2
    assert fresh.keys() == first.keys() == kept.keys() and groups[0] in kept
    for k, p in fresh.items():
        for q in (first[k], kept[k]):
            assert (q.type_id, q.rows, q.cols) == (p.type_id, p.rows, p.cols)
            assert np.array_equal(q.data, p.data)
    assert isinstance(kept[names[0]].data.base, np.memmap) or isinstance(kept[names[0]].data, np.memmap)
    assert draft.keys() == kept.keys()
    for k, p in draft.items():
        assert p.type_id == again[k].type_id == T.Q4_0 != kept[k].type_id
        assert np.array_equal(p.data, again[k].data)


def test_created_entry_appears_only_when_committed(home, tmp_path):
    """create() maps a temporary file that pack_file fills in place; the entry is there
    (and load maps it) only after commit()."""
    src = tmp_path / "m.gguf"
    src.write_bytes(b"model")
    made = derived.create(src, "repacked", "k", 8192)
    made.array[:] = np.arange(8192) % 251
    assert derived.load(src, "repacked", "k", 8192) is None
    made.commit()
    assert np.array_equal(derived.load(src, "repacked", "k", 8192), np.arange(8192) % 251)
    assert len(entries(home)) == 1 and not any(n.endswith(".tmp") for n in entries(home))


@pytest.mark.skipif(not packed.enabled(), reason="repacking needs AVX512-VNNI (and NUMBAT_REPACK unset)")
def test_pack_file_without_space_for_a_mapped_entry_saves_instead(home, tmp_path, monkeypatch):
    """No room for create()'s file (fallocate fails: a full disk): pack_file packs into memory
    and save()s, leaving no temporary file behind."""
    import errno
    path = write_tiny_model(tmp_path / "q.gguf", "qwen2", n_embd=256, n_ff=512, n_head=4, n_head_kv=2,
                            weight_type=T.Q8_0)
    names = [n for n, t in open_gguf(path).tensors.items() if len(t.dims) == 2]
    fresh = packed.pack_file(open_gguf(path), names)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    kept = packed.pack_file(open_gguf(path), names, keep=derived)
    assert [n for n in entries(home) if n.endswith(".tmp")] == [] and len(entries(home)) == 1
    again = packed.pack_file(open_gguf(path), names, keep=derived)     # maps the saved entry
    for n, p in fresh.items():
        assert np.array_equal(p.data, kept[n].data) and np.array_equal(p.data, again[n].data)
    assert isinstance(again[names[0]].data.base, np.memmap) or isinstance(again[names[0]].data, np.memmap)


def test_rm_forgets_the_models_entries(home, monkeypatch):
    name = next(iter(catalog.CATALOG))
    p = catalog.model_path(name)
    p.parent.mkdir(parents=True)
    p.write_bytes(b"gguf")
    derived.save(p, "repacked", "k", np.ones(64, np.uint8))
    assert entries(home)
    assert catalog.remove(name)
    assert entries(home) == []


def test_reader_takes_known_string_arrays_only_where_they_were(tmp_path):
    """GGUFFile(known=...) takes an earlier open's decoded string arrays (a start's 0.1-0.2 s),
    but only at the offsets they were read from, inside the file."""
    path = write_tiny_model(tmp_path / "m.gguf", n_vocab=1100)
    f = open_gguf(path)
    key = "tokenizer.ggml.tokens"
    assert set(f.string_arrays) == {key} and f.kept == set()
    start, end, tokens = f.string_arrays[key]
    assert tokens == f.metadata[key] and 0 < start < end < f.file_size
    g = open_gguf(path, {key: [start, end, ["x"] * 1100]})      # taken as given: not re-read
    assert g.kept == {key} and g.metadata[key] == ["x"] * 1100 and g.tensors == f.tensors
    for bad in ([start + 8, end, ["x"]], [start, f.file_size + 1, ["x"]], [start, start, ["x"]]):
        h = open_gguf(path, {key: bad})
        assert h.kept == set() and h.metadata[key] == tokens and h.tensors == f.tensors


def test_model_load_keeps_the_string_arrays(home, tmp_path, monkeypatch):
    """The first load keeps the decoded, validated arrays; the next takes them; a changed file
    or a damaged entry reads the file again."""
    import gguf_io.reader
    from runner import model as rm
    monkeypatch.setattr(gguf_io.reader, "KEEP_STRINGS", 16)
    path = write_tiny_model(tmp_path / "m.gguf", "qwen2", n_vocab=300)
    assert rm.load(str(path)).file.kept == set()
    assert [e for e in entries(home) if e.startswith("strings-")]
    second = rm.load(str(path))
    assert second.file.kept == {"tokenizer.ggml.tokens"}
    assert second.tokenizer.encode("ab") == rm.load(str(path)).tokenizer.encode("ab")
    os.utime(path, ns=(1, 1))
    assert rm.load(str(path)).file.kept == set()
    entry = next((home / "derived").glob("strings-*"))
    entry.write_bytes(entry.read_bytes()[:derived.HEADER] + b"\x00garbage")
    assert rm.load(str(path)).file.kept == set()


def test_model_load_keeps_the_merge_table(home, tmp_path, monkeypatch):
    """The tokenizer's merge table is made once per file (0.1 s for qwen2.5, 1.0-1.3 s for
    gemma3) and read back after; a damaged entry is made again. An SPM vocabulary's (the tiny
    files have one) is made only when a text first needs the whole vocabulary's model: short
    texts take their own tokens' rows."""
    from runner import model as rm
    from runner import tokenizer as tk
    path = write_tiny_model(tmp_path / "m.gguf", "qwen2", n_vocab=300)
    first = rm.load(str(path)).tokenizer
    short = first.encode("ab ba")
    assert not [e for e in entries(home) if e.startswith("merges-")]
    long = "ab ba " * tk.PARTIAL_MAX
    ids = first.encode(long)
    assert first._encoder.whole is not None and len(first.merges)
    assert [e for e in entries(home) if e.startswith("merges-")]
    monkeypatch.setattr(tk, "_spm_merges", lambda *a: pytest.fail("made again despite the kept table"))
    second = rm.load(str(path)).tokenizer
    assert second._encoder._merges is not None and np.array_equal(second.merges, first.merges)
    assert second.encode("ab ba") == short and second.encode(long) == ids
    entry = next((home / "derived").glob("merges-*"))
    entry.write_bytes(entry.read_bytes()[:derived.HEADER] + b"\x00garbage")
    monkeypatch.undo()
    monkeypatch.setenv("NUMBAT_HOME", str(home))
    monkeypatch.setattr(derived, "MIN_BYTES", 0)
    assert np.array_equal(rm.load(str(path)).tokenizer.merges, first.merges)


@pytest.mark.real
def test_kept_merges_are_not_checked_again(monkeypatch):
    """Validation checks a BPE vocabulary's merges once; arrays kept from that open skip it."""
    import gguf_io.validate as v
    from models.catalog import fetch
    calls = []
    real = v._merges
    monkeypatch.setattr(v, "_merges", lambda *a: (calls.append(1), real(*a)))
    path = fetch("qwen2.5-coder:0.5b")
    f = open_gguf(path)
    v.validate(f, config_from_gguf(f))
    assert calls == [1] and {"tokenizer.ggml.tokens", "tokenizer.ggml.merges"} <= set(f.string_arrays)
    g = open_gguf(path, f.string_arrays)
    v.validate(g, config_from_gguf(g))
    assert calls == [1] and g.kept == {"tokenizer.ggml.tokens", "tokenizer.ggml.merges"}
    assert all(g.metadata[k] == f.metadata[k] for k in g.kept) and g.metadata.keys() == f.metadata.keys()

