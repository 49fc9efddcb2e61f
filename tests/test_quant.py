"""Every block format against gguf-py's reference dequantizer, on random blocks."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

import quant
from quant import packed
from conftest import random_blocks

TYPES = sorted(quant.QTYPES)
ids = [quant.QTYPES[t].name for t in TYPES]


def _shape(type_id, n_blocks):
    return n_blocks * quant.QTYPES[type_id].block_size


@pytest.mark.parametrize("type_id", TYPES, ids=ids)
@pytest.mark.parametrize("seed", range(8))
def test_dequant_bit_exact(type_id, seed):
    rng = np.random.default_rng(seed)
    rows, nb = [(1, 1), (7, 3), (13, 2), (4, 9)][seed % 4]
    if quant.QTYPES[type_id].block_size == 1:
        nb *= 32
    raw = random_blocks(type_id, rows, nb, rng)
    ref = gq.dequantize(raw, T(type_id))
    out = quant.dequantize(type_id, raw, _shape(type_id, nb))
    np.testing.assert_array_equal(out, ref)


def act_reference(type_id, x):
    """llama.cpp's rounding of activations before its dot products, in plain numpy: Q8_0 for
    the 32-blocks (d = f16(amax/127), q = rint(x*127/amax)), Q8_K for the K-quants
    (iscale = -127/max, q = min(127, rint(iscale*x)), d = 1/iscale), f16/bf16 for half weights."""
    x = np.asarray(x, np.float32)
    name = quant.QTYPES[type_id].name
    if name == "F32":
        return x.astype(np.float64)
    if name == "F16":
        return x.astype(np.float16).astype(np.float64)
    if name == "BF16":
        b = x.view(np.uint32).astype(np.uint64)
        return (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    k = 256 if name.endswith("_K") else 32
    blocks = x.reshape(-1, k)
    if k == 32:
        amax = np.abs(blocks).max(axis=1, keepdims=True)
        with np.errstate(divide="ignore"):
            q = np.rint(blocks * np.where(amax > 0, np.float32(127) / amax, 0).astype(np.float32))
        d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    else:
        mx = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)
        with np.errstate(divide="ignore"):
            iscale = np.where(mx != 0, np.float32(-127) / mx, 0).astype(np.float32)
        q = np.minimum(127, np.rint(iscale * blocks))
        with np.errstate(divide="ignore"):
            d = np.where(iscale != 0, np.float32(1) / iscale, 0).astype(np.float32)
    return (q.astype(np.float64) * d).reshape(x.shape)


def test_q8_0_activation_blocks_are_llamas_bit_for_bit():
    """quantize_q8_0 (llama.cpp's quantize_row_q8_0/q8_1 on x86) to the bit: q = rint(x*127/amax),
    d = f16(amax/127), s = f16(d*sum q), over blocks whose scales are normal, subnormal or
    beyond f16 (d*s overflows to inf) and all-zero blocks."""
    from quant.act import quantize_q8_0
    rng = np.random.default_rng(7)
    scales = np.array([1.0, 1e-3, 3e-6, 1e-9, 0.0, 300.0, 6e4, 2.5e5], np.float32)
    x = (rng.standard_normal((64, 32)) * np.resize(scales, 64)[:, None]).astype(np.float32).ravel()
    xq, xd = np.zeros(x.size, np.int8), np.zeros(64, np.float32)
    xs, isum = np.zeros(64, np.float32), np.zeros(64, np.int32)
    quantize_q8_0(x, xq, xd, xs, isum)
    b = x.reshape(64, 32)
    amax = np.abs(b).max(axis=1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, 0).astype(np.float32)
    q = np.rint(b * inv[:, None]).astype(np.int32)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(xq.reshape(64, 32), q)
        np.testing.assert_array_equal(isum, q.sum(axis=1))
        np.testing.assert_array_equal(xd, d.astype(np.float16).astype(np.float32))
        np.testing.assert_array_equal(xs, (d * q.sum(axis=1).astype(np.float32)).astype(np.float16).astype(np.float32))
    assert np.isinf(xs).any() and (xd[np.resize(scales, 64) == 3e-6] < 6.2e-5).all()   # the ranges were reached


# With the activations rounded as llama.cpp rounds them, the kernels compute the same sums; what
# is left is float32 accumulation order, far below 1e-4 of the scale of the terms (|W| @ |x|).
TOL = 1e-4


@pytest.mark.parametrize("type_id", TYPES, ids=ids)
@pytest.mark.parametrize("rows,nb", [(1, 1), (5, 3), (67, 4), (130, 7)])
def test_matvec(type_id, rows, nb):
    rng = np.random.default_rng(rows * 100 + nb)
    if quant.QTYPES[type_id].block_size == 1:
        nb *= 32
    raw = random_blocks(type_id, rows, nb, rng)
    W = gq.dequantize(raw, T(type_id)).astype(np.float64)
    x = rng.standard_normal(W.shape[1]).astype(np.float32)
    y = np.full(rows, np.nan, np.float32)
    quant.matvec(type_id, raw, x, y)
    xr = act_reference(type_id, x)
    err = np.abs(y - W @ xr) / (np.abs(W) @ np.abs(xr))
    assert err.max() < TOL, err.max()


@pytest.mark.parametrize("type_id", TYPES, ids=ids)
@pytest.mark.parametrize("n,rows,nb", [(1, 3, 2), (17, 45, 3), (64, 300, 2)])
def test_matmul(type_id, n, rows, nb):
    rng = np.random.default_rng(n + rows)
    if quant.QTYPES[type_id].block_size == 1:
        nb *= 32
    raw = random_blocks(type_id, rows, nb, rng)
    W = gq.dequantize(raw, T(type_id)).astype(np.float64)
    X = rng.standard_normal((n, W.shape[1])).astype(np.float32)
    Y = np.full((n, rows), np.nan, np.float32)
    quant.matmul(type_id, raw, X, Y)
    Xr = np.stack([act_reference(type_id, x) for x in X])
    err = np.abs(Y - Xr @ W.T) / (np.abs(Xr) @ np.abs(W).T)
    assert err.max() < TOL, err.max()


@pytest.mark.parametrize("type_id", [T.Q4_0, T.Q6_K], ids=["Q4_0", "Q6_K"])
def test_matmul_into_a_strided_output(type_id):
    """Y a column slice of a wider array (not contiguous): the same values as a fresh Y."""
    rng = np.random.default_rng(3)
    raw = random_blocks(type_id, 48, 2, rng)
    X = rng.standard_normal((20, 2 * quant.QTYPES[type_id].block_size)).astype(np.float32)
    Y = np.full((20, 48), np.nan, np.float32)
    quant.matmul(type_id, raw, X, Y)
    wide = np.full((20, 60), np.nan, np.float32)
    quant.matmul(type_id, raw, X, wide[:, 5:53])
    np.testing.assert_array_equal(wide[:, 5:53], Y)
    assert np.isnan(wide[:, :5]).all() and np.isnan(wide[:, 53:]).all()
    if packed.supports(type_id, 48):
        p = packed.pack(type_id, raw)
        small = np.full((4, 60), np.nan, np.float32)
        packed.matmul_rows(p, X[:4], small[:, 5:53])
        ref = np.full((4, 48), np.nan, np.float32)
        packed.matmul_rows(p, X[:4].copy(), ref)
        np.testing.assert_array_equal(small[:, 5:53], ref)


def test_matmul_tiles_cover_all_rows(monkeypatch):
    monkeypatch.setattr(quant, "_TILE_BYTES", 16 * 4 * 64)   # 16-row tiles, 1000 rows -> a ragged last tile
    rng = np.random.default_rng(1)
    raw = random_blocks(T.Q8_0, 1000, 2, rng)
    X = rng.standard_normal((5, 64)).astype(np.float32)
    Y = np.full((5, 1000), np.nan, np.float32)
    quant.matmul(T.Q8_0, raw, X, Y)
    Xr = np.stack([act_reference(T.Q8_0, x) for x in X])
    np.testing.assert_allclose(Y, Xr @ gq.dequantize(raw, T.Q8_0).T, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("type_id", quant.QUANTIZABLE, ids=lambda t: T(t).name)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_quantize_round_trips_with_gguf(type_id, dtype):
    rng = np.random.default_rng(3)
    data = rng.standard_normal((37, 96)).astype(dtype)
    raw = quant.quantize(data, type_id, rows_per_chunk=8)
    np.testing.assert_array_equal(raw, gq.quantize(data.astype(np.float32), T(type_id)))
    back = quant.dequantize(type_id, raw, 96)
    step = np.abs(data).max(axis=1, keepdims=True) / (127 if type_id == T.Q8_0 else 8)
    assert (np.abs(back - data) <= step).all()


@pytest.mark.parametrize("type_id", [T.Q5_0, T.Q8_0, T.Q6_K, T.Q4_K, T.F16, T.F32], ids=lambda t: T(t).name)
def test_requantize_to_q4_0_is_llamas(type_id):
    """A draft's matrices: dequantized, then quantize_row_q4_0_ref's bytes (gguf-py's copy of
    it), chunk by chunk (37 rows in chunks of 16: a short last chunk)."""
    cols = 512
    raw = random_blocks(type_id, 37, cols // gq.GGML_QUANT_SIZES[T(type_id)][0], np.random.default_rng(4))
    got = quant.requantize(type_id, raw, cols, rows_per_chunk=16)
    want = gq.quantize(gq.dequantize(raw, T(type_id)).reshape(37, cols), T.Q4_0)
    np.testing.assert_array_equal(got, want)
    # a block of zeros (of either sign): llama.cpp's max starts at +0, so d = 0 / -8 = -0
    # (gguf-py takes the -0 itself and stores +0), and every code is 8
    z = quant.requantize(type_id, np.zeros_like(raw[:1]), cols)
    assert (z.reshape(-1, 18)[:, :2].view(np.float16).view(np.uint16) == 0x8000).all()
    assert (z.reshape(-1, 18)[:, 2:] == 0x88).all()
    with pytest.raises(quant.UnsupportedType, match="Q4_0 blocks of 32"):
        quant.requantize(T.F32, np.zeros((2, 48 * 4), np.uint8), 48)


def test_quantize_rejects_other_types():
    with pytest.raises(quant.UnsupportedType, match="Q8_0 or Q4_0"):
        quant.quantize(np.zeros((2, 32), np.float32), T.Q4_K)


def test_unsupported_type_names_it():
    with pytest.raises(quant.UnsupportedType, match="IQ2_XXS"):
        quant.qtype(T.IQ2_XXS)


def test_kernels_take_readonly_memmap_views():
    rng = np.random.default_rng(0)
    raw = random_blocks(T.Q4_0, 8, 2, rng)
    raw.flags.writeable = False
    y = np.empty(8, np.float32)
    x = np.ones(64, np.float32)
    quant.matvec(T.Q4_0, raw, x, y)
    np.testing.assert_allclose(y, gq.dequantize(raw, T.Q4_0) @ act_reference(T.Q4_0, x), rtol=1e-5, atol=1e-5)


# Q4_0/Q5_0/Q8_0/Q4_K/Q6_K repacked at load (quant.packed): the 16-row kernels sum the same
# integers as the row kernels, held to the float reference like every matvec; the float steps
# are llama.cpp's for the batch size (llama_orders); with batch=False a few tokens at once
# (speculative verification) get the bits each gets alone.
@pytest.mark.skipif(not packed.enabled(), reason="repacking needs AVX512-VNNI (and NUMBAT_REPACK unset)")
@pytest.mark.parametrize("type_id", sorted(packed.KINDS), ids=lambda t: T(t).name)
@pytest.mark.parametrize("rows,nb", [(16, 1), (48, 3), (160, 28)])
def test_packed_matches_file_layout(type_id, rows, nb):
    rng = np.random.default_rng(rows + nb)
    raw = random_blocks(type_id, rows, nb, rng)
    p = packed.pack(type_id, raw)
    n = nb * quant.QTYPES[type_id].block_size
    W = gq.dequantize(raw, T(type_id)).astype(np.float64)
    X = rng.standard_normal((21, n)).astype(np.float32)
    y = np.full(rows, np.nan, np.float32)
    quant.matvec(type_id, p, X[0], y)
    xr = act_reference(type_id, X[0])
    assert (np.abs(y - W @ xr) / (np.abs(W) @ np.abs(xr))).max() < TOL
    for t in (2, 3, 4, 7, 9):
        Y = np.full((t, rows), np.nan, np.float32)
        packed.matmul_rows(p, X[:t], Y, batch=False)
        for i in range(t):
            quant.matvec(type_id, p, X[i], y)
            np.testing.assert_array_equal(Y[i], y)
    Y = np.full((21, rows), np.nan, np.float32)
    quant.matmul(type_id, p, X, Y)
    Xr = np.stack([act_reference(type_id, x) for x in X])
    assert (np.abs(Y - Xr @ W.T) / (np.abs(Xr) @ np.abs(W).T)).max() < TOL


@pytest.mark.skipif(not packed.enabled(), reason="repacking needs AVX512-VNNI (and NUMBAT_REPACK unset)")
@pytest.mark.parametrize("type_id", [T.Q4_0, T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K], ids=lambda t: T(t).name)
def test_packed_sums_in_llamas_order(type_id):
    """Bit for bit against llama.cpp's kernels' float steps (tests/llama_orders.py) for one
    token and for batches of 6 (Q4_K: gemm for four, gemv for two) and 9 (Q6_K's tiled
    kernel); decode's order differs from the batch's on these blocks."""
    import llama_orders
    rng = np.random.default_rng(7)
    raw = random_blocks(type_id, 16, 3 if type_id in (T.Q4_K, T.Q6_K) else 8, rng)
    p = packed.pack(type_id, raw)
    X = (rng.standard_normal((9, p.cols)) * rng.uniform(0.1, 10, (9, 1))).astype(np.float32)
    for n in (1, 6, 9):
        Y = np.full((n, 16), np.nan, np.float32)
        packed.matmul_rows(p, X[:n], Y)
        np.testing.assert_array_equal(Y, llama_orders.matmul(type_id, raw, X[:n]))
    if type_id in (T.Q4_K, T.Q6_K):
        one = np.full((9, 16), np.nan, np.float32)
        packed.matmul_rows(p, X, one, batch=False)
        assert (one != Y).any()


@pytest.mark.skipif(not packed.enabled(), reason="repacking needs AVX512-VNNI (and NUMBAT_REPACK unset)")
def test_packed_q4_0_prompt_in_llamas_order():
    """A prompt's Q4_0 batch of 40 tokens, bit for bit against llama.cpp's float steps: on a
    CPU row with AMX its first 32 tokens go through int8 tiles (quant.amx; 9 blocks: the
    tile kernel's pairs of blocks and its last one alone), the last 8 through the VNNI batch
    kernel."""
    import llama_orders
    rng = np.random.default_rng(11)
    raw = random_blocks(T.Q4_0, 48, 9, rng)
    p = packed.pack(T.Q4_0, raw)
    X = (rng.standard_normal((40, p.cols)) * rng.uniform(0.1, 10, (40, 1))).astype(np.float32)
    Y = np.full((40, 48), np.nan, np.float32)
    packed.matmul_rows(p, X, Y)
    np.testing.assert_array_equal(Y, llama_orders.matmul(T.Q4_0, raw, X))


@pytest.mark.skipif(not quant.cpu.KIND.amx, reason="no AMX int8 tiles on this CPU (or Linux refused them)")
def test_amx_tiles_give_llamas_bits():
    """The tile kernel alone (quant.amx.q4_0, not the VNNI kernel beside it) on 32 tokens and
    two groups: the same bits as llama.cpp's float steps."""
    import llama_orders
    from quant import amx
    rng = np.random.default_rng(12)
    raw = random_blocks(T.Q4_0, 32, 4, rng)
    p = packed.pack(T.Q4_0, raw)
    X = (rng.standard_normal((32, p.cols)) * rng.uniform(0.1, 10, (32, 1))).astype(np.float32)
    xq, xd, _, nb = packed._quantized(p, X, 32)
    Y = np.full((32, 32), np.nan, np.float32)
    amx.q4_0(p.data, 0, 2, nb, xq, xd, Y, 32)
    np.testing.assert_array_equal(Y, llama_orders.matmul(T.Q4_0, raw, X))


@pytest.mark.skipif(not packed.enabled(), reason="repacking needs AVX512-VNNI (and NUMBAT_REPACK unset)")
@pytest.mark.parametrize("type_id", [T.Q8_0, T.Q4_K], ids=lambda t: T(t).name)
def test_packed_rows_do_not_depend_on_how_threads_share_them(type_id):
    """The threads take runs of groups in turn (quant.packed._run): every row is written
    once, with the bits its group of 16 rows gets alone, on one thread or two."""
    import numba
    rng = np.random.default_rng(3)
    groups = 65                 # runs of 16 (one thread) or 8 (two), the last one short
    p = packed.pack(type_id, random_blocks(type_id, 16 * groups, 2, rng))
    X = rng.standard_normal((1, p.cols)).astype(np.float32)
    alone = np.empty((1, p.rows), np.float32)
    for g in range(groups):
        packed.matmul_rows(packed.Packed(type_id, p.data[g:g + 1], 16, p.cols), X, alone[:, 16 * g:16 * g + 16])
    before = numba.get_num_threads()
    try:
        for threads in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            numba.set_num_threads(threads)
            Y = np.full((1, p.rows), np.nan, np.float32)
            packed.matmul_rows(p, X, Y, batch=False)
            np.testing.assert_array_equal(Y, alone)
    finally:
        numba.set_num_threads(before)


@pytest.mark.skipif(not packed.enabled(), reason="repacking needs AVX512-VNNI (and NUMBAT_REPACK unset)")
def test_packed_q6_K_extreme_dots_in_llamas_order():
    """The decode kernel multiplies each four-value dot by its scale as int16 words: at the
    bounds (q = 63, scales -128 and 127, activations quantized to -128 and 127) the lanes
    still hold llama.cpp's integers, for one token and four at once."""
    import llama_orders
    raw = np.zeros((16, 2, 210), np.uint8)
    raw[:, :, :192] = 0xFF                              # ql, qh: every q = 63
    raw[:, 0, 192:208] = np.uint8(0x80)                 # scales -128 (block 0) and 127 (block 1)
    raw[:, 1, 192:208] = 127
    raw[:, :, 208:210] = np.array([1.0], np.float16).view(np.uint8)
    raw = raw.reshape(16, 420)
    p = packed.pack(T.Q6_K, raw)
    X = np.stack([np.full(512, -1.0), np.full(512, 1.0), np.where(np.arange(512) < 256, -3.0, 3.0),
                  np.full(512, -2.5)]).astype(np.float32)
    want = np.concatenate([llama_orders.matmul(T.Q6_K, raw, x[None]) for x in X])    # one token each
    Y = np.full((4, 16), np.nan, np.float32)
    packed.matmul_rows(p, X, Y, batch=False)
    np.testing.assert_array_equal(Y, want)
    assert np.isfinite(want).all() and (want != 0).all()


@pytest.mark.skipif(not packed.enabled(), reason="repacking needs AVX512-VNNI (and NUMBAT_REPACK unset)")
def test_pack_file_fuses_groups_of_one_type():
    """q, k, v (gate, up) of one type become one matrix whose rows are the members' rows in
    order, with each member's bits; a group of mixed types is left as its members."""
    rng = np.random.default_rng(5)
    shapes = {"q": (T.Q4_K, 32), "k": (T.Q4_K, 16), "v": (T.Q4_K, 48), "a": (T.Q4_K, 16), "b": (T.Q6_K, 16)}
    raws = {n: random_blocks(t, rows, 2, rng) for n, (t, rows) in shapes.items()}

    class File:
        tensors = {n: type("Tensor", (), {"type_id": t, "dims": (512, rows)}) for n, (t, rows) in shapes.items()}
        released = []
        raw = staticmethod(raws.__getitem__)
        release = released.append

    out = packed.pack_file(File, list(shapes), [("q", "k", "v"), ("a", "b")])
    assert sorted(File.released) == sorted(shapes) and ("a", "b") not in out
    fused = out[("q", "k", "v")]
    assert (fused.rows, fused.cols) == (96, 512)
    X = rng.standard_normal((5, 512)).astype(np.float32)
    Y = np.empty((5, 96), np.float32)
    packed.matmul_rows(fused, X, Y)
    for n, cols in (("q", slice(0, 32)), ("k", slice(32, 48)), ("v", slice(48, 96))):
        Yn = np.empty((5, out[n].rows), np.float32)
        packed.matmul_rows(out[n], X, Yn)
        np.testing.assert_array_equal(Y[:, cols], Yn)


def test_packed_only_whole_groups():
    assert not packed.supports(T.Q4_0, 40)          # 16 rows per group
    assert not packed.supports(T.Q5_K, 64)          # Q5_K keeps the file's layout
