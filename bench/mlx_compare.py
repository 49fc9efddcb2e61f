"""numbat's MLX backend, mlx-lm and llama.cpp on the same model in one run, one table (for a Mac).

    pip install -e ".[mlx]" mlx-lm          # llama.cpp: `brew install llama.cpp` (llama-bench on PATH)
    python bench/mlx_compare.py qwen2.5-coder:0.5b [-p 512] [-n 128] [-r 3] [-a 2] [--json]
        [--llama-bin DIR] [--mlx-model PATH_OR_REPO | --hf-repo REPO --mlx-bits B] [-t N]
        [--engines numbat-mlx,mlx-lm,llama.cpp]

MODEL is a catalog name or a .gguf path. Each of -a rounds runs every engine once (the first
engine rotates from round to round, so a drift of the machine's speed hits all alike); the
table gives the medians over rounds and numbat-mlx / mlx-lm, numbat-mlx / llama.cpp:
- numbat-mlx: `numbat bench MODEL -p P -n N -r R --json --backend mlx` (mean of R runs);
- llama.cpp:  `llama-bench -m GGUF -p P -n N -r R -o json`, its defaults otherwise (on a Mac:
  Metal, every layer offloaded), the GGUF numbat reads;
- mlx-lm:     `python -m mlx_lm.benchmark --model M -p P -g N -n R` (mlx-lm >= 0.27, flags from
  ml-explore/mlx-lm mlx_lm/benchmark.py), mean of its "Trial" lines. Older mlx-lm: R runs of
  `python -m mlx_lm.generate --model M --prompt TEXT --max-tokens N --ignore-chat-template`,
  its "Prompt:" / "Generation:" lines (each a cold process; the table says so).
mlx-lm does not read GGUF, so M is --mlx-model, or the model's Hugging Face repo (HF_REPOS, or
--hf-repo) converted once by `python -m mlx_lm.convert --hf-path REPO -q --q-bits B
--q-group-size 64` into NUMBAT_HOME/bench/mlx/, B (or --mlx-bits) the MLX width whose
bits/weight (B + 0.5 at group 64) is nearest the GGUF's matrices' (printed). An engine that is
missing or fails is skipped with one line. tests/test_mlx_compare.py runs everything but the engines.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ)          # before anything of ours sets OpenMP defaults (as bench/compare.py)
sys.path.insert(0, str(ROOT))
from bench.depth_compare import cpu_name  # noqa: E402

ENGINES = ("numbat-mlx", "mlx-lm", "llama.cpp")
# the catalog GGUFs' original checkpoints; speed depends on shapes and widths, not on which
# fine-tune's values (the 0.5b GGUF says it came from the AWQ release of the same model)
HF_REPOS = {"qwen2.5-coder:0.5b": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
            "qwen2.5-coder:1.5b": "Qwen/Qwen2.5-Coder-1.5B-Instruct",
            "gemma3:270m": "google/gemma-3-270m-it"}    # gated on Hugging Face: accept its licence first
MLX_BITS = (2, 3, 4, 5, 6, 8)


class EngineError(Exception):
    pass


def machine() -> str:
    name = ""
    if sys.platform == "darwin":    # /proc/cpuinfo and lscpu do not exist there
        name = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True).stdout.strip()
    return f"{platform.machine()}, {name or cpu_name()}, {os.cpu_count()} cores"


def llama_bench(bin_dir: Path | None) -> Path | None:
    p = bin_dir / "llama-bench" if bin_dir else shutil.which("llama-bench")
    return Path(p) if p and Path(p).is_file() else None


def missing(engine: str, a) -> str | None:
    """Why an engine cannot run here (one line), or None. Checks without importing: mlx_lm's
    import pulls in transformers, seconds for nothing."""
    if engine == "numbat-mlx" and importlib.util.find_spec("mlx") is None:
        return "mlx is not installed (pip install -e '.[mlx]')"
    if engine == "mlx-lm" and importlib.util.find_spec("mlx_lm") is None:
        return "mlx-lm is not installed (pip install mlx-lm)"
    if engine == "mlx-lm" and not a.mlx_model and not (a.hf_repo or HF_REPOS.get(a.model)):
        return f"no Hugging Face repo known for {a.model}: give --hf-repo REPO or --mlx-model PATH_OR_REPO"
    if engine == "llama.cpp" and llama_bench(a.llama_bin) is None:
        return (f"no llama-bench in {a.llama_bin}" if a.llama_bin else "llama-bench is not on PATH") + \
            " (brew install llama.cpp, or --llama-bin DIR)"
    return None


def gguf_bits(path) -> float:
    """Bits per weight of the GGUF's matrices (norms and biases left out, as mlx-lm keeps them float)."""
    from gguf_io import open_gguf
    ts = [t for t in open_gguf(path).tensors.values() if len(t.dims) >= 2]
    return 8 * sum(t.nbytes for t in ts) / sum(t.n_elements for t in ts)


