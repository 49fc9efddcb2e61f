"""llama.cpp and numbat on the same GGUF, same threads, one command: pp512 and tg128 tok/s,
their ratios, and the decode roofline (weight bytes read per token / measured read bandwidth).

    pip install -e ".[dev]"          # llama-cpp-python, the oracle (compiles for minutes)
    python bench/compare.py qwen2.5-coder:0.5b [more models or .gguf paths] [-t 2] [-r 3]
    python bench/compare.py qwen2.5-coder:0.5b@Q8_0 qwen2.5-coder:0.5b@Q4_0

    python bench/compare.py qwen2.5-coder:1.5b --draft qwen2.5-coder:0.5b --code bench/prompts/code_*.txt

MODEL@TYPE is MODEL requantized to TYPE (Q8_0, Q4_0) by llama.cpp's own quantizer, made once
into NUMBAT_HOME/bench/.

--draft DRAFT adds greedy decoding of -n tokens after code prompts: the fixed one of `numbat
bench` (cli.BENCH_CODE) and the files given with --code (bench/prompts/code_*.txt are three
more, in Python, C and JavaScript). For each: llama.cpp plain, numbat plain and numbat with
DRAFT speculating (k = --draft-max), as tokens after the first over the time after the first;
numbat's plain and speculative runs alternate.

Each engine runs in its own process started with the caller's environment: numbat sets
OpenMP wait defaults when it loads (runner/env.py) and llama.cpp links the same libgomp,
so sharing a process would impose numbat's choice on llama.cpp. Both see the same random
token ids, as llama-bench uses. Medians of -r runs after a warm-up; the engines alternate
-a rounds per model so drifts in the machine hit both alike.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ)          # before anything of ours sets OpenMP defaults


def bench_code() -> str:
    """cli.BENCH_CODE, read from cli.py's source: importing cli would set numbat's OpenMP wait
    defaults (runner/env.py) in llama.cpp's worker too (as it did until session 41)."""
    import ast
    for node in ast.parse((ROOT / "cli.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "BENCH_CODE" for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit("cli.py has no BENCH_CODE")


def worker(engine: str, path: str, threads: int, p: int, n: int, reps: int, seed: int,
           draft: str | None = None, draft_max: int = 3, code_files=()) -> dict:
    """Runs in the child: warm up, then reps of pp and tg (and with a draft, greedy decoding
    on the code prompts); tok/s lists as JSON."""
    import time
    if engine != "llama.cpp":      # numbat's thread-pool defaults, as its CLI sets them
        sys.path.insert(0, str(ROOT))
        import runner.env  # noqa: F401

    import numpy as np
    if draft:
        prompts = {"code": bench_code(), **{f"code {Path(c).name.removeprefix('code_').split('.')[0]}": Path(c).read_text()
                                          for c in code_files}}
    if engine == "llama.cpp":
        assert "runner.env" not in sys.modules, "llama.cpp's libgomp would take numbat's OpenMP defaults"
        import llama_cpp
        llm = llama_cpp.Llama(model_path=path, n_ctx=max(p, 512) + n + 8, n_batch=512, n_ubatch=512,
                              n_threads=threads, n_threads_batch=threads, verbose=False)
        vocab = llm.n_vocab()

        def pp(ids):
            llm.reset()
            llm.eval(ids)

        def tg(ids):
            llm.reset()
            for i in ids:
                llm.eval([i])

        def code(name, speculate):       # plain greedy on a code prompt: rate after the first token
            llm.reset()
            llm.eval(llm.tokenize(prompts[name].encode(), add_bos=True, special=False))
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            t = time.perf_counter()
            for _ in range(n - 1):
                llm.eval([tok])
                tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            return (n - 1) / (time.perf_counter() - t)
    else:
        import numba

        from runner.model import load
        numba.set_num_threads(threads)
        m = load(path)
        cache = m.backend.make_cache(p + n + 8)
        vocab = m.tokenizer.vocab_size

        def pp(ids):
            cache.reset()
            m.backend.forward(ids, cache)

        def tg(ids):
            cache.reset()
            for i in ids:
                m.backend.forward([i], cache)

        if draft:
            from runner.generate import generate
            from runner.sampler import Sampler, SamplerConfig
            from runner.speculative import DraftModel, speculative_generate
            code_ids = {k: m.tokenizer.encode(v) for k, v in prompts.items()}
            code_cache = m.make_cache(max(map(len, code_ids.values())) + n)
            proposer = DraftModel(m, load(draft, draft=True), code_cache.n_ctx, draft_max)

        def code(name, speculate):
            code_cache.reset()
            greedy = Sampler(SamplerConfig(temp=0))
            ids = code_ids[name]
            events = (speculative_generate(m, ids, greedy, code_cache, proposer, n) if speculate
                      else generate(m, ids, greedy, code_cache, n))
            return list(events)[-1].stats.gen_tps
    rng = np.random.default_rng(seed)
    out = {}
    for test, k, f in (("pp", p, pp), ("tg", n, tg)):
        rates = []
        for rep in range(reps + 1):
            ids = rng.integers(0, vocab, k).tolist()
            t = time.perf_counter()
            f(ids)
            if rep:      # rep 0 warms up
                rates.append(k / (time.perf_counter() - t))
        out[f"{test}{k}"] = rates
    # plain and speculative alternate, so that a drift of the machine's speed (minutes here)
    # does not land in their ratio; the first round warms up
    kinds = (False, True) if draft and engine != "llama.cpp" else (False,) if draft else ()
    for name in prompts if draft else ():
        runs = [(speculate, code(name, speculate)) for _ in range(reps + 1) for speculate in kinds][len(kinds):]
        for speculate in kinds:
            out[f"tg{n} {name}" + (", draft" if speculate else "")] = [r for s, r in runs if s == speculate]
    return out


def run_worker(engine, path, a) -> dict:
    cmd = [sys.executable, __file__, "--worker", engine, str(path), "-t", str(a.threads),
           "-p", str(a.p), "-n", str(a.n), "-r", str(a.reps), "--draft-max", str(a.draft_max)]
    if a.draft:
        cmd += ["--draft", a.draft, "--code", *a.code]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"{engine} on {path} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def read_bandwidth(threads: int) -> float:
    """Median GB/s of bench/kernels.py's parallel vectorized sum over 1 GiB, in a child with
    the same thread count."""
    code = ("import sys, numba; sys.path.insert(0, %r); numba.set_num_threads(%d); "
            "from bench.kernels import read_bandwidth; print(read_bandwidth(7)[0])" % (str(ROOT), threads))
    r = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, check=True)
    return float(r.stdout.strip().splitlines()[-1])


def decode_bytes(path) -> int:
    """Weight bytes one decode step reads: every matrix once, the embedding one row."""
    sys.path.insert(0, str(ROOT))
    from gguf_io import open_gguf
    f = open_gguf(path)
    total = sum(t.nbytes for n, t in f.tensors.items() if n != "token_embd.weight")
    if "output.weight" not in f.tensors:       # tied: the head reads the embedding matrix
        total += f.tensors["token_embd.weight"].nbytes
    return total


def requantized(model: str) -> Path:
    """MODEL@TYPE -> the GGUF requantized by llama_model_quantize (cached)."""
    from runner.model import resolve
    name, _, qtype = model.partition("@")
    src = resolve(name)
    out = Path(os.environ.get("NUMBAT_HOME", Path.home() / ".cache" / "numbat")) / "bench" / f"{src.stem}-{qtype}.gguf"
    if not out.exists():      # in a child: llama.cpp prints every tensor it converts
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".part")
        code = ("import llama_cpp as l, sys; p = l.llama_model_quantize_default_params(); "
                f"p.ftype = l.LLAMA_FTYPE_MOSTLY_{qtype}; p.allow_requantize = True; "
                f"sys.exit(l.llama_model_quantize({str(src)!r}.encode(), {str(tmp)!r}.encode(), p))")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"requantizing {src} to {qtype} failed:\n{r.stderr[-2000:]}")
        tmp.rename(out)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("-a", "--alternations", type=int, default=2)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--draft", help="also greedy decoding on a code prompt, numbat speculating with this draft")
    ap.add_argument("--draft-max", type=int, default=3)
    ap.add_argument("--code", nargs="*", default=[], help="more code prompts (files) for --draft")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.models[0], a.threads, a.p, a.n, a.reps, os.getpid(),
                                a.draft, a.draft_max, a.code)))
        return
    sys.path.insert(0, str(ROOT))
    from runner.model import resolve
    bw = read_bandwidth(a.threads)
    print(f"read bandwidth ({a.threads} threads): {bw:.1f} GB/s\n")
    print("| model | test | llama.cpp tok/s | numbat tok/s | numbat / llama.cpp | roofline tok/s | numbat / roofline |")
    print("|---|---|---|---|---|---|---|")
    for model in a.models:
        path = requantized(model) if "@" in model else resolve(model)
        rates = {"llama.cpp": {}, "numbat": {}}
        for _ in range(a.alternations):
            for engine in rates:
                for test, r in run_worker(engine, path, a).items():
                    rates[engine].setdefault(test, []).extend(r)
        roof = bw * 1e9 / decode_bytes(path)
        for test in (f"pp{a.p}", f"tg{a.n}"):
            ll, nb = statistics.median(rates["llama.cpp"][test]), statistics.median(rates["numbat"][test])
            extra = f"{roof:.1f} | {nb / roof:.2f}" if test.startswith("tg") else "- | -"
            print(f"| {model} | {test} | {ll:.1f} | {nb:.1f} | {nb / ll:.2f} | {extra} |", flush=True)
        spec = {}           # prompt -> (speculative / numbat plain, speculative / llama.cpp)
        for test in [t for t in rates["llama.cpp"] if t.startswith(f"tg{a.n} code")] if a.draft else ():
            ll = statistics.median(rates["llama.cpp"][test])     # llama.cpp decodes plainly in both rows
            nb, sp = (statistics.median(rates["numbat"][t]) for t in (test, test + ", draft"))
            print(f"| {model} | {test} | {ll:.1f} | {nb:.1f} | {nb / ll:.2f} | - | - |")
            print(f"| {model} | {test}, numbat with draft {a.draft} k={a.draft_max} | {ll:.1f} | {sp:.1f} | {sp / ll:.2f} | - | - |", flush=True)
            spec[test.removeprefix(f"tg{a.n} ")] = (sp / nb, sp / ll)
        for i, base in enumerate(("numbat plain", "llama.cpp plain") if spec else ()):
            gm = statistics.geometric_mean(v[i] for v in spec.values())
            print(("\n" if i == 0 else "") + f"speculative / {base}: " + ", ".join(f"{k} {v[i]:.2f}" for k, v in spec.items())
                  + f" (geometric mean {gm:.2f})")


if __name__ == "__main__":
    main()
