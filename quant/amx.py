"""Intel AMX int8 tiles for a prompt's Q4_0 matmuls (the CPU rows that list Q4_0 in
quant.cpu's ``amx``; bench/amx_tile.py measures them).

llama.cpp's Q4_0 kernels turn each block's whole integer dot into float32 and add it in one
chain, acc = fma(dot, d_w * d_x, acc), block by block (tests/llama_orders.py). A tile
multiply gives exactly those dots for 16 tokens x 16 rows at once: tile A holds 16 tokens'
32 activation bytes of a block (Q8_0), tile B the block of a repacked group (quant.packed:
byte 4i+j of a chunk is row i's value 4c+j, the tile's own layout for 16 columns), unpacked
to signed values; tdpbssd sums each token-row pair's 32 products into an int32, and the
float steps after it are the VNNI kernel's, so the bits are the same. The other kinds'
float steps start from lanes of 4 values (Q8_0, Q5_0) or from several scaled sub-blocks,
which a tile's whole sums do not give.

The tile registers are not renamed: a load into a tile waits for the multiply reading it,
so blocks alternate between two sets (C 0/1, A 2/3, B 4/5). Linux hands the tile state to
a process that asks for it: quant.cpu asks once, at import, and drops the row's ``amx``
types if refused.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from quant.gemm8 import I8, I32, F32, V16I, V16F, _ptr
from quant.intrin import _splat

I64, V16H = ir.IntType(64), ir.VectorType(ir.HalfType(), 16)
P8, ZERO = I8.as_pointer(), ir.Constant(I64, 0)
TOKENS = 16         # a tile's tokens: a batch's first multiple of 16 goes through the tiles


def config(shapes: dict) -> np.ndarray:
    """ldtilecfg's 64 bytes: palette 1, then per tile (shapes: tile -> (rows, bytes a row))."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    for t, (rows, colsb) in shapes.items():
        cfg[16 + 2 * t:18 + 2 * t] = np.array([colsb], np.uint16).view(np.uint8)
        cfg[48 + t] = rows
    return cfg


# C 0/1: 16 tokens x 16 int32; A 2/3: 16 tokens x 32 bytes; B 4/5: 8 rows of 4 values x 16 weight rows
CONFIG = config({0: (16, 64), 1: (16, 64), 2: (16, 32), 3: (16, 32), 4: (8, 64), 5: (8, 64)})


def _fn(builder, name, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), args), name)


@intrinsic
def _tiles_on(typingctx, cfg):
    def codegen(context, builder, sig, args):
        builder.call(_fn(builder, "llvm.x86.ldtilecfg", [P8]), [_ptr(context, builder, sig.args[0], args[0], ZERO, I8)])
        return context.get_dummy_value()
    return types.none(cfg), codegen


@intrinsic
def _tiles_off(typingctx):
    def codegen(context, builder, sig, args):
        builder.call(_fn(builder, "llvm.x86.tilerelease", []), [])
        return context.get_dummy_value()
    return types.none(), codegen