def mlx_bits(bpw: float) -> int | None:
    """The MLX width whose bits/weight at group 64 (a f16 scale and bias per 64: +0.5) is nearest
    bpw; None (no -q, float weights) for a float GGUF."""
    return None if bpw > 12 else min(MLX_BITS, key=lambda b: abs(b + 0.5 - bpw))


def convert_cmd(repo: str, out: Path, bits: int | None) -> list[str]:
    q = ["-q", "--q-bits", str(bits), "--q-group-size", "64"] if bits else []
    return [sys.executable, "-m", "mlx_lm.convert", "--hf-path", repo, "--mlx-path", str(out), *q]


def numbat_cmd(a) -> list[str]:
    return [sys.executable, "-m", "cli", "bench", a.model, "-p", str(a.p), "-n", str(a.n), "-r", str(a.reps),
            "--json", "--backend", "mlx", *(["-t", str(a.threads)] if a.threads else [])]


def llama_cmd(bench: Path, gguf, a) -> list[str]:
    return [str(bench), "-m", str(gguf), "-p", str(a.p), "-n", str(a.n), "-r", str(a.reps), "-o", "json",
            *(["-t", str(a.threads)] if a.threads else [])]


def mlx_lm_cmd(model: str, a, benchmark: bool) -> list[str]:
    if benchmark:
        return [sys.executable, "-m", "mlx_lm.benchmark", "--model", model, "-p", str(a.p), "-g", str(a.n), "-n", str(a.reps)]
    return [sys.executable, "-m", "mlx_lm.generate", "--model", model, "--prompt", " ".join(["hello"] * a.p),
            "--max-tokens", str(a.n), "--ignore-chat-template"]


def parse_numbat(out: str, a) -> dict[str, float]:
    rows = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    if not rows or any(r["backend"] != "mlx" for r in rows):
        raise EngineError(f"numbat bench did not report the mlx backend: {[r.get('backend') for r in rows]}")
    return {r["test"]: r["tokens_per_s"] for r in rows if r["n_depth"] == 0}


def parse_llama(out: str) -> dict[str, float]:
    # depth_compare.run_llama's reading of llama-bench's JSON rows
    return {f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}": float(r["avg_ts"])
            for r in json.loads(out) if r["n_prompt"] == 0 or r["n_gen"] == 0}


def parse_mlx_benchmark(out: str, a) -> dict[str, float]:
    trials = re.findall(r"^Trial \d+:\s+prompt_tps=([\d.]+), generation_tps=([\d.]+)", out, re.M)
    if not trials:
        raise EngineError("mlx_lm.benchmark printed no 'Trial' lines")
    # mlx-lm's generation_tps counts all N tokens over the time after the first one (N-1 steps,
    # generate.stream_generate); llama-bench and numbat time N steps: scale to tokens per step
    return {f"pp{a.p}": statistics.mean(float(p) for p, _ in trials),
            f"tg{a.n}": statistics.mean(float(g) for _, g in trials) * (a.n - 1) / a.n}


