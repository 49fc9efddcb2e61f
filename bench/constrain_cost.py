"""What constrained output costs: decode tok/s with a JSON schema vs without, on the same
prompts, and the delay before the first token that setting the constraint up adds.

Decode: for each of the extraction prompts (tests/fixtures/constrain_prompts.json, one per
schema unless --prompts says more), greedy, the plain and the --schema run one after the
other, their order swapped every pair (this machine's speed drifts over minutes: a drift
then lands on both sides). Decode tok/s is generate()'s (tokens after the first over the
time after the first). The first pair warms up and is not counted.

First-token delay: parse_constraint (schema -> grammar, no model), the tokenizer bridge
(once per tokenizer and process: every token's bytes handed to llguidance) and spec.start
(the matcher for one sequence), each timed on its own; cold = the first of each in the process.

    python bench/constrain_cost.py [MODEL] [-n 64] [-r 3] [--prompts 10]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import runner.env  # noqa: E402,F401  (thread-pool defaults, before numpy)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="qwen2.5-coder:0.5b")
    ap.add_argument("-n", "--max-tokens", type=int, default=64)
    ap.add_argument("-r", "--reps", type=int, default=3, help="counted pairs per prompt")
    ap.add_argument("--prompts", type=int, default=10, help="how many prompts (one per schema first)")
    ap.add_argument("--json", action="store_true", help="one JSON object at the end")
    a = ap.parse_args()

    from runner.constrain import bridge, parse_constraint
    from runner.generate import Done, generate
    from runner.model import load
    from runner.sampler import Sampler, SamplerConfig

    fx = json.loads((ROOT / "tests/fixtures/constrain_prompts.json").read_text(encoding="utf-8"))
    seen, first, rest = set(), [], []
    for p in fx["prompts"]:   # one prompt per schema first, so that every schema is measured
        (rest if p["schema"] in seen else first).append(p)
        seen.add(p["schema"])
    prompts = (first + rest)[:a.prompts]

    t = time.perf_counter()
    specs = {p["schema"]: parse_constraint("schema", fx["schemas"][p["schema"]]) for p in prompts[:1]}
    parse_cold = time.perf_counter() - t
    parse_warm = []
    for p in prompts:
        t = time.perf_counter()
        specs[p["schema"]] = parse_constraint("schema", fx["schemas"][p["schema"]])
        parse_warm.append(time.perf_counter() - t)

    m = load(a.model)
    tok = m.tokenizer
    t = time.perf_counter()
    bridge(tok)
    bridge_s = time.perf_counter() - t
    start_s = []
    for p in prompts:
        t = time.perf_counter()
        specs[p["schema"]].start(tok)
        start_s.append(time.perf_counter() - t)

    def run(p, constrained: bool) -> float:
        ids = m.template.encode(tok, [{"role": "user", "content": p["prompt"]}])
        c = specs[p["schema"]].start(tok) if constrained else None
        s = Sampler(SamplerConfig(temp=0), constraint=c)
        done = [ev for ev in generate(m, ids, s, m.make_cache(512), a.max_tokens) if isinstance(ev, Done)][0]
        return done.stats.gen_tps

    rows = []
    for p in prompts:
        rates = {False: [], True: []}
        for rep in range(a.reps + 1):
            order = (False, True) if rep % 2 == 0 else (True, False)
            for constrained in order:
                rates[constrained].append(run(p, constrained))
        plain, cons = statistics.mean(rates[False][1:]), statistics.mean(rates[True][1:])
        rows.append({"schema": p["schema"], "plain_tok_s": round(plain, 2), "schema_tok_s": round(cons, 2),
                     "ratio": round(cons / plain, 3) if plain else None})
        if not a.json:
            print(f"{p['schema']:10s} plain {plain:6.1f} tok/s  --schema {cons:6.1f} tok/s  ratio {cons / plain:.3f}",
                  flush=True)
    ratios = [r["ratio"] for r in rows if r["ratio"]]
    geo = statistics.geometric_mean(ratios) if ratios else float("nan")
    delay = {"parse_cold_ms": round(parse_cold * 1e3, 2), "parse_median_ms": round(statistics.median(parse_warm) * 1e3, 2),
             "bridge_ms": round(bridge_s * 1e3, 1), "start_median_ms": round(statistics.median(start_s) * 1e3, 2),
             "start_max_ms": round(max(start_s) * 1e3, 2)}
    if a.json:
        print(json.dumps({"model": a.model, "max_tokens": a.max_tokens, "reps": a.reps, "rows": rows,
                          "geomean_ratio": round(geo, 3), **delay}))
        return
    print(f"geometric mean --schema/plain decode: {geo:.3f} over {len(ratios)} prompts ({a.model}, -n {a.max_tokens}, "
          f"{a.reps} counted pairs each)")
    print(f"first-token delay: parse {delay['parse_cold_ms']} ms cold / {delay['parse_median_ms']} ms median; "
          f"bridge {delay['bridge_ms']} ms once per tokenizer; matcher start {delay['start_median_ms']} ms median "
          f"({delay['start_max_ms']} max)")


if __name__ == "__main__":
    main()
