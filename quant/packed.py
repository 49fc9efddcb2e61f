"""Q4_0, Q5_0 and Q8_0 weights repacked at load for AVX512-VNNI decode.

In the file each row is a run of 32-value blocks, so a kernel that walks rows must unpack and
scale every 32 values on their own (27-30 GB/s here, compute-bound). Repacked, 16 rows share
each block's bytes the way quant.gemm8's panels do: byte 4i + j of a 64-byte chunk belongs
to row i, so one vpdpbusd with 4 broadcast activation bytes advances 16 rows, and the 16
scales of a block are one vector. Measured, Q4_0: 79-91 GB/s in L3, 43 from DRAM (the read
bandwidth is 48), against 23-26 GB/s of the row kernel; the result is the row kernel's bits.

Per group of 16 rows and block b (the same number of bytes as the file's 16 blocks):
  Q4_0 (288): 4 chunks of nibble bytes: chunk c byte 4i+j = row i's byte 4c+j, whose low
              nibble is value 4c+j and high nibble value 16+4c+j; then 16 f16 d.
  Q5_0 (352): the same 4 chunks; then per chunk c two 64-bit planes of fifth bits, bit 4i+j
              = bit 4c+j (low) and bit 16+4c+j (high) of row i's qh; then 16 f16 d.
  Q8_0 (544): 8 chunks, chunk c byte 4i+j = row i's value 4c+j + 128 (unsigned); 16 f16 d.
The unsigned values carry an offset (8, 16, 128) that comes off through the block's sum of
activations: sum (u - off) x = sum u x - off * sum x.

A copy: the file's pages of a repacked tensor are released (GGUFFile.release), so resident
memory stays the size of the weights. NUMBAT_REPACK=0 keeps the file's layout.
"""
from __future__ import annotations

import os

import numpy as np
from gguf import GGMLQuantizationType as T
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from quant.act import quantize_q8_0
from quant.gemm8 import I8, I32, F32, V64B, V16I, V16F, _ptr, _splat
from quant.vnni import AVAILABLE

I1 = ir.IntType(1)
# kind: (file block bytes, group-block bytes, offset of the unsigned values)
Q4_0, Q5_0, Q8_0 = 0, 1, 2
LAYOUT = {Q4_0: (18, 288, 8), Q5_0: (22, 352, 16), Q8_0: (34, 544, 128)}
KINDS = {T.Q4_0: Q4_0, T.Q5_0: Q5_0, T.Q8_0: Q8_0}
GB = np.array([LAYOUT[k][1] for k in range(3)], np.int64)


class Packed:
    """A repacked (rows, cols) weight: data (rows // 16, blocks * group-block bytes)."""

    def __init__(self, type_id: int, data: np.ndarray, rows: int, cols: int):
        self.type_id, self.data, self.rows, self.cols = int(type_id), data, rows, cols
        self.kind = KINDS[type_id]
        self.shape = (rows, cols)       # what callers check of a weight


def enabled() -> bool:
    return AVAILABLE and os.environ.get("NUMBAT_REPACK", "1") != "0"


def supports(type_id: int, rows: int) -> bool:
    return enabled() and type_id in KINDS and rows % 16 == 0


