"""Start-up as a user sees it: `numbat prompt "Hi" -n 1` (chat template) and `numbat prompt
--raw "Hi" -n 1` as whole processes, from starting the command to the first byte of the reply
and to the process's end (Python start, imports, model open, prefill, one token, exit).
Cold = an empty kernel cache (everything compiles; the model's repacked weights already kept
or not, as NUMBAT_HOME has them); --fresh-home: cold runs in an empty NUMBAT_HOME holding only
a link to this one's models (a first run after install: the repacking and the tokenizer's
tables are made too); --download: cold runs in an empty NUMBAT_HOME that also downloads the
catalog model (a newcomer's first command); --cold N such runs, each after the last one's
background compile helper has exited; warm = medians of -r runs after that. With --llama-bin,
llama.cpp's `llama-completion -m FILE -p Hi -n 1 -no-cnv` runs alternately with the raw
numbat command (same file, same threads) and the ratio of their medians is printed.

    python bench/ttft.py [MODEL] [-r 5] [--llama-bin DIR] [--no-cold | --cold N [--fresh-home | --download]]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def first_byte(cmd: list[str], env: dict, settle: bool = False, cwd: str | None = None) -> tuple[float, float]:
    """settle: then wait until every process the command left behind (a first run's compile
    helper finishing in the background) has exited, so the next run has both cores."""
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, start_new_session=settle,
                         cwd=cwd)
    p.stdout.read(1)
    ttft = time.perf_counter() - t
    p.stdout.read()
    if p.wait():
        sys.exit(f"{' '.join(cmd)} failed with exit code {p.returncode}")
    took = time.perf_counter() - t
    while settle:
        try:
            os.killpg(p.pid, 0)
            time.sleep(0.2)
        except (ProcessLookupError, PermissionError):
            break
    return ttft, took


def summary(name: str, runs: list[tuple[float, float]]) -> str:
    med = lambda i: statistics.median(r[i] for r in runs)
    return (f"{name}: first byte median {med(0):.2f} s, whole process {med(1):.2f} s "
            f"(runs {', '.join(f'{r[1]:.2f}' for r in runs)})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="qwen2.5-coder:0.5b")
    ap.add_argument("-r", "--reps", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--llama-bin", type=Path, help="a llama.cpp build's bin/ (llama-completion)")
    ap.add_argument("--no-cold", action="store_true", help="skip the run with an empty kernel cache")
    ap.add_argument("--cold", type=int, default=1, help="runs with an empty kernel cache")
    ap.add_argument("--fresh-home", action="store_true", help="cold runs with an empty NUMBAT_HOME (the models linked)")
    ap.add_argument("--download", action="store_true", help="cold runs with an empty NUMBAT_HOME: a catalog model is downloaded too")
    a = ap.parse_args()
    # the installed script itself, not a version manager's shim in front of it
    numbat = str(Path(sys.executable).parent / "numbat")
    if not os.path.exists(numbat):
        numbat = shutil.which("numbat") or sys.exit("numbat is not installed: pip install -e .")
    chat = [numbat, "prompt", a.model, "Hi", "-n", "1", "-t", str(a.threads)]
    raw = chat + ["--raw"]
    env = dict(os.environ)
    for _ in range(0 if a.no_cold else a.cold):
        scratch = tempfile.mkdtemp(prefix="numbat-cold-")
        try:
            cold_env = dict(env, NUMBA_CACHE_DIR=os.path.join(scratch, "kernels"))
            if a.fresh_home or a.download:
                from models.catalog import home
                if not a.download:
                    os.symlink(home() / "models", os.path.join(scratch, "models"))
                cold_env["NUMBAT_HOME"] = scratch
            cold = first_byte(chat, cold_env, settle=True)
            print(f"cold (empty {'NUMBAT_HOME, downloading' if a.download else 'NUMBAT_HOME' if a.fresh_home else 'kernel cache'}): "
                  f"first byte {cold[0]:.2f} s, whole process {cold[1]:.2f} s", flush=True)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    first_byte(chat, env)       # warm the kernel cache this environment uses
    llama = None
    if a.llama_bin:
        from models.catalog import fetch
        exe = a.llama_bin / "llama-completion"
        llama = [str(exe), "-m", str(fetch(a.model) if ":" in a.model else a.model), "-p", "Hi", "-n", "1",
                 "-no-cnv", "-t", str(a.threads)]
    runs = {"chat": [], "raw": [], "llama": []}
    for _ in range(a.reps):
        runs["chat"].append(first_byte(chat, env))
        runs["raw"].append(first_byte(raw, env))
        if llama:
            runs["llama"].append(first_byte(llama, env))
    print(summary(" ".join(chat[1:]), runs["chat"]))
    print(summary(" ".join(raw[1:]), runs["raw"]))
    if llama:
        print(summary(" ".join(["llama-completion"] + llama[1:]), runs["llama"]))
        ratio = statistics.median(r[1] for r in runs["raw"]) / statistics.median(r[1] for r in runs["llama"])
        print(f"numbat --raw / llama-completion, whole process: {ratio:.2f}")


if __name__ == "__main__":
    main()
