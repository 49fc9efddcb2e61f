"""Intel AMX int8 tiles, measured as an LLVM-IR kernel in numba (issue 19), against numbat's
AVX512-VNNI kernels. Needs a CPU with amx-int8/amx-tile (LLVM's host features) and Linux.

1. The tile operations alone, one thread: tdpbssd (16x16 int32 += 16x64 . 64x16 int8, a
   chain and four independent), tileloadd and tilestored of 1 KB tiles from L1.
2. A prompt's Q4_0 matmul (the 0.5b's ffn_up shape by default, 512 tokens), one thread:
   numbat's repacked batch kernel (quant.packed, llama.cpp's float order) against a tile
   kernel with the same float order: the activations (16 tokens x one block's 32 bytes) as
   tile A, the weights' group-block unpacked to signed bytes as tile B (the repacked layout
   is already the tile's: byte 4i+j of a chunk is row i's value 4c+j), one tdpbssd per
   block for 16 tokens x 16 rows, stored and fma'd into float32 accumulators as the VNNI
   kernel adds its block sums. Blocks alternate between two sets of tiles (the tile
   registers are not renamed: a load into a tile waits for the multiply reading it).
   The outputs are compared bit for bit.

    python bench/amx_tile.py [--rows 4864] [--cols 896] [--tokens 512] [--reps 7]

Why only Q4_0: llama.cpp converts a block's integer dot to float whole only in its
Q4_0 kernels (and Q4_K's gemm per pair of sub-blocks, Q6_K's tiled kernel per 256 values);
Q8_0 and Q5_0 go through 8 lanes of 4 values each (tests/llama_orders.py), which a tile
multiply, summing 32 or 64 values into one int32, cannot give.
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import runner.env  # noqa: E402,F401  thread-pool settings before numpy

import llvmlite.binding as llvm  # noqa: E402
import numba  # noqa: E402
import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from kernels import random_weights  # noqa: E402  (bench/kernels.py)
from quant import packed as P  # noqa: E402

I8, I32, I64, F32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
V16F, V16I, V16H = ir.VectorType(F32, 16), ir.VectorType(I32, 16), ir.VectorType(ir.HalfType(), 16)
P8 = I8.as_pointer()


def request_tiles() -> bool:
    """arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): Linux grants the tile state per
    process on request; a tile instruction without it is SIGILL."""
    return ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18) == 0


def _fn(builder, name, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), args), name)


def _data(context, builder, ty, a, t=I8):
    return builder.bitcast(context.make_array(ty)(context, builder, a).data, t.as_pointer())


@intrinsic
def tilecfg(typingctx, cfg):
    def codegen(context, builder, sig, args):
        builder.call(_fn(builder, "llvm.x86.ldtilecfg", [P8]), [_data(context, builder, sig.args[0], args[0])])
        return context.get_dummy_value()
    return types.none(cfg), codegen


@intrinsic
def tilerelease(typingctx):
    def codegen(context, builder, sig, args):
        builder.call(_fn(builder, "llvm.x86.tilerelease", []), [])
        return context.get_dummy_value()
    return types.none(), codegen


def _ops(kind, tiles=()):
    """An intrinsic f(arr, n) repeating n times, over the tiles: kind "dp" tdpbssd (tile, 6, 7),
    "load" tileloadd of arr into each, "store" tilestored of each into arr."""
    @intrinsic
    def f(typingctx, arr, n):
        def codegen(context, builder, sig, args):
            base = _data(context, builder, sig.args[0], args[0])
            k8, c = (lambda v: ir.Constant(I8, v)), (lambda v: ir.Constant(I64, v))
            with cgutils.for_range(builder, args[1]):
                for i, t in enumerate(tiles):
                    if kind == "dp":
                        builder.call(_fn(builder, "llvm.x86.tdpbssd", [I8] * 3), [k8(t), k8(6), k8(7)])
                    else:
                        name = "llvm.x86.tileloadd64" if kind == "load" else "llvm.x86.tilestored64"
                        builder.call(_fn(builder, name, [I8, P8, I64]), [k8(t), builder.gep(base, [c(1024 * i)]), c(64)])
            return context.get_dummy_value()
        return types.none(arr, types.int64), codegen
    return f


_chain, _indep = _ops("dp", (0,)), _ops("dp", (0, 1, 2, 3))
_loads, _stores = _ops("load", (4, 5, 6, 7)), _ops("store", (0, 1, 2, 3))


def _op_rates(cfg, arr, n):
    for name, f, k in (("tdpbssd, one chain", _chain, 1), ("tdpbssd, 4 independent", _indep, 4),
                       ("tileloadd 1 KB (L1)", _loads, 4), ("tilestored 1 KB (L1)", _stores, 4)):
        @njit
        def run(cfg, arr, n):
            tilecfg(cfg)
            f(arr, n)
            tilerelease()
        run(cfg, arr, 10)
        t = min(_timed(lambda: run(cfg, arr, n)) for _ in range(5))
        rate = f" ({16 * 16 * 64 * n * k / t / 1e9:.0f} GMAC/s)" if "tdp" in name else ""
        print(f"  {name}: {t / (n * k) * 1e9:.2f} ns an op{rate}")


@intrinsic
def _q4_0_tiles(typingctx, xq, xoff, ncol, wb, pk, pkoff, xd, xdoff, nbx, y, yoff, ldy, nb):
    """y[yoff + t * ldy + r] for 16 tokens t (xq rows from xoff / ncol) and 16 rows r (the
    group's blocks unpacked in wb, its d at pk + pkoff + 288 b + 256): per block, the block
    dot of tile A (tokens) and B (rows) into C, then acc = fma(float(C), d_w * d_x, acc)."""
    def codegen(context, builder, sig, args):
        axq, axoff, ancol, awb, apk, apkoff, axd, axdoff, anbx, ay, ayoff, aldy, anb = args
        c, k8 = (lambda v: ir.Constant(I64, v)), (lambda v: ir.Constant(I8, v))
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16F, [V16F] * 3), "llvm.fma.v16f32")
        pxq, pwb, ppk = (_data(context, builder, sig.args[i], args[i]) for i in (0, 3, 4))
        pxd, py = _data(context, builder, sig.args[6], axd, F32), _data(context, builder, sig.args[9], ay, F32)
        cbuf = cgutils.alloca_once(builder, ir.ArrayType(I32, 512))
        cbuf.align = 64
        cb8 = builder.bitcast(cbuf, P8)
        accs = [cgutils.alloca_once_value(builder, ir.Constant(V16F, [0.0] * 16)) for _ in range(16)]
        tz, tl = _fn(builder, "llvm.x86.tilezero", [I8]), _fn(builder, "llvm.x86.tileloadd64", [I8, P8, I64])
        tdp, ts = _fn(builder, "llvm.x86.tdpbssd", [I8] * 3), _fn(builder, "llvm.x86.tilestored64", [I8, P8, I64])

        def tiles(b, s):        # set s: C s, A 2 + s, B 4 + s
            builder.call(tz, [k8(s)])
            builder.call(tl, [k8(2 + s), builder.gep(pxq, [builder.add(axoff, builder.mul(b, c(32)))]), ancol])
            builder.call(tl, [k8(4 + s), builder.gep(pwb, [builder.mul(b, c(512))]), c(64)])
            builder.call(tdp, [k8(s), k8(2 + s), k8(4 + s)])
            builder.call(ts, [k8(s), builder.gep(cb8, [c(1024 * s)]), c(64)])

        def floats(b, s):
            o = builder.add(apkoff, builder.add(builder.mul(b, c(288)), c(256)))
            dw = builder.fpext(builder.load(builder.bitcast(builder.gep(ppk, [o]), V16H.as_pointer()), align=1), V16F)
            for t in range(16):
                dx = builder.load(builder.gep(pxd, [builder.add(axdoff, builder.add(builder.mul(c(t), anbx), b))]))
                dd = builder.fmul(dw, P._splat(builder, dx, V16F))
                v = builder.load(builder.bitcast(builder.gep(cb8, [c(1024 * s + 64 * t)]), V16I.as_pointer()), align=64)
                builder.store(builder.call(fma, [builder.sitofp(v, V16F), dd, builder.load(accs[t])]), accs[t])

        half = builder.sdiv(anb, c(2))
        with cgutils.for_range(builder, half) as loop:
            b0 = builder.mul(loop.index, c(2))
            b1 = builder.add(b0, c(1))
            tiles(b0, 0)
            tiles(b1, 1)
            floats(b0, 0)
            floats(b1, 1)
        with cgutils.if_unlikely(builder, builder.icmp_signed("!=", builder.mul(half, c(2)), anb)):
            last = builder.sub(anb, c(1))
            tiles(last, 0)
            floats(last, 0)
        for t in range(16):
            dst = builder.gep(py, [builder.add(ayoff, builder.mul(c(t), aldy))])
            builder.store(builder.load(accs[t]), builder.bitcast(dst, V16F.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.none(xq, xoff, ncol, wb, pk, pkoff, xd, xdoff, nbx, y, yoff, ldy, nb), codegen


@njit
def q4_0_tiles(cfg, pk, nb, xq, xd, y, wb):
    """y (T, rows) for T (a multiple of 16) tokens of xq through a repacked Q4_0 weight pk."""
    tilecfg(cfg)
    ncol, nbx, ldy = xq.shape[1], xd.shape[1], y.shape[1]
    for g in range(pk.shape[0]):
        row = pk[g]
        for b in range(nb):          # tile B rows 0-3 the low nibbles of chunks 0-3, 4-7 the high, less 8
            for ch in range(4):
                for k in range(64):
                    q = row[288 * b + 64 * ch + k]
                    wb[b, ch, k] = np.int8(q & 15) - np.int8(8)
                    wb[b, 4 + ch, k] = np.int8(q >> 4) - np.int8(8)
        for tt in range(0, xq.shape[0], 16):
            _q4_0_tiles(xq.ravel(), tt * ncol, ncol, wb.ravel(), pk.ravel(), g * pk.shape[1], xd.ravel(), tt * nbx, nbx,
                        y.ravel(), tt * ldy + 16 * g, ldy, nb)
    tilerelease()


def _config(shapes: dict) -> np.ndarray:
    """ldtilecfg's 64 bytes: palette 1, then per tile its bytes a row and its rows."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    for t, (rows, colsb) in shapes.items():
        cfg[16 + 2 * t:18 + 2 * t] = np.array([colsb], np.uint16).view(np.uint8)
        cfg[48 + t] = rows
    return cfg


def _timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4864)
    ap.add_argument("--cols", type=int, default=896)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    feats = llvm.get_host_cpu_features()
    if not (feats.get("amx-int8") and feats.get("amx-tile")):
        sys.exit(f"amx_tile: this CPU ({llvm.get_host_cpu_name()}) has no AMX int8 tiles")
    if not request_tiles():
        sys.exit("amx_tile: the kernel refused the tile state (arch_prctl ARCH_REQ_XCOMP_PERM); Linux 5.16 or later")
    numba.set_num_threads(1)
    print(f"{llvm.get_host_cpu_name()}, one thread")
    _op_rates(_config({t: (16, 64) for t in range(8)}), np.zeros(8192, np.int8), 200_000)

    rng = np.random.default_rng(0)
    p = P.pack(T.Q4_0, random_weights(T.Q4_0, a.rows, a.cols, rng))
    X = rng.standard_normal((a.tokens, a.cols)).astype(np.float32)
    Y, Y2 = np.zeros((a.tokens, a.rows), np.float32), np.zeros((a.tokens, a.rows), np.float32)
    xq, xd, isum, nb = P._quantized(p, X, a.tokens)
    cfg = _config({0: (16, 64), 1: (16, 64), 2: (16, 32), 3: (16, 32), 4: (8, 64), 5: (8, 64)})
    wb = np.zeros((nb, 8, 64), np.int8)
    vnni = P._matmul(p.kind)
    vnni(p.data, nb, xq, xd, isum, Y, a.tokens)
    q4_0_tiles(cfg, p.data, nb, xq, xd, Y2, wb)
    same = np.array_equal(Y.view(np.int32), Y2.view(np.int32))
    tv, ta = [], []
    for _ in range(a.reps):      # alternating
        tv.append(_timed(lambda: vnni(p.data, nb, xq, xd, isum, Y, a.tokens)))
        ta.append(_timed(lambda: q4_0_tiles(cfg, p.data, nb, xq, xd, Y2, wb)))
    ops = 2 * a.rows * a.cols * a.tokens
    v, t = np.median(tv), np.median(ta)
    print(f"Q4_0 {a.rows}x{a.cols}, {a.tokens} tokens: VNNI {ops / v / 1e9:.0f} GOP/s, tiles {ops / t / 1e9:.0f} GOP/s, "
          f"tiles / VNNI {v / t:.2f} (medians of {a.reps}); the same bits: {same}")


if __name__ == "__main__":
    main()
