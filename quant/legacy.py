"""The 32-element block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

Layouts (bytes per block): Q4_0 [d f16][16 nibble pairs]; Q4_1 [d][m][16]; Q5_0 [d][qh u32][16];
Q5_1 [d][m][qh][16]; Q8_0 [d][32 int8]. Nibble j of a block holds element j (low) and j+16 (high);
bit j of qh is the fifth bit of element j.

matvec quantizes x once per call to 8-bit blocks of 32 exactly as llama.cpp does (quant.act)
and multiplies in integers. Q4/Q5 sum each block in int32 and apply d*dx to the sum; offsets
(-8, -16) go through the integer block sum of the quantized x, minimums through Q8_1's s, as in
llama.cpp's dot products. Q8_0 sums pairs of products per lane in int16 and scales the lanes in
float, as llama.cpp's AVX2 kernel does. See the comments above the kernels for how the code was
shaped for LLVM, and BENCHMARKS.md for the rates.
"""
from __future__ import annotations

import numpy as np
from gguf_io.types import GGMLQuantizationType as T
from numba import njit, prange, types

from quant.common import F16, QType, readonly
from quant.intrin import _add32, _field, _int_op, _mul16, _mul32, _or16, f2h
from quant.act import quantize_q8_0, roundtrip_q8_0, scratch

I32 = np.int32
U = np.uint64
_add16 = _int_op(types.int16, "add")


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
# Code generation (besides the int16/int32 intrinsics of quant.intrin):
# - numba leaves LLVM's SLP vectorizer off, so a lane loop with a literal count of 16 or 32
#   is fully unrolled into scalar code. The lane count comes in as an argument instead (n16,
#   always 16) and the loops run over range(n16 & 16): LLVM vectorizes them and, knowing the
#   count is a multiple of 16 and at most 16, emits one vector pass and no remainder loop.
#   The & must happen inside the prange body: values computed before it reach the parallel
#   loop as opaque arguments, and the loop got 2-3x slower.
# - indices are uint64: numba wraps negative int64 indices with a select, which makes loads
#   look non-contiguous (vpinsrb gathers). uint64 mixed with int64 is float64 in numba, so
#   every index term is uint64.
# - the f16 scales are read through a uint16 view of the rows (all block sizes are even).
# Reading the asm (njit(fastmath=True)(kernel.py_func).inspect_asm()): the hot loop is the one
# with vpmaddwd/vpdpwssd (Q8_0: vpmullw); the copy of the block loop for n == 0, which never
# runs, is vectorized with gathers (vpinsrw) and can be ignored.

@njit(inline="always")
def _nib_dot(w, q, xq, x, l):
    """Lane l of a 4-bit block: low nibble of byte l times x[l], high nibble times x[l+16]."""
    return _add32(_mul32(_field(w[q + l], 0, 15, 0), xq[x + l]),
                  _mul32(_field(w[q + l], 4, 15, 0), xq[x + l + U(16)]))


@njit(inline="always")
def _nib5_dot(w, q, h0, h1, xq, x, l):
    """As _nib_dot with bit l of h0 (low half) and of h1 (high half) as the fifth bits."""
    lo = _or16(_field(w[q + l], 0, 15, 0), _field(h0, np.int16(l), 1, 4))
    hi = _or16(_field(w[q + l], 4, 15, 0), _field(h1, np.int16(l), 1, 4))
    return _add32(_mul32(lo, xq[x + l]), _mul32(hi, xq[x + l + U(16)]))


# Q4/Q5: per block, an int32 sum over the 16 lanes (vpmaddwd + vpdpwssd and a horizontal
# add), then the float scales. The minimum term has its own accumulator so the float add
# chain per block stays one fma long.

@njit(parallel=True, fastmath=True, cache=True)
def _mv_4bit(raw, xq, xd, xs, isum, y, F16, bs, has_min, n16):
    h16 = raw.view(np.uint16)
    bs = U(bs)
    hs = bs // U(2)
    nb = U(raw.shape[1]) // bs
    for r in prange(raw.shape[0]):
        n = U(n16) & U(16)
        w, h = raw[r], h16[r]
        acc, accm = np.float32(0), np.float32(0)
        for b in range(nb):
            q, x = b * bs + bs - U(16), b * U(32)
            s = I32(0)
            for l in range(n):
                s = _add32(s, _nib_dot(w, q, xq, x, l))
            if has_min:   # x_block . (d*q + m) = d*dx*s + m*s_x (Q8_1's s)
                acc += F16[h[b * hs]] * xd[b] * np.float32(s)
                accm += F16[h[b * hs + U(1)]] * xs[b]
            else:         # x_block . d*(q-8) = d*dx*(s - 8*sum(xq))
                acc += F16[h[b * hs]] * xd[b] * np.float32(s - 8 * isum[b])
        y[r] = acc + accm


@njit(parallel=True, fastmath=True, cache=True)
def _mv_5bit(raw, xq, xd, xs, isum, y, F16, bs, has_min, n16):
    h16 = raw.view(np.uint16)
    bs = U(bs)
    hs = bs // U(2)
    nb = U(raw.shape[1]) // bs
    for r in prange(raw.shape[0]):
        n = U(n16) & U(16)
        w, h = raw[r], h16[r]
        acc, accm = np.float32(0), np.float32(0)
        for b in range(nb):
            q, x = b * bs + bs - U(16), b * U(32)
            g = (q - U(4)) // U(2)      # qh, as two uint16
            s = I32(0)
            for l in range(n):
                s = _add32(s, _nib5_dot(w, q, h[g], h[g + U(1)], xq, x, l))
            if has_min:
                acc += F16[h[b * hs]] * xd[b] * np.float32(s)
                accm += F16[h[b * hs + U(1)]] * xs[b]
            else:
                acc += F16[h[b * hs]] * xd[b] * np.float32(s - 16 * isum[b])
        y[r] = acc + accm


