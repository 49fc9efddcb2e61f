"""F32, F16 and BF16 tensors. Half formats decode through a 65536-entry table: exact, and
numba has no float16 arithmetic on the CPU."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit, prange

from quant.common import F16, QType, readonly

BF16 = (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)


@njit(parallel=True, cache=True)
def _dq_half(h, out, table):
    for r in prange(h.shape[0]):
        for c in range(h.shape[1]):
            out[r, c] = table[h[r, c]]


@njit(parallel=True, fastmath=True, cache=True)
def _mv_half(h, x, y, table):
    for r in prange(h.shape[0]):
        acc = np.float32(0)
        for c in range(h.shape[1]):
            acc += table[h[r, c]] * x[c]
        y[r] = acc


@njit(parallel=True, fastmath=True, cache=True)
def _mv_f32(w, x, y):
    for r in prange(w.shape[0]):
        acc = np.float32(0)
        for c in range(w.shape[1]):
            acc += w[r, c] * x[c]
        y[r] = acc


def _half(type_id, name, table):
    def dequant_rows(raw, out):
        _dq_half(readonly(raw).view(np.uint16), out, table)

    def matvec(raw, x, y):
        _mv_half(readonly(raw).view(np.uint16), x, y, table)
    return QType(int(type_id), name, 1, 2, dequant_rows, matvec)


def _f32_dequant(raw, out):
    out[...] = raw.view(np.float32)


def _f32_matvec(raw, x, y):
    _mv_f32(readonly(raw).view(np.float32), x, y)


QTYPES = {q.type_id: q for q in [
    QType(int(T.F32), "F32", 1, 4, _f32_dequant, _f32_matvec),
    _half(T.F16, "F16", F16),
    _half(T.BF16, "BF16", BF16),
]}
