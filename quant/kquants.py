"""The K-quant block formats: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (super-blocks of 256 values).

Block layouts (bytes), as ggml and gguf-py define them (d, dmin are f16):
  Q2_K (84):  scales[16] (low nibble scale, high nibble min) | qs[64] 2-bit | d | dmin
  Q3_K (110): hmask[32] | qs[64] 2-bit | scales[12] (16 six-bit values, minus 32) | d
  Q4_K (144): d | dmin | scales[12] (8 six-bit scales, 8 six-bit mins) | qs[128] 4-bit
  Q5_K (176): d | dmin | scales[12] | qh[32] | qs[128]
  Q6_K (210): ql[128] | qh[64] | scales[16] int8 | d
In Q2_K/Q3_K/Q6_K value 128h + 32s + l (l < 32) is field s of byte l of half h (Q6_K: low
4 bits from ql, nibble s >> 1 of byte 64h + 32(s & 1) + l, high 2 bits from qh) and has
scale (128h + 32s + l) // 16. In Q4_K/Q5_K value 64i + l is the low nibble of qs[32i + l],
value 64i + 32 + l the high one (bit 4 of value 32j + l is bit j of qh[l]); scale j covers
values 32j..32j + 31.

dequant_rows_*: gguf-py's float32 operations in its order ((d*scale)*q - dmin*min), so the
result is bit-exact.

matvec_*: x is quantized once per call to Q8_K as llama.cpp does (quant.act: int8 values
per 256 with a float scale, sums per 16), stored here as int16 so the kernels read it
without widening. Per row and block the kernel sums scale*q*xq in int32, applies minimums
and the offsets (-4 of Q3_K, -32 of Q6_K) through the sums of xq, and adds
xd*(d*sum - dmin*mins) in float32. Measured faster here than float activations (Q4_K,
896x4864, 2 threads: 31 vs 24 GB/s), at the cost of llama.cpp's activation rounding: up to
about 1e-3 of |W|@|x|, typically 1e-4 (see tests). The scratch buffers are shared, so
matvec calls must not run concurrently from several Python threads.

Code generation: numba types int16*int16 and int32*int32 as int64 and LLVM does not always
narrow that back (knowing the operands are small, it drops the truncations and vectorizes
64-bit lanes). The intrinsics below emit the 16/32-bit operations directly; a lane loop then
becomes vpmovzxbw, shifts/ands, vpmullw by the broadcast scale and vpdpwssd with xq. The
sub-blocks of a lane are written out rather than looped, so LLVM vectorizes over lanes (a
loop over sub-blocks inside the lane loop was 5x slower). One row per prange iteration:
four rows sharing x ran out of registers for their 32 broadcast scales and were slower.
"""
from __future__ import annotations

import numpy as np
from gguf_io.types import GGMLQuantizationType as T
from numba import njit, prange

from quant.act import quantize_q8_K, roundtrip_q8_K
from quant.common import F16, QType, readonly
from quant.intrin import _add32, _field, _mul16, _mul32, _or16
from quant.cpu import KIND, SMALL_BATCH
from quant.vnni import q4k_dot, q6k_dot

f32 = np.float32
i16 = np.int16
u32 = np.uint32


@njit(inline="always")
def _p(sc, q, x):
    """sc*q*x in int32. |sc*q| fits int16 for every type (at most 128*63, Q6_K)."""
    return _mul32(_mul16(sc, q), x)


@njit(inline="always")
def _f16(w, o, F16):
    return F16[w[o] | (np.int32(w[o + 1]) << 8)]


# ---------------------------------------------------------------- scales, four per uint32

@njit(inline="always")
def _u32(w, o):
    """Little-endian uint32 at w[o:o+4] (LLVM makes it one load)."""
    return u32(w[o]) | (u32(w[o + 1]) << u32(8)) | (u32(w[o + 2]) << u32(16)) | (u32(w[o + 3]) << u32(24))


@njit(inline="always")
def _byte(u, k):
    return np.int32((u >> u32(8 * k)) & u32(255))


