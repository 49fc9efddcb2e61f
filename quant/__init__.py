"""Block formats: one registry of QType records by GGML type id, plus the operations every
type shares (dequantize a tensor, matvec, batched matmul, quantize)."""
from __future__ import annotations

import runner.env  # noqa: F401  (thread-pool defaults, before numpy loads OpenBLAS)

import numpy as np  # noqa: E402
from gguf_io.types import GGMLQuantizationType as T

from quant import cpu, floats, gemm8, kquants, legacy, packed
from quant.common import QType, threads  # noqa: F401  (quant.threads: the backend reads it too)

QTYPES: dict[int, QType] = {**floats.QTYPES, **legacy.QTYPES, **kquants.QTYPES}


class UnsupportedType(Exception):
    pass


def qtype(type_id: int) -> QType:
    q = QTYPES.get(int(type_id))
    if q is None:
        name = T(type_id).name if type_id in T._value2member_map_ else str(type_id)
        raise UnsupportedType(f"tensor type {name} is not supported (numbat runs "
                              f"{', '.join(q.name for q in QTYPES.values())}); use a file quantized to one of those")
    return q


def dequantize(type_id: int, raw: np.ndarray, n_cols: int) -> np.ndarray:
    out = np.empty((raw.shape[0], n_cols), np.float32)
    qtype(type_id).dequant_rows(raw, out)
    return out


def matvec(type_id: int, raw, x: np.ndarray, y: np.ndarray) -> None:
    """y = W @ x, W raw blocks (rows, row_bytes) or a quant.packed.Packed."""
    if isinstance(raw, packed.Packed):
        packed.matvec(raw, x, y)
    else:
        qtype(type_id).matvec(raw, x, y)


# Prefill (quant.cpu says which kernel, by CPU kind): repacked weights go through quant.packed
# (llama.cpp's float order for the batch), the other quantized types through quant.gemm8 where
# the CPU has it (int8 products, 2-4x float32 BLAS here). Elsewhere, and for the float types:
# dequantize a tile of rows into a reused buffer that stays in cache, then let BLAS multiply
# it with all activation vectors at once, the activations first rounded as llama.cpp's integer
# kernels round them (act_roundtrip). See BENCHMARKS.md for the rates.
_TILE_BYTES = 4 << 20
_tiles: dict[tuple[int, int], np.ndarray] = {}


def _buffer(key, shape) -> np.ndarray:
    buf = _tiles.get(key)
    if buf is None or buf.shape[0] < shape[0]:
        buf = _tiles[key] = np.empty(shape, np.float32)
    return buf[:shape[0]]


def matmul(type_id: int, raw: np.ndarray, X: np.ndarray, Y: np.ndarray, rounded: dict | None = None) -> None:
    """Y (n, rows) = X (n, cols) @ W.T for W given as raw blocks (rows, row_bytes) or a
    quant.packed.Packed.
    ``rounded``: a dict the caller keeps while X is unchanged, so weights that share X (Q, K
    and V; gate and up) round it once per kind."""
    q = qtype(type_id)
    rows, cols = raw.shape[0], X.shape[1]
    if isinstance(raw, packed.Packed):      # llama.cpp's float order for a batch of len(X)
        packed.matmul_rows(raw, X, Y)
        return
    if gemm8.supports(type_id):
        gemm8.matmul(type_id, q.block_size, q.type_size, raw, X, Y, rounded)
        return
    if type_id == T.F32:
        np.matmul(X, raw.view(np.float32).T, out=Y)
        return
    if q.act_roundtrip is not None:
        Xr = rounded.get(q.act_roundtrip) if rounded is not None else None
        if Xr is None:
            Xr = _buffer(("act", q.act_roundtrip, cols), X.shape)
            q.act_roundtrip(X, Xr)
            if rounded is not None:
                rounded[q.act_roundtrip] = Xr
        X = Xr
    tr = max(16, min(rows, _TILE_BYTES // (4 * cols)))
    tile = _buffer(("tile", tr, cols), (tr, cols))
    # Tiles are dequantized on all numba threads: their workers spin only briefly after a
    # region (GOMP_SPINCOUNT above), so OpenBLAS's threads get the cores right after.
    for r0 in range(0, rows, tr):
        n = min(tr, rows - r0)
        q.dequant_rows(raw[r0:r0 + n], tile[:n])
        np.matmul(X, tile[:n].T, out=Y[:, r0:r0 + n])


QUANTIZABLE = (T.Q8_0, T.Q4_0)


def quantize(data: np.ndarray, type_id: int, rows_per_chunk: int = 1024) -> np.ndarray:
    """F32/F16 (rows, cols) -> raw blocks (rows, row_bytes) of Q8_0 or Q4_0, with gguf-py's
    reference quantizers (the same rounding as llama.cpp), a chunk of rows at a time so a
    large tensor never exists in float32 at once."""
    if type_id not in QUANTIZABLE:
        raise UnsupportedType(f"quantize to {T(type_id).name} is not supported; use Q8_0 or Q4_0")
    q = qtype(type_id)
    if data.shape[-1] % q.block_size:
        raise UnsupportedType(f"rows of {data.shape[-1]} values do not fit {q.name} blocks of {q.block_size}")
    from gguf import quants as gq     # not at import: the gguf package takes 65 ms to import
    out = np.empty((data.shape[0], q.row_bytes(data.shape[1])), np.uint8)
    for r0 in range(0, data.shape[0], rows_per_chunk):
        out[r0:r0 + rows_per_chunk] = gq.quantize(np.asarray(data[r0:r0 + rows_per_chunk], np.float32), T(type_id))
    return out


def requantize(type_id: int, raw: np.ndarray, n_cols: int, rows_per_chunk: int = 256) -> np.ndarray:
    """A matrix of type_id (raw blocks, rows of n_cols values) as raw Q4_0 rows, the way
    llama.cpp's quantizer requantizes: each chunk of rows dequantized to float32, then
    quantize_row_q4_0_ref (a draft's weights: runner.backends.numba_cpu.DRAFT_Q4_0; numba's
    loop, 6x gguf-py's speed: the 0.5b in 2.3 s instead of 5.5, once per file)."""
    if n_cols % 32:
        raise UnsupportedType(f"rows of {n_cols} values do not fit Q4_0 blocks of 32")
    out = np.empty((raw.shape[0], qtype(T.Q4_0).row_bytes(n_cols)), np.uint8)
    buf = np.empty((min(rows_per_chunk, raw.shape[0]), n_cols), np.float32)
    for r0 in range(0, raw.shape[0], rows_per_chunk):
        x = buf[:min(rows_per_chunk, raw.shape[0] - r0)]
        qtype(type_id).dequant_rows(raw[r0:r0 + len(x)], x)
        legacy.q4_0_rows(x, out[r0:r0 + len(x)])
    return out
