"""In-process A/B of a CPU row's prefetch distances for the packed kernels, on a model's real
matrices in a forward's order (quant/cpu.py's rows; this host's speed drifts by 10-40% within
minutes, so separate processes cannot tell a 5% change apart):

    python bench/prefetch_ab.py [--model qwen2.5-coder:1.5b | --matrix Q4_K] [--draft] [--tokens 4] \\
        [-r 25] "B={1: (16384, 2), 4: (8192, 2)}" "C={1: (16384, 2), 4: (4096, 2), 'spread': (4,)}"

--matrix TYPE: one matrix of random weights of that type instead (17920 x 1536, the 1.5b's
gate and up), its copies cycled through 256 MB so that each call reads it from memory.
A is the row as committed; each NAME=DICT loads quant/packed.py once more with the row's
prefetch replaced (bytes ahead, LLVM locality, by tokens a call or (type, tokens); the key
'spread' sets the row's spread_prefetch, the token counts that spread). Outputs
are asserted equal to A's; reports medians and their ratio to A. The kernels of this run are
cached in a temporary directory: a copy of quant/packed.py under another module name must not
leave entries in the project's cache that a normal import would then fail to load.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="numbat-prefetch-ab-")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import runner.env  # noqa: E402,F401  thread-pool settings before numpy

import ast  # noqa: E402
import numpy as np  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rows", nargs="*", help="NAME={tokens: (bytes, locality), ...}")
    ap.add_argument("--model", default="qwen2.5-coder:1.5b")
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--draft", action="store_true", help="the model's weights as a speculative draft's")
    ap.add_argument("--matrix", help="a type (Q4_K, Q6_K, ...): one synthetic matrix from memory")
    ap.add_argument("-r", type=int, default=25)
    a = ap.parse_args()
    from quant import cpu
    from quant import packed as A
    from quant.common import threads
    from runner.model import load
    variants = {"A": A}
    for spec_ in a.rows:
        name, pf = spec_.split("=", 1)
        pf = ast.literal_eval(pf)      # 'spread': the row's spread_prefetch (token counts)
        cpu.KIND = replace(cpu.KIND, spread_prefetch=tuple(pf.pop("spread", cpu.KIND.spread_prefetch)), prefetch=pf)
        spec = importlib.util.spec_from_file_location("packed_" + name, ROOT / "quant" / "packed.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["packed_" + name] = mod
        spec.loader.exec_module(mod)
        variants[name] = mod
    rng = np.random.default_rng(0)
    if a.matrix:
        from gguf_io.types import GGMLQuantizationType as T
        from kernels import random_weights      # bench/kernels.py
        p = A.pack(T[a.matrix], random_weights(T[a.matrix], 17920, 1536, rng))
        seq = [(p, 1536, 17920, [p.data] + [p.data.copy() for _ in range(-(-(256 << 20) // p.data.nbytes) - 1)])]
    else:
        be = load(a.model, draft=a.draft).backend
        Ws = []
        for L in be.layers:
            Ws += ([L.qkv] if L.qkv is not None else [L.wq, L.wk, L.wv]) + [L.wo]
            Ws += ([L.gate_up] if L.gate_up is not None else [L.gate, L.up]) + [L.down]
        Ws.append(be.output)
        seq = [(W.raw, W.n_in, W.n_out, [W.raw.data]) for W in Ws if isinstance(W.raw, A.Packed)]
    calls = []
    for p, n_in, n_out, datas in seq:
        t = A.padded(p.kind, a.tokens)     # as matmul_rows runs them
        X = rng.standard_normal((a.tokens, n_in)).astype(np.float32)
        xq, xd, isum, nb = (np.array(v) if isinstance(v, np.ndarray) else v for v in A._quantized(p, X, t))
        calls.append((p, datas, xq, xd, isum, nb, np.empty((t, n_out), np.float32)))
    addr = {k: {kind: m._kernel(kind).address for kind in {c[0].kind for c in calls}} for k, m in variants.items()}
    n, turn = threads(), [0]

    def run(k):
        turn[0] += 1        # a synthetic matrix's next copy, not in cache from the call before
        t0 = time.perf_counter()
        for p, datas, xq, xd, isum, nb, y in calls:
            A._run(addr[k][p.kind], n, datas[turn[0] % len(datas)], nb, xq, xd, isum, y, 0)
        return time.perf_counter() - t0

    outs = {}
    for k in variants:
        run(k)
        outs[k] = [c[-1].copy() for c in calls]
        assert all(np.array_equal(x, y) for x, y in zip(outs["A"], outs[k])), f"{k}: outputs differ from A's"
    times = collections.defaultdict(list)
    for r in range(a.r):
        for k in (list(variants) if r % 2 else list(variants)[::-1]):
            times[k].append(run(k))
    base = statistics.median(times["A"])
    for k in variants:
        med = statistics.median(times[k])
        print(f"{k} {med * 1e3:.2f} ms  {med / base:.3f}x A")


if __name__ == "__main__":
    main()