@njit(inline="always")
def _k4_scales(w, o):
    """The 12-byte Q4_K/Q5_K scale field at w[o:] -> (scales 0-3, scales 4-7, mins 0-3,
    mins 4-7), one six-bit value per byte (ggml's get_scale_min_k4, four at a time)."""
    a, b, c = _u32(w, o), _u32(w, o + 4), _u32(w, o + 8)
    lo6, lo4, hi2 = u32(0x3F3F3F3F), u32(0x0F0F0F0F), u32(0x30303030)
    return (a & lo6, (c & lo4) | ((a >> u32(2)) & hi2),
            b & lo6, ((c >> u32(4)) & lo4) | ((b >> u32(2)) & hi2))


@njit(inline="always")
def _q3_scales(w, o):
    """The 12-byte Q3_K scale field at w[o:] -> four uint32 holding scale j + 32 in byte
    j & 3 of word j >> 2 (low 4 bits from bytes 0-7, high 2 bits from bytes 8-11)."""
    a, b, t = _u32(w, o), _u32(w, o + 4), _u32(w, o + 8)
    lo4, lo2 = u32(0x0F0F0F0F), u32(0x03030303)
    return ((a & lo4) | ((t & lo2) << u32(4)), (b & lo4) | (((t >> u32(2)) & lo2) << u32(4)),
            ((a >> u32(4)) & lo4) | (((t >> u32(4)) & lo2) << u32(4)),
            ((b >> u32(4)) & lo4) | (((t >> u32(6)) & lo2) << u32(4)))


@njit(inline="always")
def _dot4(u, v, k):
    """sum_i byte i of u * v[k + i]."""
    return _byte(u, 0) * v[k] + _byte(u, 1) * v[k + 1] + _byte(u, 2) * v[k + 2] + _byte(u, 3) * v[k + 3]


# ---------------------------------------------------------------- dequantization (bit-exact)

