"""The KV store: per layer K and V in pages of 64 slots, read by one attention kernel through
a block table (logical slot -> page), so where a page lives changes no bit.

Two owners of pages:

- ``KVCache``, a single sequence's ring (prompt, chat, speculation, perplexity): its pages
  are its own and in order (the identity table). Keys are cached after RoPE at their
  absolute positions, so a query only needs each slot's position to mask it.
  Sliding-window layers hold their window plus one prefill chunk (a chunk must not overwrite
  keys that its own first queries still see); global layers hold the context. Past the
  context length the first ``n_keep`` slots stay (BOS, system prompt) and the oldest of the
  rest are overwritten: positions keep growing, and ``dropped`` turns true once.
- ``PagedKV``, many sequences over one pool of pages (the batch engine): each sequence has a
  block table; logical slot = position in every layer (no ring: a sequence never outgrows
  the context it was admitted with); full pages of prompt are shared between sequences by
  the hash of their tokens and of everything before them (``BlockPool``).

Arrays are allocated once, in pages of 64 slots (attention sums 64 at a time); within a
page k holds a row of slots per dim, so scores vectorize over slots, and each row is 16
values longer so that one slot's dims do not all fall in one L1 cache set. K and V are
float16 (uint16 bits, numba has no float16), as llama.cpp's default cache: 2 bytes a value. A page's K and V
are contiguous and pages never touched are never resident (zeroed memory is mapped lazily,
in huge pages too), so memory follows the tokens held.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

PAGE = 64


@dataclass
class LayerKV:
    """What attention and the K/V store of one layer read in one forward."""
    k: np.ndarray            # f16: (pages, n_kv, head_dim, 64 + 16) float16 bits, a dim's slots in a row;
                             # q8_0/q4_0: (pages, n_kv, 64, block bytes of a row)
    v: np.ndarray            # f16: (pages, n_kv, 64, head_dim) float16 bits; quantized as k
    pos: np.ndarray          # (n_phys,) position held by each physical slot, -1 empty
    slots: np.ndarray        # (n_tok,) physical slot each new token is written to
    tables: np.ndarray       # (n_seq, pages) int64: logical page -> physical page
    seq_slots: np.ndarray    # (n_seq,) logical slots of each sequence that may hold keys
    window: int              # 0: attend to everything cached


# cache element types (llama.cpp's -ctk/-ctv): bytes per block of 32 values (f16: 2 a value)
CACHE_TYPES = {"f16": 64, "q8_0": 34, "q4_0": 18}


# What a quantized K and V cache costs, measured: perplexity with -ctk/-ctv T over perplexity
# with the f16 cache, flash attention on, ctx 512, on tests/fixtures/ppl_text.txt (llama.cpp's
# figures, tests/fixtures/kv_types.json, which numbat's equal to the printed digit).
KV_COST = {
    "qwen2.5-coder:0.5b": {"q8_0": 6.1782 / 5.9748, "q4_0": 36.8565 / 5.9748},
    "qwen2.5-coder:1.5b": {"q8_0": 1.8433 / 1.8408, "q4_0": 1317.3899 / 1.8408},
    "gemma3:270m": {"q8_0": 14.8704 / 14.9329, "q4_0": 16.7384 / 14.9329},
}


def kv_cost_warning(model: str, types: tuple[str, str]) -> str | None:
    """One line for a cache type that costs more than 2% perplexity on this model, or that
    can cost much and was not measured on it (q4_0); None otherwise."""
    worst = "q4_0" if "q4_0" in types else "q8_0" if "q8_0" in types else None
    if worst is None:
        return None
    cost = KV_COST.get(model, {}).get(worst)
    if cost is None:
        return (f"warning: a {worst} KV cache was not measured on {model}; on the catalog models it raised "
                f"perplexity by up to {max(c[worst] for c in KV_COST.values()):.0f}x (numbat info and README: KV cache types)"
                if worst == "q4_0" else None)
    if cost <= 1.02:
        return None
    figure = f"{(cost - 1) * 100:.1f}%" if cost < 1.5 else f"{cost:.1f}x"
    return (f"warning: a {worst} KV cache raises {model}'s perplexity by {figure} (measured at ctx 512 against "
            f"the f16 cache); -ctk/-ctv f16 keeps it")


def bytes_per_value(t: str) -> float:
    return CACHE_TYPES[t] / 32


def _kv_arrays(n_kv: int, head_dim: int, n_pages: int, types: tuple[str, str] = ("f16", "f16")):
    """K and V of n_pages pages, each page's contiguous: memory (huge pages too) is touched
    only where pages are written. f16 K: a row of slots per dim; quantized K or V: a slot's
    row of blocks (llama.cpp's block_q8_0 / block_q4_0 bytes)."""
    kt, vt = types
    rows = lambda t: (n_pages, n_kv, PAGE, head_dim // 32 * CACHE_TYPES[t])
    k = np.zeros((n_pages, n_kv, head_dim, PAGE + 16), np.uint16) if kt == "f16" else np.zeros(rows(kt), np.uint8)
    v = np.zeros((n_pages, n_kv, PAGE, head_dim), np.uint16) if vt == "f16" else np.zeros(rows(vt), np.uint8)
    return k, v


class _Slots:
    """The slots' bookkeeping of the layers of one capacity and window, which every claim and
    rollback changes alike: shared, so that a decode step's claim costs one update per kind of
    layer, not one per layer (24 layers: 38 -> 13 us with hot caches, ~3x that inside a step)."""

    def __init__(self, cap: int, window: int):
        self.cap, self.window = cap, window
        self.pos = np.full(-(-cap // PAGE) * PAGE, -1, np.int64)   # the position each slot holds
        self.table = np.arange(len(self.pos) // PAGE, dtype=np.int64)[None]   # each layer's pages, in order
        self.hi = 0                             # slots [0, hi) have been written


class LayerCache:
    def __init__(self, n_kv: int, head_dim: int, slots: _Slots, types=("f16", "f16"), arrays=_kv_arrays):
        self.slots = slots                      # shared with the layers of its capacity and window
        self.pos, self.table, self.cap, self.window = slots.pos, slots.table, slots.cap, slots.window
        self.k, self.v = arrays(n_kv, head_dim, len(slots.pos) // PAGE, types)   # the extra slots stay empty


class KVCache:
    """One sequence's ring cache."""

    def __init__(self, n_layer: int, n_kv: int, head_dim: int, n_ctx: int,
                 windows: list[int], chunk: int, n_keep: int = 0, types=("f16", "f16"), arrays=_kv_arrays):
        # arrays(n_kv, head_dim, n_pages, types) -> (K, V): the backend's storage (numpy here,
        # mx arrays for MLX); this class only keeps the slots' bookkeeping
        self.n_ctx, self.n_keep = n_ctx, n_keep
        keys = list(zip(self.caps(n_ctx, windows, chunk), windows))
        self.groups = {key: _Slots(*key) for key in dict.fromkeys(keys)}
        self.layers = [LayerCache(n_kv, head_dim, self.groups[key], types, arrays) for key in keys]
        self.n_past = 0          # tokens processed so far = the next absolute position
        self.dropped = False     # context overflowed at least once

    @staticmethod
    def caps(n_ctx: int, windows: list[int], chunk: int) -> list[int]:
        """Slots per layer: a sliding layer's window plus one prefill chunk, a global one's n_ctx."""
        return [min(n_ctx, w + chunk) if w else n_ctx for w in windows]

    @property
    def capacity(self) -> int:
        """The most logical slots a layer has (attention's scratch is sized by it)."""
        return max(g.pos.shape[0] for g in self.groups.values())

    def slots(self, positions: np.ndarray, cap: int, window: int) -> np.ndarray:
        if window:
            return positions % cap
        keep = min(self.n_keep, cap - 1)
        return np.where(positions < cap, positions, keep + (positions - keep) % (cap - keep))

    def claim(self, n: int) -> tuple[np.ndarray, list[LayerKV]]:
        """Claim slots for the next n positions in every layer; returns the positions and what
        each layer's forward reads and writes."""
        positions = np.arange(self.n_past, self.n_past + n)
        views = {}
        for g in self.groups.values():
            s = self.slots(positions, g.cap, g.window)
            if not g.window and self.n_past + n > g.cap:
                self.dropped = True
            g.pos[s] = positions
            g.hi = max(g.hi, int(s.max()) + 1)
            views[g] = s, g.table, np.array([g.hi], np.int64)
        out = [LayerKV(lc.k, lc.v, lc.pos, *views[lc.slots], lc.window) for lc in self.layers]
        self.n_past += n
        return positions, out

    def rollback(self, k: int) -> None:
        """Forget the last k positions (rejected speculative tokens). Slots they overwrote in a
        full ring are not restored: those keys were past the window or the oldest context."""
        k = min(k, self.n_past)
        for g in self.groups.values():
            g.pos[g.pos >= self.n_past - k] = -1
        self.n_past -= k

    def reset(self) -> None:
        for g in self.groups.values():
            g.pos[:] = -1
            g.hi = 0
        self.n_past = 0
        self.dropped = False

    def nbytes(self) -> int:
        return sum(lc.k.nbytes + lc.v.nbytes for lc in self.layers)


class PoolFull(Exception):
    """No free or evictable page: the caller admitted more than the pool holds."""


class BlockPool:
    """Reference-counted pages with prefix hashing and LRU eviction (the bookkeeping only; the
    arrays live in PagedKV).

    A full page of prompt is registered under a key chained from its parent's key and its
    tokens, so equal keys mean equal tokens from position 0 on. A page whose count drops to
    zero stays cached under its key (least recently released first out) until a new page is
    needed; a page without a key goes straight back to the free list."""

    def __init__(self, n_pages: int):
        self.n_pages = n_pages
        self.ref = np.zeros(n_pages, np.int64)
        self.free = list(range(n_pages - 1, -1, -1))     # pop() gives page 0 first
        self.cached: OrderedDict[int, None] = OrderedDict()   # unreferenced pages with a key, LRU first
        self.by_key: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.peak = 0
        self.evictions = 0

    @staticmethod
    def key(parent: bytes | None, tokens) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        h.update(parent or b"root")
        h.update(np.asarray(tokens, np.int64).tobytes())
        return h.digest()

    def available(self) -> int:
        return len(self.free) + len(self.cached)

    def in_use(self) -> int:
        return self.n_pages - self.available()

    def allocate(self) -> int:
        if self.free:
            p = self.free.pop()
        elif self.cached:
            p, _ = self.cached.popitem(last=False)      # evict the least recently released
            del self.by_key[self.key_of.pop(p)]
            self.evictions += 1
        else:
            raise PoolFull("no free KV page")
        self.ref[p] = 1
        self.peak = max(self.peak, self.in_use())
        return p

    def lookup(self, key: bytes) -> int | None:
        """The cached page with this key, now referenced once more; None on a miss."""
        p = self.by_key.get(key)
        if p is None:
            return None
        if self.ref[p] == 0:
            del self.cached[p]
        self.ref[p] += 1
        self.peak = max(self.peak, self.in_use())
        return p

    def register(self, p: int, key: bytes) -> None:
        """Offer page p (full, referenced) for sharing under key; a page already holding the
        same tokens keeps the key."""
        if key not in self.by_key and p not in self.key_of:
            self.by_key[key] = p
            self.key_of[p] = key

    def release(self, p: int) -> None:
        assert self.ref[p] > 0, f"page {p} released twice"
        self.ref[p] -= 1
        if self.ref[p] == 0:
            if p in self.key_of:
                self.cached[p] = None
            else:
                self.free.append(p)


@dataclass
class SeqKV:
    """One sequence's pages in a PagedKV."""
    pages: list[int] = field(default_factory=list)
    n: int = 0                   # tokens written (= the next position)
    keys: list[bytes] = field(default_factory=list)   # keys of its leading full, shareable pages
    cached_tokens: int = 0       # prompt tokens that came from shared pages


class PagedKV:
    """Many sequences' K/V over one pool of pages (see the module docstring)."""

    def __init__(self, n_layer: int, n_kv: int, head_dim: int, n_pages: int, max_pages: int, types=("f16", "f16"),
                 arrays=_kv_arrays):
        self.pool = BlockPool(n_pages)
        self.max_pages = max_pages                  # pages one sequence may have (its context)
        n_phys = n_pages * PAGE
        self.layers = [arrays(n_kv, head_dim, n_pages, types) for _ in range(n_layer)]
        self.pos = np.full(n_phys, -1, np.int64)    # one for all layers: logical slot = position
        self.hits = 0          # prompt tokens served from shared pages
        self.lookups = 0       # prompt tokens that could have been

    def nbytes_per_page(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers) // self.pool.n_pages

    def attach(self, seq: SeqKV, prompt: list[int], limit: int, computing: set[bytes]) -> bool:
        """Give seq the longest run of shared full pages of prompt that leaves at least
        ``limit`` prompt tokens to compute. False, and nothing attached, when the first page
        it lacks is one that ``computing`` (keys of pages being computed now) will provide:
        the caller waits a step and reuses it. Otherwise adds that page's key to computing."""
        keys, pages, parent = [], [], None
        while (len(pages) + 1) * PAGE <= len(prompt) - limit:
            lo = len(pages) * PAGE
            key = self.pool.key(parent, prompt[lo:lo + PAGE])
            p = self.pool.by_key.get(key)
            if p is None:
                if key in computing:
                    return False
                computing.add(key)
                break
            keys.append(key)
            pages.append(p)
            parent = key
        for p in pages:
            self.pool.lookup(self.pool.key_of[p])
        seq.pages, seq.keys = pages, keys
        seq.n = seq.cached_tokens = len(pages) * PAGE
        self.hits += seq.n
        self.lookups += len(prompt)
        return True

    def grow(self, seq: SeqKV, n: int) -> np.ndarray:
        """Room for n more tokens of seq: returns their physical slots (new pages are cleared)."""
        logical = np.arange(seq.n, seq.n + n)
        while len(seq.pages) * PAGE < seq.n + n:
            if len(seq.pages) >= self.max_pages:
                raise PoolFull("sequence longer than its context")
            p = self.pool.allocate()
            self.pos[p * PAGE:(p + 1) * PAGE] = -1      # a recycled page's old positions are not ours
            seq.pages.append(p)
        pages = np.asarray(seq.pages, np.int64)
        slots = pages[logical // PAGE] * PAGE + logical % PAGE
        self.pos[slots] = logical
        seq.n += n
        return slots

    def share(self, seq: SeqKV, prompt: list[int], upto: int) -> None:
        """Register seq's full pages that lie within prompt[:upto] (computed by a prefill whose
        arithmetic is a cold run's) for other sequences to reuse."""
        parent = seq.keys[-1] if seq.keys else None
        while (len(seq.keys) + 1) * PAGE <= upto:
            i = len(seq.keys)
            key = self.pool.key(parent, prompt[i * PAGE:(i + 1) * PAGE])
            self.pool.register(seq.pages[i], key)
            seq.keys.append(key)
            parent = key

    def free(self, seq: SeqKV) -> None:
        for p in seq.pages:
            self.pool.release(p)
        seq.pages, seq.keys, seq.n = [], [], 0

    def view(self, seqs: list[SeqKV], slots: np.ndarray, window_of: list[int]) -> list[LayerKV]:
        """What each layer reads in a forward over tokens of seqs (slots: where they go)."""
        width = max(len(s.pages) for s in seqs)
        tables = np.zeros((len(seqs), width), np.int64)
        for i, s in enumerate(seqs):
            tables[i, :len(s.pages)] = s.pages
        seq_slots = np.array([s.n for s in seqs], np.int64)
        return [LayerKV(k, v, self.pos, slots, tables, seq_slots, w) for (k, v), w in zip(self.layers, window_of)]
