"""Kernel throughput against the machine's read bandwidth: matvec GB/s for every block type,
batched matmul GFLOP/s against numpy's float32 matmul.

    python bench/kernels.py                  # 2 numba threads, prints markdown tables
    python bench/kernels.py -t 2,1 --write   # also 1 thread; put the tables into BENCHMARKS.md

(a) read bandwidth: a numba parallel sum over 1 GiB, the ceiling for decode.
(b) matvec (quant.matvec, including the quantization of x) in GB/s of weight bytes on the
    FFN shape, 896 in x 4864 out (a few MB: it stays in cache), and on the output head,
    896 in x 151936 out (read from DRAM). K-quants need inputs divisible by 256: their FFN
    shape is the transposed one (4864 in x 896 out) and their head has 1024 inputs.
    Q4_0/Q5_0/Q8_0 also as repacked at load (quant.packed), where the CPU has VNNI.
(c) prefill, quant.matmul on 512 activation vectors x the FFN matrix (896 in, 4864 out;
    K-quants 1024 in), in G(FL)OP/s next to numpy's float32 X @ W.T of the same shape.
Weights are random blocks with finite scales. Medians of several runs after a warm-up.
Absolute numbers drift with the machine and its load: compare the ratios to the bandwidth.
With other jobs on the cores, the 2-thread numbers collapse whenever a worker thread is
descheduled; `chrt -f 1 python bench/kernels.py ...` (real-time priority) keeps them off for
the run, and --note records such conditions next to the tables.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
USER_ENV = dict(os.environ)      # before runner.env sets its thread-pool defaults

import runner.env  # noqa: E402, F401  (before numpy loads OpenBLAS)

import numba  # noqa: E402
import numpy as np  # noqa: E402
from gguf import GGML_QUANT_SIZES  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from numba import njit, prange  # noqa: E402

import quant  # noqa: E402
from quant import packed  # noqa: E402

# byte offsets of the f16 scale fields inside one block (as tests/conftest.py)
HALF_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
               T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
FFN, HEAD, BATCH = (4864, 896), (151936, 896), 512      # (out = rows, in = cols)


@njit(parallel=True, fastmath=True, cache=True)
def _sum(a):
    s = np.float32(0)
    for i in prange(a.shape[0]):
        s += a[i]
    return s


def times(f, runs: int) -> np.ndarray:
    f()
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return np.array(ts)


def median_time(f, runs: int) -> float:
    return float(np.median(times(f, runs)))


def read_bandwidth(runs: int) -> tuple[float, float, float]:
    """GB/s of the median, slowest and fastest run."""
    a = np.ones(1 << 28, np.float32)            # 1 GiB
    rates = a.nbytes / times(lambda: _sum(a), runs) / 1e9
    return float(np.median(rates)), float(rates.min()), float(rates.max())


def shape_for(q, shape):
    """(rows, cols) for this type: K-quants get inputs divisible by 256."""
    rows, cols = shape
    if cols % q.block_size:
        return (896, 4864) if shape == FFN else (rows, 1024)
    return shape


def random_weights(type_id: int, rows: int, cols: int, rng) -> np.ndarray:
    """Raw (rows, row_bytes) blocks with finite scales, like a read-only GGUF memmap."""
    q = quant.qtype(type_id)
    if q.block_size == 1:
        vals = rng.standard_normal((rows, cols), dtype=np.float32)
        if type_id == T.F16:
            vals = vals.astype(np.float16)
        elif type_id == T.BF16:
            vals = (vals.view(np.uint32) >> 16).astype(np.uint16)
        raw = vals.view(np.uint8)
    else:
        block, size = GGML_QUANT_SIZES[T(type_id)]
        nb = cols // block
        raw = rng.integers(0, 256, (rows, nb, size), dtype=np.uint8)
        halves = rng.uniform(0.01, 0.1, 4096).astype(np.float16).view(np.uint8).reshape(-1, 2)
        for off in HALF_FIELDS[T(type_id)]:
            raw[:, :, off:off + 2] = halves[rng.integers(0, 4096, (rows, nb))]
        raw = raw.reshape(rows, nb * size)
    raw.flags.writeable = False
    return raw


def matvec_rate(type_id, w, nbytes, cols, runs) -> float:
    x = np.random.default_rng(1).standard_normal(cols).astype(np.float32)
    y = np.empty(w.shape[0], np.float32)
    return nbytes / median_time(lambda: quant.matvec(type_id, w, x, y), runs) / 1e9


def matmul_rates(type_id, raw, rows, cols, runs) -> tuple[float, float]:
    rng = np.random.default_rng(2)
    X = rng.standard_normal((BATCH, cols)).astype(np.float32)
    Y = np.empty((BATCH, rows), np.float32)
    W = rng.standard_normal((rows, cols)).astype(np.float32)
    flop = 2.0 * BATCH * rows * cols
    ours = flop / median_time(lambda: quant.matmul(type_id, raw, X, Y), runs) / 1e9
    ref = flop / median_time(lambda: np.matmul(X, W.T, out=Y), runs) / 1e9
    return ours, ref


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        m = re.search(r"Model name:\s*(.+)", out)
        name = m.group(1).strip() if m else platform.processor()
        avx = "AVX-512" if "avx512f" in out else "AVX2" if "avx2" in out else "no AVX2"
        return f"{name}, {os.cpu_count()} cores, {avx}"
    except OSError:
        return platform.processor() or "unknown CPU"


def run(threads: list[int], runs: int) -> str:
    rng = np.random.default_rng(0)
    bw, bw_range = {}, {}
    for t in threads:
        numba.set_num_threads(t)
        bw[t], lo, hi = read_bandwidth(max(5, runs // 4))
        bw_range[t] = f"{bw[t]:.1f} GB/s with {t} thread{'s' if t > 1 else ''} (runs {lo:.0f}-{hi:.0f})"
        print(f"read bandwidth: {bw_range[t]}", file=sys.stderr)

    # the file's layout for every type, then the types repacked at load (quant.packed)
    variants = [(q.name, t, False) for t, q in quant.QTYPES.items()]
    variants += [(quant.QTYPES[t].name + " repacked", t, True) for t in packed.KINDS if packed.enabled()]
    mv_rows, mm_rows = [], []
    for name, type_id, pk in variants:
        q = quant.QTYPES[type_id]
        cells, shapes = {}, []
        for label, shape in (("ffn", FFN), ("head", HEAD)):
            rows, cols = shape_for(q, shape)
            shapes.append(f"{cols} -> {rows} ({rows * q.row_bytes(cols) / 1e6:.{1 if label == 'ffn' else 0}f} MB)")
            raw = random_weights(type_id, rows, cols, rng)
            w = packed.pack(type_id, raw) if pk else raw
            for t in threads:
                numba.set_num_threads(t)
                r = matvec_rate(type_id, w, raw.nbytes, cols, runs if label == "ffn" else max(5, runs // 4))
                cells[label, t] = f"{r:.1f} ({100 * r / bw[t]:.0f}%)"
            del raw, w
        mv_rows.append(f"| {name} | {'; '.join(shapes)} | " + " | ".join(
            f"{cells['ffn', t]} | {cells['head', t]}" for t in threads) + " |")
        print(mv_rows[-1], file=sys.stderr)

    numba.set_num_threads(threads[0])
    for name, type_id, pk in variants:
        q = quant.QTYPES[type_id]
        rows, cols = FFN[0], 1024 if q.block_size == 256 else FFN[1]
        raw = random_weights(type_id, rows, cols, rng)
        ours, ref = matmul_rates(type_id, packed.pack(type_id, raw) if pk else raw, rows, cols, max(3, runs // 8))
        mm_rows.append(f"| {name} | {BATCH} x {cols} -> {rows} | {ours:.0f} | {ref:.0f} | {ours / ref:.2f} |")
        print(mm_rows[-1], file=sys.stderr)

    head = " | ".join(f"FFN, {t}T | head, {t}T" for t in threads)
    lines = [
        "Read bandwidth (numba parallel float32 sum over 1 GiB, vectorized): " +
        ", ".join(bw_range[t] for t in threads) + ".",
        "",
        "Matvec (`quant.matvec`, x quantized inside), GB/s of weight bytes and % of the read",
        "bandwidth at the same thread count. Shapes are inputs -> outputs; the FFN matrix stays in",
        "cache, the head comes from DRAM. K-quants need inputs divisible by 256: transposed FFN, and",
        "1024 inputs for the head-sized matrix.",
        "",
        f"| type | shapes (FFN; head) | {head} |",
        "|---|---|" + "---|" * (2 * len(threads)),
        *mv_rows,
        "",
        f"Prefill (`quant.matmul`, {BATCH} activation vectors, {threads[0]} numba threads; numpy's BLAS",
        "with its default threads), in G(FL)OP/s against numpy's float32 `X @ W.T` of the same shape.",
        "Quantized types multiply int8 (quant.gemm8) on AVX512-VNNI CPUs, float32 BLAS elsewhere:",
        "",
        "| type | X x in -> out | quant.matmul GOP/s | numpy f32 GFLOP/s | ratio |",
        "|---|---|---|---|---|",
        *mm_rows,
    ]
    return "\n".join(lines)


def command_line() -> str:
    """This run's command, with the scheduling and OpenMP settings that change the numbers."""
    env = "".join(f"{k}={USER_ENV[k]} " for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT", "NUMBA_THREADING_LAYER")
                  if k in USER_ENV)
    realtime = hasattr(os, "sched_getscheduler") and os.sched_getscheduler(0) in (os.SCHED_FIFO, os.SCHED_RR)
    args, skip = [], False
    for arg in sys.argv[1:]:           # the --note text goes into the section, not the command
        if not skip and not arg.startswith("--note"):
            args.append(arg)
        skip = arg == "--note"
    return env + ("chrt -f 1 " if realtime else "") + " ".join(["python bench/kernels.py", *args])


