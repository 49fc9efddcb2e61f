"""How near the MLX backend's answers are to llama.cpp's, against the llama.cpp fixtures the
numba backend is tested with (tests/fixtures/model_*.json: -fa off; *_fa.json: -fa on):
perplexity by llama.cpp's method on the first N tokens of tests/fixtures/ppl_text.txt, top-1
agreement over those positions, and where each greedy 64-token continuation leaves
llama.cpp's (with llama.cpp's top-2 gap there).

    python bench/mlx_accuracy.py qwen2.5-coder:1.5b                 # the first 512-token chunk
    python bench/mlx_accuracy.py gemma3:270m --tokens 0 --no-greedy # the whole text (slow on mlx[cpu])

The whole text in pieces, in parallel processes (each 512-token chunk is scored on its own,
so the pieces' scores are the whole run's):

    python bench/mlx_accuracy.py qwen2.5-coder:1.5b --chunks 0:6 --save a.npz   # one process
    python bench/mlx_accuracy.py qwen2.5-coder:1.5b --chunks 6:11 --save b.npz  # another
    python bench/mlx_accuracy.py qwen2.5-coder:1.5b --combine a.npz b.npz

The README's MLX table came from this (and the whole-text figures from
`numbat perplexity MODEL --backend mlx -f tests/fixtures/ppl_text.txt`).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIXTURES = ROOT / "tests" / "fixtures"


def fixtures(model: str) -> tuple[dict, dict]:
    """llama.cpp's fixtures of a model: -fa off's and -fa on's."""
    stem = "model_" + model.replace(":", "-")
    try:
        return tuple(json.loads((FIXTURES / f"{stem}{s}.json").read_text(encoding="utf-8")) for s in ("", "_fa"))
    except FileNotFoundError:
        sys.exit(f"no llama.cpp fixtures for {model} in {FIXTURES}")


def first_divergence(ours: list[int], ref: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a catalog name with fixtures: qwen2.5-coder:0.5b, qwen2.5-coder:1.5b, gemma3:270m")
    ap.add_argument("--tokens", type=int, default=512, help="score the first N tokens (0: the whole text)")
    ap.add_argument("--no-greedy", action="store_true", help="skip the greedy continuations")
    ap.add_argument("--chunks", help="A:B: score only 512-token chunks A..B-1 of the whole text (no greedy runs)")
    ap.add_argument("--save", help="with --chunks: write the scored tokens' NLL and top-1 to this .npz")
    ap.add_argument("--combine", nargs="+", help="the whole text's figures from --save files of every chunk")
    a = ap.parse_args()
    if a.combine:
        return combine(a.model, a.combine)
    from runner.model import load
    from runner.perplexity import perplexity
    off, on = fixtures(a.model)
    m = load(a.model, backend="mlx")
    ids = off["text_ids"][:a.tokens] if a.tokens else off["text_ids"]
    t = time.perf_counter()
    if a.chunks:
        c0, c1 = (int(v) for v in a.chunks.split(":"))
        r = perplexity(m, off["text_ids"][c0 * 512:c1 * 512], n_ctx=512)
        print(f"{a.model} --backend mlx, chunks {c0}..{c1 - 1}: PPL {r.ppl:.4f} ({time.perf_counter() - t:.0f} s)")
        if a.save:
            np.savez(a.save, c0=c0, c1=c1, nll=r.nll, top1=r.top1)
        return
    r = perplexity(m, ids, n_ctx=512)
    print(f"{a.model} --backend mlx, {len(ids)} tokens: PPL {r.ppl:.4f} +/- {r.error:.4f} ({r.n_scored} scored, "
          f"{time.perf_counter() - t:.0f} s)")
    for label, fx in (("-fa off", off), ("-fa on", on)):
        top1 = float((r.top1 == np.asarray(fx["perplexity"]["top1"][:len(r.top1)])).mean())
        whole = f", llama.cpp's PPL over the whole text {fx['perplexity']['ppl']:.4f}" if not a.tokens else ""
        print(f"  top-1 = llama.cpp {label}'s: {top1:.1%}{whole}")
    if a.no_greedy:
        return
    for g_off, g_on in zip(off["greedy"], on["greedy"]):
        if g_off["prompt"] is None:
            continue
        cache = m.make_cache(256)
        logits = m.backend.forward(g_off["prompt_ids"], cache)[-1]
        out = []
        for _ in range(len(g_off["ids"])):
            out.append(int(np.argmax(logits)))
            if out != g_off["ids"][:len(out)] and out != g_on["ids"][:len(out)]:
                break
            logits = m.backend.forward(out[-1:], cache)[-1]
        parts = []
        for label, g in (("-fa off", g_off), ("-fa on", g_on)):
            i = first_divergence(out, g["ids"])
            parts.append(f"{label}: " + ("all 64" if i is None else f"leaves at step {i} (gap {g['gaps'][i]:.3f})"))
        print(f"  greedy {g_off['prompt'][:24]!r}: " + "; ".join(parts))


def combine(model: str, files: list[str]) -> None:
    """The whole text's perplexity and top-1 agreement from pieces that cover every chunk once."""
    from runner.perplexity import ppl_and_error
    fx = dict(zip(("-fa off", "-fa on"), fixtures(model)))
    parts = sorted((np.load(f) for f in files), key=lambda p: int(p["c0"]))
    n_chunks = len(fx["-fa off"]["text_ids"]) // 512
    if [(int(p["c0"]), int(p["c1"])) for p in parts] != list(zip([0] + [int(p["c1"]) for p in parts[:-1]], [int(p["c1"]) for p in parts])) \
            or int(parts[-1]["c1"]) != n_chunks:
        sys.exit(f"the pieces must cover chunks 0..{n_chunks - 1} once, in runs that meet")
    nll, top1 = np.concatenate([p["nll"] for p in parts]), np.concatenate([p["top1"] for p in parts])
    ppl, err = ppl_and_error(nll)
    print(f"{model} --backend mlx, the whole text ({n_chunks} chunks, {len(nll)} scored): PPL {ppl:.4f} +/- {err:.4f}")
    for label, f in fx.items():
        ref = f["perplexity"]
        agree = float((top1 == np.asarray(ref["top1"][:len(top1)])).mean())
        print(f"  llama.cpp {label}: PPL {ref['ppl']:.4f} ({(ppl / ref['ppl'] - 1):+.2%}), top-1 agreement {agree:.1%}")


if __name__ == "__main__":
    main()
