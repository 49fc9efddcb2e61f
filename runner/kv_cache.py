"""Ring KV cache: per layer one contiguous buffer, allocated once.

Keys are cached after RoPE at their absolute positions, so a query only needs each slot's
position to mask it. Sliding-window layers hold their window plus one prefill chunk (a chunk
must not overwrite keys that its own first queries still see); global layers hold the context.
Past the context length the first ``n_keep`` slots stay (BOS, system prompt) and the oldest of
the rest are overwritten: positions keep growing, and ``dropped`` turns true once.
"""
from __future__ import annotations

import numpy as np


class LayerCache:
    def __init__(self, n_kv: int, cap: int, head_dim: int, window: int):
        # arrays of a multiple of 64 slots (the extra ones stay empty): attention sums 64 at a
        # time; k holds a row of slots per dim, so scores vectorize over slots, and each row is
        # 16 floats longer so that one slot's dims do not all fall in one L1 cache set
        size = -(-cap // 64) * 64
        self.k = np.zeros((n_kv, head_dim, size + 16), np.float32)
        self.v = np.zeros((n_kv, size, head_dim), np.float32)
        self.pos = np.full(size, -1, np.int64)  # absolute position held by each slot, -1 empty
        self.window = window                    # 0: attend to everything cached
        self.cap = cap
        self.hi = 0                             # slots [0, hi) have been written


class KVCache:
    def __init__(self, n_layer: int, n_kv: int, head_dim: int, n_ctx: int,
                 windows: list[int], chunk: int, n_keep: int = 0):
        self.n_ctx, self.n_keep = n_ctx, n_keep
        self.layers = [LayerCache(n_kv, min(n_ctx, w + chunk) if w else n_ctx, head_dim, w) for w in windows]
        self.n_past = 0          # tokens processed so far = the next absolute position
        self.dropped = False     # context overflowed at least once

    def slots(self, positions: np.ndarray, cap: int, window: int) -> np.ndarray:
        if window:
            return positions % cap
        keep = min(self.n_keep, cap - 1)
        return np.where(positions < cap, positions, keep + (positions - keep) % (cap - keep))

    def write_slots(self, n: int) -> list[np.ndarray]:
        """Claim slots for the next n positions in every layer; returns them per layer."""
        positions = np.arange(self.n_past, self.n_past + n)
        out, known = [], {}     # layers of one capacity and window share their slots: computed once
        for lc in self.layers:
            key = (lc.cap, lc.window)
            if key not in known:
                s = self.slots(positions, lc.cap, lc.window)
                known[key] = s, int(s.max()) + 1
            s, hi = known[key]
            if not lc.window and positions[-1] >= lc.cap:
                self.dropped = True
            lc.pos[s] = positions
            lc.hi = max(lc.hi, hi)
            out.append(s)
        self.n_past += n
        return out

    def rollback(self, k: int) -> None:
        """Forget the last k positions (rejected speculative tokens). Slots they overwrote in a
        full ring are not restored: those keys were past the window or the oldest context."""
        k = min(k, self.n_past)
        for lc in self.layers:
            lc.pos[lc.pos >= self.n_past - k] = -1
        self.n_past -= k

    def reset(self) -> None:
        for lc in self.layers:
            lc.pos[:] = -1
            lc.hi = 0
        self.n_past = 0
        self.dropped = False

    def nbytes(self) -> int:
        return sum(lc.k.nbytes + lc.v.nbytes for lc in self.layers)
