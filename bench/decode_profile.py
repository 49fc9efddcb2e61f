"""Where a decode step's time goes: matvec kernels, attention, norms/RoPE/activations,
sampling, and the Python around them.

    python bench/decode_profile.py [MODEL] [-n 64] [-t 2] [--check K | --prompt P]

cProfile over n greedy decode steps, its per-function own time summed by category. With
--check K, each step is instead one forward of K tokens with all their logits, rolled back
after: what a speculative check of K - 1 guesses costs. With --prompt P, a P-token prompt into an
empty cache, the last logits only (what pp512 times). Compiled kernels count as whole
calls; "python" is everything else (the forward's bookkeeping, the wrappers, cProfile's own
per-call cost of about a microsecond per call, included).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import runner.env  # noqa: E402, F401  (thread-pool defaults, before numpy loads OpenBLAS)

CATEGORIES = (      # first match wins: (category, substrings of "file:function")
    ("matvec", ("quant/legacy.py:_mv", "quant/kquants.py:matvec_", "quant/packed.py:_run", "quant/packed.py:_matmul", "quant/floats.py:", "quant/act.py:quantize",
                "quant/kquants.py:quantize_x", "quant/kquants.py:quantize_rows", "quant/legacy.py:_quantize")),
    ("attention", ("kernels.py:flash_attention", "kernels.py:attention", "kernels.py:_fa_run")),
    ("norms/rope/act", ("kernels.py:rms_norm", "kernels.py:rope", "kernels.py:silu", "kernels.py:gelu",
                        "dequant_rows")),
    ("sampling", ("sampler.py:",)),
)


def categorize(stats: pstats.Stats) -> dict[str, float]:
    out = {c: 0.0 for c, _ in CATEGORIES} | {"python": 0.0}
    for (file, _, fn), (_, _, tottime, _, _) in stats.stats.items():
        key = f"{file}:{fn}".replace("\\", "/")
        cat = next((c for c, subs in CATEGORIES if any(s in key for s in subs)), "python")
        out[cat] += tottime
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="qwen2.5-coder:0.5b")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--check", type=int, default=0, help="profile forwards of this many tokens instead")
    ap.add_argument("--prompt", type=int, default=0,
                    help="profile prompts of this many tokens instead (the last logits only, as pp512)")
    a = ap.parse_args()
    import numba

    from runner.model import load
    from runner.sampler import Sampler, SamplerConfig
    numba.set_num_threads(a.threads)
    m = load(a.model)
    cache = m.backend.make_cache(max(512, a.prompt + 64))
    sampler = Sampler(SamplerConfig(temp=0))
    ids = m.tokenizer.encode("def quicksort(xs):")

    def decode(n):
        cache.reset()
        logits = m.backend.forward(ids, cache)[-1]
        for _ in range(n):
            t = sampler.next(logits)
            logits = m.backend.forward([t], cache)[-1]

    def check():
        m.backend.forward((ids * a.check)[:a.check], cache, logits="all", one_by_one=True)   # as speculative_generate
        cache.rollback(a.check)

    def prompt():
        cache.reset()
        m.backend.forward((ids * a.prompt)[:a.prompt], cache)

    decode(4)                       # compile / warm
    prof = cProfile.Profile()
    cache.reset()
    logits = m.backend.forward(ids, cache)[-1]
    if a.check:
        check()
    if a.prompt:
        prompt()
    prof.enable()
    for _ in range(a.n):
        if a.check:
            check()
        elif a.prompt:
            prompt()
        else:
            t = sampler.next(logits)
            logits = m.backend.forward([t], cache)[-1]
    prof.disable()
    cats = categorize(pstats.Stats(prof))
    total = sum(cats.values())
    step = f"forwards of {a.check} tokens" if a.check else f"prompts of {a.prompt} tokens" if a.prompt else "decode steps"
    print(f"{a.model}, {a.threads} threads, {a.n} {step}: {total / a.n * 1e3:.2f} ms each under cProfile\n")
    print("| part | ms | share |\n|---|---|---|")
    for c, v in cats.items():
        print(f"| {c} | {v / a.n * 1e3:.2f} | {v / total:.0%} |")


if __name__ == "__main__":
    main()
