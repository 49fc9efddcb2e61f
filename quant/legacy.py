"""The 32-element block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

Layouts (bytes per block): Q4_0 [d f16][16 nibble pairs]; Q4_1 [d][m][16]; Q5_0 [d][qh u32][16];
Q5_1 [d][m][qh][16]; Q8_0 [d][32 int8]. Nibble j of a block holds element j (low) and j+16 (high);
bit j of qh is the fifth bit of element j.

matvec quantizes x once per call to 8-bit blocks of 32 exactly as llama.cpp does (quant.act)
and works in integers: the products and partial sums are cast to int32 so LLVM emits vpmaddwd
rather than widening to 64-bit lanes. Offsets (-8, -16) go through the integer block sum of the
quantized x, minimums through Q8_1's s, as in llama.cpp's dot products.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit, prange

from quant.common import F16, QType, readonly
from quant.intrin import _add32, _field, _mul32, _or16
from quant.act import quantize_q8_0, roundtrip_q8_0, scratch

I32 = np.int32


@njit(inline="always")
def _f16(row, o, F16):
    return F16[row[o] | (np.uint16(row[o + 1]) << 8)]


@njit(inline="always")
def _u32(row, o):
    return (np.uint32(row[o]) | (np.uint32(row[o + 1]) << 8) | (np.uint32(row[o + 2]) << 16)
            | (np.uint32(row[o + 3]) << 24))


# ---------------------------------------------------------------- dequantization (bit-exact)

@njit(parallel=True, cache=True)
def _dq_4bit(raw, out, F16, bs, has_min):
    nb = raw.shape[1] // bs
    for r in prange(raw.shape[0]):
        row = raw[r]
        for b in range(nb):
            o = b * bs
            d = _f16(row, o, F16)
            m = _f16(row, o + 2, F16) if has_min else np.float32(0)
            q = o + bs - 16
            for j in range(16):
                lo, hi = np.float32(row[q + j] & 15), np.float32(row[q + j] >> 4)
                if has_min:
                    out[r, b * 32 + j] = d * lo + m
                    out[r, b * 32 + j + 16] = d * hi + m
                else:
                    out[r, b * 32 + j] = d * (lo - np.float32(8))
                    out[r, b * 32 + j + 16] = d * (hi - np.float32(8))


@njit(parallel=True, cache=True)
def _dq_5bit(raw, out, F16, bs, has_min):
    nb = raw.shape[1] // bs
    for r in prange(raw.shape[0]):
        row = raw[r]
        for b in range(nb):
            o = b * bs
            d = _f16(row, o, F16)
            m = _f16(row, o + 2, F16) if has_min else np.float32(0)
            qh = _u32(row, o + bs - 20)
            q = o + bs - 16
            for j in range(16):
                lo = (row[q + j] & 15) | (((qh >> j) & 1) << 4)
                hi = (row[q + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)
                if has_min:
                    out[r, b * 32 + j] = d * np.float32(lo) + m
                    out[r, b * 32 + j + 16] = d * np.float32(hi) + m
                else:
                    out[r, b * 32 + j] = d * np.float32(np.int32(lo) - 16)
                    out[r, b * 32 + j + 16] = d * np.float32(np.int32(hi) - 16)


@njit(parallel=True, cache=True)
def _dq_q8_0(raw, out, F16):
    nb = raw.shape[1] // 34
    for r in prange(raw.shape[0]):
        row = raw[r]
        for b in range(nb):
            d = _f16(row, b * 34, F16)
            for j in range(32):
                out[r, b * 32 + j] = np.float32(np.int8(row[b * 34 + 2 + j])) * d


# ---------------------------------------------------------------- matvec on 8-bit activations
# Lanes of a block are written as loops over l with 16/32-bit intrinsics (quant.intrin), so
# LLVM vectorizes them; xq is int16 so it is read without widening.

@njit(parallel=True, fastmath=True, cache=True)
def _mv_4bit(raw, xq, xd, xs, isum, y, F16, bs, has_min):
    nb = raw.shape[1] // bs
    for r in prange(raw.shape[0]):
        w = raw[r]
        acc = np.float32(0)
        for b in range(nb):
            o = b * bs
            q, x = o + bs - 16, b * 32
            s = I32(0)
            for l in range(16):
                s = _add32(s, _add32(_mul32(_field(w[q + l], 0, 15, 0), xq[x + l]),
                                     _mul32(_field(w[q + l], 4, 15, 0), xq[x + l + 16])))
            d = _f16(w, o, F16)
            if has_min:   # x_block . (d*q + m) = d*dx*s + m*s_x (Q8_1's s)
                acc += d * xd[b] * np.float32(s) + _f16(w, o + 2, F16) * xs[b]
            else:         # x_block . d*(q-8) = d*dx*(s - 8*sum(xq))
                acc += d * xd[b] * np.float32(s - 8 * isum[b])
        y[r] = acc


@njit(parallel=True, fastmath=True, cache=True)
def _mv_5bit(raw, xq, xd, xs, isum, y, F16, bs, has_min):
    nb = raw.shape[1] // bs
    for r in prange(raw.shape[0]):
        w = raw[r]
        acc = np.float32(0)
        for b in range(nb):
            o = b * bs
            qh = _u32(w, o + bs - 20)
            q, x = o + bs - 16, b * 32
            s = I32(0)
            for l in range(16):
                lo = _or16(_field(w[q + l], 0, 15, 0), _field(np.int16(qh >> np.uint32(l)), 0, 1, 4))
                hi = _or16(_field(w[q + l], 4, 15, 0), _field(np.int16(qh >> np.uint32(l + 16)), 0, 1, 4))
                s = _add32(s, _add32(_mul32(lo, xq[x + l]), _mul32(hi, xq[x + l + 16])))
            d = _f16(w, o, F16)
            if has_min:
                acc += d * xd[b] * np.float32(s) + _f16(w, o + 2, F16) * xs[b]
            else:
                acc += d * xd[b] * np.float32(s - 16 * isum[b])
        y[r] = acc


@njit(parallel=True, fastmath=True, cache=True)
def _mv_q8_0(raw, wi, xq, xd, y, F16):
    """wi: the same bytes as int8, so quants sign-extend as they load."""
    nb = raw.shape[1] // 34
    for r in prange(raw.shape[0]):
        w, v = raw[r], wi[r]
        acc = np.float32(0)
        for b in range(nb):
            o, x = b * 34 + 2, b * 32
            s = I32(0)
            for l in range(32):
                s = _add32(s, _mul32(v[o + l], xq[x + l]))
            acc += _f16(w, b * 34, F16) * xd[b] * np.float32(s)
        y[r] = acc


# ---------------------------------------------------------------- wrappers and registry

def _make(type_id, name, bs, dq, mv):
    return QType(int(type_id), name, 32, bs, dq, mv, roundtrip_q8_0)


def _legacy(type_id, name, bs, dq_kernel, mv_kernel, has_min):
    def dequant_rows(raw, out):
        dq_kernel(readonly(raw), out, F16, bs, has_min)

    def matvec(raw, x, y):
        xq, xd, xs, isum = scratch("q8_0", x.shape[0])
        quantize_q8_0(x, xq, xd, xs, isum)
        mv_kernel(readonly(raw), xq, xd, xs, isum, y, F16, bs, has_min)
    return _make(type_id, name, bs, dequant_rows, matvec)


def _q8_dequant(raw, out):
    _dq_q8_0(readonly(raw), out, F16)


def _q8_matvec(raw, x, y):
    xq, xd, xs, isum = scratch("q8_0", x.shape[0])
    quantize_q8_0(x, xq, xd, xs, isum)
    raw = readonly(raw)
    _mv_q8_0(raw, raw.view(np.int8), xq, xd, y, F16)


QTYPES = {q.type_id: q for q in [
    _legacy(T.Q4_0, "Q4_0", 18, _dq_4bit, _mv_4bit, False),
    _legacy(T.Q4_1, "Q4_1", 20, _dq_4bit, _mv_4bit, True),
    _legacy(T.Q5_0, "Q5_0", 22, _dq_5bit, _mv_5bit, False),
    _legacy(T.Q5_1, "Q5_1", 24, _dq_5bit, _mv_5bit, True),
    _make(T.Q8_0, "Q8_0", 34, _q8_dequant, _q8_matvec),
]}
