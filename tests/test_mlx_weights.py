"""GGUF tensors converted to MLX arrays (runner/backends/mlx_weights.py) against gguf-py's
reference dequantizer: bit-exact values, and matmuls through mx.quantized_matmul."""
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from gguf import GGML_QUANT_SIZES  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants as gq  # noqa: E402

from conftest import random_blocks  # noqa: E402
from quant import UnsupportedType  # noqa: E402
from runner.backends import mlx_weights as mw  # noqa: E402

TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
         T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
LEGACY = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
ids = [t.name for t in TYPES]


def _reference(t, raw, n_cols):
    return gq.dequantize(raw, t).reshape(raw.shape[0], n_cols).astype(np.float32)


def _check(t, raw, n_cols, rng):
    w = mw.to_mlx(t, raw, n_cols)
    ref = _reference(t, raw, n_cols)
    got = np.array(mw.dequantize(w))
    assert got.dtype == np.float32 and got.shape == ref.shape
    assert np.array_equal(got, ref), f"{t.name}: max diff {np.abs(got - ref).max()}"
    # matmul in float32 against float64: within the worst-case bound of an n-term float32 sum
    x = rng.standard_normal((3, n_cols)).astype(np.float32)
    y = np.array(mw.matmul(mx.array(x), w))
    exact = x.astype(np.float64) @ ref.astype(np.float64).T
    bound = 2 * n_cols * 2.0 ** -24 * (np.abs(x).astype(np.float64) @ np.abs(ref).astype(np.float64).T)
    assert y.shape == exact.shape and y.dtype == np.float32
    assert np.all(np.abs(y - exact) <= bound + 1e-30), f"{t.name}: {np.abs(y - exact).max()}"
    return w


@pytest.mark.parametrize("t", TYPES, ids=ids)
@pytest.mark.parametrize("seed", range(3))
def test_random_blocks_bit_exact(t, seed):
    """Random bytes (every code and scale bit pattern) with finite f16 scales."""
    rng = np.random.default_rng(seed)
    block, _ = GGML_QUANT_SIZES[t]
    nb = (512 if block == 1 else 2 * 256 // block) * (seed + 1)   # 512, 1024, 1536 columns
    raw = random_blocks(t, 5 + seed, nb, rng)
    _check(t, raw, nb * block, rng)


@pytest.mark.parametrize("t", LEGACY + [T.F16, T.BF16], ids=[t.name for t in LEGACY + [T.F16, T.BF16]])
def test_quantized_weights_bit_exact(t):
    """Blocks as gguf's own quantizer writes them, from weights of varied scale."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((9, 768)) * np.exp(rng.uniform(-4, 2, (9, 1)))).astype(np.float32)
    raw = gq.quantize(x, t).reshape(9, -1)
    w = _check(t, raw, 768, rng)
    if t in LEGACY:   # d, 8d, 16d, 128d and m are all f16 values: half-size scales
        assert w.terms[0].scales.dtype == mx.float16 and w.terms[0].biases.dtype == mx.float16


def test_k_quants_keep_float32_scales():
    """d*sc needs up to 19 bits: the K-quants' scales must not be narrowed to float16."""
    rng = np.random.default_rng(3)
    w = mw.to_mlx(T.Q4_K, random_blocks(T.Q4_K, 4, 2, rng), 512).terms[0]
    assert w.scales.dtype == mx.float32 and w.biases.dtype == mx.float32


def test_q4_0_nibble_order():
    """GGUF's byte j holds weights j (low nibble) and j+16 (high); MLX packs weights
    8k..8k+7 LSB-first into word k. A wrong reshuffle fails both checks."""
    block = np.zeros(18, np.uint8)
    block[0:2] = np.array([1.0], np.float16).view(np.uint8)
    j = np.arange(16, dtype=np.uint8)
    block[2:] = j | ((15 - j) << 4)
    w = mw.to_mlx(T.Q4_0, block.reshape(1, 18), 32)
    words = np.array(w.terms[0].w)[0]
    assert [hex(v) for v in words] == ["0x76543210", "0xfedcba98", "0x89abcdef", "0x1234567"]
    want = np.concatenate([np.arange(16), 15 - np.arange(16)]) - 8.0
    assert np.array_equal(np.array(mw.dequantize(w))[0], want)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_matches_mlx(bits):
    """pack() lays codes out as mx.dequantize reads them (scale 1, bias 0 gives the codes back)."""
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 2 ** bits, (3, 256)).astype(np.uint8)
    ones, zeros = mx.ones((3, 8)), mx.zeros((3, 8))
    got = mx.dequantize(mx.array(mw.pack(codes, bits)), ones, zeros, group_size=32, bits=bits)
    assert np.array_equal(np.array(got), codes)


def test_bf16_not_rounded_to_f16():
    """A bf16 value with more range than f16 (1e30) and one with bits f16 would round."""
    vals = np.array([1e30, 1.0 + 2 ** -7, -3.0e-20, 65504.0 * 4], np.float32)
    raw = (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(1, 8)
    w = mw.to_mlx(T.BF16, raw, 4)
    assert w.plain.dtype == mx.bfloat16
    assert np.array_equal(np.array(mw.dequantize(w)), _reference(T.BF16, raw, 4))


def test_chunked_rows_match_whole():
    """Tensors wider than a chunk are converted in row chunks; the seams must not show."""
    rng = np.random.default_rng(11)
    raw = random_blocks(T.Q6_K, 3, 2, rng)
    old, mw._CHUNK = mw._CHUNK, 512   # one row per chunk
    try:
        w = mw.to_mlx(T.Q6_K, raw, 512)
    finally:
        mw._CHUNK = old
    assert np.array_equal(np.array(mw.dequantize(w)), _reference(T.Q6_K, raw, 512))


def test_memory_per_weight():
    """The bytes per weight the module docstring states."""
    rng = np.random.default_rng(5)
    want = {T.Q4_0: 0.625, T.Q4_1: 0.625, T.Q5_0: 0.75, T.Q5_1: 0.75, T.Q8_0: 1.125,
            T.Q4_K: 0.75, T.Q5_K: 0.875, T.Q3_K: 1.03125, T.Q6_K: 1.6875, T.Q2_K: 1.03125}
    for t, bpw in want.items():
        raw = gq.quantize(rng.standard_normal((4, 256)).astype(np.float32), t).reshape(4, -1) \
            if t in LEGACY else random_blocks(t, 4, 1, rng)
        assert mw.to_mlx(t, raw, 256).nbytes / (4 * 256) == bpw, t.name


@pytest.mark.parametrize("t", [T.Q8_K, T.IQ2_XXS, T.IQ4_NL, T.TQ1_0], ids=lambda t: t.name)
def test_unsupported_type_raises(t):
    block, size = GGML_QUANT_SIZES[t]
    with pytest.raises(UnsupportedType, match=t.name):
        mw.to_mlx(t, np.zeros((1, size), np.uint8), block)
