"""Which kernel runs on which CPU: one table. A new kind of CPU is a row of KINDS, not a hunt
through the kernels.

The packed kernels take llama.cpp's float steps for the type and the batch size
(tests/llama_orders.py): logits bit for bit. gemm8, tile and the file-layout matvecs sum in
their own orders (rounding noise from llama.cpp's, tests/test_kernel_paths.py), so a kind
without repacking gives up bit-exactness, not correctness. vnni only changes speed: the
integer sums of vpdpbusd are exact, so the VNNI and portable forms of a kernel agree.

A weight of n_out rows times n tokens (see ``linear``):
  packed   Q4_0/Q5_0/Q8_0/Q4_K/Q6_K repacked at load into 16-row groups (quant.packed): one
           token, two (Q4_0: a draft's catch-up), four at a time (speculative checks, short
           batches) or ``batch_step``
           tokens per call for a prompt; on a row with ``amx`` types, a prompt's 16 tokens
           at a time through AMX int8 tiles (quant.amx)
  rows     up to 16 tokens with one token's steps each (quant.kquants' matvec_rows)
  matvec   one token at a time (every type's portable kernel)
  gemm8    a prompt through int8 panels unpacked on the fly (quant.gemm8)
  tile     a prompt through float32 tiles dequantized into cache and BLAS (everything else)
"""
from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass, field, replace

import llvmlite.binding as llvm
from gguf_io.types import GGMLQuantizationType as T

LEGACY = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0})
K_QUANTS = frozenset({T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K})
REPACKABLE = frozenset({T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K})
SMALL_BATCH = 16        # the most tokens that take one token's steps each (the backend contract)


@dataclass(frozen=True)
class Kind:
    name: str
    needs: tuple[str, ...]              # LLVM host features (llvm.get_host_cpu_features)
    seen: str                           # the machines it was measured on
    vnni: bool = False                  # vpdpbusd kernels (quant.vnni, quant.intrin, kquants')
    repack: frozenset = frozenset()     # types quant.packed repacks
    gemm8: frozenset = frozenset()      # types whose prompts go through quant.gemm8
    batch_step: int = 8                 # tokens per packed batch call, Q4_0/Q5_0/Q8_0 (Q4_K and
                                        # Q6_K: 4, llama.cpp's gemm takes them four at a time)
    prefetch: dict = field(default_factory=dict)    # packed decode: bytes ahead, by tokens a call
                                        # ((type name, tokens) first, then tokens); (bytes, level):
                                        # LLVM's locality, 3 (into L1, the default) to 0
    cpus: tuple[str, ...] = ()          # LLVM CPU names the row is for (empty: any with the needs)
    amx: frozenset = frozenset()        # repacked types whose batches take AMX int8 tiles (quant.amx)
    spread_prefetch: tuple = ()         # tokens a call whose packed prefetches go one before each
                                        # 64-byte load of a block (the rest at its top), not all at its top


AVX512_VNNI = dict(vnni=True, repack=REPACKABLE, gemm8=LEGACY | K_QUANTS, batch_step=8,
                   # measured on the 1.5b's matrices: 4 tokens 41.6 -> 33.6 ms, 1 token
                   # 27.2 -> 24.6 ms against the hardware prefetcher alone (2-16 KB within a
                   # few percent of these); Q6_K's one token (3360-byte groups) 8 KB ahead:
                   # its matrices 5-15% faster than at 2 KB on Zen 5 (session 18)
                   # two tokens (a draft's Q4_0, quant.packed.TWO): four's, not measured here
                   prefetch={1: 2048, 2: 8192, 4: 8192, ("Q6_K", 1): 8192})