@njit(inline="always")
def _q8_lane(v, o, xq, x, l):
    """w[l]*x[l] + w[l+16]*x[l+16] of a Q8_0 block as a float; exact, since it fits int16
    (at most 2*128*127 = 32512)."""
    return np.float32(_add16(_mul16(np.int16(v[o + l]), xq[x + l]),
                             _mul16(np.int16(v[o + l + U(16)]), xq[x + l + U(16)])))


@njit(parallel=True, fastmath=True, cache=True)
def _mv_q8_0(raw, xq, xd, y, F16, n16):
    """Q8_0 spends little on unpacking, so the horizontal sums per block dominated: here each
    lane is scaled in float and four blocks share one vector sum."""
    wi, h16 = raw.view(np.int8), raw.view(np.uint16)   # int8: quants sign-extend as they load
    nb = U(raw.shape[1]) // U(34)
    for r in prange(raw.shape[0]):
        n = U(n16) & U(16)
        v, h = wi[r], h16[r]
        acc = np.float32(0)
        b = U(0)
        while b + U(4) <= nb:
            o, x = b * U(34) + U(2), b * U(32)
            c0, c1 = F16[h[b * U(17)]] * xd[b], F16[h[b * U(17) + U(17)]] * xd[b + U(1)]
            c2, c3 = F16[h[b * U(17) + U(34)]] * xd[b + U(2)], F16[h[b * U(17) + U(51)]] * xd[b + U(3)]
            t = np.float32(0)
            for l in range(n):
                t += ((_q8_lane(v, o, xq, x, l) * c0 + _q8_lane(v, o + U(34), xq, x + U(32), l) * c1)
                      + (_q8_lane(v, o + U(68), xq, x + U(64), l) * c2
                         + _q8_lane(v, o + U(102), xq, x + U(96), l) * c3))
            acc += t
            b += U(4)
        while b < nb:
            o, x = b * U(34) + U(2), b * U(32)
            c0 = F16[h[b * U(17)]] * xd[b]
            t = np.float32(0)
            for l in range(n):
                t += _q8_lane(v, o, xq, x, l) * c0
            acc += t
            b += U(1)
        y[r] = acc


# ---------------------------------------------------------------- quantization to Q4_0

@njit(inline="always")
def q4_0_row(x, out):
    """x to block_q4_0 bytes as ggml's quantize_row_q4_0_ref: d = (value of largest
    magnitude) / -8, codes min(15, trunc(x / d + 8.5)), low nibbles the first 16."""
    for b in range(x.shape[0] // 32):
        amax, mx = np.float32(0), np.float32(0)
        for j in range(32):
            a = abs(x[b * 32 + j])
            if amax < a:
                amax, mx = a, x[b * 32 + j]
        d = mx / np.float32(-8)
        inv = np.float32(1) / d if d != 0 else np.float32(0)
        h = f2h(d)
        out[b * 18], out[b * 18 + 1] = np.uint8(h & 0xFF), np.uint8(h >> 8)
        for j in range(16):
            lo = min(15, I32(np.int8(I32(x[b * 32 + j] * inv + np.float32(8.5)))))
            hi = min(15, I32(np.int8(I32(x[b * 32 + 16 + j] * inv + np.float32(8.5)))))
            out[b * 18 + 2 + j] = np.uint8(lo | (hi << 4))


@njit(parallel=True, cache=True)
def q4_0_rows(x, out):
    for r in prange(x.shape[0]):
        q4_0_row(x[r], out[r])


# ---------------------------------------------------------------- wrappers and registry

def _make(type_id, name, bs, dq, mv):
    return QType(int(type_id), name, 32, bs, dq, mv, roundtrip_q8_0)


def _legacy(type_id, name, bs, dq_kernel, mv_kernel, has_min):
    def dequant_rows(raw, out):
        dq_kernel(readonly(raw), out, F16, bs, has_min)

    def matvec(raw, x, y):
        xq, xd, xs, isum = scratch("q8_0", x.shape[0])
        quantize_q8_0(x, xq, xd, xs, isum)
        mv_kernel(readonly(raw), xq, xd, xs, isum, y, F16, bs, has_min, 16)
    return _make(type_id, name, bs, dequant_rows, matvec)


def _q8_dequant(raw, out):
    _dq_q8_0(readonly(raw), out, F16)


def _q8_matvec(raw, x, y):
    xq, xd, xs, isum = scratch("q8_0", x.shape[0])
    quantize_q8_0(x, xq, xd, xs, isum)
    _mv_q8_0(readonly(raw), xq, xd, y, F16, 16)


QTYPES = {q.type_id: q for q in [
    _legacy(T.Q4_0, "Q4_0", 18, _dq_4bit, _mv_4bit, False),
    _legacy(T.Q4_1, "Q4_1", 20, _dq_4bit, _mv_4bit, True),
    _legacy(T.Q5_0, "Q5_0", 22, _dq_5bit, _mv_5bit, False),
    _legacy(T.Q5_1, "Q5_1", 24, _dq_5bit, _mv_5bit, True),
    _make(T.Q8_0, "Q8_0", 34, _q8_dequant, _q8_matvec),
]}
