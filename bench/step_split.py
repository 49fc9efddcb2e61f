"""A decode step taken apart without cProfile's per-call cost (bench/decode_profile.py's):

    python bench/step_split.py [MODEL] [-n 64] [--tokens T] [--calls | --python | --ab [-r 120]]

1. Ops: n greedy decode steps (--tokens T > 1: speculative checks of T tokens) with each
   backend op (graph.run's) timed, and within it the compiled kernels it calls (the packed
   matmul's parallel loop and runner.backends.kernels' functions): what is left of an op is
   its Python (wrappers, slicing, the activation quantizers' calls). "outside ops":
   graph.forward's bookkeeping, the loop over layers and the sampler.
2. Matrices: the model's weights in a forward's order (fused as the forward fuses them), T
   tokens with one token's float steps (decode T=1, a speculative check T=4), nothing else
   between the calls: ms and GB/s by role and type, median of 6 passes (compare with
   bench/kernels.py's read bandwidth).
3. Calls (--calls, instead of 1 and 2): every compiled call of n greedy decode steps timed by
   name (the packed matmul's parallel loop, its activation quantizers, each kernel of
   runner.backends.kernels, the embedding lookup, the sampler), the step's rest (Python,
   numpy glue between the calls, ~0.5 us a call of this timing) last.
4. Python alone (--python, instead of 1 and 2): a decode step (--tokens T: a check of T
   tokens) with every compiled call a no-op, against the real step measured just before: what the interpreter costs with hot
   caches. Inside a real step the same Python runs 2-4x slower (the weights streaming
   through the caches between its lines), so read it as a floor.
5. Compiled layers (--ab [-r R], instead of 1 and 2): decode steps with the numba backend's
   compiled layers (NumbaCPU._decode, what a one-token forward runs) against graph.run's
   ops one by one, in one process, alternating every 8 steps for R rounds: the medians, the
   paired ratio (compiled / ops) and how often the OpenMP worker slept a step (its voluntary
   context switches: a parallel region after a gap longer than its spin waits for it to
   wake, runner/env.py). Sections 1, 3 and 4 take the ops one by one (the
   compiled layers call the kernels where these timers do not see them).
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import runner.env  # noqa: E402,F401  thread-pool settings before numpy

import numpy as np  # noqa: E402

OPS = ("begin", "embed", "norm", "qkv", "head_norm", "attend", "linear", "rows", "add", "ffn", "head_out")


def _decoding(m, cap: int):
    """A cache of cap tokens, a greedy sampler and the logits after a short prompt and one
    decode step: every kernel of decode compiled or loaded before _wrap_kernels."""
    from runner.sampler import Sampler, SamplerConfig
    cache, sampler = m.backend.make_cache(cap), Sampler(SamplerConfig(temp=0))
    logits = m.backend.forward(m.tokenizer.encode("def quicksort(xs):"), cache)[-1]
    return cache, sampler, m.backend.forward([sampler.next(logits)], cache)[-1]


def _wrap_kernels(K, wrap) -> None:
    """Each compiled function of runner.backends.kernels as wrap(f, name) makes it. Only once
    the forward has compiled (or loaded) them: numba resolves a kernel's callees through these
    module globals when it compiles."""
    for name in dir(K):
        if hasattr(getattr(K, name), "py_func"):
            setattr(K, name, wrap(getattr(K, name), name))
    fa = K.flash_attention
    K.flash_attention = lambda *a: wrap(fa(*a), "flash_attention")


def _rebind(be) -> None:
    """Forget the quantizers that packed matrices bound for small batches (Packed.bound), so that their
    next calls take the module's functions as replaced here."""
    from quant import packed as P
    for W in [be.output, *(w for L in be.layers for w in vars(L).values())]:
        if isinstance(getattr(W, "raw", None), P.Packed):
            W.raw.bound.clear()


def _step(be, cache, sampler, tokens: int):
    """The forward of a decode step (tokens 1) or of a speculative check of tokens tokens (the
    token and tokens - 1 guesses, here the same id): the last row's logits."""
    def forward(logits):
        if tokens == 1:
            return be.forward([sampler.next(logits)], cache)[-1]
        return be.forward([sampler.next(logits)] * tokens, cache, logits="all", one_by_one=True)[-1]
    return forward


