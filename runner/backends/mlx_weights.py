"""GGUF tensors as MLX arrays: each block format mapped onto MLX's affine quantization.

MLX stores a weight as codes q (``bits`` wide, packed LSB-first into uint32) and one
scale s and bias b per ``group_size`` codes (32, 64 or 128), w = s * q + b. Every GGUF
type below maps onto that form so that ``dequantize`` gives exactly the float32 values of
``gguf.quants.dequantize`` (tested bit for bit on random blocks):

  type   MLX form                                            bytes/weight  GGUF   exact
  F32    plain float32                                        4.0           4.0    yes
  F16    plain float16                                        2.0           2.0    yes
  BF16   plain bfloat16 (never rounded through f16)           2.0           2.0    yes
  Q8_0   8-bit g32, code q+128, s=d, b=-128d                  1.125         1.0625 yes
  Q4_0   4-bit g32, s=d, b=-8d                                0.625         0.5625 yes
  Q4_1   4-bit g32, s=d, b=m                                  0.625         0.625  yes
  Q5_0   5-bit g32, s=d, b=-16d                               0.75          0.6875 yes
  Q5_1   5-bit g32, s=d, b=m                                  0.75          0.75   yes
  Q4_K   4-bit g32, s=d*sc, b=-dmin*m (float32)               0.75          0.5625 yes
  Q5_K   5-bit g32, s=d*sc, b=-dmin*m (float32)               0.875         0.6875 yes
  Q3_K   8-bit g128, code 128-sc*q, s=-d, b=128d              1.03125       0.4297 yes
  Q6_K   6-bit g32, each 16-weight sub-block padded to a      2.0           0.8203 yes
         group (pad code 32 = 0.0), s=d*sc, b=-32*d*sc;
         x gets 16 zeros after every 16 values
  Q2_K   two terms: 6-bit g128 code sc*q, s=d, b=0; plus the  1.03125      0.3281 yes
         mins -dmin*m per 16 weights as a float32 matrix
         that multiplies x summed over each 16

(bytes/weight with the scales; GGUF's for comparison.) Scales and biases are float16 when
every one of a tensor's is exactly a float16 (the legacy types: d, 8d, m are), float32
otherwise: d*sc needs up to 19 bits. ``mx.dequantize`` computes in float16 when handed
float16 scales, so ``dequantize`` passes them as float32; ``mx.quantized_matmul`` casts
them to x's dtype itself, and with float32 x gives the same bits for either (checked).

Why these constructions (measured here, mlx 0.32.4 CPU):
- Q3_K: sc*q lies in [-124, 128] and d is per 256 weights, so one 8-bit code per weight
  with the largest group (128) holds it exactly; nothing narrower does.
- Q6_K: d*sc*q needs sc per 16 weights and 13-bit products sc*q, so no single group of 32
  is exact. Padding each sub-block into its own 32-group doubles the codes (2.0 B/w);
  8-bit requantization per 32 weights costs 1.125 B/w and adds an error of up to half its
  step, about 1/8 of Q6_K's own step (rms 0.09% of the weights' rms on the 1.5b's Q6_K
  tensors). Exact was chosen: the backend's logits are to follow the numba backend's.
  Speed: see the matmul timing in the module's measurement notes below.
- Q2_K: the two-term form is exact and smaller (1.03 B/w) than 8-bit requantization
  (1.125 B/w, inexact), so there is no trade-off.

Load cost: the conversion is vectorized numpy over whole row chunks (no Python loop per
block), then one copy into MLX. Measured here on 16 MB tensors: see LOAD_MS_PER_MB below.
Peak memory while converting a tensor: the numpy result plus its MLX copy (about twice
the converted size) plus chunk temporaries of a few tens of MB; the mmap is only read.

Unsupported types (IQ*, TQ*, Q8_K, ...) raise quant.UnsupportedType: never a silent
float16 fallback.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from quant import UnsupportedType

# rows are converted in chunks of about this many weights, to bound the temporaries
_CHUNK = 1 << 20


@dataclass
class MlxWeight:
    """One GGUF tensor (n_rows, n_cols) as MLX arrays.

    Plain types: ``w`` is the float array, scales is None. Quantized: ``w`` the packed
    uint32 codes, ``scales``/``biases`` one per group, as mx.quantized_matmul takes them.
    ``padded``: Q6_K's codes cover 2*n_cols, each 16 weights followed by 16 zeros.
    ``mins16``: Q2_K's second term, (n_rows, n_cols/16) float32, one value per 16 weights.
    """
    type_id: int
    n_rows: int
    n_cols: int
    w: mx.array
    scales: mx.array | None = None
    biases: mx.array | None = None
    group_size: int = 0
    bits: int = 0
    padded: bool = False
    mins16: mx.array | None = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.w, self.scales, self.biases, self.mins16) if a is not None)


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
    return _nibbles(b[:, 2:18]), d, -8 * d


def _q4_1(b):
    return _nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2)


def _q5_0(b):
    d = _f16(b, 0)
    return _nibbles(b[:, 6:22]) | (_bits(b[:, 2:6], 32) << 4), d, -16 * d


def _q5_1(b):
    return _nibbles(b[:, 8:24]) | (_bits(b[:, 4:8], 32) << 4), _f16(b, 0), _f16(b, 2)


def _q8_0(b):
    d = _f16(b, 0)
    return b[:, 2:34] ^ np.uint8(0x80), d, -128 * d   # int8 q -> q + 128 as uint8


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
    return codes, _f16(b, 0) * sc, -(_f16(b, 2) * mn)


def _q5_k(b):
    n = len(b)
    sc, mn = _k_scale_min(b[:, 4:16])
    low = _nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    high = (b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return (low | (high << 4)).reshape(n, 256), _f16(b, 0) * sc, -(_f16(b, 2) * mn)


def _q6_k(b):
    n = len(b)
    low = _nibbles(b[:, 0:128].reshape(n, 2, 64)).reshape(n, 8, 32)
    high = (b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    codes = (low | (high.reshape(n, 8, 32) << 4)).reshape(n, 16, 16)   # q + 32, in [0, 63]
    s = _f16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)   # d * sc, (n, 16)
    # each 16-weight sub-block gets its own group of 32; pad code 32 dequantizes to 0.0
    padded = np.concatenate([codes, np.full_like(codes, 32)], axis=2).reshape(n, 512)
    return padded, s, -32 * s


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
    return codes.reshape(n, 256), np.repeat(-d, 2, axis=1), np.repeat(128 * d, 2, axis=1)


def _q2_k(b):
    n = len(b)
    s = b[:, 0:16]
    q = (b[:, 16:80].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    codes = (s & 15).reshape(n, 16, 1) * q.reshape(n, 16, 16)   # sc * q in [0, 45]
    d = _f16(b, 80)
    mins = -(_f16(b, 82) * (s >> 4).astype(np.float32))         # (n, 16)
    return codes.reshape(n, 256), np.repeat(d, 2, axis=1), np.zeros((n, 2), np.float32), mins


# type -> (bits, group_size, codes per block, unpack(blocks) -> codes, scales, biases[, mins16])
_QUANT: dict[int, tuple[int, int, int, Callable]] = {
    T.Q4_0: (4, 32, 32, _q4_0), T.Q4_1: (4, 32, 32, _q4_1),
    T.Q5_0: (5, 32, 32, _q5_0), T.Q5_1: (5, 32, 32, _q5_1), T.Q8_0: (8, 32, 32, _q8_0),
    T.Q4_K: (4, 32, 256, _q4_k), T.Q5_K: (5, 32, 256, _q5_k), T.Q6_K: (6, 32, 512, _q6_k),
    T.Q3_K: (8, 128, 256, _q3_k), T.Q2_K: (6, 128, 256, _q2_k),
}


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes (rows, n) < 2**bits -> (rows, n*bits/32) uint32 in MLX's layout: one LSB-first
    bit stream per row, read as little-endian words. Packs the fewest codes that fill whole
    bytes (lcm(bits, 8) bits) in a uint64, then keeps those bytes."""
    rows, n = codes.shape
    per = math.lcm(bits, 8) // bits
    c = codes.reshape(rows, n // per, per).astype(np.uint64)
    v = np.zeros((rows, n // per), np.uint64)
    for k in range(per):
        v |= c[:, :, k] << np.uint64(k * bits)
    out = v.view(np.uint8).reshape(rows, n // per, 8)[:, :, :per * bits // 8]
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
    if type_id == T.BF16:   # the 16 bits as they are: a cast through numpy would need f16
        return MlxWeight(type_id, n_rows, n_cols, mx.array(raw.view(np.uint16)).view(mx.bfloat16))
    if type_id not in _QUANT:
        name = T(type_id).name if type_id in T._value2member_map_ else str(type_id)
        raise UnsupportedType(f"tensor type {name} has no MLX conversion (supported: "
                              f"F32, F16, BF16, {', '.join(T(t).name for t in _QUANT)})")
    bits, group, per_block, unpack = _QUANT[type_id]
    block_size, type_size = GGML_QUANT_SIZES[T(type_id)]
    nb = n_cols // block_size
    if raw.shape[1] != nb * type_size or n_cols % block_size:
        raise ValueError(f"{T(type_id).name}: {raw.shape[1]} bytes per row do not hold {n_cols} values")
    step = max(1, _CHUNK // n_cols)
    parts = []
    for r in range(0, n_rows, step):   # whole rows at a time: bounded temporaries
        rows = min(step, n_rows - r)
        out = unpack(np.ascontiguousarray(raw[r:r + rows]).reshape(rows * nb, type_size))
        codes = pack(out[0].reshape(rows, nb * per_block), bits)
        parts.append((codes,) + tuple(a.reshape(rows, -1) for a in out[1:]))
    codes, scales, biases, *mins = (np.concatenate(p) for p in zip(*parts))
    del parts
    dt = _scale_dtype(scales, biases)
    return MlxWeight(type_id, n_rows, n_cols, mx.array(codes), mx.array(scales.astype(dt)),
                     mx.array(biases.astype(dt)), group, bits, padded=type_id == T.Q6_K,
                     mins16=mx.array(mins[0]) if mins else None)


def dequantize(w: MlxWeight) -> mx.array:
    """The tensor as float32 (n_rows, n_cols)."""
    if w.scales is None:
        return w.w.astype(mx.float32)
    # float32 scales: with float16 ones mx.dequantize computes in float16
    out = mx.dequantize(w.w, w.scales.astype(mx.float32), w.biases.astype(mx.float32),
                        group_size=w.group_size, bits=w.bits)
    if w.padded:
        out = out.reshape(w.n_rows, w.n_cols // 16, 32)[:, :, :16].reshape(w.n_rows, w.n_cols)
    if w.mins16 is not None:
        out = out + mx.repeat(w.mins16, 16, axis=1)
    return out


def matmul(x: mx.array, w: MlxWeight) -> mx.array:
    """x (T, n_cols) float32 -> x @ W.T (T, n_rows), float32."""
    if w.scales is None:
        return x @ w.w.T     # float16/bfloat16 weights are promoted to x's float32
    xq = x
    if w.padded:   # zeros where Q6_K's codes are padding
        t = x.shape[0]
        xq = mx.concatenate([x.reshape(t, -1, 16), mx.zeros((t, w.n_cols // 16, 16), x.dtype)],
                            axis=2).reshape(t, 2 * w.n_cols)
    y = mx.quantized_matmul(xq, w.w, w.scales, w.biases, transpose=True,
                            group_size=w.group_size, bits=w.bits)
    if w.mins16 is not None:   # Q2_K's mins: constant over each 16 weights
        y = y + x.reshape(x.shape[0], -1, 16).sum(axis=2) @ w.mins16.T
    return y
