"""Every block format against gguf-py's reference dequantizer, on random blocks."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

import quant
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


# matvec on 8-bit activations: the error is that of rounding x to 8 bits per block of 32
# (at most half a step, 1/254 of the block's max, per element), summed over the row. Against
# the scale of the terms (|W| @ |x|) it stays below 1e-2; float kernels are far tighter.
MV_TOL = 1e-2


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
    scale = np.abs(W) @ np.abs(x)
    err = np.abs(y - W @ x) / scale
    assert err.max() < MV_TOL, err.max()


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
    # float32 BLAS on exactly dequantized weights: only accumulation rounding
    np.testing.assert_allclose(Y, X @ W.T, rtol=1e-4, atol=1e-5 * (np.abs(X) @ np.abs(W).T).max())


def test_matmul_tiles_cover_all_rows(monkeypatch):
    monkeypatch.setattr(quant, "_TILE_BYTES", 16 * 4 * 64)   # 16-row tiles, 1000 rows -> a ragged last tile
    rng = np.random.default_rng(1)
    raw = random_blocks(T.Q8_0, 1000, 2, rng)
    X = rng.standard_normal((5, 64)).astype(np.float32)
    Y = np.full((5, 1000), np.nan, np.float32)
    quant.matmul(T.Q8_0, raw, X, Y)
    np.testing.assert_allclose(Y, X @ gq.dequantize(raw, T.Q8_0).T, rtol=1e-4, atol=1e-3)


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
    quant.matvec(T.Q4_0, raw, np.ones(64, np.float32), y)
    np.testing.assert_allclose(y, gq.dequantize(raw, T.Q4_0).sum(axis=1), rtol=1e-2, atol=1e-2)