def ops(m, n: int, tokens: int = 1) -> None:
    from quant import packed as P
    from runner.backends import kernels as K
    be, inside = m.backend, [0.0]
    spent, kern, calls = collections.Counter(), collections.Counter(), collections.Counter()

    def timed(f, op=None):
        def g(*a, **k):
            k0, t0 = inside[0], time.perf_counter()
            r = f(*a, **k)
            dt = time.perf_counter() - t0
            if op is None:
                inside[0] += dt
            else:
                spent[op] += dt
                kern[op] += inside[0] - k0
                calls[op] += 1
            return r
        return g

    be.compiled_step = False
    cache, sampler, logits = _decoding(m, 512)
    _wrap_kernels(K, lambda f, name: timed(f))
    P._run = timed(P._run)
    for op in OPS:
        setattr(be, op, timed(getattr(be, op), op))
    forward = _step(be, cache, sampler, tokens)
    for _ in range(4):
        logits = forward(logits)
    spent.clear(), kern.clear(), calls.clear()
    t0 = time.perf_counter()
    for _ in range(n):
        logits = forward(logits)
    step = (time.perf_counter() - t0) / n
    print(f"{'decode step' if tokens == 1 else f'check of {tokens} tokens'} {step * 1e3:.2f} ms ({n} steps)\n\n| op | calls a step | ms | kernels ms | Python ms | Python a call (us) |\n|---|---|---|---|---|---|")
    for op in (o for o in OPS if calls[o]):
        py = (spent[op] - kern[op]) / n
        print(f"| {op} | {calls[op] / n:.0f} | {spent[op] / n * 1e3:.2f} | {kern[op] / n * 1e3:.2f} | {py * 1e3:.2f} | {py / (calls[op] / n) * 1e6:.1f} |")
    print(f"| outside ops | | {(step - sum(spent.values()) / n) * 1e3:.2f} | | | |\n")


