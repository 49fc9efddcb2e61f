"""llama.cpp and numbat on the same GGUF, same threads, one run: pp512 and tg128 tok/s, their
ratios, and the decode roofline (weight bytes read per token / measured read bandwidth).

    pip install -e ".[dev]"          # llama-cpp-python, the oracle (compiles for minutes)
    python bench/compare.py qwen2.5-coder:0.5b [more models or .gguf paths] [-t 2] [-r 3]

Both engines see the same random token ids, as llama-bench uses. Medians of -r runs after a
warm-up; the two engines alternate run by run so drifts in the machine hit both alike.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def read_bandwidth(threads: int) -> float:
    """GB/s of a parallel sum over 1 GiB, the ceiling for decode."""
    import numba
    from numba import njit, prange

    @njit(parallel=True)
    def total(a):
        s = 0.0
        for i in prange(a.shape[0]):
            s += a[i]
        return s
    numba.set_num_threads(threads)
    a = np.ones(1 << 27, np.float64)
    total(a)
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        total(a)
        ts.append(time.perf_counter() - t)
    return a.nbytes / statistics.median(ts) / 1e9


class Llama:
    name = "llama.cpp"

    def __init__(self, path, threads, n_ctx):
        import llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_ubatch=512,
                                   n_threads=threads, n_threads_batch=threads, verbose=False)

    def pp(self, ids):
        self.llm.reset()
        self.llm.eval(ids)

    def tg(self, ids):
        self.llm.reset()
        for i in ids:
            self.llm.eval([i])


class Numbat:
    name = "numbat"

    def __init__(self, path, threads, n_ctx):
        import numba
        from runner.model import load
        numba.set_num_threads(threads)
        self.m = load(str(path))
        self.cache = self.m.backend.make_cache(n_ctx)

    def pp(self, ids):
        self.cache.reset()
        self.m.backend.forward(ids, self.cache)

    def tg(self, ids):
        self.cache.reset()
        for i in ids:
            self.m.backend.forward([i], self.cache)


def decode_bytes(path) -> int:
    """Weight bytes one decode step reads: every matrix once, the embedding one row."""
    from gguf_io import open_gguf
    f = open_gguf(path)
    total = sum(t.nbytes for n, t in f.tensors.items() if n != "token_embd.weight")
    if "output.weight" not in f.tensors:       # tied: the head reads the embedding matrix
        total += f.tensors["token_embd.weight"].nbytes
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    a = ap.parse_args()
    from runner.model import resolve
    bw = read_bandwidth(a.threads)
    print(f"read bandwidth ({a.threads} threads): {bw:.1f} GB/s\n")
    print("| model | test | llama.cpp tok/s | numbat tok/s | numbat / llama.cpp | roofline tok/s | numbat / roofline |")
    print("|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for model in a.models:
        path = resolve(model)
        engines = [Llama(path, a.threads, a.p + a.n + 8), Numbat(path, a.threads, a.p + a.n + 8)]
        vocab = engines[1].m.tokenizer.vocab_size
        roof = bw * 1e9 / decode_bytes(path)
        for test, n in (("pp", a.p), ("tg", a.n)):
            rates = {e.name: [] for e in engines}
            for rep in range(a.reps + 1):
                ids = rng.integers(0, vocab, n).tolist()
                for e in engines:
                    t = time.perf_counter()
                    getattr(e, test)(ids)
                    if rep:      # rep 0 warms up
                        rates[e.name].append(n / (time.perf_counter() - t))
            ll, nb = statistics.median(rates["llama.cpp"]), statistics.median(rates["numbat"])
            extra = f"{roof:.1f} | {nb / roof:.2f}" if test == "tg" else "- | -"
            print(f"| {model} | {test}{n} | {ll:.1f} | {nb:.1f} | {nb / ll:.2f} | {extra} |", flush=True)


if __name__ == "__main__":
    main()