# First match wins: the most specific kind first.
KINDS = (
    # Intel Xeon (Sapphire Rapids and later): Q4_0's prompts through int8 tiles, the same bits
    # (quant.amx); one thread, 512 tokens, the tiles against the VNNI batch kernel: 4864x896
    # 1.94x, 896x4864 2.22x, 896x896 2.20x (bench/amx_tile.py); @Q4_0's pp512 1.48 -> 2.32x
    # llama.cpp's (Emerald Rapids, session 33). The other kinds' float steps start from
    # 4-value lanes or scaled sub-blocks, not a block's whole dot (Q4_K's gemm through tiles:
    # 0.78-0.92x the VNNI kernel, not kept)
    # Prefetch into L2, 16 KB ahead, for one token and four (session 34, every packed matrix
    # of a model in a forward's order, variants alternating in one process, medians of 13):
    # the 1.5b's one token 60.8 -> 55.1 ms (2 KB into L1; 4 and 8 KB into L2 2-3% slower, 24
    # and 32 KB 4-5% slower, 16 KB into L1 6% slower), four tokens 79.0 -> 73.6 ms (8 KB into
    # L1); the 0.5b's one token 24.8 -> 22.2 ms, its draft (Q4_0) 16.3 -> 14.7. Four tokens
    # 8 KB ahead into L2 (session 36, bench/prefetch_ab.py: the 1.5b's matrices in a forward's
    # order, rows alternating in one process, medians of 15-25, four runs): 0.92-0.98x the time at 16 KB (4 and 6 KB
    # about as 8, 12 KB 0.99x, 32 KB 1.02x, 8 KB into L1 1.07x, none 1.25x). Two tokens (a
    # draft's Q4_0, session 37, `bench/prefetch_ab.py --model qwen2.5-coder:0.5b --draft
    # --tokens 2`): 8 KB into L2 0.68x the time without prefetch (16 and 4 KB 0.71x).
    # Spread prefetches (session 38): with a Q4_K or Q6_K block's 37 or 53 issued at its top,
    # four tokens from memory ran at the sum of the memory's time and the arithmetic's, not
    # the larger (the burst holds up the block's loads, we take it: no counters here). One before each
    # 64-byte load instead (bench/prefetch_ab.py, rows alternating in one process, medians of
    # 15): the 1.5b's four-token matrices 67.6 -> 54.8 ms (4 and 16 KB ahead about the same),
    # its one-token ones 46.6 -> 45.6, the 0.5b draft's (Q4_0) one token the same, two tokens
    # 13.1 -> 12.7; one synthetic matrix from memory (2 threads): Q6_K four tokens 0.80x,
    # Q4_K 0.87x, Q4_K one token 0.96x, Q5_0 0.96x, Q8_0 and Q6_K one token 0.99-1.02x
    Kind("avx512-amx", ("avx512f", "avx512bw", "avx512vnni", "amx-int8", "amx-tile"),
         "Intel Xeon with AMX, Emerald Rapids (2026-12-06), 2 cores",
         **{**AVX512_VNNI, "prefetch": {1: (16384, 2), 2: (8192, 2), 4: (8192, 2)}}, amx=frozenset({T.Q4_0}),
         spread_prefetch=(1, 2, 4)),
    # Zen 4: Q6_K's one-token kernel waited on memory with its prefetches into L1 (7-13 GB/s
    # on 2 threads against Q4_K's 34); into L2 (locality 2 or 1) 19-25 GB/s (session 26); the
    # other kinds' one token into L2 too: the 1.5b's matrices in a token's order 39.1 -> 35.6
    # ms (medians of 7 alternating runs; 8 KB ahead or 4 KB into L1 no better), the 0.5b's at
    # the memory's rate either way; four tokens (speculative checks) 4 KB ahead into L2:
    # 95.7 -> 60.8 ms (8 KB into L2: 71.6; medians of 5 alternating runs) (session 27).
    # Session 31: one token without software prefetch at all, the hardware prefetcher alone
    # (Q6_K's one-token kernel now reads its block in ascending order): the 1.5b's decode step
    # 36.8 -> 27.9 ms (medians of 5 alternating processes); from memory on one thread
    # (bench/packed_stream.py, alternating) Q4_K 21 -> 24-30 GB/s, Q6_K 17-18 -> 24-26, Q4_0
    # the same, Q5_0 no worse; Q8_0 slower without in a one-matrix measure (37 -> 33 GB/s on
    # two threads): it keeps its prefetch. Four tokens without: their matrices 43.8 -> 54.8 ms (kept)
    # Session 40 (bench/prefetch_ab.py, rows alternating in one process, medians of 15-25):
    # spread prefetches (as the AMX row's) for four tokens, the 1.5b's matrices 0.80-0.86x the
    # time at 4 KB ahead, 0.78-0.83x at 8 KB (6 KB as 8; 2 KB 1.11x); two tokens (the draft's
    # forward) without prefetch, as one token: 0.92-0.93x the time at 4 KB (2 KB 0.95x); one
    # token's as they were (@Q8_0's matrices with its Q8_0 prefetch spread 0.996-1.06x the
    # time in three runs)
    Kind("avx512-vnni-zen4", ("avx512f", "avx512bw", "avx512vnni"), "AMD EPYC Zen 4 (znver4, 2026-12-06), 2 cores",
         cpus=("znver4",), **{**AVX512_VNNI, "prefetch": {("Q8_0", 1): (2048, 2), 4: (8192, 2)}},
         spread_prefetch=(4,)),
    Kind("avx512-vnni", ("avx512f", "avx512bw", "avx512vnni"),
         "AMD EPYC Zen 5 (LLVM: znver5, 2026-12-02; Zen 4 too until 2026-12-04), 2 cores", **AVX512_VNNI),
    # AVX2, ARM, anything else: the portable numba kernels (LLVM vectorizes them for the host)
    Kind("portable", (), "not measured against llama.cpp"),
)


def pick(features: dict, name: str = "") -> Kind:
    """The first kind whose features the CPU has (features: name -> bool, as LLVM reports) and,
    where the row names CPUs, whose LLVM CPU name is one of them."""
    return next(k for k in KINDS if all(features.get(f, False) for f in k.needs) and (not k.cpus or name in k.cpus))


def grant_tiles() -> bool:
    """Ask Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA):
    a process that has not is killed (SIGILL) by its first tile instruction."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18) == 0
    except (OSError, AttributeError):
        return False


CPU_NAME = llvm.get_host_cpu_name()     # LLVM's name for the host (znver5, sapphirerapids, ...)
KIND = pick(llvm.get_host_cpu_features(), CPU_NAME)
if KIND.amx and (os.environ.get("NUMBAT_AMX", "1") == "0" or not grant_tiles()):
    KIND = replace(KIND, amx=frozenset())


def repacking() -> bool:
    """Whether this row repacks any type (NUMBAT_REPACK=0 keeps the file's layout)."""
    return bool(KIND.repack) and os.environ.get("NUMBAT_REPACK", "1") != "0"


def repacked(type_id: int, rows: int) -> bool:
    """Whether a weight is repacked at load."""
    return type_id in KIND.repack and rows % 16 == 0 and repacking()


def linear(type_id: int, packed: bool, n: int, batch: bool, has_rows: bool) -> str:
    """The kernel for n tokens through a weight of type_id (packed: repacked at load), with a
    batch's float steps (batch) or one token's for every row; has_rows: the type has a
    matvec_rows kernel on this CPU."""
    if packed:
        return "packed"
    if n <= SMALL_BATCH or not batch:
        return "rows" if n > 1 and has_rows else "matvec"
    if type_id in KIND.gemm8:
        return "gemm8"
    return "tile"
