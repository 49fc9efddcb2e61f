"""GB/s of the repacked one-token kernels (quant.packed) on one matrix of each kind, 1 and 2
threads: with many rows the matrix streams from memory (decode's case; copies of it, 256 MB
in all, taken in turn), with few it stays in cache (the kernel's compute). Random weights
with finite scales (bench/kernels.py's); GB/s of weight bytes, median of REPS calls. Compare
with bench/kernels.py's read bandwidth.

    python bench/packed_stream.py Q4_K,Q6_K,Q8_0 [--rows 65536] [--reps 30]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import runner.env  # noqa: E402,F401  thread-pool settings before numpy

import numba  # noqa: E402
import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from kernels import random_weights  # noqa: E402  (bench/kernels.py)
from quant import packed as P  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kinds", nargs="?", default="Q4_K,Q6_K,Q8_0")
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--cols", type=int, default=1536)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    for name in a.kinds.split(","):
        p = P.pack(getattr(T, name), random_weights(getattr(T, name), a.rows, a.cols, rng))
        xq, xd, isum, nb = P._quantized(p, rng.standard_normal((1, a.cols)).astype(np.float32), 1)
        y = np.zeros((1, a.rows), np.float32)
        mm = P._matmul(p.kind)
        # a matrix larger than the caches is cycled through copies making 256 MB, so that no
        # part of it is still in L3 from the call before (a victim L3 keeps some of a
        # stream that overflows it by less than a few times)
        big = p.data.nbytes > (8 << 20)
        datas = [p.data] + [p.data.copy() for _ in range(-(-(256 << 20) // p.data.nbytes) - 1 if big else 0)]
        for threads in (1, 2):
            numba.set_num_threads(threads)
            mm(p.data, nb, xq, xd, isum, y, 0)
            ts = []
            for i in range(a.reps):
                d = datas[i % len(datas)]
                t0 = time.perf_counter()
                mm(d, nb, xq, xd, isum, y, 0)
                ts.append(time.perf_counter() - t0)
            print(f"{name} {threads} thread(s): {p.data.nbytes / np.median(ts) / 1e9:.1f} GB/s "
                  f"({p.data.nbytes / 1e6:.0f} MB)", flush=True)


if __name__ == "__main__":
    main()
