"""In-process A/B of speculative decoding set-ups: the target's plain greedy decode and each
proposer on the code prompts (cli's BENCH_CODE and bench/prompts/code_*.txt), one process,
runs alternating prompt by prompt (this host's speed drifts by 10-40% within minutes:
separate processes cannot tell a 10% change apart). A first round warms up.

    python bench/spec_ab.py [--target qwen2.5-coder:1.5b] [-n 128] [-r 2]
                            [--draft qwen2.5-coder:0.5b --draft qwen2.5-coder:0.5b:file@4 ...]

A draft is MODEL[:file][@K]: loaded as the CLI loads a draft (its wider matrices requantized
to Q4_0) or, with :file, in the file's own types; K guesses a check (default 3). Reports each
run's generation rate and, per draft, the geometric mean over plain and the tokens a check.

--parts: where a round goes, per draft, in plain decode steps of the same prompt's run (medians
over the runs, each part's apart): the target's check, the draft's one-token forwards and its forwards of two
tokens or more (the guess it did not feed and the target's token, after a check that took
every guess), its output layer (DraftHead), and the rest (verification, sampling, Python
between them). Each wrapped call's first of a run (the prompt's forward, the draft's head
after it) is left out; the parts are timed around whole calls (~1 us a call).
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
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
from runner import speculative  # noqa: E402
from runner.speculative import DRAFT_K, DraftModel, speculative_generate  # noqa: E402


class Parts:
    """Time spent in the calls of a round, by part (see --parts), and their counts."""

    def __init__(self, target, drafts):
        self.ms, self.calls, self.first = collections.Counter(), collections.Counter(), set()
        self._wrap(target.backend, "forward", lambda ids: "check")
        for m in drafts:
            self._wrap(m.backend, "forward", lambda ids: "draft 1" if len(ids) == 1 else "draft 2+")
        self._wrap(speculative.DraftHead, "__call__", lambda h: "draft head")

    def _wrap(self, obj, attr, part):
        f = getattr(obj, attr)

        def timed(*a, **k):
            t0 = time.perf_counter()
            r = f(*a, **k)
            if id(obj) in self.first:       # each model's first call of a run: the prompt's
                name = part(a[-1] if attr == "__call__" else a[0])
                self.ms[name] += (time.perf_counter() - t0) * 1e3
                self.calls[name] += 1
            self.first.add(id(obj))
            return r
        setattr(obj, attr, timed)

    def reset(self):
        self.ms.clear(), self.calls.clear(), self.first.clear()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder:1.5b")
    ap.add_argument("--draft", action="append", help="MODEL[:file][@K], repeatable")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", "--reps", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--parts", action="store_true", help="where a round goes (see above)")
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
    parts = Parts(target, models.values()) if a.parts else None
    shares = {k: collections.defaultdict(list) for k in props}
    for r in range(a.reps + 1):
        for text in prompts:
            ids = target.tokenizer.encode(text)
            for k in rates:
                cache.reset()
                greedy = Sampler(SamplerConfig(temp=0))
                if parts:
                    parts.reset()
                events = (generate(target, ids, greedy, cache, a.n) if k == "plain" else
                          speculative_generate(target, ids, greedy, cache, props[k], a.n))
                done = list(events)[-1]
                if r:
                    rates[k].append(done.stats.gen_tps)
                    if k == "plain":
                        step = 1e3 / done.stats.gen_tps     # ms a plain step, this prompt
                    else:
                        spec = done.stats.spec
                        per_check[k].append(spec.as_dict()["tokens_per_target_forward"])
                        if parts and spec.forwards:   # per round (check), in plain steps
                            rnd = 1e3 * spec.tokens / done.stats.gen_tps / spec.forwards
                            for name in ("check", "draft 1", "draft 2+", "draft head"):
                                shares[k][name].append(parts.ms[name] / spec.forwards / step)
                                shares[k][name + " calls"].append(parts.calls[name] / spec.forwards)
                                shares[k][name + " ms"].append(parts.ms[name] / max(parts.calls[name], 1))
                            shares[k]["round"].append(rnd / step)
                            shares[k]["rest"].append((rnd - sum(parts.ms.values()) / spec.forwards) / step)
    for k, v in rates.items():
        print(f"{k}: " + " ".join(f"{x:.1f}" for x in v) + " tok/s")
    plain = np.array(rates["plain"])
    for k in props:
        gain = np.exp(np.mean(np.log(np.array(rates[k]) / plain)))
        print(f"{k}: {gain:.3f}x plain (geometric mean), {np.mean(per_check[k]):.2f} tokens a check")
        if parts:
            med = {n: statistics.median(v) for n, v in shares[k].items()}
            print(f"  a round {med['round']:.2f} plain steps: " + ", ".join(
                f"{n} {med[n]:.2f} ({med[n + ' calls']:.2f} calls of {med[n + ' ms']:.2f} ms)"
                for n in ("check", "draft 1", "draft 2+", "draft head")) + f", the rest {med['rest']:.2f}")


if __name__ == "__main__":
    main()
