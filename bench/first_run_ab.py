"""A/B of a first run: two (or more) checkouts of numbat alternate, each run of
`python -m cli prompt MODEL Hi -n 1` from a fresh NUMBAT_HOME and kernel cache, after the
last run's background compile helper has exited (this host's speed drifts within minutes:
only alternating runs compare). --linked: the home links this machine's downloaded models
(no download); otherwise the catalog model is downloaded too, as on a newcomer's machine.

    python bench/first_run_ab.py MODEL CHECKOUT [CHECKOUT ...] [-r 3] [--linked]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models.catalog import home as default_home  # noqa: E402
from ttft import first_byte  # noqa: E402  (bench/ is this script's directory)


def run(checkout: str, model: str, linked: bool) -> float:
    home = tempfile.mkdtemp(prefix="numbat-ab-home-")
    try:
        if linked:
            os.symlink(default_home() / "models", os.path.join(home, "models"))
        env = dict(os.environ, NUMBAT_HOME=home, NUMBA_CACHE_DIR=os.path.join(home, "kernels"))
        cmd = [sys.executable, "-m", "cli", "prompt", model, "Hi", "-n", "1"]
        return first_byte(cmd, env, settle=True, cwd=checkout)[1]      # whole process, helper waited for
    finally:
        shutil.rmtree(home, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("checkouts", nargs="+")
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--linked", action="store_true", help="link the downloaded models: no download")
    a = ap.parse_args()
    res = {c: [] for c in a.checkouts}
    for i in range(a.reps):
        for c in a.checkouts if i % 2 == 0 else a.checkouts[::-1]:
            res[c].append(run(c, a.model, a.linked))
            print(f"{c}: {res[c][-1]:.2f} s", flush=True)
    for c, v in res.items():
        print(f"{c}: median {statistics.median(v):.2f} s (runs {', '.join(f'{x:.2f}' for x in v)})")


if __name__ == "__main__":
    main()
