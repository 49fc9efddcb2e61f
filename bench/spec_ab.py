"""In-process A/B of speculative decoding set-ups: the target's plain greedy decode and each
proposer on the code prompts (cli's BENCH_CODE and bench/prompts/code_*.txt), one process,
runs alternating prompt by prompt (this host's speed drifts by 10-40% within minutes:
separate processes cannot tell a 10% change apart). A first round warms up.

    python bench/spec_ab.py [--target qwen2.5-coder:1.5b] [-n 128] [-r 2]
                            [--draft qwen2.5-coder:0.5b --draft qwen2.5-coder:0.5b:file@4 ...]

A draft is MODEL[:file][@K]: loaded as the CLI loads a draft (its wider matrices requantized
to Q4_0) or, with :file, in the file's own types; K guesses a check (default 3). Reports each
run's generation rate and, per draft, the geometric mean over plain and the tokens a check.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import runner.env  # noqa: E402,F401  thread-pool settings before numpy

import numba  # noqa: E402
import numpy as np  # noqa: E402

from cli import BENCH_CODE  # noqa: E402
from runner.generate import generate  # noqa: E402
from runner.model import load  # noqa: E402
from runner.sampler import Sampler, SamplerConfig  # noqa: E402
from runner.speculative import DRAFT_K, DraftModel, speculative_generate  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder:1.5b")
    ap.add_argument("--draft", action="append", help="MODEL[:file][@K], repeatable")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", "--reps", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    numba.set_num_threads(a.threads)
    target = load(a.target)
    cache = target.make_cache(2048)
    models, props = {}, {}
    for spec in a.draft or ["qwen2.5-coder:0.5b", "qwen2.5-coder:0.5b:file"]:
        name, _, k = spec.partition("@")
        k, _, p_min = k.partition("/")
        if name not in models:
            models[name] = load(name.removesuffix(":file"), draft=not name.endswith(":file"))
        props[spec] = DraftModel(target, models[name], cache.n_ctx, k=int(k) if k else DRAFT_K,
                                 p_min=float(p_min) if p_min else 0.0)
    prompts = [BENCH_CODE] + [p.read_text() for p in sorted((ROOT / "bench" / "prompts").glob("code_*.txt"))]
    rates = {k: [] for k in ["plain", *props]}
    per_check = {k: [] for k in props}
    for r in range(a.reps + 1):
        for text in prompts:
            ids = target.tokenizer.encode(text)
            for k in rates:
                cache.reset()
                greedy = Sampler(SamplerConfig(temp=0))
                events = (generate(target, ids, greedy, cache, a.n) if k == "plain" else
                          speculative_generate(target, ids, greedy, cache, props[k], a.n))
                done = list(events)[-1]
                if r:
                    rates[k].append(done.stats.gen_tps)
                    if k != "plain":
                        per_check[k].append(done.stats.spec.as_dict()["tokens_per_target_forward"])
    for k, v in rates.items():
        print(f"{k}: " + " ".join(f"{x:.1f}" for x in v) + " tok/s")
    plain = np.array(rates["plain"])
    for k in props:
        gain = np.exp(np.mean(np.log(np.array(rates[k]) / plain)))
        print(f"{k}: {gain:.3f}x plain (geometric mean), {np.mean(per_check[k]):.2f} tokens a check")


if __name__ == "__main__":
    main()