@njit(parallel=True, cache=True)
def _repack(raw, kind, out):
    """In 16-bit words (every block size is even): row i's word h of chunk c of block b goes
    to word 32c + 2i + h of the group-block (Q4_0/Q5_0: h < 2; Q8_0: h < 2 per 4 bytes)."""
    bs = 17 if kind == Q8_0 else 11 if kind == Q5_0 else 9         # words
    gb = 272 if kind == Q8_0 else 176 if kind == Q5_0 else 144
    q0 = 3 if kind == Q5_0 else 1
    nb = raw.shape[1] // (2 * bs)
    r16, o16 = raw.view(np.uint16), out.view(np.uint16)
    for g in prange(raw.shape[0] // 16):
        o = o16[g]
        for i in range(16):
            w = r16[16 * g + i]
            for b in range(nb):
                wb, ob = b * bs, b * gb
                o[ob + gb - 16 + i] = w[wb]                                   # d
                if kind == Q8_0:
                    for c in range(8):
                        o[ob + 32 * c + 2 * i] = w[wb + 1 + 2 * c] ^ 0x8080
                        o[ob + 32 * c + 2 * i + 1] = w[wb + 2 + 2 * c] ^ 0x8080
                else:
                    for c in range(4):
                        o[ob + 32 * c + 2 * i] = w[wb + q0 + 2 * c]
                        o[ob + 32 * c + 2 * i + 1] = w[wb + q0 + 2 * c + 1]
                if kind == Q5_0:     # nibble 4c+h*16.. of qh -> bits 4i.. of plane (c, h)
                    qh = np.uint32(w[wb + 1]) | (np.uint32(w[wb + 2]) << 16)
                    for c in range(4):
                        for h in range(2):
                            nib = (qh >> np.uint32(16 * h + 4 * c)) & np.uint32(15)
                            o[ob + 128 + 8 * c + 4 * h + i // 4] |= np.uint16(nib << np.uint32(4 * (i % 4)))


def pack(type_id: int, raw: np.ndarray, out: np.ndarray | None = None) -> Packed:
    """raw (rows, row_bytes) repacked into out (uint8, at least packed_bytes) or a new array."""
    kind = KINDS[type_id]
    rows, gb = raw.shape[0], LAYOUT[kind][1]
    nb = raw.shape[1] // LAYOUT[kind][0]
    n = rows // 16 * nb * gb
    out = (np.empty(n, np.uint8) if out is None else out[:n]).reshape(rows // 16, nb * gb)
    if kind == Q5_0:
        out[:, :] = 0       # the bit planes are or-ed in
    _repack(raw, kind, out)
    return Packed(type_id, out, rows, nb * 32)


def pack_file(f, names) -> dict:
    """The tensors of names that repack (supports()), into one buffer (large enough for the
    kernel's transparent huge pages: writing it costs a fault per 2 MB, not per 4 KB), their
    mapped pages released after. 0.5b: about 0.1 s for 220 MB. (Reading the file with read()
    instead of the mapping took 0.44 s here for the same bytes.)"""
    todo = [n for n in names if supports(f.tensors[n].type_id, f.raw(n).shape[0])]
    arena = np.empty(sum(f.tensors[n].nbytes for n in todo), np.uint8)
    out, at = {}, 0
    for n in todo:
        t = f.tensors[n]
        out[n] = pack(t.type_id, f.raw(n), arena[at:at + t.nbytes])
        f.release(n)
        at += t.nbytes
    return out


def _rows16(kind):
    """y[16g:16g+16] = group g of pk (2-D) . x, over nb blocks: xq int8, xd (nb,) float32
    scales, isum (nb,) int32 block sums of xq."""
    _, gb, off = LAYOUT[kind]

    @intrinsic
    def rows16(typingctx, pk, g, nb, xq, xd, isum, y):
        def codegen(context, builder, sig, args):
            apk, ag, anb, axq, axd, aisum, ay = args
            tpk, txq = sig.args[0], sig.args[3]
            i64 = ag.type
            c = lambda v: ir.Constant(i64, v)
            pkarr = context.make_array(tpk)(context, builder, apk)
            stride = cgutils.unpack_tuple(builder, pkarr.strides, 2)[0]
            gbase = builder.mul(ag, stride)
            dpbusd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16I, [V16I, V64B, V64B]),
                                                    "llvm.x86.avx512.vpdpbusd.512")
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16F, [V16F] * 3), "llvm.fma.v16f32")
            base = builder.bitcast(pkarr.data, I8.as_pointer())

            def load(o, ty, align=1):
                return builder.load(builder.bitcast(builder.gep(base, [o]), ty.as_pointer()), align=align)

            def xword(o):
                w = builder.load(_ptr(context, builder, txq, axq, o, I32), align=1)
                return builder.bitcast(_splat(builder, w, V16I), V64B)

            acc = cgutils.alloca_once_value(builder, ir.Constant(V16F, None))
            low4 = ir.Constant(V64B, [15] * 64)
            with cgutils.for_range(builder, anb) as loop:
                b = loop.index
                o = builder.add(gbase, builder.mul(b, c(gb)))
                x0 = builder.mul(b, c(32))
                ia = ir.Constant(V16I, None)
                if kind == Q8_0:
                    for ch in range(8):
                        u = load(builder.add(o, c(64 * ch)), V64B)
                        ia = builder.call(dpbusd, [ia, u, xword(builder.add(x0, c(4 * ch)))])
                else:
                    for ch in range(4):
                        q = load(builder.add(o, c(64 * ch)), V64B)
                        lo = builder.and_(q, low4)
                        hi = builder.lshr(q, ir.Constant(V64B, [4] * 64))
                        if kind == Q5_0:
                            sixteen, zero = ir.Constant(V64B, [16] * 64), ir.Constant(V64B, [0] * 64)
                            for half in range(2):
                                m = load(builder.add(o, c(256 + 16 * ch + 8 * half)), ir.IntType(64))
                                bits = builder.select(builder.bitcast(m, ir.VectorType(I1, 64)), sixteen, zero)
                                if half == 0:
                                    lo = builder.or_(lo, bits)
                                else:
                                    hi = builder.or_(hi, bits)
                        ia = builder.call(dpbusd, [ia, lo, xword(builder.add(x0, c(4 * ch)))])
                        ia = builder.call(dpbusd, [ia, hi, xword(builder.add(x0, c(16 + 4 * ch)))])
                s = builder.load(_ptr(context, builder, sig.args[5], aisum, b, I32))
                ia = builder.sub(ia, _splat(builder, builder.mul(s, ir.Constant(I32, off)), V16I))
                d = builder.fpext(load(builder.add(o, c(gb - 32)), ir.VectorType(ir.HalfType(), 16)), V16F)
                dx = builder.load(_ptr(context, builder, sig.args[4], axd, b, F32))
                builder.store(builder.call(fma, [builder.sitofp(ia, V16F), builder.fmul(d, _splat(builder, dx, V16F)),
                                                 builder.load(acc)]), acc)
            builder.store(builder.load(acc), _ptr(context, builder, sig.args[6], ay, builder.mul(ag, c(16)), V16F), align=4)
            return context.get_dummy_value()
        return types.none(pk, g, nb, xq, xd, isum, y), codegen
    return rows16


