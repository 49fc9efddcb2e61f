"""Activation quantization: x (float32) -> 8-bit blocks of 32, once per matvec call.

Per block b: xd[b] = max|x|/127, xq = round(x/xd[b]) as int8, xs[b] = xd[b]*sum(xq) (the
block sum that offset and minimum terms need, as llama.cpp's Q8_1 keeps it).
"""
from __future__ import annotations

import numpy as np
from numba import njit

_scratch: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def scratch_q8(n: int):
    """Buffers for n activations, allocated once per size and reused."""
    buf = _scratch.get(n)
    if buf is None:
        buf = _scratch[n] = (np.empty(n, np.int8), np.empty(n // 32, np.float32), np.empty(n // 32, np.float32))
    return buf


@njit(cache=True, fastmath=True)
def quantize_q8(x, xq, xd, xs):
    for b in range(x.shape[0] // 32):
        amax = np.float32(0)
        for j in range(32):
            amax = max(amax, abs(x[b * 32 + j]))
        d = amax / np.float32(127)
        inv = np.float32(1) / d if d > 0 else np.float32(0)
        s = np.int32(0)
        for j in range(32):
            q = np.int32(np.rint(x[b * 32 + j] * inv))
            xq[b * 32 + j] = q
            s += q
        xd[b] = d
        xs[b] = d * np.float32(s)