@intrinsic
def _q4_0_tile(typingctx, xq, xoff, ncol, wb, pk, pkoff, xd, xdoff, nbx, y, yoff, ldy, nb):
    """y[yoff + t ldy + r] for 16 tokens t (xq's rows from xoff, ncol bytes apart; their
    scales xd from xdoff, nbx apart) and a group's 16 rows r (its nb blocks unpacked in wb,
    512 bytes each; its d at pk + pkoff + 288 b + 256)."""
    def codegen(context, builder, sig, args):
        axq, axoff, ancol, awb, apk, apkoff, axd, axdoff, anbx, ay, ayoff, aldy, anb = args
        c, k8 = (lambda v: ir.Constant(I64, v)), (lambda v: ir.Constant(I8, v))
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16F, [V16F] * 3), "llvm.fma.v16f32")
        pxq, pwb, ppk = (_ptr(context, builder, sig.args[i], args[i], ZERO, I8) for i in (0, 3, 4))
        pxd, py = _ptr(context, builder, sig.args[6], axd, ZERO, F32), _ptr(context, builder, sig.args[9], ay, ZERO, F32)
        cbuf = cgutils.alloca_once(builder, ir.ArrayType(I32, 1024))
        cbuf.align = 64
        cb8 = builder.bitcast(cbuf, P8)
        accs = [cgutils.alloca_once_value(builder, ir.Constant(V16F, [0.0] * 16)) for _ in range(16)]
        tz, tl = _fn(builder, "llvm.x86.tilezero", [I8]), _fn(builder, "llvm.x86.tileloadd64", [I8, P8, I64])
        tdp, ts = _fn(builder, "llvm.x86.tdpbssd", [I8] * 3), _fn(builder, "llvm.x86.tilestored64", [I8, P8, I64])

        def dots(b, s, slot):   # block b's int32 dots through tile set s into cbuf's slot
            builder.call(tz, [k8(s)])
            builder.call(tl, [k8(2 + s), builder.gep(pxq, [builder.add(axoff, builder.mul(b, c(32)))]), ancol])
            builder.call(tl, [k8(4 + s), builder.gep(pwb, [builder.mul(b, c(512))]), c(64)])
            builder.call(tdp, [k8(s), k8(2 + s), k8(4 + s)])
            builder.call(ts, [k8(s), builder.gep(cb8, [c(1024 * slot)]), c(64)])

        def floats(b, slot):    # the VNNI kernel's steps: fma(float(dot), d_w * d_x, acc)
            o = builder.add(apkoff, builder.add(builder.mul(b, c(288)), c(256)))
            dw = builder.fpext(builder.load(builder.bitcast(builder.gep(ppk, [o]), V16H.as_pointer()), align=1), V16F)
            for t in range(16):
                dx = builder.load(builder.gep(pxd, [builder.add(axdoff, builder.add(builder.mul(c(t), anbx), b))]))
                dd = builder.fmul(dw, _splat(builder, dx, V16F))
                v = builder.load(builder.bitcast(builder.gep(cb8, [c(1024 * slot + 64 * t)]), V16I.as_pointer()), align=64)
                builder.store(builder.call(fma, [builder.sitofp(v, V16F), dd, builder.load(accs[t])]), accs[t])

        # a pipeline two blocks deep: block k's dots are issued before block k - 2's floats,
        # which read what its tile store wrote, so the store's latency is hidden (slots k % 4)
        with cgutils.for_range(builder, builder.sdiv(builder.add(anb, c(5)), c(4))) as loop:
            for u in range(4):
                k = builder.add(builder.mul(loop.index, c(4)), c(u))
                with builder.if_then(builder.icmp_signed("<", k, anb)):
                    dots(k, u % 2, u)
                with builder.if_then(builder.and_(builder.icmp_signed(">=", k, c(2)), builder.icmp_signed("<", k, builder.add(anb, c(2))))):
                    floats(builder.sub(k, c(2)), (u + 2) % 4)
        for t in range(16):
            dst = builder.gep(py, [builder.add(ayoff, builder.mul(c(t), aldy))])
            builder.store(builder.load(accs[t]), builder.bitcast(dst, V16F.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.none(xq, xoff, ncol, wb, pk, pkoff, xd, xdoff, nbx, y, yoff, ldy, nb), codegen


@njit
def q4_0(pk, g0, g1, nb, xq, xd, y, n):
    """y[t, 16g:16g+16] for the first n tokens (a multiple of 16) of xq and the groups g0..g1
    of a repacked Q4_0 weight pk (2-D: a row per group); xq (T, cols) int8, xd (T, nb). The
    run's groups are unpacked once into wb, allocated per call (a run is at most 16 groups:
    1.2 MB for 4864 inputs; numba's cfuncs have no per-thread buffer to keep)."""
    _tiles_on(CONFIG)
    wb = np.empty((g1 - g0, nb, 8, 64), np.int8)
    ncol, ldy = xq.shape[1], y.shape[1]
    for g in range(g0, g1):
        row, w = pk[g], wb[g - g0]
        for b in range(nb):         # B's rows 0-3: chunks 0-3's low nibbles, 4-7 the high; less 8
            for ch in range(4):
                for k in range(64):
                    q = row[288 * b + 64 * ch + k]
                    w[b, ch, k] = np.int8(q & 15) - np.int8(8)
                    w[b, 4 + ch, k] = np.int8(q >> 4) - np.int8(8)
    # tokens outer: a tile's 16 tokens stay in L1 for the run's groups, and their outputs
    # are each token's run of rows (groups outer, the 0.5b's 4864 x 896 took 1.2x the VNNI
    # kernel's speed instead of 1.9x: each group's outputs scattered over 512 rows of Y)
    for t in range(0, n, 16):
        for g in range(g0, g1):
            _q4_0_tile(xq.ravel(), t * ncol, ncol, wb[g - g0].ravel(), pk.ravel(), g * pk.shape[1], xd.ravel(),
                       t * xd.shape[1], xd.shape[1], y.ravel(), t * ldy + 16 * g, ldy, nb)
    _tiles_off()
