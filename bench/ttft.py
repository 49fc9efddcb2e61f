"""Time to first token of `numbat prompt "Hi" -n 1` as a user sees it: from starting the
command to the first byte of the reply on stdout (Python start, imports, model open, chat
template, prefill, one token). Cold = an empty kernel cache (everything compiles); warm =
median of -r runs after that, with the kernels cached.

    python bench/ttft.py [MODEL] [-r 5]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def first_byte(cmd: list[str], env: dict) -> tuple[float, float]:
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    p.stdout.read(1)
    ttft = time.perf_counter() - t
    p.stdout.read()
    if p.wait():
        sys.exit(f"{' '.join(cmd)} failed with exit code {p.returncode}")
    return ttft, time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("-r", "--reps", type=int, default=5)
    a = ap.parse_args()
    numbat = shutil.which("numbat") or sys.exit("numbat is not installed: pip install -e .")
    cmd = [numbat, "prompt"] + ([a.model] if a.model else []) + ["Hi", "-n", "1"]
    kernels = tempfile.mkdtemp(prefix="numbat-kernels-")
    env = dict(os.environ, NUMBA_CACHE_DIR=kernels)
    try:
        cold = first_byte(cmd, env)
        warm = [first_byte(cmd, env) for _ in range(a.reps)]
    finally:
        shutil.rmtree(kernels, ignore_errors=True)
    med = statistics.median(w[0] for w in warm)
    print(f"{' '.join(cmd[1:])}: cold {cold[0]:.2f} s to first token ({cold[1]:.2f} s total); "
          f"warm median of {a.reps} {med:.2f} s (runs {', '.join(f'{w[0]:.2f}' for w in warm)})")


if __name__ == "__main__":
    main()
