"""In-process A/B of the repacked kernels (quant/packed.py): a git revision's version against
the working tree's, both imported in one process, calls alternating (this host's speed drifts
by 10-40% within minutes, so separate processes cannot tell a 10% change apart). Random
weights with finite f16 scales (bench/kernels.py's), the outputs of the two
asserted equal (the repacked kernels' bits are llama.cpp's: a change may not move them).

    python bench/packed_ab.py HEAD~1 [--rows 512] [--threads 1] [--kinds Q4_K,Q6_K,Q5_0,Q8_0]

512 rows keep a matrix in L2 (the kernels' compute); 65536 rows with 2 threads stream it
from memory (decode's case). Reports new / old for one token, four (a speculative check's
float steps) and a prompt's batch (4 tokens for Q4_K/Q6_K, 8 for the others).
"""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import runner.env  # noqa: E402,F401  thread-pool settings before numpy

import numba  # noqa: E402
import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from kernels import random_weights  # noqa: E402  (bench/kernels.py: blocks with finite scales)
from quant import packed as new  # noqa: E402

COLS = {"Q4_K": 1536, "Q6_K": 1536, "Q5_0": 896, "Q8_0": 896, "Q4_0": 896}


def load_old(rev: str):
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:quant/packed.py"], check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="numbat-ab-")) / "packed_old.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("packed_old", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["packed_old"] = mod     # numba's cache finds the module by name
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rev")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kinds", default="Q4_K,Q6_K,Q5_0,Q8_0")
    a = ap.parse_args()
    old = load_old(a.rev)
    numba.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    for name in a.kinds.split(","):
        t, cols = getattr(T, name), COLS[name]
        raw = random_weights(t, a.rows, cols, rng)
        batch = 4 if name in ("Q4_K", "Q6_K") else 8
        for n, nbatch, label in ((1, 0, "one token"), (4, 0, "four"), (batch, batch, f"batch of {batch}")):
            X = rng.standard_normal((n, cols)).astype(np.float32)
            calls, outs = {}, {}
            for tag, P in (("old", old), ("new", new)):
                p = P.pack(t, raw)
                Y = np.zeros((n, a.rows), np.float32)
                xq, xd, isum, nb = P._quantized(p, X, n)
                mm = P._matmul(p.kind)
                calls[tag] = (lambda mm=mm, p=p, nb=nb, xq=xq, xd=xd, isum=isum, Y=Y:
                              mm(p.data, nb, xq, xd, isum, Y, nbatch))
                calls[tag]()
                outs[tag] = Y
            assert np.array_equal(outs["old"], outs["new"]), f"{name} {label}: the two versions' outputs differ"
            reps = max(20, 200_000 // a.rows // n)
            times = {"old": [], "new": []}
            for r in range(15):
                for tag in ("old", "new") if r % 2 else ("new", "old"):
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        calls[tag]()
                    times[tag].append((time.perf_counter() - t0) / reps)
            mo, mn = np.median(times["old"]), np.median(times["new"])
            print(f"{name:5s} {label:11s} old {mo * 1e6:9.1f} us  new {mn * 1e6:9.1f} us  new/old {mn / mo:.3f}", flush=True)


if __name__ == "__main__":
    main()