def parse_mlx_generate(out: str) -> tuple[int, float, int, float]:
    """(prompt tokens, prompt tok/s, generated tokens, tok/s per step) from mlx_lm.generate's lines."""
    p = re.search(r"^Prompt: (\d+) tokens, ([\d.]+) tokens-per-sec", out, re.M)
    g = re.search(r"^Generation: (\d+) tokens, ([\d.]+) tokens-per-sec", out, re.M)
    if not (p and g):
        raise EngineError("mlx_lm.generate printed no 'Prompt:'/'Generation:' lines")
    n = int(g[1])
    return int(p[1]), float(p[2]), n, float(g[2]) * (n - 1) / max(n, 1)     # as parse_mlx_benchmark


def run(cmd, **kw) -> str:
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, **kw)
    if r.returncode < 0:
        raise EngineError(f"{Path(cmd[0]).name} was killed by {signal.Signals(-r.returncode).name}")
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise EngineError(f"`{' '.join(cmd[:6])} ...` failed: {last}")
    return r.stdout


def run_engine(engine: str, a, ctx: dict, notes: set) -> dict[str, float]:
    if engine == "numbat-mlx":
        return parse_numbat(run(numbat_cmd(a), cwd=ROOT), a)
    if engine == "llama.cpp":
        return parse_llama(run(llama_cmd(ctx["llama"], ctx["gguf"], a)))
    if ctx["benchmark"]:
        return parse_mlx_benchmark(run(mlx_lm_cmd(ctx["mlx_model"], a, True)), a)
    got = [parse_mlx_generate(run(mlx_lm_cmd(ctx["mlx_model"], a, False))) for _ in range(a.reps)]
    notes.add(f"mlx-lm has no mlx_lm.benchmark (< 0.27): mlx_lm.generate, one cold process per run, prompts of "
              f"{got[0][0]} tokens, {min(g[2] for g in got)}-{max(g[2] for g in got)} generated")
    return {f"pp{a.p}": statistics.mean(g[1] for g in got), f"tg{a.n}": statistics.mean(g[3] for g in got)}


def mlx_model(a, gguf) -> tuple[str, str]:
    """The model mlx-lm runs and a line saying what it is; converts (once, cached) if needed."""
    if a.mlx_model:
        return a.mlx_model, f"mlx-lm model: {a.mlx_model} (given by --mlx-model)"
    from models import catalog
    repo, bpw = a.hf_repo or HF_REPOS[a.model], gguf_bits(gguf)
    bits = a.mlx_bits or mlx_bits(bpw)
    out = catalog.home() / "bench" / "mlx" / f"{repo.replace('/', '--')}-{f'q{bits}' if bits else 'float'}"
    if not out.exists():        # convert refuses an existing path: into .part, renamed when complete
        part = out.with_name(out.name + ".part")
        shutil.rmtree(part, ignore_errors=True)
        print(f"converting {repo} with mlx-lm ...", file=sys.stderr, flush=True)
        run(convert_cmd(repo, part, bits))
        part.rename(out)
    how = f"-q --q-bits {bits} --q-group-size 64: {bits + 0.5:g} bits/weight" if bits else "unquantized"
    return str(out), f"mlx-lm model: {out}, converted from {repo} ({how}; the GGUF's matrices: {bpw:.2f})"


def medians(rates: dict) -> dict:
    return {e: {t: statistics.median(v) for t, v in tests.items()} for e, tests in rates.items()}


