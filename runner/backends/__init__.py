"""The backend contract: what the runner, chat, speculation and the batch engine may ask of a
backend, whichever runs (numba kernels on the CPU, MLX on Apple Silicon). Callers import
this module, never a backend's own: ``make(name, ...)`` is the one place that picks one.

A backend holds one model's weights and runs the forward graph of runner/backends/graph.py
over its own ops. Two entry points:

- ``forward(tokens, cache, logits)``: one sequence's tokens at the positions its KVCache
  says (prompt, chat, speculation, perplexity), in prompt chunks of ``chunk`` tokens.
- ``run(batch, kv)``: tokens of many sequences at once (the batch engine) over a view of a
  PagedKV; at most ``max_tokens`` tokens.

Both return fresh float32 numpy arrays (never a buffer the next call overwrites).

A backend that computes asynchronously (MLX) may also offer ``greedy(first, cache)``: an
endless generator of first and the greedy tokens after it, equal to forward() and argmax
one token at a time, with each step started before the token it consumes is handed out
(the cache one token ahead: emit() rolls it back). generate() uses it for plain greedy
decoding (no penalty, no constraint) where it exists.
"""
from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

# Speculative checks run the last token and up to CHECK_ROWS - 1 guesses in one forward with
# one token's bits per row (numba: its matvec kernels' row blocks; MLX: any size, checked)
CHECK_ROWS = 16

BACKENDS = ("numba", "mlx")


@dataclass
class Batch:
    """The tokens of one forward, of any number of sequences."""
    tokens: np.ndarray          # (n,) int64
    positions: np.ndarray       # (n,) int64
    seq: np.ndarray             # (n,) the token's sequence: its row in the KV view's tables
    segments: list              # [(start, end, batch[, size])]: runs of tokens whose matmuls take
                                # the float steps of one llama.cpp batch of end - start (batch)
                                # or of one token per row; together they cover 0..n. size: the
                                # tokens of the llama.cpp batch the run is the end of (after
                                # reused prefix pages), whose flash-attention path it takes
    out: np.ndarray | None      # rows that need output, increasing (None: all, each with its
                                # segment's steps; otherwise each with one token's steps)


class Head(Protocol):
    """A part of the output layer: logits over some ids for final normed states h (1, n_embd)."""
    n_out: int

    def __call__(self, h: np.ndarray) -> np.ndarray: ...


@runtime_checkable
class Backend(Protocol):
    name: str                   # "numba-cpu" | "mlx"
    cfg: object                 # gguf_io.config.ModelConfig
    chunk: int                  # llama.cpp's batch for one sequence's prompt
    max_tokens: int             # the most tokens one run() takes
    flash: bool                 # -fa: llama.cpp's flash-attention arithmetic
    cache_types: tuple[str, str]
    windows: list[int]          # each layer's sliding window, 0: global

    def make_cache(self, n_ctx: int, n_keep: int = 0): ...      # a runner.kv_cache.KVCache

    def make_store(self, n_pages: int, n_ctx: int): ...         # a runner.kv_cache.PagedKV

    def forward(self, tokens, cache, logits: str = "last", one_by_one: bool = False) -> np.ndarray:
        """logits "last": (1, vocab); "all": (n, vocab); "hidden": the last final normed state
        (1, n_embd), for a Head. one_by_one: every row with one token's bits (speculative
        checks, up to CHECK_ROWS tokens)."""

    def run(self, b: Batch, kv: list, hidden: bool = False) -> np.ndarray | None: ...

    def head(self, ids: np.ndarray | int) -> Head:
        """The output layer's rows for ids (an array), or its first ids rows (an int, a multiple
        of 16), for a draft that reads a part of its vocabulary."""


class BackendError(Exception):
    """A backend that cannot run here; the message says what to do."""


def default() -> str:
    """mlx on Apple Silicon when mlx is installed, numba elsewhere."""
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        try:
            import mlx.core  # noqa: F401
            return "mlx"
        except ImportError:
            pass
    return "numba"


def first_run(flash: bool = True, cache_types: tuple[str, str] = ("f16", "f16")):
    """The numba backend's first run on a machine (no compiled kernels cached): call before
    the model loads and pass it to runner.model.load (first=); its warm(backend, token)
    after, close() in any case (see numba_cpu.FirstRun: it compiles in two processes)."""
    from runner.backends.numba_cpu import FirstRun
    return FirstRun(flash, cache_types)


def make(name: str, f, cfg, flash: bool = True, cache_types: tuple[str, str] = ("f16", "f16"),
         progress=None, draft: bool = False) -> Backend:
    """The backend called name ("auto": default()) for a validated file f and its config.
    draft: the model only proposes tokens (speculative decoding): numba requantizes its wider
    matrices to Q4_0 (runner.backends.numba_cpu.DRAFT_Q4_0); mlx runs the file's types."""
    name = default() if name == "auto" else name
    if name == "numba":
        from runner.backends.numba_cpu import NumbaCPU
        return NumbaCPU(f, cfg, flash=flash, cache_types=cache_types, draft=draft)
    if name == "mlx":
        try:
            import mlx.core  # noqa: F401
        except ImportError:
            raise BackendError('--backend mlx needs mlx: pip install "numbat[mlx]" (mlx on macOS, mlx[cpu] on Linux)') from None
        from runner.backends.mlx_backend import MLX
        return MLX(f, cfg, flash=flash, cache_types=cache_types, progress=progress)
    raise BackendError(f"--backend must be one of {', '.join(BACKENDS)} or auto, got {name!r}")
