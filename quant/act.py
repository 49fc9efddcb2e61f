"""Activation quantization, exactly as llama.cpp's CPU backend does it before a dot product
with quantized weights (its "vec_dot_type"): Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 for Q4_1/Q5_1,
Q8_K for the K-quants. Matching it bit for bit keeps our logits within float rounding of the
oracle's, which greedy decoding needs (a 0.3 logit error flips near-ties; see tests).

Q8_0/Q8_1 (x86 path): per 32-block amax, d = f16(amax/127), q = round_half_even(x*(127/amax)),
Q8_1 also s = f16(d_f32 * sum(q)). Q8_K: per 256-block the signed value of largest magnitude
max, iscale = -127/max, q = min(127, round_half_even(iscale*x)), d = 1/iscale (float32),
bsums = sums of q over each 16.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from quant.intrin import bits_f32, f2h, f32_bits, h2f


@njit(inline="always")
def f16_round(x):
    """The float32 value of the nearest float16 (ties to even), as GGML_FP32_TO_FP16 rounds:
    the hardware conversion (vcvtps2ph), 7x faster per Q8_0 block than the frexp/ldexp
    arithmetic it replaced, which made quantizing a prompt's activations a fifth of its time."""
    return h2f(f2h(np.float32(x)))


@njit(inline="always")
def _absmax(x, b, n):
    """(max |x|, the first x of that magnitude) over block b of n <= 256 values, as llama.cpp's
    scan finds them. One integer max over |x|'s bits (ordered as the floats are) with 255 - j
    below them, so that ties go to the first: it vectorizes, where the scan with a branch ran
    one value a cycle (2 of the 30 ms of a 4-token forward of the 1.5b)."""
    k = np.int64(0)
    for j in range(n):
        k = max(k, (np.int64(f32_bits(x[b * n + j]) & np.int32(0x7FFFFFFF)) << 8) | (255 - j))
    return bits_f32(np.int32(k >> 8)), x[b * n + 255 - (k & 255)]


@njit(fastmath=False, cache=True)
def quantize_q8_0(x, xq, xd, xs, isum):
    """x (n,) -> xq int8 (n,), xd (n/32,) float32 values of the f16 scales, xs (n/32,) Q8_1's s,
    isum (n/32,) int32 block sums of xq (for the -8/-16 offsets of Q4_0/Q5_0)."""
    for b in range(x.shape[0] // 32):
        amax = _absmax(x, b, 32)[0]
        d = amax / np.float32(127)
        inv = np.float32(127) / amax if amax != 0 else np.float32(0)
        s = 0
        for j in range(32):
            q = np.int32(np.rint(x[b * 32 + j] * inv))
            xq[b * 32 + j] = q
            s += q
        xd[b] = f16_round(d)
        xs[b] = f16_round(d * np.float32(s))
        isum[b] = s


@njit(fastmath=False, cache=True)
def quantize_q8_K(x, xq, xd, bsums):
    """x (n,) -> xq int8 (n,), xd (n/256,) float32, bsums int32 (n/16,)."""
    for b in range(x.shape[0] // 256):
        amax, mx = _absmax(x, b, 256)
        if amax == 0:
            xd[b] = 0
            for j in range(256):
                xq[b * 256 + j] = 0
            for j in range(16):
                bsums[b * 16 + j] = 0
            continue
        iscale = np.float32(-127) / mx
        for j in range(256):
            xq[b * 256 + j] = min(127, np.int32(np.rint(iscale * x[b * 256 + j])))
        for j in range(16):
            s = 0
            for i in range(16):
                s += xq[b * 256 + j * 16 + i]
            bsums[b * 16 + j] = s
        # an infinite activation makes iscale -0 or +0: C's 1 / iscale is then -inf or +inf
        # (llama.cpp goes on with inf/NaN logits), numba's would raise
        xd[b] = np.float32(1) / iscale if iscale != 0 else (np.float32(-np.inf) if mx > 0 else np.float32(np.inf))


# ---- prefill: the same rounding applied to a whole batch, dequantized back to float32 so BLAS
# multiplies exactly the values llama.cpp's integer kernels see.

@njit(parallel=True, cache=True)
def roundtrip_q8_0(X, out):
    xq = np.empty(X.shape, np.int8)
    nb = X.shape[1] // 32
    xd = np.empty((X.shape[0], nb), np.float32)
    xs = np.empty((X.shape[0], nb), np.float32)
    isum = np.empty((X.shape[0], nb), np.int32)
    for i in prange(X.shape[0]):
        quantize_q8_0(X[i], xq[i], xd[i], xs[i], isum[i])
        for j in range(X.shape[1]):
            out[i, j] = np.float32(xq[i, j]) * xd[i, j // 32]


@njit(parallel=True, cache=True)
def roundtrip_q8_K(X, out):
    xq = np.empty(X.shape, np.int8)
    xd = np.empty((X.shape[0], X.shape[1] // 256), np.float32)
    bs = np.empty((X.shape[0], X.shape[1] // 16), np.int32)
    for i in prange(X.shape[0]):
        quantize_q8_K(X[i], xq[i], xd[i], bs[i])
        for j in range(X.shape[1]):
            out[i, j] = np.float32(xq[i, j]) * xd[i, j // 256]


_scratch: dict[tuple, tuple] = {}


def scratch(kind: str, n: int):
    """Quantized-activation buffers for n values, allocated once per (kind, n) and reused."""
    key = (kind, n)
    buf = _scratch.get(key)
    if buf is None:
        buf = (np.empty(n, np.int16), np.empty(n // 32, np.float32), np.empty(n // 32, np.float32),
               np.empty(n // 32, np.int32))
        _scratch[key] = buf
    return buf