@njit(parallel=True, cache=True)
def dequant_rows_q2_K(raw, out, F16):
    for r in prange(raw.shape[0]):
        w = raw[r]
        for b in range(raw.shape[1] // 84):
            o = b * 84
            d, dmin = _f16(w, o + 80, F16), _f16(w, o + 82, F16)
            for j in range(16):
                dl, ml = d * f32(w[o + j] & 15), dmin * f32(w[o + j] >> 4)
                h, s, l0 = j >> 3, (j >> 1) & 3, (j & 1) * 16
                for l in range(16):
                    q = (w[o + 16 + 32 * h + l0 + l] >> (2 * s)) & 3
                    out[r, b * 256 + 16 * j + l] = dl * f32(q) - ml


@njit(parallel=True, cache=True)
def dequant_rows_q3_K(raw, out, F16):
    for r in prange(raw.shape[0]):
        w = raw[r]
        for b in range(raw.shape[1] // 110):
            o = b * 110
            d = _f16(w, o + 108, F16)
            sc = _q3_scales(w, o + 96)
            for j in range(16):
                dl = d * f32(_byte(sc[j >> 2], j & 3) - 32)
                h, s, l0 = j >> 3, (j >> 1) & 3, (j & 1) * 16
                for l in range(16):
                    q = np.int32((w[o + 32 + 32 * h + l0 + l] >> (2 * s)) & 3)
                    m = np.int32((w[o + l0 + l] >> (4 * h + s)) & 1)
                    out[r, b * 256 + 16 * j + l] = dl * f32(q - 4 + 4 * m)   # -4 where the hmask bit is 0


@njit(parallel=True, cache=True)
def dequant_rows_q4_K(raw, out, F16):
    for r in prange(raw.shape[0]):
        w = raw[r]
        for b in range(raw.shape[1] // 144):
            o = b * 144
            d, dmin = _f16(w, o, F16), _f16(w, o + 2, F16)
            sm = _k4_scales(w, o + 4)
            for j in range(8):
                dl, ml = d * f32(_byte(sm[j >> 2], j & 3)), dmin * f32(_byte(sm[2 + (j >> 2)], j & 3))
                q, sh = o + 16 + 32 * (j >> 1), 4 * (j & 1)
                for l in range(32):
                    out[r, b * 256 + 32 * j + l] = dl * f32((w[q + l] >> sh) & 15) - ml


@njit(parallel=True, cache=True)
def dequant_rows_q5_K(raw, out, F16):
    for r in prange(raw.shape[0]):
        w = raw[r]
        for b in range(raw.shape[1] // 176):
            o = b * 176
            d, dmin = _f16(w, o, F16), _f16(w, o + 2, F16)
            sm = _k4_scales(w, o + 4)
            for j in range(8):
                dl, ml = d * f32(_byte(sm[j >> 2], j & 3)), dmin * f32(_byte(sm[2 + (j >> 2)], j & 3))
                q, sh = o + 48 + 32 * (j >> 1), 4 * (j & 1)
                for l in range(32):
                    v = ((w[q + l] >> sh) & 15) | (((w[o + 16 + l] >> j) & 1) << 4)
                    out[r, b * 256 + 32 * j + l] = dl * f32(v) - ml


@njit(parallel=True, cache=True)
def dequant_rows_q6_K(raw, out, F16):
    for r in prange(raw.shape[0]):
        w = raw[r]
        for b in range(raw.shape[1] // 210):
            o = b * 210
            d = _f16(w, o + 208, F16)
            for j in range(16):
                dl = d * f32(np.int8(w[o + 192 + j]))
                h, s, l0 = j >> 3, (j >> 1) & 3, (j & 1) * 16
                for l in range(16):
                    lo = (w[o + 64 * h + 32 * (s & 1) + l0 + l] >> (4 * (s >> 1))) & 15
                    hi = (w[o + 128 + 32 * h + l0 + l] >> (2 * s)) & 3
                    out[r, b * 256 + 16 * j + l] = dl * f32(np.int32(lo | (hi << 4)) - 32)


@njit(inline="always")
def _k4_term(d, dmin, b, s, ma, mb, xd, bs):
    """Q4_K/Q5_K block b: xd * (d * s - dmin * sum_j min_j * bsum_j), s its scaled integer
    dot; the float part every Q4_K/Q5_K kernel shares (so they give the same bits)."""
    mins = _dot4(ma, bs, b * 8) + _dot4(mb, bs, b * 8 + 4)
    return xd[b] * (d * f32(s) - dmin * f32(mins))


@njit(inline="always")
def _k6_term(w, o, d, b, s, xd, bs):
    """Q6_K block b at w[o]: xd * d * (s - 32 * sum_j scale_j * bsum_j), s its dot with q + 32."""
    off = 0
    for j in range(16):
        off += np.int8(w[o + 192 + j]) * bs[b * 16 + j]
    return xd[b] * (d * f32(np.int32(s - 32 * off)))


# ---------------------------------------------------------------- matvec on Q8_K activations
# Lane loops: l runs over 32 values (Q4_K/Q5_K: all 8 sub-blocks of a lane in one
# expression) or over 16 (the 16-scale types: value l and l + 16 of a 32-run differ in scale,
# so each half is its own group of four).

@njit(inline="always")
def _quad(s0, s1, s2, s3, q0, q1, q2, q3, x, c):
    """s0*q0*x[c] + s1*q1*x[c+32] + s2*q2*x[c+64] + s3*q3*x[c+96]."""
    return _add32(_add32(_p(s0, q0, x[c]), _p(s1, q1, x[c + 32])),
                  _add32(_p(s2, q2, x[c + 64]), _p(s3, q3, x[c + 96])))


@njit(inline="always")
def _q2_group(w, o, h, half, l, x, c):
    """Values 128h + 32s + 16half + l (s = 0..3) of the Q2_K block at w[o:]; scale j + 2s."""
    j = 8 * h + half
    q = w[o + 16 + 32 * h + 16 * half + l]
    return _quad(w[o + j] & 15, w[o + j + 2] & 15, w[o + j + 4] & 15, w[o + j + 6] & 15,
                 _field(q, 0, 3, 0), _field(q, 2, 3, 0), _field(q, 4, 3, 0), _field(q, 6, 3, 0),
                 x, c + 128 * h + 16 * half + l)


@njit(inline="always")
def _q3_group(w, o, h, half, l, x, c, s0, s1, s2, s3):
    """As _q2_group for Q3_K, with q + 4 (0..7): the -4 goes through the sums of xq."""
    q = w[o + 32 + 32 * h + 16 * half + l]
    m = w[o + 16 * half + l]
    return _quad(s0, s1, s2, s3,
                 _or16(_field(q, 0, 3, 0), _field(m, 4 * h, 1, 2)),
                 _or16(_field(q, 2, 3, 0), _field(m, 4 * h + 1, 1, 2)),
                 _or16(_field(q, 4, 3, 0), _field(m, 4 * h + 2, 1, 2)),
                 _or16(_field(q, 6, 3, 0), _field(m, 4 * h + 3, 1, 2)), x, c + 128 * h + 16 * half + l)


@njit(inline="always")
def _q6_group(w, o, h, half, l, x, c):
    """As _q2_group for Q6_K, with q + 32 (0..63): the -32 goes through the sums of xq."""
    j = 8 * h + half
    a = o + 64 * h + 16 * half + l
    qa, qb, qh = w[a], w[a + 32], w[o + 128 + 32 * h + 16 * half + l]
    return _quad(np.int8(w[o + 192 + j]), np.int8(w[o + 194 + j]),
                 np.int8(w[o + 196 + j]), np.int8(w[o + 198 + j]),
                 _or16(_field(qa, 0, 15, 0), _field(qh, 0, 3, 4)), _or16(_field(qb, 0, 15, 0), _field(qh, 2, 3, 4)),
                 _or16(_field(qa, 4, 15, 0), _field(qh, 4, 3, 4)), _or16(_field(qb, 4, 15, 0), _field(qh, 6, 3, 4)),
                 x, c + 128 * h + 16 * half + l)


@njit(inline="always")
def _nib2(s0, s1, q, h, k, x, c):
    """Low nibble of q (bit k of h as bit 4) times x[c] with scale s0; high nibble (bit k+1
    of h) times x[c + 32] with scale s1."""
    return _add32(_p(s0, _or16(_field(q, 0, 15, 0), _field(h, k, 1, 4)), x[c]),
                  _p(s1, _or16(_field(q, 4, 15, 0), _field(h, k + 1, 1, 4)), x[c + 32]))


@njit(inline="always")
def _k4_lane(w, q, h, x, c, sa, sb):
    """Lane l of the 8 sub-blocks of a Q4_K (h = 0) or Q5_K (h = qh[l]) block: q = qs + l,
    c = block's x + l, scales in the bytes of sa (0-3) and sb (4-7)."""
    return _add32(
        _add32(_nib2(_byte(sa, 0), _byte(sa, 1), w[q], h, 0, x, c),
               _nib2(_byte(sa, 2), _byte(sa, 3), w[q + 32], h, 2, x, c + 64)),
        _add32(_nib2(_byte(sb, 0), _byte(sb, 1), w[q + 64], h, 4, x, c + 128),
               _nib2(_byte(sb, 2), _byte(sb, 3), w[q + 96], h, 6, x, c + 192)))


@njit(parallel=True, fastmath=True, cache=True)
def matvec_q2_K(raw, xq, xd, bs, y, F16):
    """bs: per-16 sums of xq."""
    for r in prange(raw.shape[0]):
        w = raw[r]
        acc = f32(0)
        for b in range(raw.shape[1] // 84):
            o, c = b * 84, b * 256
            s = np.int32(0)
            for l in range(16):
                s = _add32(s, _add32(_add32(_q2_group(w, o, 0, 0, l, xq, c), _q2_group(w, o, 0, 1, l, xq, c)),
                                     _add32(_q2_group(w, o, 1, 0, l, xq, c), _q2_group(w, o, 1, 1, l, xq, c))))
            mins = 0
            for j in range(16):
                mins += (w[o + j] >> 4) * bs[b * 16 + j]
            acc += xd[b] * (_f16(w, o + 80, F16) * f32(s) - _f16(w, o + 82, F16) * f32(mins))
        y[r] = acc


@njit(parallel=True, fastmath=True, cache=True)
def matvec_q3_K(raw, xq, xd, bs, y, F16):
    """bs: per-16 sums of xq."""
    for r in prange(raw.shape[0]):
        w = raw[r]
        acc = f32(0)
        for b in range(raw.shape[1] // 110):
            o, c = b * 110, b * 256
            u0, u1, u2, u3 = _q3_scales(w, o + 96)
            sc = (i16(_byte(u0, 0) - 32), i16(_byte(u0, 1) - 32), i16(_byte(u0, 2) - 32), i16(_byte(u0, 3) - 32),
                  i16(_byte(u1, 0) - 32), i16(_byte(u1, 1) - 32), i16(_byte(u1, 2) - 32), i16(_byte(u1, 3) - 32),
                  i16(_byte(u2, 0) - 32), i16(_byte(u2, 1) - 32), i16(_byte(u2, 2) - 32), i16(_byte(u2, 3) - 32),
                  i16(_byte(u3, 0) - 32), i16(_byte(u3, 1) - 32), i16(_byte(u3, 2) - 32), i16(_byte(u3, 3) - 32))
            s = np.int32(0)
            for l in range(16):
                s = _add32(s, _add32(
                    _add32(_q3_group(w, o, 0, 0, l, xq, c, sc[0], sc[2], sc[4], sc[6]),
                           _q3_group(w, o, 0, 1, l, xq, c, sc[1], sc[3], sc[5], sc[7])),
                    _add32(_q3_group(w, o, 1, 0, l, xq, c, sc[8], sc[10], sc[12], sc[14]),
                           _q3_group(w, o, 1, 1, l, xq, c, sc[9], sc[11], sc[13], sc[15]))))
            k = b * 16
            xsum = 0
            for j in range(16):
                xsum += bs[k + j]
            # sum_j (scale_j + 32) * bs_j - 32 * sum(xq) = sum_j scale_j * bs_j
            off = _dot4(u0, bs, k) + _dot4(u1, bs, k + 4) + _dot4(u2, bs, k + 8) + _dot4(u3, bs, k + 12) - 32 * xsum
            acc += xd[b] * (_f16(w, o + 108, F16) * f32(np.int32(s - 4 * off)))
        y[r] = acc


@njit(parallel=True, fastmath=True, cache=True)
def matvec_q4_K(raw, xq, xd, bs, y, F16):
    """bs: per-32 sums of xq."""
    for r in prange(raw.shape[0]):
        w = raw[r]
        acc = f32(0)
        for b in range(raw.shape[1] // 144):
            o, c = b * 144, b * 256
            sa, sb, ma, mb = _k4_scales(w, o + 4)
            s = np.int32(0)
            for l in range(32):
                s = _add32(s, _k4_lane(w, o + 16 + l, 0, xq, c + l, sa, sb))
            acc += _k4_term(_f16(w, o, F16), _f16(w, o + 2, F16), b, s, ma, mb, xd, bs)
        y[r] = acc


@njit(parallel=True, fastmath=True, cache=True)
def matvec_q5_K(raw, xq, xd, bs, y, F16):
    """bs: per-32 sums of xq."""
    for r in prange(raw.shape[0]):
        w = raw[r]
        acc = f32(0)
        for b in range(raw.shape[1] // 176):
            o, c = b * 176, b * 256
            sa, sb, ma, mb = _k4_scales(w, o + 4)
            s = np.int32(0)
            for l in range(32):
                s = _add32(s, _k4_lane(w, o + 48 + l, w[o + 16 + l], xq, c + l, sa, sb))
            acc += _k4_term(_f16(w, o, F16), _f16(w, o + 2, F16), b, s, ma, mb, xd, bs)
        y[r] = acc


@njit(parallel=True, fastmath=True, cache=True)
def matvec_q6_K(raw, xq, xd, bs, y, F16):
    """bs: per-16 sums of xq."""
    for r in prange(raw.shape[0]):
        w = raw[r]
        acc = f32(0)
        for b in range(raw.shape[1] // 210):
            o, c = b * 210, b * 256
            s = np.int32(0)
            for l in range(16):
                s = _add32(s, _add32(_add32(_q6_group(w, o, 0, 0, l, xq, c), _q6_group(w, o, 0, 1, l, xq, c)),
                                     _add32(_q6_group(w, o, 1, 0, l, xq, c), _q6_group(w, o, 1, 1, l, xq, c))))
            acc += _k6_term(w, o, _f16(w, o + 208, F16), b, s, xd, bs)
        y[r] = acc


# ---------------------------------------------------------------- the same on AVX512-VNNI
# xq as int8; one vpdpbusd per 64 values (quant.vnni), the float part unchanged, so the
# results are the portable kernels' bits. Measured (2 threads, FFN shapes): Q4_K 32 -> 45,
# Q6_K 38 -> 46 GB/s.

@njit(parallel=True, fastmath=True, cache=True)
def matvec_q4_K_vnni(raw, xq, xd, bs, y, F16):
    for r in prange(raw.shape[0]):
        w = raw[r]
        acc = f32(0)
        for b in range(raw.shape[1] // 144):
            o = b * 144
            sa, sb, ma, mb = _k4_scales(w, o + 4)
            s = q4k_dot(w, o + 16, xq, b * 256, sa, sb)
            acc += _k4_term(_f16(w, o, F16), _f16(w, o + 2, F16), b, s, ma, mb, xd, bs)
        y[r] = acc


@njit(parallel=True, fastmath=True, cache=True)
def matvec_q6_K_vnni(raw, xq, xd, bs, y, F16):
    for r in prange(raw.shape[0]):
        w = raw[r]
        acc = f32(0)
        for b in range(raw.shape[1] // 210):
            o = b * 210
            s = q6k_dot(w, o, xq, b * 256)
            acc += _k6_term(w, o, _f16(w, o + 208, F16), b, s, xd, bs)
        y[r] = acc


@njit(parallel=True, fastmath=True, cache=True)
def matrows_q4_K_vnni(raw, xq, xd, bs, y, F16):
    """y (m, rows): m activation vectors xq (m, n) at once, each exactly as matvec_q4_K_vnni
    computes it alone (the float sum per row runs in y, in the same order), each block read
    once for all. Slower than matvec_q4_K_vnni for m = 1 (13%), so decode keeps that one;
    each further vector costs about half of the first (measured, 8960 x 1536)."""
    for r in prange(raw.shape[0]):
        w = raw[r]
        for c in range(xq.shape[0]):
            y[c, r] = 0
        for b in range(raw.shape[1] // 144):
            o = b * 144
            sa, sb, ma, mb = _k4_scales(w, o + 4)
            d, dmin = _f16(w, o, F16), _f16(w, o + 2, F16)
            for c in range(xq.shape[0]):
                s = q4k_dot(w, o + 16, xq[c], b * 256, sa, sb)
                y[c, r] += _k4_term(d, dmin, b, s, ma, mb, xd[c], bs[c])


@njit(parallel=True, fastmath=True, cache=True)
def matrows_q6_K_vnni(raw, xq, xd, bs, y, F16):
    """As matrows_q4_K_vnni."""
    for r in prange(raw.shape[0]):
        w = raw[r]
        for c in range(xq.shape[0]):
            y[c, r] = 0
        for b in range(raw.shape[1] // 210):
            o = b * 210
            d = _f16(w, o + 208, F16)
            for c in range(xq.shape[0]):
                s = q6k_dot(w, o, xq[c], b * 256)
                y[c, r] += _k6_term(w, o, d, b, s, xd[c], bs[c])


# ---------------------------------------------------------------- activations, wrappers, registry

@njit(cache=True)
def quantize_x(x, xq, xd, bs16, bs32):
    """x -> Q8_K (quant.act) with xq int16, plus per-32 sums for Q4_K/Q5_K."""
    quantize_q8_K(x, xq, xd, bs16)
    for i in range(bs32.shape[0]):
        bs32[i] = bs16[2 * i] + bs16[2 * i + 1]


_xbuf: dict[tuple, tuple] = {}


def _x_scratch(n: int, dtype=np.int16, rows: int = 0):
    """Quantized-activation buffers for n values (rows > 0: that many vectors), allocated once
    per shape and reused."""
    key = (n, dtype, rows)
    buf = _xbuf.get(key)
    if buf is None:
        lead = (rows,) if rows else ()
        buf = _xbuf[key] = (np.empty(lead + (n,), dtype), np.empty(lead + (n // 256,), np.float32),
                            np.empty(lead + (n // 16,), np.int32), np.empty(lead + (n // 32,), np.int32))
    return buf


@njit(cache=True)
def quantize_rows(X, xq, xd, bs16, bs32):
    for i in range(X.shape[0]):
        quantize_x(X[i], xq[i], xd[i], bs16[i], bs32[i])


ROWS = SMALL_BATCH    # the most activation vectors one matvec_rows call takes (quant.cpu)


def _ktype(type_id, name, type_size, dq_kernel, mv_kernel, sums32, vnni=None):
    """vnni: (matvec, matrows) kernels for AVX512-VNNI CPUs, or None."""
    if KIND.vnni and vnni is not None:
        mv_kernel, xtype = vnni[0], np.int8
    else:
        xtype = np.int16

    def dequant_rows(raw, out):
        dq_kernel(readonly(raw), out, F16)

    def check(raw, n):
        if n != raw.shape[1] // type_size * 256:
            raise ValueError(f"{name} matvec: {raw.shape[1]} bytes per row do not match {n} inputs")

    def matvec_rows(raw, X, Y):
        """Y (m, rows) for X (m, n), m <= ROWS: each row the bits it gets alone."""
        check(raw, X.shape[1])
        xq, xd, bs16, bs32 = (b[:X.shape[0]] for b in _x_scratch(X.shape[1], np.int8, ROWS))
        quantize_rows(X, xq, xd, bs16, bs32)
        vnni[1](readonly(raw), xq, xd, bs32 if sums32 else bs16, Y, F16)

    def matvec(raw, x, y):
        check(raw, x.shape[0])
        xq, xd, bs16, bs32 = _x_scratch(x.shape[0], xtype)
        quantize_x(x, xq, xd, bs16, bs32)
        mv_kernel(readonly(raw), xq, xd, bs32 if sums32 else bs16, y, F16)

    dequant_rows.__qualname__ = dequant_rows.__name__ = f"dequant_rows_{name}"
    matvec.__qualname__ = matvec.__name__ = f"matvec_{name}"
    return QType(int(type_id), name, 256, type_size, dequant_rows, matvec, roundtrip_q8_K,
                 matvec_rows if KIND.vnni and vnni is not None else None)


QTYPES = {q.type_id: q for q in [
    _ktype(T.Q2_K, "Q2_K", 84, dequant_rows_q2_K, matvec_q2_K, False),
    _ktype(T.Q3_K, "Q3_K", 110, dequant_rows_q3_K, matvec_q3_K, False),
    _ktype(T.Q4_K, "Q4_K", 144, dequant_rows_q4_K, matvec_q4_K, True, (matvec_q4_K_vnni, matrows_q4_K_vnni)),
    _ktype(T.Q5_K, "Q5_K", 176, dequant_rows_q5_K, matvec_q5_K, True),
    _ktype(T.Q6_K, "Q6_K", 210, dequant_rows_q6_K, matvec_q6_K, False, (matvec_q6_K_vnni, matrows_q6_K_vnni)),
]}
