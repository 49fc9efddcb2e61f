"""Shared pieces of the block kernels: the f16 lookup table and the type record.

Conventions every kernel follows:
- a tensor's raw data is a 2-D uint8 array ``raw`` of shape (n_rows, row_bytes): one
  output feature per row, a row is a run of whole blocks (GGUF's dims[0] is contiguous).
  It is usually a read-only view of the memory-mapped file; kernels never write to it.
- half floats inside blocks are decoded through ``F16`` (65536 float32 values, indexed by
  the raw 16 bits): exact, and numba has no CPU float16 arithmetic.
- ``dequant_rows(raw, out)`` writes float32 (n_rows, n_cols); ``matvec(raw, x, y)`` writes
  y = W @ x for a float32 x. Both are numba-compiled, parallel over rows, and allocate nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

F16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


_count = None


def threads() -> int:
    """numba.get_num_threads() (the calling thread's count) for the ~150 kernel calls of a
    decode step: numba's own function costs 0.7 us a call in checks, reading the count
    0.1 us once the threads are launched."""
    global _count
    n = _count() if _count is not None else 0
    if n > 0:
        return n
    import numba
    from numba.np.ufunc import parallel
    n = numba.get_num_threads()             # launches the threads first
    _count = getattr(parallel, "_get_num_threads", None)
    return n


def readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view, so numba compiles one specialization for memmaps and tests alike."""
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


@dataclass(frozen=True)
class QType:
    type_id: int          # gguf.GGMLQuantizationType value
    name: str
    block_size: int       # elements per block
    type_size: int        # bytes per block
    dequant_rows: Callable[[np.ndarray, np.ndarray], None]
    matvec: Callable[[np.ndarray, np.ndarray, np.ndarray], None]
    # prefill: X -> the activations as llama.cpp's kernels see them (8-bit rounded for
    # quantized weights), written to out; None keeps float32
    act_roundtrip: Callable[[np.ndarray, np.ndarray], None] | None = None
    # (raw, X (m, n), Y (m, rows)) for a few vectors at once, reading each block once; each
    # row of Y has the bits matvec gives it alone. None: callers loop over matvec.
    matvec_rows: Callable | None = None

    def row_bytes(self, n_cols: int) -> int:
        return n_cols // self.block_size * self.type_size
