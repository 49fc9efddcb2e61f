"""Thread-pool defaults, set in the environment before the libraries that read them load:
import this before numpy (cli.py, quant, tests and bench scripts do). The user's own
settings win.

numba's OpenMP workers wait for the next parallel region. Decode runs ~360 regions per token,
so how they wait decides its speed. Measured here (qwen2.5-coder 0.5b tg128, 2 threads):
sleeping at once (PASSIVE) 34 tok/s idle and 34 with one other busy process; spinning 1000
rounds first 63 idle, 23 busy; spinning 10000 rounds 64 idle, 7 busy (llama.cpp: 62 / 18).
libgomp loads lazily, at numba's first parallel region.

numpy's OpenBLAS (prefill attention) keeps its threads spinning for 2^28 cycles after each
call, and on 2 cores they took the cycles of the numba kernels that follow: the int8 GEMM ran
at half its speed inside prefill (1.5b pp512 3.46 s; with 2^4 cycles 1.97 s). OpenBLAS reads
this when numpy loads it.
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "1000")
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
