"""numbat bench and llama-bench at context depths, on the same GGUF and threads, in one run.

    python bench/depth_compare.py qwen2.5-coder:1.5b --llama-bin DIR [--types f16,q8_0]
        [--depths 0,4096,16384] [-p 512] [-n 128] [-t 2] [-r 3]

For each cache type T (K and V both T) and each depth D, the two engines take turns (which
goes first alternates from one depth to the next, so a drift of the machine's speed hits
both alike):
- `numbat bench MODEL -p P -n N -d D -r R -t T -fa on -ctk T -ctv T --json`;
- `DIR/llama-bench -m FILE -p P -n N -d D -t T -fa 1 -ctk T -ctv T -r R -o json`
  (its fields n_prompt, n_gen, n_depth, avg_ts).
Both fill the cache with D random tokens untimed and time ppP / tgN from there, each run
after a warm-up. DIR holds llama.cpp's tools built from the llama-cpp-python 0.3.36 sdist
(../shared/DESIGN.md section 7). Prints a markdown table of tok/s and numbat / llama.cpp
per type, test and depth, under the CPU's name. Dev only: never part of the tests.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ)          # before anything of ours sets OpenMP defaults (as bench/compare.py)
sys.path.insert(0, str(ROOT))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_numbat(model: str, a, t: str, depth: int) -> dict[str, float]:
    """{"pp512": tok/s, "tg128": tok/s} of numbat bench at one depth."""
    cmd = [sys.executable, "-m", "cli", "bench", model, "-p", str(a.p), "-n", str(a.n), "-d", str(depth),
           "-r", str(a.reps), "-t", str(a.threads), "-fa", "on", "-ctk", t, "-ctv", t, "--json"]
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"numbat bench failed ({' '.join(cmd[2:])}):\n{r.stderr[-2000:]}")
    rows = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    return {row["test"]: row["tokens_per_s"] for row in rows if row["n_depth"] == depth}


def run_llama(bench: Path, path: str, a, t: str, depth: int) -> dict[str, float]:
    cmd = [str(bench), "-m", path, "-p", str(a.p), "-n", str(a.n), "-d", str(depth), "-t", str(a.threads),
           "-fa", "1", "-ctk", t, "-ctv", t, "-r", str(a.reps), "-o", "json"]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    if r.returncode < 0:
        sys.exit(f"llama-bench was killed by {signal.Signals(-r.returncode).name} ({' '.join(cmd[1:])}): on an Intel "
                 f"AMX machine a native llama.cpp build crashes in its AMX kernels; build it without AMX "
                 f"(../shared/DESIGN.md section 7)\n{r.stderr[-2000:]}")
    if r.returncode:
        sys.exit(f"llama-bench failed ({' '.join(cmd[1:])}):\n{r.stderr[-2000:]}")
    out = {}
    for row in json.loads(r.stdout):
        test = f"pp{row['n_prompt']}" if row["n_gen"] == 0 else f"tg{row['n_gen']}" if row["n_prompt"] == 0 \
            else f"pp{row['n_prompt']}+tg{row['n_gen']}"
        if row["n_depth"] == depth:
            out[test] = float(row["avg_ts"])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", help="a catalog name or a .gguf path")
    ap.add_argument("--llama-bin", type=Path, required=True, help="the directory holding llama-bench")
    ap.add_argument("--types", default="f16,q8_0", help="KV cache types to run, each for K and V (f16, q8_0, q4_0)")
    ap.add_argument("--depths", default="0,4096,16384")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--reps", type=int, default=3)
    a = ap.parse_args()
    from runner.kv_cache import CACHE_TYPES
    from runner.model import resolve
    types = a.types.split(",")
    for t in types:
        if t not in CACHE_TYPES:
            sys.exit(f"--types: {t!r} is not one of {', '.join(CACHE_TYPES)}")
    try:
        depths = [int(d) for d in a.depths.split(",")]
    except ValueError:
        sys.exit(f"--depths must be comma-separated integers, got {a.depths!r}")
    bench = a.llama_bin / "llama-bench"
    if not bench.is_file():
        sys.exit(f"{bench} does not exist: give --llama-bin the directory of llama.cpp's built tools")
    path = str(resolve(a.model))            # a catalog name: the cached file (fetched on first use)
    tests = [f"pp{a.p}"] * (a.p > 0) + [f"tg{a.n}"] * (a.n > 0)
    rates = {}          # (type, test, depth) -> {engine: tok/s}
    step = 0
    for t in types:
        for depth in depths:
            engines = ("numbat", "llama.cpp") if step % 2 == 0 else ("llama.cpp", "numbat")
            step += 1
            for engine in engines:
                got = run_numbat(a.model, a, t, depth) if engine == "numbat" else run_llama(bench, path, a, t, depth)
                for test, v in got.items():
                    rates.setdefault((t, test, depth), {})[engine] = v
                print(f"  {t} d{depth} {engine}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()),
                      file=sys.stderr, flush=True)
    print(f"# {a.model}: {cpu_name()}, {os.cpu_count()} cores, -t {a.threads}, -fa on, -r {a.reps}\n")
    print("| cache K/V | test | depth | numbat t/s | llama.cpp t/s | numbat / llama.cpp |")
    print("|---|---|---|---|---|---|")
    nan = float("nan")
    for t in types:
        for depth in depths:
            for test in tests:
                r = rates.get((t, test, depth), {})
                nb, ll = r.get("numbat", nan), r.get("llama.cpp", nan)
                print(f"| {t} | {test} | {depth} | {nb:.2f} | {ll:.2f} | {nb / ll if ll else nan:.2f} |")


if __name__ == "__main__":
    main()