def table_rows(med: dict, tests: list[str]) -> list[dict]:
    rows = []
    for t in tests:
        row = {"test": t, **{e: med.get(e, {}).get(t) for e in ENGINES}}
        for other in ENGINES[1:]:
            nb, o = row["numbat-mlx"], row[other]
            row[f"numbat-mlx/{other}"] = round(nb / o, 3) if nb and o else None
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    cell = lambda v, f: "-" if v is None else f"{v:{f}}"  # noqa: E731
    lines = ["| test | " + " | ".join(f"{e} t/s" for e in ENGINES) + " | numbat-mlx / mlx-lm | numbat-mlx / llama.cpp |",
             "|---" * 6 + "|"]
    for r in rows:
        lines.append(f"| {r['test']} | " + " | ".join(cell(r[e], ".2f") for e in ENGINES) + " | "
                     + " | ".join(cell(r[f"numbat-mlx/{o}"], ".2f") for o in ENGINES[1:]) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a catalog name or a .gguf path")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("-a", "--rounds", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int, help="passed to numbat and llama-bench (default: theirs)")
    ap.add_argument("--llama-bin", type=Path, help="the directory holding llama-bench (default: PATH)")
    ap.add_argument("--mlx-model", help="an MLX model directory or Hugging Face repo for mlx-lm (no conversion)")
    ap.add_argument("--hf-repo", help="the Hugging Face repo to convert for mlx-lm (default: HF_REPOS)")
    ap.add_argument("--mlx-bits", type=int, choices=MLX_BITS, help="mlx-lm's width (default: nearest the GGUF's)")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    a = ap.parse_args(argv)
    a.engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    if bad := [e for e in a.engines if e not in ENGINES]:
        ap.error(f"--engines: unknown {', '.join(bad)} (one of {', '.join(ENGINES)})")
    if a.p < 1 or a.n < 2 or a.reps < 1 or a.rounds < 1:
        ap.error("need -p >= 1, -n >= 2, -r >= 1, -a >= 1")
    return a


def main(argv=None):
    a = parse_args(argv)
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    if not (sys.platform == "darwin" and platform.machine() == "arm64"):
        say(f"not an Apple Silicon Mac ({sys.platform} {platform.machine()}): mlx here is mlx[cpu], a correctness "
            f"vehicle only; its speeds say nothing of a Mac's")
    skipped = {e: why for e in a.engines if (why := missing(e, a))}
    for e, why in skipped.items():
        say(f"{e}: skipped: {why}")
    engines = [e for e in a.engines if e not in skipped]
    if not engines:
        sys.exit("nothing to run: every engine was skipped")
    from models import catalog
    try:                                    # a catalog name: the cached GGUF (fetched on first use)
        gguf = catalog.fetch(a.model) if a.model in catalog.CATALOG else Path(a.model)
    except catalog.FetchError as e:
        sys.exit(str(e))
    if not gguf.is_file():
        sys.exit(catalog.unknown_name_message(a.model))
    spec = importlib.util.find_spec("mlx_lm")     # mlx_lm.benchmark: mlx-lm >= 0.27 (August 2025)
    ctx = {"gguf": gguf, "llama": llama_bench(a.llama_bin),
           "benchmark": bool(spec and spec.origin and (Path(spec.origin).parent / "benchmark.py").is_file())}
    notes = set()
    if "mlx-lm" in engines:
        try:
            ctx["mlx_model"], line = mlx_model(a, gguf)
            notes.add(line)
        except EngineError as e:
            say(f"mlx-lm: skipped: {e}")
            skipped["mlx-lm"] = str(e)
            engines.remove("mlx-lm")
    if not engines:
        sys.exit("nothing to run: every engine was skipped")
    rates = {}                              # engine -> test -> [tok/s per round]
    for rnd in range(a.rounds):
        for e in engines[rnd % len(engines):] + engines[:rnd % len(engines)]:
            if e in skipped:
                continue
            try:
                got = run_engine(e, a, ctx, notes)
            except EngineError as err:      # stop that engine, keep the others' numbers
                say(f"{e}: skipped from round {rnd + 1}: {err}")
                skipped[e] = str(err)
                continue
            for t, v in got.items():
                rates.setdefault(e, {}).setdefault(t, []).append(v)
            say(f"  round {rnd + 1} {e}: " + ", ".join(f"{t} {v:.2f}" for t, v in got.items()))
    rows = table_rows(medians(rates), [f"pp{a.p}", f"tg{a.n}"])
    head = f"{a.model} on {machine()}; -p {a.p} -n {a.n} -r {a.reps}, medians of {a.rounds} rounds"
    if a.json:
        print(json.dumps({"title": head, "gguf": str(gguf), "notes": sorted(notes), "skipped": skipped, "rows": rows}))
        return
    print(f"# {head}\n")
    print(markdown(rows))
    for line in sorted(notes) + [f"{e}: skipped: {why}" for e, why in skipped.items()]:
        print(f"\n{line}", end="")
    print()


if __name__ == "__main__":
    main()
