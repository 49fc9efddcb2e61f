"""The CPU backend: the ops of graph.run (the one forward for llama, qwen2, qwen3 and gemma3)
as numba kernels over the memory-mapped blocks. Decode (one token) runs the fused matvec
kernels; prefill chunks go through the tiled matmul. Every activation buffer is allocated
once, at load."""
from __future__ import annotations

import os
from dataclasses import dataclass

import numba
import numpy as np
from numba import njit
from gguf_io.types import GGMLQuantizationType as T

import quant
from quant import packed
from models import derived
from gguf_io.config import ModelConfig
from gguf_io.reader import GGUFError, GGUFFile
from runner.backends import CHECK_ROWS, Batch, graph
from runner.backends import kernels as K
from runner.backends.graph import Layer
from runner.kv_cache import CACHE_TYPES, PAGE, KVCache, LayerKV, PagedKV


# Batches up to this size run the matvec kernels where the weights are not repacked
# (matvec_rows where the type has it: faster than dequantizing every weight tile for a few
# tokens), and Q/K/V (gate/up) as one fused repacked matrix where they have one.
SMALL_BATCH = quant.kquants.ROWS
assert SMALL_BATCH == CHECK_ROWS   # the contract's exact verification size is this one

# A draft's matrices of more than 4.5 bits a weight are requantized to Q4_0 at load (kept in
# NUMBAT_HOME, as repacking is): a draft only proposes, the target's check keeps the output
# exact, and the draft's steps are a third of a speculative round's time. The 0.5b (Q5_0,
# Q8_0 and Q6_K layers) as the 1.5b's draft: 13.4 -> 9.4 ms a step, 3.55 -> 3.49 tokens a
# check (BENCHMARKS.md, session 20).
DRAFT_Q4_0 = frozenset({T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.Q8_0, T.F16, T.BF16, T.F32})


