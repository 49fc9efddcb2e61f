"""numbat batch against what a llama.cpp user runs for many prompts, in one run.

    python bench/batch_compare.py qwen2.5-coder:0.5b qwen2.5-coder:1.5b --llama-bin DIR \
        [-n 64] [--max-tokens 128] [--parallel 1,2,4,8,16] [-t 2] [-r 2]

For each model, alternating engines within each round:
- `numbat batch` on a file of n chat records (code and prose questions under one shared system
  prompt, greedy, --max-tokens each) at every --parallel: aggregate generation tok/s
  (completion tokens / the run's wall time, model load excluded) from --metrics;
- `llama-server --parallel 8` (continuous batching, its prompt cache on) fed the same records
  by 8 concurrent HTTP clients, and `--parallel 1` by one client: completion tokens (from
  each response's usage) / wall time from the first request to the last answer;
- `llama-batched-bench -npp 128 -ntg 128 -npl 1,2,4,8,16`: raw batched decode (S_TG t/s).
DIR holds llama.cpp's tools built from the llama-cpp-python 0.3.36 sdist (../shared/DESIGN.md
section 7). Prints medians over the rounds and the ratios numbat / llama-server and numbat's
--parallel 8 / --parallel 1. Dev only: never part of the tests.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SYSTEM = ("You are a patient senior engineer and writer. Answer every question completely: for code, "
          "write the whole program with comments and a short usage example; for other questions, write "
          "a clear explanation of several paragraphs with examples. Do not ask questions back, do not "
          "apologize, and do not stop early: the reader wants the full answer in one message.")
TOPICS_CODE = ["a Python function that merges two sorted lists", "a C function that reverses a linked list",
               "a JavaScript function that debounces another function", "a Python class for an LRU cache",
               "a Rust function that counts words in a string", "a Go HTTP handler that returns JSON",
               "a SQL query that finds the top five customers by revenue", "a bash script that backs up a folder"]
TOPICS_PROSE = ["how a hash table handles collisions", "why the sky is blue", "how vaccines train the immune system",
                "what causes the seasons on Earth", "how a compiler turns source code into machine code",
                "the history of the printing press", "how photosynthesis works", "what inflation is and why it happens"]


def records(n: int, max_tokens: int) -> list[dict]:
    out = []
    for i in range(n):
        q = f"Write {TOPICS_CODE[i // 2 % 8]}." if i % 2 == 0 else f"Explain {TOPICS_PROSE[i // 2 % 8]}."
        if i >= 16:
            q += f" (Variant {i // 16}: use different names and examples.)"
        out.append({"id": f"r{i}", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                    "max_tokens": max_tokens, "temperature": 0})
    return out


def run_numbat(model, inp: Path, parallel: int, threads: int, tmp: Path) -> dict:
    out, met = tmp / f"out{parallel}.jsonl", tmp / f"m{parallel}.json"
    subprocess.run([sys.executable, "-m", "cli", "batch", model, str(inp), "-o", str(out), "--parallel", str(parallel),
                    "-t", str(threads), "--metrics", str(met), "--overwrite"], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(met.read_text())


def _post(port: int, rec: dict) -> dict:
    body = json.dumps({"messages": rec["messages"], "max_tokens": rec["max_tokens"], "temperature": 0,
                       "cache_prompt": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


def run_server(server: Path, model_path: str, recs: list[dict], parallel: int, threads: int, port: int) -> dict:
    ctx = parallel * 1024
    p = subprocess.Popen([str(server), "-m", model_path, "-t", str(threads), "--parallel", str(parallel), "-c", str(ctx),
                          "--port", str(port), "--host", "127.0.0.1", "-fa", "off"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if p.poll() is not None:
                raise RuntimeError(f"llama-server exited with {p.returncode} (an AMX build crashes: see DESIGN.md section 7)")
            if time.time() > deadline:
                raise RuntimeError("llama-server did not start in 300 s")
            time.sleep(0.5)
        _post(port, {**recs[0], "max_tokens": 4})        # warm
        queue, lock, tokens = list(recs), threading.Lock(), [0]

        def client():
            while True:
                with lock:
                    if not queue:
                        return
                    rec = queue.pop(0)
                u = _post(port, rec)["usage"]
                with lock:
                    tokens[0] += u["completion_tokens"]
        t0 = time.perf_counter()
        workers = [threading.Thread(target=client) for _ in range(parallel)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = time.perf_counter() - t0
        return {"completion_tokens": tokens[0], "wall_s": wall, "generation_tokens_per_s": tokens[0] / wall}
    finally:
        p.terminate()
        p.wait()


def run_batched_bench(bb: Path, model_path: str, threads: int, npl: list[int]) -> dict[int, float]:
    r = subprocess.run([str(bb), "-m", model_path, "-t", str(threads), "-c", str(256 * max(npl) + 256), "-npp", "128",
                        "-ntg", "128", "-npl", ",".join(map(str, npl)), "-fa", "off"], capture_output=True, text=True, check=True)
    out = {}
    for line in r.stdout.splitlines():      # |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s | ...
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[2].isdigit():
            out[int(cells[2])] = float(cells[7])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--llama-bin", type=Path, required=True)
    ap.add_argument("-n", type=int, default=64, help="records")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--parallel", default="1,2,4,8,16")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=18080)
    ap.add_argument("--no-batched-bench", action="store_true")
    a = ap.parse_args()
    from models import catalog
    par = [int(x) for x in a.parallel.split(",")]
    recs = records(a.n, a.max_tokens)
    print(f"# {os.uname().machine}, {os.cpu_count()} cores, -t {a.threads}; {a.n} records, max {a.max_tokens} tokens, greedy")
    for model in a.models:
        path = str(catalog.fetch(model)) if model in catalog.CATALOG else model
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            inp = tmp / "in.jsonl"
            inp.write_text("".join(json.dumps(r) + "\n" for r in recs))
            warm = tmp / "warm.jsonl"         # compiles the kernels (first run) outside the timings
            warm.write_text(json.dumps({**recs[0], "max_tokens": 2}) + "\n")
            run_numbat(model, warm, 1, a.threads, tmp)
            nb = {p: [] for p in par}
            srv = {8: [], 1: []}
            bb = []
            for rnd in range(a.rounds):
                for p in par:
                    m = run_numbat(model, inp, p, a.threads, tmp)
                    nb[p].append(m["generation_tokens_per_s"])
                    print(f"  round {rnd}: numbat --parallel {p}: {m['generation_tokens_per_s']:.1f} tok/s "
                          f"({m['completion_tokens']} tokens, {m['wall_s']:.1f} s, prefix cache {m['prefix_cache_hit_rate']:.2f})", flush=True)
                    if p in srv:
                        s = run_server(a.llama_bin / "llama-server", path, recs, p, a.threads, a.port)
                        srv[p].append(s["generation_tokens_per_s"])
                        print(f"  round {rnd}: llama-server --parallel {p}: {s['generation_tokens_per_s']:.1f} tok/s "
                              f"({s['completion_tokens']} tokens, {s['wall_s']:.1f} s)", flush=True)
                if not a.no_batched_bench:
                    bb.append(run_batched_bench(a.llama_bin / "llama-batched-bench", path, a.threads, par))
                    print(f"  round {rnd}: llama-batched-bench S_TG: {bb[-1]}", flush=True)
            med = lambda xs: statistics.median(xs) if xs else float("nan")
            print(f"\n## {model}\n\n| sequences | numbat batch tok/s | llama-batched-bench S_TG tok/s | llama-server tok/s |")
            print("|---|---|---|---|")
            for p in par:
                b = med([r.get(p, float("nan")) for r in bb]) if bb else float("nan")
                s = med(srv[p]) if p in srv else float("nan")
                print(f"| {p} | {med(nb[p]):.1f} | {b:.1f} | {s:.1f} |")
            if 8 in nb and srv[8]:
                print(f"\nnumbat --parallel 8 / llama-server --parallel 8: {med(nb[8]) / med(srv[8]):.2f}")
            if 8 in nb and 1 in nb:
                print(f"numbat --parallel 8 / numbat --parallel 1: {med(nb[8]) / med(nb[1]):.2f}")
            if srv[8] and srv[1]:
                print(f"llama-server --parallel 8 / --parallel 1: {med(srv[8]) / med(srv[1]):.2f}")


if __name__ == "__main__":
    main()
