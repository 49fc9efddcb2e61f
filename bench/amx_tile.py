"""Intel AMX int8 tiles, measured as an LLVM-IR kernel in numba (issue 19), against numbat's
AVX512-VNNI kernels. Needs a CPU with amx-int8/amx-tile (LLVM's host features) and Linux.

1. The tile operations alone, one thread: tdpbssd (16x16 int32 += 16x64 . 64x16 int8, a
   chain and four independent), tileloadd and tilestored of 1 KB tiles from L1.
2. A prompt's Q4_0 matmul (the 0.5b's ffn_up shape by default, 512 tokens), one thread:
   numbat's repacked VNNI batch kernel (quant.packed, llama.cpp's float order) against the
   tile kernel (quant.amx: its docstring has the tiles' layout and order), handed runs of 16
   groups as quant.packed._run does; the outputs are compared bit for bit.

    python bench/amx_tile.py [--rows 4864] [--cols 896] [--tokens 512] [--reps 7]

Why only Q4_0: llama.cpp converts a block's integer dot to float whole only in its
Q4_0 kernels (and Q4_K's gemm per pair of sub-blocks, Q6_K's tiled kernel per 256 values);
Q8_0 and Q5_0 go through 8 lanes of 4 values each (tests/llama_orders.py), which a tile
multiply, summing 32 or 64 values into one int32, cannot give.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import runner.env  # noqa: E402,F401  thread-pool settings before numpy

os.environ["NUMBAT_AMX"] = "0"      # quant.packed's group kernels without tiles: the VNNI side

import llvmlite.binding as llvm  # noqa: E402
import numba  # noqa: E402
import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from kernels import random_weights  # noqa: E402  (bench/kernels.py)
from quant import amx, cpu, packed as P  # noqa: E402
from quant.amx import P8, I8, I64, ZERO, _fn, _ptr, _tiles_off as tilerelease, _tiles_on as tilecfg  # noqa: E402


def _ops(kind, tiles=()):
    """An intrinsic f(arr, n) repeating n times, over the tiles: kind "dp" tdpbssd (tile, 6, 7),
    "load" tileloadd of arr into each, "store" tilestored of each into arr."""
    @intrinsic
    def f(typingctx, arr, n):
        def codegen(context, builder, sig, args):
            base = _ptr(context, builder, sig.args[0], args[0], ZERO, I8)
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


@njit
def _runs(pk, nb, xq, xd, y, n):
    """The tile kernel on runs of 16 groups, as quant.packed._run hands them to a thread."""
    for g0 in range(0, pk.shape[0], 16):
        amx.q4_0(pk, g0, min(pk.shape[0], g0 + 16), nb, xq, xd, y, n)


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
    if not cpu.grant_tiles():
        sys.exit("amx_tile: Linux refused the tile state (arch_prctl ARCH_REQ_XCOMP_PERM; it needs 5.16 or later)")
    numba.set_num_threads(1)
    print(f"{llvm.get_host_cpu_name()}, one thread")
    _op_rates(amx.config({t: (16, 64) for t in range(8)}), np.zeros(8192, np.int8), 200_000)

    rng = np.random.default_rng(0)
    p = P.pack(T.Q4_0, random_weights(T.Q4_0, a.rows, a.cols, rng))
    X = rng.standard_normal((a.tokens, a.cols)).astype(np.float32)
    Y, Y2 = np.zeros((a.tokens, a.rows), np.float32), np.zeros((a.tokens, a.rows), np.float32)
    xq, xd, isum, nb = P._quantized(p, X, a.tokens)
    vnni = P._matmul(p.kind)
    tiles = lambda: _runs(p.data, nb, xq, xd, Y2, a.tokens)
    vnni(p.data, nb, xq, xd, isum, Y, a.tokens)
    tiles()
    same = np.array_equal(Y.view(np.int32), Y2.view(np.int32))
    tv, ta = [], []
    for _ in range(a.reps):      # alternating
        tv.append(_timed(lambda: vnni(p.data, nb, xq, xd, isum, Y, a.tokens)))
        ta.append(_timed(tiles))
    ops = 2 * a.rows * a.cols * a.tokens
    v, t = np.median(tv), np.median(ta)
    print(f"Q4_0 {a.rows}x{a.cols}, {a.tokens} tokens: VNNI {ops / v / 1e9:.0f} GOP/s, tiles {ops / t / 1e9:.0f} GOP/s, "
          f"tiles / VNNI {v / t:.2f} (medians of {a.reps}); the same bits: {same}")


if __name__ == "__main__":
    main()