@dataclass
class Linear:
    type_id: int
    raw: np.ndarray | quant.packed.Packed   # (n_out, row_bytes) read-only view of the file, or repacked
    n_in: int
    n_out: int
    bias: np.ndarray | None = None

    def __call__(self, X: np.ndarray, Y: np.ndarray, rounded: dict | None = None, batch: bool = True) -> None:
        """Y = X W^T (+ bias). Repacked weights take llama.cpp's float steps for a batch of
        len(X) tokens (batch) or, row by row, those of a single token."""
        packed = isinstance(self.raw, quant.packed.Packed)
        rows = None if packed else quant.qtype(self.type_id).matvec_rows
        kernel = quant.cpu.linear(self.type_id, packed, X.shape[0], batch, rows is not None)
        if kernel == "packed":
            quant.packed.matmul_rows(self.raw, X, Y, batch, rounded)
        elif kernel in ("rows", "matvec"):      # one token's steps for every row
            for s in range(0, X.shape[0], SMALL_BATCH):
                Xs, Ys = X[s:s + SMALL_BATCH], Y[s:s + SMALL_BATCH]
                if len(Xs) > 1 and kernel == "rows":
                    rows(self.raw, Xs, Ys)
                else:
                    for i in range(Xs.shape[0]):
                        quant.matvec(self.type_id, self.raw, Xs[i], Ys[i])
        else:
            quant.matmul(self.type_id, self.raw, X, Y, rounded)
        if self.bias is not None:
            Y += self.bias

    def first(self, n: int) -> Linear:
        """The first n output rows (n a multiple of 16 when repacked)."""
        raw = self.raw
        if isinstance(raw, quant.packed.Packed):
            raw = quant.packed.Packed(raw.type_id, raw.data[:n // 16], n, raw.cols)
        else:
            raw = raw[:n]
        return Linear(self.type_id, raw, self.n_in, n, None if self.bias is None else self.bias[:n])


@dataclass
class _State:
    """One forward's bookkeeping for the ops."""
    b: Batch
    n: int                      # rows now (the last layer keeps only the output rows)
    segs: list
    qbatch: np.ndarray          # per token: its segment is a batch (the non-flash path's steps)
    qmode: np.ndarray           # per token: flash attention's path
    paths: tuple = (True, False)  # (some token's path is not FA_TILE, some token's is)
    nth: int = 1                # numba's threads (attention's split depends on them), read once


class _Head:
    def __init__(self, lin: Linear):
        self.lin, self.n_out = lin, lin.n_out

    def __call__(self, h: np.ndarray) -> np.ndarray:
        out = np.empty((1, self.n_out), np.float32)
        self.lin(h, out)
        return out[0]


# The flags of a compiled decode layer (_layer_in, _layer_out): which of graph.run's optional
# steps the architecture takes.
BIAS, SPLIT_V, HEAD_NORM = 1, 2, 4          # _layer_in: Q/K/V biases, V apart from [q | k], q/k norms
POST_ATTN, POST_FFN, GELU = 1, 2, 4         # _layer_out: gemma3's post-norms and GELU


@njit(cache=True)
def _layer_in(x, h, norm, eps, out, M, bias, v, Mv, bias_v, q_norm, k_norm, nq, nk, hd, flags, nth):
    """graph.run's steps of one decode token (one layer) up to attention, in one call: the
    norm, [q | k | v] (or [q | k] and v) and their biases, q and k's head norms. The same
    kernels in the same order as the ops, so the same bits (tests/test_tiny_models.py
    compares the two paths)."""
    e = np.float32(eps)
    K.rms_row(x[0], norm, e, h[0])
    packed.decode_matvec(h, out, M, nth)
    if flags & BIAS:
        for j in range(out.shape[1]):
            out[0, j] += bias[j]
    if flags & SPLIT_V:
        packed.decode_matvec(h, v, Mv, nth)
        if flags & BIAS:
            for j in range(v.shape[1]):
                v[0, j] += bias_v[j]
    if flags & HEAD_NORM:
        for o in range(0, nq + nk, hd):
            w = q_norm if o < nq else k_norm
            K.rms_row(out[0, o:o + hd], w, e, out[0, o:o + hd])


@njit(cache=True)
def _layer_out(a, x, h, o, gu, u, Mo, post_attn, ffn_norm, Mgu, Md, post_ffn, eps, table, flags, nth):
    """graph.run's steps of one decode token (one layer) after attention, in one call: wo, the
    residual, the norm, [gate | up], the activation, down and the residual again (gemma3's
    post-norms where flags say)."""
    e = np.float32(eps)
    packed.decode_matvec(a, o, Mo, nth)
    if flags & POST_ATTN:
        K.rms_row(o[0], post_attn, e, o[0])
    for j in range(x.shape[1]):
        x[0, j] += o[0, j]
    K.rms_row(x[0], ffn_norm, e, h[0])
    packed.decode_matvec(h, gu, Mgu, nth)
    n = u.shape[1]
    if flags & GELU:
        K.gelu_mul_row(gu[0, :n], gu[0, n:], u[0], table)
    else:
        K.silu_mul_halves(gu, u, nth)
    packed.decode_matvec(u, o, Md, nth)
    if flags & POST_FFN:
        K.rms_row(o[0], post_ffn, e, o[0])
    for j in range(x.shape[1]):
        x[0, j] += o[0, j]


def _qkv(i: int) -> tuple:
    return tuple(f"blk.{i}.attn_{x}.weight" for x in "qkv")


def _gate_up(i: int) -> tuple:
    return f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight"


def _packed(f: GGUFFile, cfg: ModelConfig) -> tuple[list, list]:
    """The matrices repacked for decode where quant.packed has their type (the embedding only
    for the output head it may double as: lookups read the file's rows), and the groups that
    share an input (quant.packed.pack_file's names and groups)."""
    names = [n for n, t in f.tensors.items() if len(t.dims) == 2 and (n != "token_embd.weight" or cfg.tied_output)]
    groups = [g(i) for i in range(cfg.n_layer) for g in (_qkv, _gate_up) if all(n in f.tensors for n in g(i))]
    return names, groups


def facts(f: GGUFFile, cfg: ModelConfig) -> dict:
    """What needs() reads of a validated file: its head size, embedding type, activation and
    the distinct [type, rows, columns] of the matrices the backend may repack. A catalog
    entry lists its model's (models.catalog.Entry.facts): a first run starts compiling
    before the download ends."""
    mats = {(int(f.tensors[n].type_id), int(f.tensors[n].dims[1]), int(f.tensors[n].dims[0])) for n in _packed(f, cfg)[0]}
    return dict(head_dim=int(cfg.head_dim), embd_type=int(f.tensors["token_embd.weight"].type_id),
                silu=cfg.act == "silu", matrices=[list(m) for m in sorted(mats)])


def needs(fs: dict, draft: bool = False) -> dict:
    """What the backend of a model of these facts() will run, jobs()'s model arguments, known
    before it is built: its head size, embedding type, repacked kinds (the plan
    quant.packed.pack_file follows on this CPU) and activation."""
    q4_0 = DRAFT_Q4_0 if draft else ()
    kinds = {quant.packed.KINDS[t] for t in (quant.packed.repack_type(t, r, c, q4_0) for t, r, c in fs["matrices"])
             if t is not None}
    return dict(head_dim=fs["head_dim"], embd_type=fs["embd_type"], kinds=sorted(int(k) for k in kinds), silu=fs["silu"])


class NumbaCPU:
    name = "numba-cpu"

    def __init__(self, f: GGUFFile, cfg: ModelConfig, chunk: int = 512, max_tokens: int | None = None,
                 flash: bool = True, cache_types: tuple[str, str] = ("f16", "f16"), draft: bool = False):
        from gguf_io.validate import validate; validate(f, cfg)  # noqa: E702  untrusted file: shapes proven before any kernel runs
        # chunk: llama.cpp's batch size for one sequence's prompt; max_tokens: the most tokens
        # one run() takes (a batch engine's step: a prompt chunk and other sequences' tokens)
        self.cfg, self.chunk, self.max_tokens = cfg, chunk, max_tokens or chunk + 64
        # flash: llama.cpp's flash-attention kernel (its default on the CPU), else its
        # mul_mat + soft_max path; both to the bit (see K.flash_attention, K.attention)
        self.flash = flash
        # a draft's attention takes the tiled path for every query (begin)
        self.tile_all = draft
        # K and V element types (llama.cpp's -ctk/-ctv): f16, or q8_0/q4_0 blocks; a quantized
        # V only with flash attention (llama.cpp's mul_mat path reads V transposed, in f16)
        for t in cache_types:
            if t not in CACHE_TYPES:
                raise GGUFError(f"cache type {t!r}: use one of {', '.join(CACHE_TYPES)}")
        if cache_types != ("f16", "f16"):
            if not flash and cache_types[1] != "f16":
                raise GGUFError("a quantized V cache needs flash attention (-fa on), as llama.cpp's does")
            if cfg.head_dim % 32:
                raise GGUFError(f"a quantized KV cache needs a head size that is a multiple of 32, not {cfg.head_dim}")
        self.cache_types = tuple(cache_types)
        # llama.cpp rotates q and k (rows of the largest power of 2 >= 64 dividing the head
        # size) and v and the attention output (rows of 64) by a Hadamard matrix around a
        # quantized cache, so that outliers spread before 8 or 4 bits hold them
        # (LLAMA_ATTN_ROT_DISABLE=1 turns that off there, and here)
        rot = os.environ.get("LLAMA_ATTN_ROT_DISABLE", "0") in ("", "0")
        hd = cfg.head_dim
        self.rot_k = hd & -hd if rot and cache_types[0] != "f16" and hd % 64 == 0 else 0
        self.rot_v = 64 if rot and cache_types[1] != "f16" and hd % 64 == 0 else 0
        self._kv_codes = tuple({"f16": K.KV_F16, "q8_0": K.KV_Q8_0, "q4_0": K.KV_Q4_0}[t] for t in cache_types)
        for t in f.tensors.values():
            quant.qtype(t.type_id)   # unsupported types fail at load, with the type named

        def vec(name):   # small float vectors (norms, biases) are copied to float32
            if name not in f.tensors:
                return None
            t = f.tensors[name]
            return quant.dequantize(t.type_id, f.raw(name).reshape(1, -1), t.n_elements)[0]

        def lin(name, bias=None):
            graph.require(f, name)
            t = f.tensors[name]
            p = packs.get(name)         # a draft's may have another type than the file's
            type_id, raw = (t.type_id, f.raw(name)) if p is None else (p.type_id, p)
            return Linear(type_id, raw, t.dims[0], t.dims[1], vec(bias) if bias else None)

        def fused(names, biases):
            """One Linear for matrices of one type that share their input (decode and
            verification then make one kernel call for them), or None."""
            p = packs.get(names)
            if p is None:
                return None
            return Linear(p.type_id, p, p.cols, p.rows, np.concatenate([vec(b) for b in biases]) if biases else None)

        names, groups = _packed(f, cfg)
        packs = quant.packed.pack_file(f, names, groups, derived, DRAFT_Q4_0 if draft else ())

        # llama 3 files carry per-pair rope frequency divisors
        freq_factors = vec("rope_freqs.weight")
        self.freq_factors = freq_factors if freq_factors is not None else np.ones(cfg.rope_dim // 2, np.float32)
        self.freq_scale = np.float32(1.0 / cfg.rope_scale)
        self.layers = graph.build_layers(f, cfg, lin, vec)
        for i, L in enumerate(self.layers):
            p = f"blk.{i}."
            biases = [p + f"attn_{x}.bias" for x in "qkv"] if cfg.qkv_bias else []
            L.qkv = fused(_qkv(i), biases)
            L.qk = fused(_qkv(i)[:2], biases[:2]) if L.qkv is None else None
            L.gate_up = fused(_gate_up(i), [])
        t = f.tensors["token_embd.weight"]      # rows are looked up: the file's layout (a plain
        # view of the map: a memmap's indexing runs numpy's Python subclass hooks, 2% of a 0.5b step)
        self.embd = Linear(t.type_id, f.raw("token_embd.weight").view(np.ndarray), t.dims[0], t.dims[1])
        self.output_norm = vec("output_norm.weight")
        out = "token_embd.weight" if cfg.tied_output else "output.weight"
        self.output = lin(out)
        t = f.tensors[out]      # the file's rows, for a head over chosen ids (a draft's)
        self.output_rows = Linear(t.type_id, f.raw(out), t.dims[0], t.dims[1])
        self._alloc()
        # one-token forwards through the compiled layers (_decode); False: the ops one by one
        self.compiled_step, self._steps = True, None

    def _alloc(self):
        c, C = self.cfg, self.max_tokens
        qd, kd = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        z = lambda *s: np.zeros(s, np.float32)
        self.x, self.h, self.o = z(C, c.n_embd), z(C, c.n_embd), z(C, c.n_embd)
        self.q, self.attn = z(C, qd), z(C, qd)
        self.k, self.v = z(C, kd), z(C, kd)
        # the activation's output apart from its inputs: written in place, LLVM's overlap check
        # fails and the SiLU loop runs scalar (2.75 against 0.28 ms for 512 x 4864 values)
        self.g, self.u, self.act = z(C, c.n_ff), z(C, c.n_ff), z(C, c.n_ff)
        self.qkv_buf, self.gu_buf = z(SMALL_BATCH, qd + 2 * kd), z(SMALL_BATCH, 2 * c.n_ff)   # fused outputs
        self.scratch = None             # attention's per-thread scores and lanes, sized by the cache

    def _scratch_for(self, slots: int) -> None:
        c = self.cfg
        size = K.attention_scratch(-(-slots // 64) * 64, c.head_dim, c.n_head // c.n_head_kv)
        if self.scratch is None or self.scratch.shape[1] < size:
            self.scratch = np.zeros((numba.config.NUMBA_NUM_THREADS, size), np.float32)

    def packed_kinds(self) -> set[int]:
        """The repacked kinds of this model's matrices (quant.packed), whose kernels it runs."""
        lins = [self.output, *(w for L in self.layers for w in vars(L).values())]
        return {w.raw.kind for w in lins if isinstance(getattr(w, "raw", None), quant.packed.Packed)}

    def make_cache(self, n_ctx: int, n_keep: int = 0) -> KVCache:
        c = self.cfg
        cache = KVCache(c.n_layer, c.n_head_kv, c.head_dim, n_ctx, self.windows, self.chunk, n_keep, self.cache_types)
        self._scratch_for(cache.capacity)
        return cache

    def make_store(self, n_pages: int, n_ctx: int) -> PagedKV:
        """A pool of n_pages KV pages for many sequences of up to n_ctx tokens each."""
        c = self.cfg
        store = PagedKV(c.n_layer, c.n_head_kv, c.head_dim, n_pages, -(-n_ctx // PAGE), self.cache_types)
        self._scratch_for(store.max_pages * PAGE)
        return store

    @property
    def windows(self) -> list[int]:
        return [l.window for l in self.layers]

    def forward(self, tokens, cache: KVCache, logits: str = "last", one_by_one: bool = False) -> np.ndarray:
        return graph.forward(self, tokens, cache, logits, one_by_one)

    def run(self, b: Batch, kv: list[LayerKV], hidden: bool = False) -> np.ndarray | None:
        """graph.run over this backend's ops. Each segment of b runs its matmuls with the
        float steps of one llama.cpp batch of its size (batch) or of one token per row, so a
        token's bits depend only on its segment, never on what else shares the forward: the
        rows of other sequences only make the weights stream once for all. Not reentrant
        (one engine thread owns every forward): the activation buffers and the kernels'
        scratch are the backend's. One decode token takes _decode's compiled layers."""
        if len(b.tokens) == 1 and not b.segments[0][2] and (b.out is None or len(b.out)) and self._decode_layers():
            return self._decode(b, kv, hidden)
        return graph.run(self, self.layers, b, kv, hidden)

    def _decode(self, b: Batch, kv: list[LayerKV], hidden: bool) -> np.ndarray:
        """graph.run for one token, each layer in three calls: _layer_in, the attention op and
        _layer_out, where the ops make a dozen calls with Python between them. The same
        kernels in the same order: the same bits. Measured in one process against the ops
        (bench/step_split.py --ab, Zen 4): steps 1.6-2.4% shorter on the 0.5b's files, 8.5%
        on gemma3 (its extra norms), ~1% on the 1.5b."""
        st = self.begin(b)
        self.embed(st)
        for L, lk, (ins, qkv, outs) in zip(self.layers, kv, self._steps):
            _layer_in(*ins, st.nth)
            self.attend(st, L, lk, *qkv)
            _layer_out(*outs, st.nth)
        return self.head_out(st, self.x[:1], hidden)

    def _decode_layers(self) -> bool:
        """Whether one-token forwards take _decode (every layer's matrices repacked, Q/K/V and
        gate/up fused; not in a first run's process, which leaves compiling it to its
        helper), its arguments made on first use."""
        if self._steps is None:
            def one(W):     # quant.cpu's choice for a token through W: the repacked kernels
                return W is not None and quant.cpu.linear(W.type_id, isinstance(W.raw, packed.Packed), 1, False, False) == "packed"
            ok = all((one(L.qkv) or one(L.qk) and one(L.wv)) and one(L.gate_up) and one(L.wo) and one(L.down)
                     for L in self.layers)
            self._steps = [self._layer_args(L) for L in self.layers] if ok else []
        return self.compiled_step and bool(self._steps)

    def _layer_args(self, L: Layer) -> tuple:
        """_layer_in's arguments, the attention op's q, k and v, _layer_out's arguments."""
        c, one = self.cfg, self.x[:1]
        nq, nk = self.q.shape[1], self.k.shape[1]
        none = np.zeros(1, np.float32)
        eps = float(c.norm_eps)
        W = L.qkv if L.qkv is not None else L.qk
        out = self.qkv_buf[:1, :W.n_out]
        M = Mv = packed.decode_args(W.raw)
        v, bias_v = self.v[:1], none
        flags = (BIAS if W.bias is not None else 0) | (HEAD_NORM if L.q_norm is not None else 0)
        if L.qkv is None:
            Mv, bias_v, flags = packed.decode_args(L.wv.raw), L.wv.bias if L.wv.bias is not None else none, flags | SPLIT_V
        else:
            v = out[:, nq + nk:]
        ins = (one, self.h[:1], L.attn_norm, eps, out, M, none if W.bias is None else W.bias, v, Mv, bias_v,
               none if L.q_norm is None else L.q_norm, none if L.k_norm is None else L.k_norm, nq, nk, c.head_dim, flags)
        gelu = c.act == "gelu_tanh"
        flags = (POST_ATTN if L.post_attn_norm is not None else 0) | (POST_FFN if L.post_ffn_norm is not None else 0) | (GELU if gelu else 0)
        outs = (self.attn[:1], one, self.h[:1], self.o[:1], self.gu_buf[:1], self.u[:1], packed.decode_args(L.wo.raw),
                none if L.post_attn_norm is None else L.post_attn_norm, L.ffn_norm, packed.decode_args(L.gate_up.raw),
                packed.decode_args(L.down.raw), none if L.post_ffn_norm is None else L.post_ffn_norm, eps,
                K._gelu_table() if gelu else none, flags)
        return ins, (out[:, :nq], out[:, nq:nq + nk], v), outs

    def head(self, ids) -> _Head:
        if isinstance(ids, (int, np.integer)):
            return _Head(self.output.first(int(ids)))
        r = self.output_rows
        rows = np.ascontiguousarray(r.raw[ids])
        if self.output.type_id != r.type_id:     # a draft's requantized head: the same values
            return _Head(Linear(self.output.type_id, quant.requantize(r.type_id, rows, r.n_in), r.n_in, len(ids)))
        return _Head(Linear(r.type_id, rows, r.n_in, len(ids)))

    # ---- the ops graph.run calls: in place over the buffers of _alloc, views returned

    def begin(self, b: Batch) -> _State:
        n, segs = len(b.tokens), b.segments
        qbatch = np.zeros(n, np.bool_)
        qmode = np.full(n, K.FA_ONE, np.int8)      # flash attention's path: llama.cpp's by batch size
        for a, e, bt, *cold in segs:
            qbatch[a:e] = bt
            if bt:      # by the size of the llama.cpp batch the run belongs to (its cold run's)
                qmode[a:e] = K.FA_TILE if (cold[0] if cold else e - a) >= 64 else K.FA_VEC
        if self.tile_all:
            # A draft's guesses need not have llama.cpp's bits (the check keeps the output
            # exact whatever they are): every query through the tiled path, whose 64-cell
            # tiles and vectorized softmax beat decode's cell-by-cell one, and whose bits do
            # not depend on the thread count. The 0.5b at 300 cells: a one-token forward's
            # attention 2.64 -> 2.12 ms, a two-token one's 4.05 -> 3.10 ms.
            qmode[:] = K.FA_TILE
        tile = qmode == K.FA_TILE
        return _State(b, n, segs, qbatch, qmode, (not tile.all(), bool(tile.any())), quant.threads())

    def embed(self, st: _State) -> np.ndarray:
        x = self.x[:st.n]
        quant.qtype(self.embd.type_id).dequant_rows(self.embd.raw[st.b.tokens], x)
        if self.cfg.embed_scale != 1.0:
            x *= np.float32(self.cfg.embed_scale)
        return x

    def norm(self, st: _State, x: np.ndarray, w: np.ndarray, inplace: bool = False) -> np.ndarray:
        out = x if inplace else self.h[:st.n]
        K.rms_norm(x, w, self.cfg.norm_eps, out)
        return out

    def qkv(self, st: _State, L: Layer, h: np.ndarray):
        nq, nk = self.q.shape[1], self.k.shape[1]
        if st.n == 1 and L.qkv is not None:     # decode: q, k and v are the fused output's parts
            qkv = self.qkv_buf[:1]              # (one row: each part a contiguous view, no copies)
            L.qkv(h, qkv, batch=False)
            return qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:]
        if st.n == 1 and L.qk is not None:     # q and k the same way, v apart; each call
            qk, v = self.qkv_buf[:1, :nq + nk], self.v[:1]      # quantizes h (its bound path is
            L.qk(h, qk, batch=False)                            # cheaper than sharing it)
            L.wv(h, v, batch=False)
            return qk[:, :nq], qk[:, nq:], v
        q, k, v = self.q[:st.n], self.k[:st.n], self.v[:st.n]
        for a, e, bt, *_ in st.segs:
            self._qkv(L, h[a:e], q[a:e], k[a:e], v[a:e], bt)
        return q, k, v

    def head_norm(self, st: _State, t: np.ndarray, w: np.ndarray) -> np.ndarray:
        t2 = t.reshape(-1, self.cfg.head_dim)
        K.rms_norm(t2, w, self.cfg.norm_eps, t2)
        return t

    def attend(self, st: _State, L: Layer, lk: LayerKV, q, k, v) -> np.ndarray:
        c, b, n, hd = self.cfg, st.b, st.n, self.cfg.head_dim
        # 1/sqrt(head_dim) on the scores, or on q before its f16 rounding (gemma3), as llama.cpp
        q_scale, kq_scale = (np.float32(hd ** -0.5), np.float32(1)) if c.scale_q else (np.float32(1), np.float32(hd ** -0.5))
        q3, k3, v3 = q.reshape(n, c.n_head, hd), k.reshape(n, c.n_head_kv, hd), v.reshape(n, c.n_head_kv, hd)
        attn = self.attn[:n]
        a3 = attn.reshape(n, c.n_head, hd)
        # the cache holds f16 values, as llama.cpp's default f16 cache does (see K.attention)
        plain = self.cache_types == ("f16", "f16")
        # q rounded to f16 where llama.cpp's mul_mat converts it for an f16 K; a quantized K
        # takes it as float32 (and quantizes it to q8_0 for the dot)
        f16_k = self.cache_types[0] == "f16"
        K.rope_store(q3, k3, v3, b.positions, L.theta_scale, self.freq_scale, self.freq_factors, c.rope_neox,
                     lk.slots, lk.k, lk.v, q_scale, not self.flash and f16_k, plain)
        if not plain:
            if self.rot_k:
                K.fwht(q3, self.rot_k)
                K.fwht(k3, self.rot_k)
            if self.rot_v:
                K.fwht(v, self.rot_v)
            K.store_kv(k3, v3, lk.slots, lk.k, lk.v, *self._kv_codes)
        if not self.flash:      # f16 or quantized K (V is f16 here)
            K.attention(q3, b.positions, b.seq, st.qbatch, lk.k, lk.v, lk.pos, lk.tables, lk.seq_slots, L.window,
                        kq_scale, a3, self.scratch, st.nth, self._kv_codes[0])
        elif plain:
            for tile in (False, True):      # each path's kernel over its queries (most batches: one)
                if st.paths[tile]:
                    K.flash_attention(c.head_dim, tile)(q3, b.positions, b.seq, st.qmode, lk.k, lk.v, lk.pos, lk.tables,
                                                        lk.seq_slots, L.window, kq_scale, a3, self.scratch,
                                                        st.nth, K.fa_items(c.head_dim, tile).address)
        else:
            K.flash_attention_q(q3, b.positions, b.seq, lk.k, lk.v, lk.pos, lk.tables, lk.seq_slots, L.window,
                                kq_scale, a3, self.scratch, st.nth, *self._kv_codes)
        if self.rot_v:          # only around a quantized V
            K.fwht(attn, self.rot_v)
        return attn

    def linear(self, st: _State, W: Linear, x: np.ndarray) -> np.ndarray:
        o = self.o[:st.n]
        for a, e, bt, *_ in st.segs:
            W(x[a:e], o[a:e], batch=bt)
        return o

    def rows(self, st: _State, x, o, rows):
        st.n, st.segs = len(rows), [(0, len(rows), False)]
        return x[rows], o[rows]

    @staticmethod
    def add(x: np.ndarray, o: np.ndarray) -> np.ndarray:
        x += o
        return x

    def ffn(self, st: _State, L: Layer, h: np.ndarray) -> np.ndarray:
        n = st.n
        g, u, o = self.g[:n], self.u[:n], self.o[:n]
        for a, e, bt, *_ in st.segs:
            self._ffn(L, h[a:e], g[a:e], u[a:e], o[a:e], bt)
        return o

    def head_out(self, st: _State, x: np.ndarray, hidden: bool) -> np.ndarray:
        c, n = self.cfg, st.n
        out = np.empty((n, c.n_embd if hidden else c.n_vocab), np.float32)
        h = self.h[:n]
        K.rms_norm(x, self.output_norm, c.norm_eps, out if hidden else h)
        if not hidden:
            for a, e, bt, *_ in st.segs:
                self.output(h[a:e], out[a:e], batch=bt)
        return out

    def finish(self, st: _State) -> None:
        pass

    def _qkv(self, L: Layer, h, q, k, v, batch: bool) -> None:
        if L.qkv is not None and len(h) <= SMALL_BATCH:
            qkv = self.qkv_buf[:len(h)]      # one kernel call for the three
            L.qkv(h, qkv, batch=batch)
            q[:], k[:], v[:] = qkv[:, :q.shape[1]], qkv[:, q.shape[1]:-v.shape[1]], qkv[:, -v.shape[1]:]
        elif L.qk is not None and len(h) <= SMALL_BATCH:
            nq = q.shape[1]     # [q | k] per row, in a contiguous part of the fused buffer
            qk = self.qkv_buf.reshape(-1)[:len(h) * (nq + k.shape[1])].reshape(len(h), -1)
            L.qk(h, qk, batch=batch)
            q[:], k[:] = qk[:, :nq], qk[:, nq:]
            L.wv(h, v, batch=batch)
        else:
            hr = {}     # h rounded for the weights' kernels, once per kind
            L.wq(h, q, hr, batch)
            L.wk(h, k, hr, batch)
            L.wv(h, v, hr, batch)

    def _ffn(self, L: Layer, h, g, u, o, batch: bool) -> None:
        gelu = self.cfg.act == "gelu_tanh"
        if L.gate_up is not None and len(h) <= SMALL_BATCH:
            gu = self.gu_buf[:len(h)]        # one kernel call for both: [gate | up] per row
            L.gate_up(h, gu, batch=batch)
            if gelu:
                K.gelu_tanh_mul(gu[:, :g.shape[1]], gu[:, g.shape[1]:], u)
            else:
                K.silu_mul_halves(gu, u, quant.threads())
            L.down(u, o, batch=batch)
        else:
            hr = {}
            L.gate(h, g, hr, batch)
            L.up(h, u, hr, batch)
            a = self.act[:len(h)]
            (K.gelu_tanh_mul if gelu else K.silu_mul)(g, u, a)
            L.down(a, o, batch=batch)


class FirstRun:
    """The first run on a machine compiles every kernel the model needs (numba caches them
    after). Two processes share it: a helper started now is told what the model needs (head
    size, embedding type, weight kinds, activation) by expect() before a catalog model's
    download (from its entry), else by tell() as soon as the file is validated, and it
    starts down the list of compile jobs, largest first, while this process goes on
    downloading and loading (a first load repacks the weights: 1-3 s). warm() then takes this process down the same list,
    each process taking the next job the other has not claimed (a file created exclusively
    per job), so their shares come out even for any model. When the helper has no job left it
    says so; this process then runs the model's own forward, which loads everything from the
    cache. The helper goes on alone to compile flash attention's path for batches of 64
    tokens and more (~7 s: a first long prompt would otherwise wait for it) and exits. A
    helper that fails costs nothing but time: whatever it did not cache is compiled where it
    is first needed."""

    def __init__(self, flash: bool, cache_types: tuple[str, str]):
        import subprocess
        self.flash, self.cache_types = flash, cache_types
        self.helper = subprocess.Popen(helper_command(flash, cache_types), stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.need, self.claims, self.ready = None, None, False

    def expect(self, known: dict, draft: bool = False, download: bool = False) -> None:
        """A catalog model's needs from its entry's facts, to the helper before the download
        (4 s and more from an empty NUMBAT_HOME): it compiles meanwhile, the repacking
        kernel first if the file is yet to come (download), for this process's load."""
        self._send(dict(needs(known, draft), repack=download))

    def tell(self, f: GGUFFile, cfg: ModelConfig, draft: bool = False) -> None:
        """The validated file's needs (runner.model.load calls it): this process's list, and
        the helper's unless expect() gave it one (a file that needs more than its entry said
        only leaves more jobs to this process)."""
        self.need = needs(facts(f, cfg), draft)
        if self.claims is None:
            self._send(self.need)

    def _send(self, need: dict) -> None:
        import json
        import tempfile
        self.claims = tempfile.mkdtemp(prefix="numbat-first-run-")
        try:
            self.helper.stdin.write(json.dumps({"claims": self.claims, **need}).encode() + b"\n")
            self.helper.stdin.close()
        except OSError:         # the helper is gone: this process takes every job
            pass

    def warm(self, be: NumbaCPU, token: int) -> None:
        """After tell() and the load: this process's share of the jobs, then the forward."""
        be.compiled_step = False        # the helper compiles it for the next processes
        run_jobs(jobs(self.flash, self.cache_types, **self.need), self.claims)
        self.helper.stdout.readline()   # its jobs are cached ("" if it died: compiled below)
        self.ready = True
        self._forget_claims()
        cache = be.make_cache(64)
        be.forward([token] * 2, cache)      # a batch's paths, then decode's
        be.forward([token], cache)

    def _forget_claims(self) -> None:
        import shutil
        if self.claims:
            shutil.rmtree(self.claims, ignore_errors=True)
            self.claims = None

    def close(self) -> None:
        """Stop the helper if the load failed before it was done with its jobs (after that it
        finishes the long batches' attention on its own)."""
        self._forget_claims()
        if not self.ready and self.helper.poll() is None:
            self.helper.kill()
            self.helper.wait()


def jobs(flash: bool, cache_types: tuple[str, str], head_dim: int, embd_type: int, kinds, silu: bool,
         repack: bool = False) -> list:
    """FirstRun's compile jobs for a model, (name, function), about the largest first, on empty
    or all-zero arrays of the types the forward passes (tests/test_first_run.py checks they
    are its signatures): repack, the load's repacking of the file (first: the helper's
    while the file downloads), RoPE, the K/V store and attention for short batches and decode (~6 s),
    the group kernel of each weight kind (1-3 s), the parallel loop over groups they share
    (~1 s), the activation quantizers (quant.packed: Q8_0
    for the legacy kinds, Q4_K, Q6_K), the embedding's row lookup, the norm and the
    activation's products (SiLU or GELU)."""
    z, z2 = np.zeros((1, 16), np.float32), np.zeros((2, 16), np.float32)    # z2's halves: strided views
    out = [("repack", quant.packed.precompile_repack)] if repack and kinds else []
    out.append(("attention", lambda: compile_attention(flash, cache_types, head_dim)))
    if quant.packed.enabled():
        out += [(f"matmul-{k}", lambda k=k: quant.packed.precompile(kinds=(k,), quantizers=()))
                for k in sorted(kinds, reverse=True)]
        out.append(("matmul", lambda: quant.packed.precompile(kinds=(), quantizers=(), run=True)))
        out += [(f"quantizer-{t}", lambda t=t: quant.packed.precompile(kinds=(), quantizers={t}))
                for t in sorted(quant.packed.quantizer_types(kinds))]
    if embd_type in quant.QTYPES:
        q = quant.qtype(embd_type)
        out.append(("embedding", lambda: q.dequant_rows(np.zeros((1, q.type_size), np.uint8),
                                                        np.zeros((1, q.block_size), np.float32))))
    out.append(("norm", lambda: K.rms_norm(z, z[0], 1e-6, z)))
    if silu:
        out += [("silu", lambda: K.silu_mul(z, z, z)), ("silu-halves", lambda: K.silu_mul_halves(z, z[:, :8], 1))]
    else:       # GELU: its table, then the kernel on whole arrays and on a fused row's halves
        out += [("gelu", lambda: K.gelu_tanh_mul(z, z, z)),
                ("gelu-halves", lambda: K.gelu_tanh_mul(z2[:, :8], z2[:, 8:], z2[:, :8].copy()))]
    return out


def run_jobs(todo: list, claims: str) -> None:
    """Run each job of todo that no other process has claimed in the directory claims."""
    for name, fn in todo:
        try:
            os.close(os.open(os.path.join(claims, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        except OSError:         # no claims directory: run it (at worst both processes do)
            pass
        fn()


def compile_attention(flash: bool, cache_types: tuple[str, str], head_dim: int, ns=(2, 1)) -> None:
    """RoPE, the K/V store and the attention kernel of a path, cache types and head size, on
    batches of ns tokens (two, then one: a short batch's path and decode's; 64: flash
    attention's FA_TILE path) of a tiny float model."""
    import tempfile
    from pathlib import Path

    from gguf_io.config import config_from_gguf
    from gguf_io.reader import open_gguf
    from gguf_io.testing import write_tiny_model
    with tempfile.TemporaryDirectory(prefix="numbat-warm-") as d:
        f = open_gguf(write_tiny_model(Path(d) / "tiny.gguf", "qwen2", n_embd=128, n_head=2, n_head_kv=1, head_dim=head_dim))
        be = NumbaCPU(f, config_from_gguf(f), flash=flash, cache_types=cache_types)
        cache = be.make_cache(128)
        for n in ns:
            positions, kv = cache.claim(n)
            st = be.begin(Batch(np.arange(1, n + 1), positions, np.zeros(n, np.int64), [(0, n, n > 1)], None))
            be.attend(st, be.layers[0], kv[0], be.q[:n], be.k[:n], be.v[:n])


def helper_command(flash: bool, cache_types: tuple[str, str]) -> list[str]:
    """The helper's command line. This package's directory goes first on its path: `python -m`
    would put the working directory there, and a `runner` package of the user's (or of
    another numbat checkout) would be imported instead. numba imports scipy only to learn
    whether np.dot may be called (never, here): 0.4-0.6 s saved, as cli.py does."""
    import sys
    from pathlib import Path
    root = str(Path(__file__).resolve().parents[2])
    code = (f"import sys; sys.path.insert(0, {root!r}); sys.modules.setdefault('scipy', None); "
            "from runner.backends.numba_cpu import helper; helper()")
    return [sys.executable, "-c", code, str(int(flash)), *cache_types]


def helper() -> None:
    """FirstRun's helper process: argv FLASH KT VT; on stdin one JSON line, the claims
    directory and what the model needs (jobs()'s arguments)."""
    import json
    import sys
    flash, types = sys.argv[1] == "1", (sys.argv[2], sys.argv[3])
    try:
        told = json.loads(sys.stdin.readline())
        need = {k: told[k] for k in ("head_dim", "embd_type", "kinds", "silu")}
        need["repack"] = told.get("repack") is True
        claims = str(told["claims"])
    except (ValueError, KeyError, TypeError):   # the parent is gone or failed before telling
        return
    run_jobs(jobs(flash, types, **need), claims)
    print("ready", flush=True)
    if flash and types == ("f16", "f16"):       # the other attention kernels serve every batch size
        compile_attention(flash, types, need["head_dim"], ns=(64,))
    if need["kinds"]:       # no repacked matrices: decode takes the ops, never the compiled layers
        compile_step()
    write_bytecode()


def compile_step() -> None:
    """Compile (or load) decode's compiled layer (_layer_in, _layer_out) on zeros of the types
    the forward passes, every branch taken. One signature serves every model (decode_args
    gives every kind the same type): the helper compiles it after its share (~3 s), the
    first run's process meanwhile decodes op by op."""
    z = lambda *s: np.zeros(s, np.float32)
    kind = packed.KINDS[T.Q4_K]
    M = packed.decode_args(packed.Packed(T.Q4_K, np.zeros((0, packed.LAYOUT[kind][1]), np.uint8), 0, 256), fn=0)
    w = z(256)
    _layer_in(z(1, 256), z(1, 256), w, 1e-6, z(1, 128), M, w, z(1, 64), M, w, w, w, 64, 64, 64,
              BIAS | SPLIT_V | HEAD_NORM, 1)
    _layer_out(z(1, 256), z(1, 256), z(1, 256), z(1, 256), z(1, 512), z(1, 256), M, w, w, M, M, w, 1e-6,
               z(65536), POST_ATTN | POST_FFN | GELU, 1)


# numbat's own modules: the packages and top-level modules pyproject.toml installs
SOURCES = ("cli.py", "gguf_io", "quant", "runner", "models")


def write_bytecode(root=None) -> None:
    """Compile numbat's modules to bytecode beside them (what the helper does last). Python
    writes .pyc files itself unless PYTHONDONTWRITEBYTECODE is set, as many container images
    set it; an editable install then compiled its ~35 modules from source at every start (0.07 s
    of `numbat prompt Hi -n 1`'s 0.9 s, measured). numba's kernel cache is already written to
    the same __pycache__ folders. Up-to-date files are skipped; compileall reports a file it
    cannot write (quietly here) and goes on."""
    import compileall
    from pathlib import Path
    root = Path(root) if root is not None else Path(__file__).resolve().parents[2]
    for name in SOURCES:
        path = root / name
        if path.is_dir():
            compileall.compile_dir(path, quiet=2)
        elif path.is_file():
            compileall.compile_file(path, quiet=2)
