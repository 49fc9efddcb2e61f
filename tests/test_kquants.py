"""K-quant kernels (quant/kquants.py) against gguf-py's reference dequantizer, on random blocks."""
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from conftest import HALF_FIELDS, random_blocks
from quant import kquants
from quant.act import roundtrip_q8_K
from quant.common import F16

KTYPES = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
ids = [t.name for t in KTYPES]
SHAPES = [(1, 1), (7, 2), (13, 3), (4, 4), (7, 1), (13, 4), (2, 3), (1, 4)]   # (rows, blocks per row)


def _kernels(t):
    name = "q" + t.name[1:]
    return getattr(kquants, "dequant_rows_" + name), getattr(kquants, "matvec_" + name)


def _x(rng, n):
    """Activations whose scale changes from block to block (each 256-block has its own xd)."""
    return (rng.standard_normal(n) * np.exp(rng.uniform(-3, 3, n // 256)).repeat(256)).astype(np.float32)


def test_registry():
    assert sorted(kquants.QTYPES) == sorted(int(t) for t in KTYPES)
    for t in KTYPES:
        q = kquants.QTYPES[int(t)]
        assert (q.name, (q.block_size, q.type_size)) == (t.name, GGML_QUANT_SIZES[t])
        assert q.row_bytes(768) == 3 * GGML_QUANT_SIZES[t][1]


@pytest.mark.parametrize("t", KTYPES, ids=ids)
@pytest.mark.parametrize("seed", range(20))
def test_dequant_bit_exact(t, seed):
    rng = np.random.default_rng(seed)
    rows, nb = SHAPES[seed % len(SHAPES)]
    raw = random_blocks(t, rows, nb, rng)
    out = np.full((rows, nb * 256), np.nan, np.float32)
    kquants.QTYPES[int(t)].dequant_rows(raw, out)
    np.testing.assert_array_equal(out, gq.dequantize(raw, t))


@pytest.mark.parametrize("t", KTYPES, ids=ids)
def test_dequant_extreme_bytes(t):
    """All-0xFF, all-0x00 and 0x80 quant bytes: largest/smallest scales, mins and values
    (Q6_K scale -128, Q3_K scale -32 and 31), with f16 fields kept finite."""
    rng = np.random.default_rng(0)
    raws = []
    for fill in (0x00, 0xFF, 0x80, 0x7F):
        raw = random_blocks(t, 3, 2, rng).reshape(3, 2, -1)
        keep = raw.copy()
        raw[...] = fill
        for off in HALF_FIELDS[t]:
            raw[:, :, off:off + 2] = keep[:, :, off:off + 2]
        raws.append(raw.reshape(3, -1))
    raw = np.concatenate(raws)
    out = np.empty((raw.shape[0], 512), np.float32)
    kquants.QTYPES[int(t)].dequant_rows(raw, out)
    np.testing.assert_array_equal(out, gq.dequantize(raw, t))


# The matvec quantizes x to Q8_K first, as llama.cpp does, then computes in integers.
# 1) Against W @ x_r in float64, x_r = the Q8_K-rounded activations the kernel sees: the
#    integer sums are exact, only a few float32 roundings per block remain (measured about
#    1e-8 of |W| @ |x_r|), so 1e-5 of |W| @ |x_r| catches any wrong value, offset or scale.
# 2) Against W @ x with the unrounded x: each x_c moves by at most d_b/2 (d_b the block's
#    Q8_K scale), so |y - W@x| <= 0.5 * |W| @ d, a bound, not a fitted number.
#    Measured: about 1e-3 of |W| @ |x| (largest row).

@pytest.mark.parametrize("t", KTYPES, ids=ids)
@pytest.mark.parametrize("seed", range(20))
def test_matvec(t, seed):
    rng = np.random.default_rng(100 + seed)
    rows, nb = SHAPES[seed % len(SHAPES)]
    raw = random_blocks(t, rows, nb, rng)
    x = _x(rng, nb * 256)
    if seed % 5 == 4:
        x[:256] = 0                      # a zero block: Q8_K scale 0
    y = np.full(rows, np.nan, np.float32)
    kquants.QTYPES[int(t)].matvec(raw, x, y)

    W = gq.dequantize(raw, t).astype(np.float64)
    xr = np.empty((1, x.size), np.float32)
    roundtrip_q8_K(x[None], xr)
    xr = xr[0].astype(np.float64)
    err = np.abs(y - W @ xr)
    assert np.all(err <= 1e-5 * (np.abs(W) @ np.abs(xr)) + 1e-30), err / (np.abs(W) @ np.abs(xr))

    d = np.abs(x.reshape(-1, 256)).max(axis=1).repeat(256) / 127
    bound = 0.5 * (np.abs(W) @ d) * (1 + 1e-4) + 1e-5 * (np.abs(W) @ np.abs(x))
    assert np.all(np.abs(y - W @ x) <= bound)


@pytest.mark.parametrize("t", KTYPES, ids=ids)
def test_matvec_error_vs_float(t):
    """The activation rounding error on a larger matrix stays near llama.cpp's (Q8_K): a
    regression check on its size, with room for other seeds."""
    rng = np.random.default_rng(7)
    raw = random_blocks(t, 64, 8, rng)
    x = rng.standard_normal(8 * 256).astype(np.float32)
    y = np.empty(64, np.float32)
    kquants.QTYPES[int(t)].matvec(raw, x, y)
    W = gq.dequantize(raw, t).astype(np.float64)
    rel = np.abs(y - W @ x).max() / (np.abs(W) @ np.abs(x)).max()
    assert 1e-5 < rel < 3e-3, rel       # nonzero: x really is rounded to 8 bits


@pytest.mark.parametrize("t", KTYPES, ids=ids)
def test_readonly_raw(t, tmp_path):
    """Kernels take read-only arrays (memory-mapped files) directly, not only through the
    wrappers' readonly() view."""
    rng = np.random.default_rng(3)
    raw = random_blocks(t, 5, 2, rng)
    path = tmp_path / "w.bin"
    raw.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r", shape=raw.shape)
    assert not mm.flags.writeable
    q = kquants.QTYPES[int(t)]
    dq, mv = _kernels(t)

    out = np.empty((5, 512), np.float32)
    dq(mm, out, F16)
    np.testing.assert_array_equal(out, gq.dequantize(raw, t))

    x = rng.standard_normal(512).astype(np.float32)
    y_mm, y = np.empty(5, np.float32), np.empty(5, np.float32)
    q.matvec(mm, x, y_mm)
    q.matvec(raw, x, y)
    np.testing.assert_array_equal(y_mm, y)
    xq, xd, bs16, bs32 = kquants._x_scratch(512)
    kquants.quantize_x(x, xq, xd, bs16, bs32)
    mv(mm, xq, xd, bs32 if t in (T.Q4_K, T.Q5_K) else bs16, y_mm, F16)
    np.testing.assert_array_equal(y_mm, y)


def test_matvec_rejects_wrong_length():
    raw = random_blocks(T.Q4_K, 2, 2, np.random.default_rng(0))
    with pytest.raises(ValueError):
        kquants.QTYPES[int(T.Q4_K)].matvec(raw, np.zeros(256, np.float32), np.empty(2, np.float32))


@pytest.mark.skipif(not kquants.KIND.vnni, reason="this CPU has no AVX512-VNNI")
@pytest.mark.parametrize("t", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("seed", range(4))
def test_vnni_kernels_return_the_portable_bits(t, seed):
    """vpdpbusd sums are exact integers and the float part is the same code, so the VNNI
    kernels must match the portable ones bit for bit, extreme activations included."""
    rng = np.random.default_rng(seed)
    raw = random_blocks(t, 37, 6, rng)
    x = rng.standard_normal(6 * 256).astype(np.float32) * rng.choice([1e-3, 1.0, 300.0])
    x[rng.integers(0, x.size, 5)] *= 50
    _, mv = _kernels(t)
    xq, xd, bs16, bs32 = kquants._x_scratch(x.size)
    kquants.quantize_x(x, xq, xd, bs16, bs32)
    y_portable, y = np.empty(37, np.float32), np.empty(37, np.float32)
    mv(raw, xq, xd, bs32 if t == T.Q4_K else bs16, y_portable, F16)
    kquants.QTYPES[int(t)].matvec(raw, x, y)
    np.testing.assert_array_equal(y, y_portable)


@pytest.mark.skipif(not kquants.KIND.vnni, reason="this CPU has no AVX512-VNNI")
@pytest.mark.parametrize("t", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("m", [2, 5, kquants.ROWS])
def test_matvec_rows_gives_each_row_the_bits_of_matvec(t, m):
    """Speculative verification runs a few tokens through matvec_rows and must see exactly
    what decoding them one by one (matvec) sees."""
    rng = np.random.default_rng(m)
    raw = random_blocks(t, 29, 4, rng)
    X = rng.standard_normal((m, 4 * 256)).astype(np.float32) * rng.uniform(0.01, 100, (m, 1)).astype(np.float32)
    q = kquants.QTYPES[int(t)]
    Y = np.empty((m, 29), np.float32)
    q.matvec_rows(raw, X, Y)
    for i in range(m):
        y = np.empty(29, np.float32)
        q.matvec(raw, X[i], y)
        np.testing.assert_array_equal(Y[i], y)