def matrices(m, tokens: int) -> None:
    import quant
    be, seq = m.backend, []
    for L in be.layers:
        parts = ([("qkv", L.qkv)] if L.qkv is not None else [("qk", L.qk), ("wv", L.wv)] if L.qk is not None
                 else [("wq", L.wq), ("wk", L.wk), ("wv", L.wv)])
        parts += [("wo", L.wo)] + ([("gate_up", L.gate_up)] if L.gate_up is not None else [("gate", L.gate), ("up", L.up)])
        seq += parts + [("down", L.down)]
    seq.append(("output", be.output))
    rng = np.random.default_rng(0)
    X = {W.n_in: rng.standard_normal((tokens, W.n_in)).astype(np.float32) for _, W in seq}
    Y = {id(W): np.empty((tokens, W.n_out), np.float32) for _, W in seq}
    times, size = collections.defaultdict(list), collections.Counter()
    for p in range(8):
        for role, W in seq:
            key = (role, quant.T(W.type_id).name)
            t0 = time.perf_counter()
            W(X[W.n_in], Y[id(W)], batch=False)
            times[key].append(time.perf_counter() - t0)
            if p == 0:
                size[key] += W.raw.data.nbytes if hasattr(W.raw, "data") else W.raw.nbytes
    c = {k: len(v) // 8 for k, v in times.items()}     # matrices of that role and type a pass
    per = {k: statistics.median(sum(v[p * c[k]:(p + 1) * c[k]]) for p in range(2, 8)) for k, v in times.items()}
    print(f"matrices, {tokens} token(s), one token's steps each\n\n| role | type | ms | MB | GB/s |\n|---|---|---|---|---|")
    for (role, t), s in per.items():
        print(f"| {role} | {t} | {s * 1e3:.2f} | {size[(role, t)] / 1e6:.0f} | {size[(role, t)] / s / 1e9:.1f} |")
    total = sum(per.values())
    print(f"| all | | {total * 1e3:.2f} | {sum(size.values()) / 1e6:.0f} | {sum(size.values()) / total / 1e9:.1f} |")


def calls(m, n: int, tokens: int = 1) -> None:
    import quant
    from quant import packed as P
    from runner.backends import kernels as K
    be = m.backend
    spent, count = collections.Counter(), collections.Counter()

    def timed(f, name):
        def g(*a):
            t0 = time.perf_counter()
            r = f(*a)
            spent[name] += time.perf_counter() - t0
            count[name] += 1
            return r
        return g

    be.compiled_step = False
    cache, sampler, logits = _decoding(m, 4096)
    _wrap_kernels(K, timed)
    for name in ("_run", "_quantize_0", "_quantize_k"):
        setattr(P, name, timed(getattr(P, name), name))
    _rebind(be)
    q = quant.qtype(be.embd.type_id)
    object.__setattr__(q, "dequant_rows", timed(q.dequant_rows, "embedding"))
    sampler.next = timed(sampler.next, "sampler")
    forward = _step(be, cache, sampler, tokens)
    for _ in range(8):
        logits = forward(logits)
    spent.clear(), count.clear()
    t0 = time.perf_counter()
    for _ in range(n):
        logits = forward(logits)
    step = (time.perf_counter() - t0) / n
    print(f"{'decode step' if tokens == 1 else f'check of {tokens} tokens'} {step * 1e3:.2f} ms ({n} from 5 tokens deep)\n\n| call | a step | ms a step | us a call |\n|---|---|---|---|")
    for name in sorted(spent, key=lambda k: -spent[k]):
        print(f"| {name} | {count[name] / n:.0f} | {spent[name] / n * 1e3:.3f} | {spent[name] / count[name] * 1e6:.1f} |")
    print(f"| the rest | | {(step - sum(spent.values()) / n) * 1e3:.3f} | |")


def python_alone(m, n: int, tokens: int = 1) -> None:
    import quant
    from quant import packed as P
    from runner.backends import kernels as K
    be = m.backend
    be.compiled_step = False
    cache = be.make_cache(4096)
    be.forward(m.tokenizer.encode("def quicksort(xs):"), cache)

    def step_ms() -> float:
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for i in range(n):
                if tokens == 1:
                    be.forward([100 + i], cache)
                else:
                    be.forward([100 + i] * tokens, cache, logits="all", one_by_one=True)
            best = min(best, (time.perf_counter() - t0) / n)
            cache.rollback(n * tokens)
        return best * 1e3

    real = step_ms()
    noop = lambda *a, **k: None     # noqa: E731
    _wrap_kernels(K, lambda f, name: noop)
    P._run = P._quantize_0 = P._quantize_k = noop
    _rebind(be)
    q = quant.qtype(be.embd.type_id)
    object.__setattr__(q, "dequant_rows", noop)
    print(f"{'decode step' if tokens == 1 else f'check of {tokens} tokens'} {real:.2f} ms; its Python alone (every compiled call a no-op) {step_ms():.3f} ms "
          f"(best of 5 runs of {n} steps)")


def _worker_sleeps() -> int:
    """Voluntary context switches of this process's threads but the main one (Linux)."""
    n = 0
    for t in Path(f"/proc/{os.getpid()}/task").iterdir():
        if t.name != str(os.getpid()):
            n += int(next(l for l in (t / "status").read_text().splitlines() if l.startswith("voluntary_ctxt")).split()[1])
    return n


def compiled_ab(m, rounds: int) -> None:
    from runner.sampler import Sampler, SamplerConfig
    be = m.backend
    assert be._decode_layers(), "this model's layers do not take the compiled decode"
    cache, sampler = be.make_cache(2048), Sampler(SamplerConfig(temp=0))
    prompt = m.tokenizer.encode("def quicksort(xs):")
    logits = be.forward(prompt, cache)[-1]
    res, sleeps = {False: [], True: []}, {False: 0, True: 0}
    for r in range(rounds):
        for k in ((False, True) if r % 2 else (True, False)):
            be.compiled_step = k
            logits = be.forward([sampler.next(logits)], cache)[-1]      # the switch's first step untimed
            s0, t0 = _worker_sleeps(), time.perf_counter()
            for _ in range(8):
                logits = be.forward([sampler.next(logits)], cache)[-1]
            res[k].append((time.perf_counter() - t0) / 8)
            sleeps[k] += _worker_sleeps() - s0
        if cache.n_past > 1900:
            cache.reset()
            logits = be.forward(prompt, cache)[-1]
    ops_, comp = res[False], res[True]
    ratios = [c / o for o, c in zip(ops_, comp)]
    print(f"decode step: ops {statistics.median(ops_) * 1e3:.2f} ms, compiled layers {statistics.median(comp) * 1e3:.2f} ms; "
          f"paired ratio {statistics.median(ratios):.3f}, compiled shorter in {sum(x < 1 for x in ratios)} of {rounds}; "
          f"the OpenMP worker slept {sleeps[False] / rounds / 8:.1f} / {sleeps[True] / rounds / 8:.1f} times a step")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="qwen2.5-coder:0.5b")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--calls", action="store_true", help="every compiled call timed (3. above)")
    ap.add_argument("--python", action="store_true", help="the Python alone (4. above)")
    ap.add_argument("--ab", action="store_true", help="compiled layers against the ops (5. above)")
    ap.add_argument("-r", type=int, default=120, help="--ab's rounds")
    ap.add_argument("--draft", action="store_true", help="loaded as a speculative draft (its wider matrices as Q4_0)")
    a = ap.parse_args()
    from runner.model import load
    m = load(a.model, draft=a.draft)
    if a.ab:
        return compiled_ab(m, a.r)
    if a.python or a.calls:
        return python_alone(m, a.n, a.tokens) if a.python else calls(m, a.n, a.tokens)
    matrices(m, a.tokens)
    print()
    ops(m, a.n, a.tokens)


if __name__ == "__main__":
    main()