_q4_0, _q5_0, _q8_0 = _rows16(Q4_0), _rows16(Q5_0), _rows16(Q8_0)


@njit(parallel=True, fastmath=True, cache=True)
def _matvec(pk, kind, nb, xq, xd, isum, y):
    for g in prange(pk.shape[0]):
        if kind == Q4_0:
            _q4_0(pk, g, nb, xq, xd, isum, y)
        elif kind == Q5_0:
            _q5_0(pk, g, nb, xq, xd, isum, y)
        else:
            _q8_0(pk, g, nb, xq, xd, isum, y)


_xbuf: dict[int, tuple] = {}


def matvec(p: Packed, x: np.ndarray, y: np.ndarray) -> None:
    if x.shape[0] != p.cols:
        raise ValueError(f"{T(p.type_id).name} matvec: {p.cols} inputs expected, got {x.shape[0]}")
    buf = _xbuf.get(p.cols)
    if buf is None:
        n = p.cols
        buf = _xbuf[n] = (np.empty(n, np.int8), np.empty(n // 32, np.float32), np.empty(n // 32, np.float32),
                          np.empty(n // 32, np.int32))
    xq, xd, xs, isum = buf
    quantize_q8_0(x, xq, xd, xs, isum)
    _matvec(p.data, p.kind, p.cols // 32, xq, xd, isum, y)