def write_section(table: str, note: str, path: Path) -> None:
    """Replace the "### Kernels" section of BENCHMARKS.md, up to the next heading of its level
    or above (other sections stay)."""
    section = "\n".join([
        "### Kernels",
        "",
        f"Machine: {cpu_name()}. Date: {datetime.date.today().isoformat()}. "
        f"numba {numba.__version__}, numpy {np.__version__}.",
        f"Command: `{command_line()}`",
        "",
        "Absolute numbers drift between runs and machines (other processes, clocks, memory): compare",
        "the ratios to the measured bandwidth, and the matmul ratio to numpy, not the GB/s.",
        *(["", note] if note else []),
        "",
        table,
        "",
    ])
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    m = re.search(r"^### Kernels\n.*?(?=^#{1,3} |\Z)", text, flags=re.S | re.M)
    text = text[:m.start()] + section + "\n" + text[m.end():] if m else text.rstrip("\n") + "\n\n" + section
    path.write_text(text.rstrip("\n") + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-t", "--threads", default="2", help="numba thread counts, e.g. 2,1 (default 2)")
    ap.add_argument("-r", "--runs", type=int, default=40, help="timed runs of the FFN matvec (others fewer)")
    ap.add_argument("--write", action="store_true", help="put the tables into BENCHMARKS.md")
    ap.add_argument("--note", default="", help="a paragraph about this run for BENCHMARKS.md")
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    table = run(threads, a.runs)
    print(table)
    if a.write:
        write_section(table, a.note, ROOT / "BENCHMARKS.md")


if __name__ == "__main__":
    main()
