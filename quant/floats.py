"""F32, F16 and BF16 tensors. Half formats decode through a 65536-entry table: exact, and
numba has no float16 arithmetic on the CPU."""
from __future__ import annotations

import numpy as np
from gguf_io.types import GGMLQuantizationType as T
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


_xbuf: dict[int, np.ndarray] = {}


def _to_f16(X, out):
    out[...] = X.astype(np.float16)


def _to_bf16(X, out):
    # round to nearest even on the upper 16 bits, as ggml_fp32_to_bf16 (no NaN inputs here)
    b = X.view(np.uint32)
    out.view(np.uint32)[...] = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16


def _half(type_id, name, table, roundtrip):
    def dequant_rows(raw, out):
        _dq_half(readonly(raw).view(np.uint16), out, table)

    def matvec(raw, x, y):   # x is rounded to the weights' format first, as llama.cpp does
        xr = _xbuf.get(x.shape[0])
        if xr is None:
            xr = _xbuf[x.shape[0]] = np.empty(x.shape[0], np.float32)
        roundtrip(x[None], xr[None])
        _mv_half(readonly(raw).view(np.uint16), xr, y, table)
    return QType(int(type_id), name, 1, 2, dequant_rows, matvec, roundtrip)


def _f32_dequant(raw, out):
    out[...] = raw.view(np.float32)


def _f32_matvec(raw, x, y):
    _mv_f32(readonly(raw).view(np.float32), x, y)


QTYPES = {q.type_id: q for q in [
    QType(int(T.F32), "F32", 1, 4, _f32_dequant, _f32_matvec),
    _half(T.F16, "F16", F16, _to_f16),
    _half(T.BF16, "BF16", BF16, _to_bf16),
]}
