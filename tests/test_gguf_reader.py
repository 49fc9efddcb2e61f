"""The GGUF reader: round-trips against gguf-py's writer and reader, zero-copy views, and a
corpus of broken files that must each fail with a GGUFError naming the file and the fault."""
import json
import math
import mmap
import os
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFValueType
from gguf import GGMLQuantizationType as T

from gguf_io.reader import GGUFError, open_gguf
from gguf_io.testing import write_tiny_model

REPO = Path(__file__).resolve().parents[1]
V = GGUFValueType

# key -> (value, type, array element type); every GGUF value type, and arrays of each kind
EXTRA = {
    "t.u8": (200, V.UINT8, None), "t.i8": (-100, V.INT8, None),
    "t.u16": (60000, V.UINT16, None), "t.i16": (-30000, V.INT16, None),
    "t.u32": (4_000_000_000, V.UINT32, None), "t.i32": (-2_000_000_000, V.INT32, None),
    "t.u64": (2**63 + 5, V.UINT64, None), "t.i64": (-2**62 - 3, V.INT64, None),
    "t.f32": (1.5, V.FLOAT32, None), "t.f64": (np.pi, V.FLOAT64, None),
    "t.true": (True, V.BOOL, None), "t.false": (False, V.BOOL, None),
    "t.str": ("héllo, wörld ✓ 🦘", V.STRING, None), "t.empty_str": ("", V.STRING, None),
    "t.arr_i32": ([1, -2, 3], V.ARRAY, V.INT32), "t.arr_u8": ([0, 255, 7], V.ARRAY, V.UINT8),
    "t.arr_u64": ([2**64 - 1, 0], V.ARRAY, V.UINT64), "t.arr_f32": ([0.5, -1.25], V.ARRAY, V.FLOAT32),
    "t.arr_f64": ([1e300, -2.5], V.ARRAY, V.FLOAT64), "t.arr_bool": ([True, False, True], V.ARRAY, V.BOOL),
    "t.arr_str": (["a", "", "ünï"], V.ARRAY, V.STRING),
    "t.nested": ([[1, 2], [3]], V.ARRAY, V.ARRAY),
}


def add_extra(w):
    for key, (val, vtype, sub) in EXTRA.items():
        w.add_key_value(key, val, vtype, sub_type=sub)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "qwen2", extra=add_extra)


def expect_error(path, *words):
    """Opening `path` raises a GGUFError (and nothing else) naming the file and every word."""
    with pytest.raises(GGUFError) as e:
        open_gguf(path)
    msg = str(e.value)
    assert str(path) in msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    return msg


def data_end(f):
    return max(t.offset + t.nbytes for t in f.tensors.values())


# ---------------------------------------------------------------- round trips

def test_metadata_roundtrip_every_type(tiny):
    f = open_gguf(tiny)
    for key, (val, vtype, sub) in EXTRA.items():
        got = f.metadata[key]
        if sub == V.ARRAY:
            assert [list(a) for a in got] == val, key
        elif sub is not None:   # the chosen floats are exact in float32
            assert len(got) == len(val) and list(got) == val, key
        else:
            assert got == val and type(got) is type(val), key
    assert f.architecture == "qwen2" and f.get("missing", 7) == 7


def test_metadata_matches_gguf_reader(tiny):
    f, ref = open_gguf(tiny), gguf.GGUFReader(tiny)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert sorted(keys) == sorted(f.metadata)
    for k in keys:
        want, got = ref.fields[k].contents(), f.metadata[k]
        if k == "t.nested":   # gguf-py flattens nested arrays
            assert [x for a in got for x in a] == want
        elif isinstance(want, list):
            assert list(got) == want, k
        else:
            assert got == want, k
    assert f.version == 3


def test_tensor_infos_match_gguf_reader(tiny):
    f, ref = open_gguf(tiny), gguf.GGUFReader(tiny)
    assert [t.name for t in ref.tensors] == list(f.tensors)
    for rt in ref.tensors:
        t = f.tensors[rt.name]
        assert t.dims == tuple(int(d) for d in rt.shape)
        assert t.type_id == rt.tensor_type and t.type_name == rt.tensor_type.name
        assert (t.offset, t.nbytes, t.n_elements) == (rt.data_offset, rt.n_bytes, rt.n_elements)
        assert np.array_equal(f.raw(rt.name).ravel(), rt.data.view(np.uint8).ravel())
    assert f.data_offset == ref.data_offset
    assert f.n_params() == sum(int(t.n_elements) for t in ref.tensors)


