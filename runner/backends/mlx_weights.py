"""GGUF tensors as MLX arrays: each block format mapped onto MLX's affine quantization.

MLX stores a matrix as codes q (``bits`` wide, packed LSB-first into uint32) with one scale
s and bias b per ``group_size`` codes along a row (32, 64 or 128): w = s * q + b. Every
GGUF type below maps onto one or two such terms, so that ``dequantize`` gives exactly the
float32 values of ``gguf.quants.dequantize`` (tested bit for bit on random blocks; no
type here is approximate):

  type   MLX form                                              bytes/weight  (GGUF)
  F32    plain float32                                         4.0           4.0
  F16    plain float16                                         2.0           2.0
  BF16   plain bfloat16, its 16 bits kept (never via f16)      2.0           2.0
  Q8_0   8-bit g32, code q+128, s=d, b=-128d                   1.125         1.0625
  Q4_0   4-bit g32, s=d, b=-8d                                 0.625         0.5625
  Q4_1   4-bit g32, s=d, b=m                                   0.625         0.625
  Q5_0   5-bit g32, s=d, b=-16d                                0.75          0.6875
  Q5_1   5-bit g32, s=d, b=m                                   0.75          0.75
  Q4_K   4-bit g32, s=d*sc, b=-dmin*m (float32)                0.75          0.5625
  Q5_K   5-bit g32, s=d*sc, b=-dmin*m (float32)                0.875         0.6875
  Q3_K   8-bit g128, code 128-sc*q, s=-d, b=128d               1.03125       0.4297
  Q6_K   two terms over c = 4096-sc*q (13 bits): 8-bit g128    1.6875        0.8203
         c>>5 with s=-32d, b=4096d, plus 5-bit g128 c&31, s=-d
  Q2_K   6-bit g128 code sc*q, s=d, b=0; plus the mins          1.03125       0.3281
         -dmin*m, one per 16 weights, as a float32 (n_rows,
         n_cols/16) matrix that multiplies x summed over each 16

Scales and biases are float16 when every one of a tensor's is exactly a float16 (the
legacy types, Q3_K, Q6_K and Q2_K: d, 8d, 4096d, m are), float32 otherwise (Q4_K, Q5_K:
d*sc needs up to 17 bits). Each term is exact in float32: its products have at most 24
significant bits, and a two-term sum is the one rounding the reference makes.
``mx.dequantize`` computes in float16 when handed float16 scales, so ``dequantize`` passes
them as float32; ``mx.quantized_matmul`` casts them to x's dtype itself (the same bits as
with float32 scales, checked).

Choices measured here (mlx 0.32.4 CPU build, 2 shared cores):
- Q3_K: sc*q lies in [-124, 128] and d is per 256 weights, so one 8-bit code per weight
  with the widest group holds it exactly; nothing narrower can.
- Q6_K: d*sc*q has a scale per 16 weights (MLX's groups are >= 32) and 13-bit products.
  Exact options: each 16-weight sub-block padded into its own 32-group (6-bit codes, x
  padded with zeros): 2.0 B/w; the 8+5-bit two-term split above: 1.6875 B/w, no padding,
  as fast here (1536x8960 matvec ~50 ms both, the machine loaded). 8-bit requantization
  per 32 weights: 1.125 B/w and ~2x faster here, but inexact: on the 1.5b's Q6_K tensors
  (ffn_down, attn_v, output) an rms error of 0.46-0.49% of the weights' rms, 0.074 of
  Q6_K's own step (Q6_K's rounding is ~0.29: +7% noise power), up to 1.96 steps where a
  32-group's two sub-block scales differ. The exact split was chosen so the MLX backend
  computes the file's weights, as the numba backend does; qwen2.5-coder:1.5b's Q6_K
  tensors then take 2.06x their GGUF bytes (requantized: 1.37x).
- Q2_K: the two-term form is exact and smaller (1.03 B/w) than 8-bit requantization
  (1.125 B/w, inexact): no trade-off.

Load cost (vectorized numpy over chunks of whole rows, ~256K weights each, no Python
loop per block; then one copy into MLX), ms per MB of GGUF data, 16 MB tensors, loaded
machine: F32/F16/BF16 0.1, Q8_0 1.6, Q4_K 2.8, Q4_0/Q4_1 5, Q5_K 5.7, Q6_K 6.5, Q3_K 7.2,
Q5_0/Q5_1 8.5, Q2_K 16.8. Whole files: gemma3:270m 1.4 s (235 -> 263 MiB), qwen2.5-coder
0.5b 4.5 s (463 -> 547 MiB), 1.5b 7.4 s (1060 -> 1657 MiB). Peak memory per tensor: its
converted numpy arrays plus their MLX copies (about twice the converted size) plus a few
MB of chunk temporaries; the mmap is only read.

Unsupported types (IQ*, TQ*, Q8_K, ...) raise quant.UnsupportedType: never a silent
float16 fallback.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np
from gguf_io.types import GGML_QUANT_SIZES
from gguf_io.types import GGMLQuantizationType as T

from quant import UnsupportedType

# rows are converted in chunks of about this many weights, to bound the temporaries
_CHUNK = 1 << 18


@dataclass(frozen=True)
class QTerm:
    """One affine-quantized matrix, as mx.quantized_matmul and mx.dequantize take it."""
    w: mx.array          # packed uint32 codes, (n_rows, n_cols * bits / 32)
    scales: mx.array     # (n_rows, n_cols / group_size), float16 or float32
    biases: mx.array
    group_size: int
    bits: int


@dataclass
class MlxWeight:
    """One GGUF tensor (n_rows, n_cols) as MLX arrays: W = plain, or the sum of ``terms``
    plus, for Q2_K, ``mins16`` (n_rows, n_cols/16) float32 repeated over each 16 columns."""
    type_id: int
    n_rows: int
    n_cols: int
    plain: mx.array | None = None      # F32, F16, BF16 as they are
    terms: tuple[QTerm, ...] = ()
    mins16: mx.array | None = None

    @property
    def nbytes(self) -> int:
        arrays = [self.plain, self.mins16] + [a for t in self.terms for a in (t.w, t.scales, t.biases)]
        return sum(a.nbytes for a in arrays if a is not None)


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of every block, as float32 (N, 1)."""
    return b[:, at:at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF's 4-bit runs: byte j of a run holds value j (low nibble) and value j + len
    (high nibble). Returns the values in order, (N, runs, 2*len)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _bits(qh: np.ndarray, n: int) -> np.ndarray:
    """Bit i of the little-endian bit field qh (N, bytes) for i < n, as uint8 (N, n)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")[:, :n]


def _q4_0(b):
    d = _f16(b, 0)
    return [(_nibbles(b[:, 2:18]), d, -8 * d)], None


def _q4_1(b):
    return [(_nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2))], None


def _q5_0(b):
    d = _f16(b, 0)
    return [(_nibbles(b[:, 6:22]) | (_bits(b[:, 2:6], 32) << 4), d, -16 * d)], None


def _q5_1(b):
    return [(_nibbles(b[:, 8:24]) | (_bits(b[:, 4:8], 32) << 4), _f16(b, 0), _f16(b, 2))], None


def _q8_0(b):
    d = _f16(b, 0)
    return [(b[:, 2:34] ^ np.uint8(0x80), d, -128 * d)], None   # int8 q -> q + 128 as uint8


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins, (N, 8) float32."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k(b):
    n = len(b)
    sc, mn = _k_scale_min(b[:, 4:16])
    codes = _nibbles(b[:, 16:144].reshape(n, 4, 32)).reshape(n, 256)
    return [(codes, _f16(b, 0) * sc, -(_f16(b, 2) * mn))], None


def _q5_k(b):
    n = len(b)
    sc, mn = _k_scale_min(b[:, 4:16])
    low = _nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    high = (b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return [((low | (high << 4)).reshape(n, 256), _f16(b, 0) * sc, -(_f16(b, 2) * mn))], None


def _q6_k(b):
    n = len(b)
    low = _nibbles(b[:, 0:128].reshape(n, 2, 64)).reshape(n, 8, 32)
    high = (b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low | (high.reshape(n, 8, 32) << 4)).astype(np.int16).reshape(n, 16, 16) - 32   # [-32, 31]
    sc = b[:, 192:208].view(np.int8).astype(np.int16).reshape(n, 16, 1)
    # w = d * sc*q with sc*q in [-4064, 4096]: code 4096 - sc*q in [0, 8160] is 13 bits,
    # split into an 8-bit term (code >> 5, scale -32d) and a 5-bit one (code & 31, scale -d)
    code = (4096 - sc * q).reshape(n, 256)
    d = np.repeat(_f16(b, 208), 2, axis=1)
    return [((code >> 5).astype(np.uint8), -32 * d, 4096 * d),
            ((code & 31).astype(np.uint8), -d, np.zeros_like(d))], None


def _q3_k(b):
    n = len(b)
    low = (b[:, 32:96].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    high = (b[:, 0:32].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = low.reshape(n, 8, 32).astype(np.int16) - 4 * (1 - high.astype(np.int16))    # [-4, 3]
    s = b[:, 96:108]
    lo = np.concatenate([s[:, 0:8] & 15, s[:, 0:8] >> 4], axis=1)
    hi = (s[:, 8:12].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)).reshape(n, 16) & 3
    sc = (lo | (hi << 4)).astype(np.int16) - 32                                      # [-32, 31]
    codes = (128 - sc.reshape(n, 16, 1) * q.reshape(n, 16, 16)).astype(np.uint8)   # [0, 252]
    d = _f16(b, 108)
    return [(codes.reshape(n, 256), np.repeat(-d, 2, axis=1), np.repeat(128 * d, 2, axis=1))], None


def _q2_k(b):
    n = len(b)
    s = b[:, 0:16]
    q = (b[:, 16:80].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    codes = (s & 15).reshape(n, 16, 1) * q.reshape(n, 16, 16)   # sc * q in [0, 45]
    d = _f16(b, 80)
    mins = -(_f16(b, 82) * (s >> 4).astype(np.float32))         # (n, 16)
    return [(codes.reshape(n, 256), np.repeat(d, 2, axis=1), np.zeros((n, 2), np.float32))], mins


# type -> (unpack, (bits, group_size) of each term). unpack(blocks (N, type_size)) gives
# [(codes (N, block_size), scales (N, groups), biases), ...] and Q2_K's mins (N, 16) or None
_QUANT: dict[int, tuple[Callable, tuple[tuple[int, int], ...]]] = {
    T.Q4_0: (_q4_0, ((4, 32),)), T.Q4_1: (_q4_1, ((4, 32),)),
    T.Q5_0: (_q5_0, ((5, 32),)), T.Q5_1: (_q5_1, ((5, 32),)), T.Q8_0: (_q8_0, ((8, 32),)),
    T.Q4_K: (_q4_k, ((4, 32),)), T.Q5_K: (_q5_k, ((5, 32),)), T.Q3_K: (_q3_k, ((8, 128),)),
    T.Q6_K: (_q6_k, ((8, 128), (5, 128))), T.Q2_K: (_q2_k, ((6, 128),)),
}


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes (rows, n) < 2**bits -> (rows, n*bits/32) uint32 in MLX's layout: one LSB-first
    bit stream per row, read as little-endian words. Packs the fewest codes that fill whole
    bytes (lcm(bits, 8) bits) into the narrowest unsigned int holding them, then keeps
    those bytes: their low bytes come first on little-endian hosts (x86-64, Apple Silicon)."""
    rows, n = codes.shape
    per = math.lcm(bits, 8) // bits
    width = per * bits
    dt = np.uint8 if width <= 8 else np.uint32 if width <= 32 else np.uint64
    c = codes.reshape(rows, n // per, per).astype(dt)
    v = c[:, :, 0].copy()
    for k in range(1, per):
        v |= c[:, :, k] << dt(k * bits)
    out = v.view(np.uint8).reshape(rows, n // per, np.dtype(dt).itemsize)[:, :, :width // 8]
    return np.ascontiguousarray(out).reshape(rows, -1).view(np.uint32)


def _scale_dtype(scales: np.ndarray, biases: np.ndarray):
    """float16 if every scale and bias is exactly a float16 (halves their memory), else float32."""
    for a in (scales, biases):
        with np.errstate(over="ignore"):
            if not np.array_equal(a.astype(np.float16).astype(np.float32), a):
                return np.float32
    return np.float16


def to_mlx(type_id: int, raw: np.ndarray, n_cols: int) -> MlxWeight:
    """Convert one tensor's raw blocks (n_rows, row_bytes) uint8 into MLX arrays."""
    type_id = int(type_id)
    n_rows = raw.shape[0]
    if type_id == T.F32:
        return MlxWeight(type_id, n_rows, n_cols, mx.array(raw.view(np.float32)))
    if type_id == T.F16:
        return MlxWeight(type_id, n_rows, n_cols, mx.array(raw.view(np.float16)))
    if type_id == T.BF16:   # the 16 bits as they are: numpy has no bfloat16 to cast through
        return MlxWeight(type_id, n_rows, n_cols, mx.array(raw.view(np.uint16)).view(mx.bfloat16))
    if type_id not in _QUANT:
        name = T(type_id).name if type_id in T._value2member_map_ else str(type_id)
        raise UnsupportedType(f"tensor type {name} has no MLX conversion (supported: "
                              f"F32, F16, BF16, {', '.join(T(t).name for t in _QUANT)})")
    unpack, spec = _QUANT[type_id]
    block_size, type_size = GGML_QUANT_SIZES[T(type_id)]
    nb = n_cols // block_size
    if n_cols % block_size or raw.shape[1] != nb * type_size:
        raise ValueError(f"{T(type_id).name}: {raw.shape[1]} bytes per row do not hold {n_cols} values")
    # the results, filled a row chunk at a time (one copy less than concatenating chunks)
    out = [[np.empty((n_rows, n_cols * bits // 32), np.uint32), np.empty((n_rows, n_cols // group), np.float32),
            np.empty((n_rows, n_cols // group), np.float32)] for bits, group in spec]
    mins = np.empty((n_rows, n_cols // 16), np.float32) if type_id == T.Q2_K else None
    step = max(1, _CHUNK // n_cols)
    for r in range(0, n_rows, step):   # whole rows at a time: bounded temporaries
        rows = min(step, n_rows - r)
        terms, m = unpack(np.ascontiguousarray(raw[r:r + rows]).reshape(rows * nb, type_size))
        for (codes, scales, biases), (bits, _), o in zip(terms, spec, out):
            o[0][r:r + rows] = pack(codes.reshape(rows, n_cols), bits)
            o[1][r:r + rows] = scales.reshape(rows, -1)
            o[2][r:r + rows] = biases.reshape(rows, -1)
        if mins is not None:
            mins[r:r + rows] = m.reshape(rows, -1)
    terms = []
    for (codes, scales, biases), (bits, group) in zip(out, spec):
        dt = _scale_dtype(scales, biases)
        terms.append(QTerm(mx.array(codes), mx.array(scales.astype(dt)), mx.array(biases.astype(dt)), group, bits))
    return MlxWeight(type_id, n_rows, n_cols, terms=tuple(terms), mins16=None if mins is None else mx.array(mins))


def dequantize(w: MlxWeight) -> mx.array:
    """The tensor as float32 (n_rows, n_cols)."""
    if w.plain is not None:
        return w.plain.astype(mx.float32)
    out = None
    for t in w.terms:   # float32 scales: with float16 ones mx.dequantize computes in float16
        v = mx.dequantize(t.w, t.scales.astype(mx.float32), t.biases.astype(mx.float32),
                          group_size=t.group_size, bits=t.bits)
        out = v if out is None else out + v
    if w.mins16 is not None:
        out = out + mx.repeat(w.mins16, 16, axis=1)
    return out


def matmul(x: mx.array, w: MlxWeight) -> mx.array:
    """x (T, n_cols) float32 -> x @ W.T (T, n_rows), float32."""
    if w.plain is not None:
        return x @ w.plain.T     # float16/bfloat16 weights are promoted to x's float32
    y = None
    for t in w.terms:
        v = mx.quantized_matmul(x, t.w, t.scales, t.biases, transpose=True,
                                group_size=t.group_size, bits=t.bits)
        y = v if y is None else y + v
    if w.mins16 is not None:   # Q2_K's mins, constant over each 16 weights: one per x's 16-sum
        y = y + x.reshape(x.shape[0], -1, 16).sum(axis=2) @ w.mins16.T
    return y