def test_shapes_in_numpy_order(tiny):
    f = open_gguf(tiny)   # qwen2 defaults: n_embd 64, 4 heads of 16, 2 kv heads, n_ff 128, vocab 384
    assert f.tensors["token_embd.weight"].dims == (64, 384)
    assert f.tensors["token_embd.weight"].shape == (384, 64)
    assert f.tensors["blk.0.attn_k.weight"].shape == (32, 64)
    assert f.tensors["blk.1.ffn_down.weight"].shape == (64, 128)
    assert f.tensors["blk.0.attn_q.bias"].shape == (64,)
    assert f.array("blk.1.ffn_down.weight").shape == (64, 128)
    assert f.raw("blk.1.ffn_down.weight").shape == (64, 128 * 4)


@pytest.mark.parametrize("wtype", [T.F32, T.F16, T.Q8_0, T.Q4_0, T.Q5_1], ids=lambda t: t.name)
def test_raw_is_a_readonly_view_of_the_map(tmp_path, wtype):
    p = write_tiny_model(tmp_path / "m.gguf", "llama", weight_type=wtype)
    f = open_gguf(p)
    block, tsize = GGML_QUANT_SIZES[wtype]
    file_bytes = p.read_bytes()
    for name in ("blk.0.attn_q.weight", "output.weight", "blk.0.attn_norm.weight"):
        t, r = f.tensors[name], f.raw(name)
        rows = math.prod(t.dims[1:])
        assert r.dtype == np.uint8 and r.shape == (rows, t.nbytes // rows)
        if name != "blk.0.attn_norm.weight":
            assert t.type_id == wtype and r.shape[1] == t.dims[0] // block * tsize
        assert r.tobytes() == file_bytes[t.offset:t.offset + t.nbytes]
        base = r
        while isinstance(base, np.ndarray):
            base = base.base
        assert isinstance(base, mmap.mmap), "raw() copied the data"
        assert not r.flags.writeable
        with pytest.raises(ValueError):
            r[0, 0] = 1
    ref = gguf.GGUFReader(p)
    for rt in ref.tensors:
        if rt.tensor_type in (T.F32, T.F16):
            assert np.array_equal(f.array(rt.name), rt.data)


@pytest.mark.parametrize("pad", [0, 32])   # one of the two puts the header end where 32- and 64-alignment differ
def test_custom_alignment(tmp_path, pad):
    def extra(w):
        w.add_custom_alignment(64)
        w.add_string("t.pad", "x" * (pad + 1))
    p = write_tiny_model(tmp_path / "a.gguf", "llama", extra=extra)
    f, ref = open_gguf(p), gguf.GGUFReader(p)
    assert f.alignment == 64 and f.data_offset == ref.data_offset and f.data_offset % 64 == 0
    for rt in ref.tensors:
        assert f.tensors[rt.name].offset == rt.data_offset and (rt.data_offset - f.data_offset) % 64 == 0
        assert np.array_equal(f.raw(rt.name).ravel(), rt.data.view(np.uint8).ravel())


def test_default_alignment(tiny):
    f = open_gguf(tiny)
    assert "general.alignment" not in f.metadata and f.alignment == 32 and f.data_offset % 32 == 0


def test_version_2(tmp_path, tiny):
    b = bytearray(tiny.read_bytes())
    struct.pack_into("<I", b, 4, 2)   # v2 and v3 share the layout (v3 only added big-endian files)
    p = tmp_path / "v2.gguf"
    p.write_bytes(b)
    f2, f3 = open_gguf(p), open_gguf(tiny)
    assert f2.version == 2
    assert f2.tensors == f3.tensors and list(f2.metadata) == list(f3.metadata)


# ---------------------------------------------------------------- broken files

@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A one-layer Q8_0 model: every structure occurs, the file is small."""
    p = write_tiny_model(tmp_path_factory.mktemp("broken") / "small.gguf", "qwen2", n_layer=1,
                         weight_type=T.Q8_0, extra=add_extra)
    return p, p.read_bytes(), open_gguf(p)


def write(tmp_path, data, name="broken.gguf"):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def find_string(blob, s):
    """Offset just past a GGUF string (u64 length + bytes) equal to `s`."""
    return blob.index(struct.pack("<Q", len(s)) + s.encode()) + 8 + len(s)


def tensor_fields(blob, name):
    """Byte offsets of (n_dims, dims[0], type, offset) in the tensor info of `name`."""
    i = find_string(blob, name)
    n_dims = struct.unpack_from("<I", blob, i)[0]
    return i, i + 4, i + 4 + 8 * n_dims, i + 8 + 8 * n_dims


def kv_value_offset(blob, key):
    """Byte offset just past a key's type field (where its value, or array element type, starts)."""
    return find_string(blob, key) + 4


def test_truncated_everywhere_in_the_header(tmp_path, small):
    _, blob, f = small
    for n in range(f.data_offset + 1):
        p = write(tmp_path, blob[:n])
        if n == 0:
            expect_error(p, "empty")
        elif n < 4:
            expect_error(p, "bad magic")
        else:
            expect_error(p, "truncated")


def test_truncated_in_the_data(tmp_path, small):
    _, blob, f = small
    end = data_end(f)
    cuts = np.linspace(f.data_offset + 1, end - 1, 60).astype(int)
    cuts = sorted({*cuts, *(t.offset + t.nbytes - 1 for t in f.tensors.values())})
    for n in cuts:
        msg = expect_error(write(tmp_path, blob[:n]), "past the end", "truncated")
        assert f"({n} bytes)" in msg
    open_gguf(write(tmp_path, blob[:end]))   # the trailing padding is optional


def test_fuzzed_header(tmp_path, small):
    """Random bytes and hostile 64-bit values over the header: a clean open or a GGUFError, fast."""
    _, blob, f = small
    rng = np.random.default_rng(1234)
    hostile = [2**64 - 1, 2**63, 2**32 - 1, 2**32, len(blob), len(blob) // 8, 0]
    opened = failed = 0
    for i in range(400):
        b = bytearray(blob)
        pos = int(rng.integers(0, f.data_offset))
        if i % 2:
            struct.pack_into("<Q", b, min(pos, len(b) - 8), hostile[i % len(hostile)])
        else:
            for _ in range(int(rng.integers(1, 5))):
                b[int(rng.integers(0, f.data_offset))] = int(rng.integers(0, 256))
        p = write(tmp_path, b)
        t0 = time.perf_counter()
        try:
            g = open_gguf(p)
        except GGUFError as e:
            assert str(p) in str(e)
            failed += 1
        else:
            opened += 1
            for t in g.tensors.values():
                assert g.data_offset <= t.offset and t.offset + t.nbytes <= g.file_size
                assert g.raw(t.name).nbytes == t.nbytes
        assert time.perf_counter() - t0 < 1.0, f"mutation {i} at {pos} took too long"
    assert opened > 20 and failed > 20   # the fuzz reaches both outcomes


def test_bad_magic(tmp_path, small):
    expect_error(write(tmp_path, b"GGUG" + small[1][4:]), "bad magic")
    expect_error(write(tmp_path, b"\x00" * 64), "bad magic")


@pytest.mark.parametrize("version", [0, 1, 4, 2**32 - 1])
def test_unsupported_version(tmp_path, small, version):
    b = bytearray(small[1])
    struct.pack_into("<I", b, 4, version)
    expect_error(write(tmp_path, b), f"version {version}")


@pytest.mark.parametrize("where,value,words", [
    (8, 2**63, ["more than the file can hold"]),           # tensor count
    (8, 2**64 - 1, ["more than the file can hold"]),
    (16, 2**63, ["more than the file can hold"]),          # metadata count
    (16, 2**40, ["more than the file can hold"]),
    (24, 2**63, ["truncated"]),                            # length of the first key
    ("general.architecture", 2**63, ["truncated"]),        # length of a string value
    ("tokenizer.ggml.tokens", 2**63, ["truncated"]),       # string array count
    ("tokenizer.ggml.tokens", 2**61, ["truncated"]),       # count * 8 bytes overflows 64 bits
    ("tokenizer.ggml.scores", 2**62, ["truncated"]),       # float array count
    ("t.nested", 2**60, ["truncated"]),                    # nested array count
])
def test_huge_counts_fail_fast(tmp_path, small, where, value, words):
    b = bytearray(small[1])
    if isinstance(where, str):
        off = kv_value_offset(b, where)
        off += 4 if struct.unpack_from("<I", b, off - 4)[0] == 9 else 0   # arrays: skip the element type
    else:
        off = where
    struct.pack_into("<Q", b, off, value)
    p = write(tmp_path, b)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        expect_error(p, *words)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 0.5
    assert peak < 16 << 20


def test_string_array_running_off_the_end(tmp_path, small):
    """String lengths inside the vocabulary that eat the rest of the file: the next length
    field lies past the end and must be reported, not unpacked from a short buffer."""
    b = bytearray(small[1])
    first = kv_value_offset(b, "tokenizer.ggml.tokens") + 12
    for rest in (0, 2, 7):
        struct.pack_into("<Q", b, first, len(b) - first - 8 - rest)
        expect_error(write(tmp_path, b), "truncated", "tokenizer.ggml.tokens")


@pytest.mark.parametrize("n_dims", [0, 5, 2**32 - 1])
def test_bad_dimension_count(tmp_path, small, n_dims):
    b = bytearray(small[1])
    struct.pack_into("<I", b, tensor_fields(b, "blk.0.attn_q.weight")[0], n_dims)
    expect_error(write(tmp_path, b), "blk.0.attn_q.weight", f"{n_dims} dimensions")


@pytest.mark.parametrize("type_id", [4, 5, 99, 2**32 - 1])   # 4 and 5 are the removed Q4_2 and Q4_3
def test_unknown_tensor_type(tmp_path, small, type_id):
    b = bytearray(small[1])
    struct.pack_into("<I", b, tensor_fields(b, "blk.0.attn_q.weight")[2], type_id)
    expect_error(write(tmp_path, b), "blk.0.attn_q.weight", f"unknown type id {type_id}")


@pytest.mark.parametrize("dim0", [48, 33, 1, 0])
def test_dims_not_a_whole_number_of_blocks(tmp_path, small, dim0):
    b = bytearray(small[1])
    struct.pack_into("<Q", b, tensor_fields(b, "blk.0.attn_q.weight")[1], dim0)   # Q8_0: blocks of 32
    expect_error(write(tmp_path, b), "blk.0.attn_q.weight", "Q8_0 blocks of 32")


def test_f32_tensor_relabelled_as_q8_0(tmp_path, small):
    b = bytearray(small[1])
    struct.pack_into("<Q", b, tensor_fields(b, "output_norm.weight")[1], 40)   # 40 floats, not 32-blocks
    struct.pack_into("<I", b, tensor_fields(b, "output_norm.weight")[2], T.Q8_0)
    expect_error(write(tmp_path, b), "output_norm.weight", "blocks of 32")


def test_misaligned_tensor_offset(tmp_path, small):
    b = bytearray(small[1])
    off = tensor_fields(b, "blk.0.ffn_up.weight")[3]
    struct.pack_into("<Q", b, off, struct.unpack_from("<Q", b, off)[0] + 4)
    expect_error(write(tmp_path, b), "blk.0.ffn_up.weight", "not aligned to 32")


@pytest.mark.parametrize("rel", [2**20, 2**63, 2**64 - 32])
def test_tensor_offset_out_of_bounds(tmp_path, small, rel):
    b = bytearray(small[1])
    struct.pack_into("<Q", b, tensor_fields(b, "blk.0.ffn_up.weight")[3], rel)
    expect_error(write(tmp_path, b), "blk.0.ffn_up.weight", "past the end")


def test_huge_dimension(tmp_path, small):
    b = bytearray(small[1])
    struct.pack_into("<Q", b, tensor_fields(b, "blk.0.attn_q.weight")[1] + 8, 2**62)
    expect_error(write(tmp_path, b), "blk.0.attn_q.weight", "past the end")


@pytest.mark.parametrize("align", [0, 48])
def test_bad_alignment_value(tmp_path, align):
    p = write_tiny_model(tmp_path / "a.gguf", "llama", extra=lambda w: w.add_uint32("general.alignment", align))
    expect_error(p, f"general.alignment {align}", "power of two")


def test_unknown_metadata_type(tmp_path, small):
    b = bytearray(small[1])
    struct.pack_into("<I", b, kv_value_offset(b, "t.u32") - 4, 13)
    expect_error(write(tmp_path, b), "unknown metadata value type 13", "t.u32")


def test_empty_file(tmp_path):
    expect_error(write(tmp_path, b""), "empty")


def test_directory(tmp_path):
    expect_error(tmp_path, "directory")


def test_missing_file(tmp_path):
    expect_error(tmp_path / "nope.gguf", "no such file")


# ---------------------------------------------------------------- real models

REAL = ["qwen2.5-coder:0.5b", "qwen2.5-coder:1.5b", "gemma3:270m"]

# Measured in a fresh interpreter: earlier tests' allocations would blur the RSS numbers.
_PROBE = """
import json, sys, time
from gguf_io.reader import open_gguf
page = __import__("os").sysconf("SC_PAGE_SIZE")
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page
before = rss()
f = open_gguf(sys.argv[1])
grew = rss() - before
times = []
for _ in range(3):
    t0 = time.perf_counter(); open_gguf(sys.argv[1]); times.append(time.perf_counter() - t0)
print(json.dumps({"grew": grew, "median": sorted(times)[1]}))
"""


@pytest.mark.real
@pytest.mark.parametrize("name", REAL)
def test_real_model_opens_mapped(name):
    import quant
    from models.catalog import fetch
    path = fetch(name)
    f = open_gguf(path)
    assert f.file_size == path.stat().st_size
    for t in f.tensors.values():
        assert t.type_id in quant.QTYPES, f"{t.name}: {t.type_name}"
        assert f.data_offset <= t.offset and t.offset + t.nbytes <= f.file_size
    out = subprocess.run([sys.executable, "-c", _PROBE, str(path)], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, check=True).stdout
    probe = json.loads(out)
    assert probe["grew"] < 50 << 20, f"opening grew RSS by {probe['grew'] >> 20} MB"
    # ~0.1 s on an idle machine, 0.2-0.3 s with this 2-core machine loaded 3x; gguf.GGUFReader
    # (a Python object per vocabulary element) takes seconds: the bound tells them apart
    assert probe["median"] < 1.0, f"median open time {probe['median']:.3f} s"


def test_string_arrays_decode_each_string_alone(tmp_path):
    """Strings with NULs, broken UTF-8 at either end, empty ones and one longer than a
    word: each reads as its own bytes decoded alone (errors replaced), none spills over."""
    raw = [b"plain", b"", b"\xe2\x82", b"\x82tail", b"caf\xc3\xa9", b"x" * 3000, b"\xf0\x9f\xa6\x98", b"", b"end\xff"]

    def write_strings(path, items):
        body = b"".join(struct.pack("<Q", len(x)) + x for x in items)
        key = b"t.strs"
        kv = struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 8, len(items)) + body
        path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv)
        return open_gguf(path).metadata["t.strs"]

    want = [x.decode("utf-8", errors="replace") for x in raw]
    assert write_strings(tmp_path / "a.gguf", raw) == want
    with_nul = raw + [b"a\0", b"\0\0\0\0\0\0\0\0\0b"]
    assert write_strings(tmp_path / "b.gguf", with_nul) == [x.decode("utf-8", errors="replace") for x in with_nul]
    assert write_strings(tmp_path / "c.gguf", []) == []


def test_our_type_table_is_gguf_pys():
    """gguf_io.types holds GGML's type ids, names and block sizes so that a start need not
    import the gguf package: the same ids, names and sizes as gguf-py's (a type added to
    gguf-py later is one numbat cannot run; it is named by its id)."""
    from gguf_io import types
    assert len(types.GGMLQuantizationType) >= 34
    for ours in types.GGMLQuantizationType:
        t = T(ours.value)
        assert ours.name == t.name and types.GGML_QUANT_SIZES[ours] == GGML_QUANT_SIZES[t], t.name


def test_a_start_does_not_import_the_gguf_package():
    """Importing gguf builds the enums of every architecture and tensor name (65 ms of every
    start); loading a model and running it needs only gguf_io.types."""
    code = ("import sys; sys.modules.setdefault('scipy', None); import cli, runner.model, runner.generate, "
            "runner.speculative, runner.backends.numba_cpu, quant; print('gguf' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
