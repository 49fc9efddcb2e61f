"""The MLX backend: the same GGUF files and the same forward graph (graph.run) on MLX, for
Apple Silicon (on Linux, mlx[cpu] runs it as a correctness vehicle: its reference BLAS is
~50x slower than numpy here).

Weights are converted once at load by mlx_weights (every GGUF type exactly, no f16
fallback): a copy out of the mmap, which unified memory makes the place they would go
anyway. The embedding is converted too (an untied one costs its converted bytes: 0.5b +102
MB, 1.5b +175 MB) and its rows dequantized on the device, so that greedy() can feed a token
picked on the device into the next step without waiting for it (mlx-lm's overlap). K and V
are float16, as llama.cpp's default cache, in mx arrays that grow with the slots written;
the slots' bookkeeping (the ring, n_keep, rollback, pages and tables) is
runner/kv_cache.py's, shared with numba.

Arithmetic: float32 activations rounded as llama.cpp rounds them where it does (a matmul's
input to its weights' dot type, q to f16, its f16 GELU table), then MLX's own matmul and
attention order: logits agree with the
numba backend (llama.cpp's bits) to a stated tolerance (tests/test_mlx_backend.py), not to
the bit. A row's result does not depend on the other rows of its forward (checked on the CPU
build: quantized_matmul of M rows equals M one-row calls; attention runs per sequence), so
batch answers and speculative checks equal one-by-one decoding's. -fa changes nothing here:
mx.fast.scaled_dot_product_attention is one float32 softmax either way.

Attention stays sdpa although llama.cpp (-fa off) rounds the softmax weights to f16 before
they meet V: written out that way (two matmuls, f16 weights) the tiny models came within
3e-7 of llama.cpp on some types, but the real models did not move (qwen2.5-coder:0.5b, 96
tokens, against numba: median 3% of the largest logit either way; first-chunk perplexity
4.8645 with sdpa, 4.8095 written out, llama.cpp 4.8398 / 4.8830). Their floor is the
activation quantizers: a 1e-7 difference in a matmul's sum moves a Q8_0/Q8_K code by one,
and only bit-exact integer sums in llama.cpp's order would remove it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import mlx.core as mx
import numpy as np
from gguf_io.types import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from gguf_io.config import ModelConfig
from gguf_io.reader import GGUFError, GGUFFile
from runner.backends import Batch, graph, mlx_weights
from runner.backends.graph import Layer
from runner.kv_cache import PAGE, KVCache, LayerKV, PagedKV

GROW = 4 * PAGE     # K/V arrays grow by this many slots at a time


def rope_freqs(theta_scale: np.float32, factors: np.ndarray) -> mx.array:
    """mx.fast.rope's freqs (each pair's wavelength divisor: angle = position * scale / freq)
    for ggml's angles position * scale * theta_scale^i / factor_i, theta_scale^i as ggml's
    running product."""
    powers = np.cumprod(np.r_[np.float32(1), np.full(len(factors) - 1, theta_scale, np.float32)], dtype=np.float32)
    return mx.array(np.asarray(factors, np.float32) / powers)


class Slots:
    """One layer's K or V: (slots, n_kv, head_dim) float16 in an mx array grown on demand
    up to the capacity the cache gave it, so memory follows the slots written."""

    def __init__(self, n_kv: int, head_dim: int, n_slots: int):
        self.n_kv, self.head_dim, self.cap = n_kv, head_dim, n_slots
        self.a = mx.zeros((0, n_kv, head_dim), mx.float16)

    @property
    def nbytes(self) -> int:        # at full size, as the numpy arrays report theirs
        return self.cap * self.n_kv * self.head_dim * 2

    def write(self, slots: np.ndarray, values: mx.array) -> None:
        hi = int(slots.max()) + 1
        if hi > self.a.shape[0]:
            size = min(self.cap, -(-hi // GROW) * GROW)
            self.a = mx.concatenate([self.a, mx.zeros((size - self.a.shape[0], self.n_kv, self.head_dim), mx.float16)])
        self.a[mx.array(slots)] = values

    def read(self, slots: np.ndarray) -> mx.array:
        if len(slots) and slots[-1] - slots[0] == len(slots) - 1 and np.all(np.diff(slots) == 1):
            return self.a[int(slots[0]):int(slots[-1]) + 1]     # a run of slots: a view, no gather
        return self.a[mx.array(slots)]


def _slots(n_kv: int, head_dim: int, n_pages: int, types) -> tuple[Slots, Slots]:
    return Slots(n_kv, head_dim, n_pages * PAGE), Slots(n_kv, head_dim, n_pages * PAGE)


@dataclass
class _State:
    b: Batch
    positions: mx.array
    written: list = field(default_factory=list)     # K/V arrays this forward wrote
    lazy: bool = False      # b.tokens is an mx array (greedy()): the logits stay on the device


# llama.cpp rounds a matmul's input to its weights' "vec_dot_type" before the dot products
# (quant/act.py does it for numba to the bit): doing the same here keeps MLX's logits within
# float summation order of llama.cpp's instead of that rounding noise (the tiny models' first
# position: ~1e-2 relative without it, ~2e-7 with it; tests/test_mlx_backend.py)
_ACT = {**{t: "q8_0" for t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)},
        **{t: "q8_K" for t in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)}, T.F16: "f16", T.BF16: "bf16"}


def _fused(fn):
    """fn with its elementwise steps fused by mx.compile where that pays: on a GPU always (one
    kernel instead of one per op: mlx-lm compiles its activations so), on the CPU for up to 16
    rows only (mlx[cpu] here, the Q8_0 rounding of a 4864-wide row: 51 -> 33 us compiled, of 64
    rows 456 -> 1415 us: its fused CPU kernels are slower on long inputs). The same bits either
    way (tests/test_mlx_backend.py)."""
    compiled = mx.compile(fn)

    def call(x: mx.array, *rest):
        gpu = mx.default_device().type == mx.DeviceType.gpu
        return compiled(x, *rest) if gpu or x.shape[0] <= 16 else fn(x, *rest)
    return call


def _q8_0(x: mx.array) -> mx.array:     # per 32: d = f16(amax / 127), q = round_half_even(x * 127 / amax)
    b = x.reshape(-1, 32)
    amax = mx.abs(b).max(axis=1, keepdims=True)
    inv = mx.where(amax > 0, 127 / amax, 0)
    return (mx.round(b * inv) * (amax / 127).astype(mx.float16).astype(mx.float32)).reshape(x.shape)


def _q8_k(x: mx.array) -> mx.array:     # per 256: m = the first value of largest magnitude, iscale = -127 / m
    b = x.reshape(-1, 256)
    m = mx.take_along_axis(b, mx.argmax(mx.abs(b), axis=1, keepdims=True), axis=1)
    iscale = mx.where(m != 0, -127 / m, 0)
    return (mx.minimum(mx.round(iscale * b), 127) * mx.where(m != 0, 1 / iscale, 0)).reshape(x.shape)


_ROUND = {"q8_0": _fused(_q8_0), "q8_K": _fused(_q8_k),
          "f16": _fused(lambda x: x.astype(mx.float16).astype(mx.float32)),
          "bf16": _fused(lambda x: x.astype(mx.bfloat16).astype(mx.float32))}


def round_act(x: mx.array, kind: str | None) -> mx.array:
    """x (n, cols) float32 as llama.cpp's activation quantizer leaves it, dequantized."""
    return x if kind is None else _ROUND[kind](x)


_SQRT_2_PI, _GELU_C = mx.array(np.float32(np.sqrt(2 / np.pi))), mx.array(np.float32(0.044715))


def _gelu_mul(g: mx.array, u: mx.array) -> mx.array:
    """llama.cpp's GELU (an f16 table over f16-rounded inputs within +-10) of g, times u."""
    f16 = lambda t: t.astype(mx.float16).astype(mx.float32)
    r = f16(g)
    a = f16(0.5 * r * (1 + mx.tanh(_SQRT_2_PI * r * (1 + _GELU_C * r * r))))
    return mx.where(g <= -10, 0, mx.where(g >= 10, g, a)) * u


def _silu_mul(g: mx.array, u: mx.array) -> mx.array:
    return g * mx.sigmoid(g) * u


_ACTIVATION = {"gelu_tanh": _fused(_gelu_mul), "silu": _fused(_silu_mul)}


def _linears(x: mx.array, *ws: _Linear) -> list[mx.array]:
    """x through each of ws, x rounded once per activation type they need."""
    rounded, out = {}, []
    for W in ws:
        kind = _ACT.get(W.w.type_id)
        if kind not in rounded:
            rounded[kind] = round_act(x, kind)
        out.append(W.on(rounded[kind]))
    return out


@dataclass
class _Linear:
    w: mlx_weights.MlxWeight
    bias: mx.array | None = None

    def __call__(self, x: mx.array) -> mx.array:
        return self.on(round_act(x, _ACT.get(self.w.type_id)))

    def on(self, r: mx.array) -> mx.array:
        """The output for an input already rounded to this weight's activation type."""
        y = mlx_weights.matmul(r, self.w)
        return y if self.bias is None else y + self.bias


class _Head:
    def __init__(self, lin: _Linear):
        self.lin, self.n_out = lin, lin.w.n_rows

    def __call__(self, h: np.ndarray) -> np.ndarray:
        return np.array(self.lin(mx.array(h)))[0]


def _rows(w: mlx_weights.MlxWeight, idx) -> mlx_weights.MlxWeight:
    """The rows idx (a slice, or an index array: numpy or mx) of a converted weight."""
    if isinstance(idx, slice):
        take, n = (lambda a: a[idx]), len(range(w.n_rows)[idx])
    else:
        ix = idx if isinstance(idx, mx.array) else mx.array(idx)
        take, n = (lambda a: mx.take(a, ix, axis=0)), ix.size
    terms = tuple(mlx_weights.QTerm(take(t.w), take(t.scales), take(t.biases), t.group_size, t.bits) for t in w.terms)
    return mlx_weights.MlxWeight(w.type_id, n, w.n_cols, None if w.plain is None else take(w.plain), terms,
                                 None if w.mins16 is None else take(w.mins16))


class MLX:
    name = "mlx"

    def __init__(self, f: GGUFFile, cfg: ModelConfig, chunk: int = 512, max_tokens: int | None = None,
                 flash: bool = True, cache_types: tuple[str, str] = ("f16", "f16"), progress=None):
        from gguf_io.validate import validate; validate(f, cfg)  # noqa: E702  untrusted file: shapes proven first
        if tuple(cache_types) != ("f16", "f16"):
            raise GGUFError("the MLX backend keeps K and V as float16: -ctk/-ctv q8_0/q4_0 need --backend numba")
        self.cfg, self.chunk, self.max_tokens = cfg, chunk, max_tokens or chunk + 64
        self.flash, self.cache_types = flash, ("f16", "f16")
        mats = [n for n, t in f.tensors.items() if len(t.dims) == 2]
        total, done = sum(f.tensors[n].nbytes for n in mats), 0

        def vec(name):
            if name not in f.tensors:
                return None
            t = f.tensors[name]
            return mx.array(gguf_dequantize(f.raw(name).reshape(1, -1), T(t.type_id)).reshape(-1).astype(np.float32))

        def lin(name, bias=None):
            nonlocal done
            graph.require(f, name)
            t = f.tensors[name]
            w = mlx_weights.to_mlx(t.type_id, f.raw(name), t.dims[0])
            mx.eval(*(a for a in (w.plain, w.mins16, *(x for q in w.terms for x in (q.w, q.scales, q.biases)))
                      if a is not None))
            done += t.nbytes
            if progress:
                progress(done, total, "converting weights for MLX")
            return _Linear(w, vec(bias) if bias else None)

        self.layers: list[Layer] = graph.build_layers(f, cfg, lin, vec)
        self.output_norm = vec("output_norm.weight")
        self.output = lin("token_embd.weight" if cfg.tied_output else "output.weight")
        # the embedding on the device too, so that a token sampled there feeds the next step
        # without a round trip (greedy()); converted exactly like the matrices
        self._embd = self.output.w if cfg.tied_output else lin("token_embd.weight").w
        # rope: MLX takes each pair's wavelength divisor, ggml's 1 / theta_scale^i (times the
        # llama 3 factor); theta_scale^i as ggml's running product
        ff = vec("rope_freqs.weight")
        ff = np.ones(cfg.rope_dim // 2, np.float32) if ff is None else np.array(ff)
        self._freqs = {float(L.theta_scale): rope_freqs(L.theta_scale, ff) for L in self.layers}
        self.freq_scale = 1.0 / cfg.rope_scale

    @property
    def windows(self) -> list[int]:
        return [L.window for L in self.layers]

    def make_cache(self, n_ctx: int, n_keep: int = 0) -> KVCache:
        c = self.cfg
        return KVCache(c.n_layer, c.n_head_kv, c.head_dim, n_ctx, self.windows, self.chunk, n_keep, arrays=_slots)

    def make_store(self, n_pages: int, n_ctx: int) -> PagedKV:
        c = self.cfg
        return PagedKV(c.n_layer, c.n_head_kv, c.head_dim, n_pages, -(-n_ctx // PAGE), arrays=_slots)

    def forward(self, tokens, cache: KVCache, logits: str = "last", one_by_one: bool = False) -> np.ndarray:
        return graph.forward(self, tokens, cache, logits, one_by_one)

    def run(self, b: Batch, kv: list[LayerKV], hidden: bool = False) -> np.ndarray | None:
        return graph.run(self, self.layers, b, kv, hidden)

    def head(self, ids) -> _Head:
        idx = slice(0, int(ids)) if isinstance(ids, (int, np.integer)) else np.asarray(ids)
        return _Head(_Linear(_rows(self.output.w, idx)))

    # ---- the ops graph.run calls: mx arrays, evaluated once per forward (head_out / finish)

    def begin(self, b: Batch) -> _State:
        return _State(b, mx.array(b.positions.astype(np.int32)), lazy=isinstance(b.tokens, mx.array))

    def embed(self, st: _State) -> mx.array:
        tokens = st.b.tokens if st.lazy else mx.array(np.asarray(st.b.tokens, np.int32))
        x = mlx_weights.dequantize(_rows(self._embd, tokens))   # gguf.quants' float32 values
        return x * self.cfg.embed_scale if self.cfg.embed_scale != 1.0 else x

    def norm(self, st: _State, x: mx.array, w: mx.array, inplace: bool = False) -> mx.array:
        return mx.fast.rms_norm(x, w, self.cfg.norm_eps)

    def qkv(self, st: _State, L: Layer, h: mx.array):
        return _linears(h, L.wq, L.wk, L.wv)

    def head_norm(self, st: _State, t: mx.array, w: mx.array) -> mx.array:
        hd = self.cfg.head_dim
        return mx.fast.rms_norm(t.reshape(-1, hd), w, self.cfg.norm_eps).reshape(t.shape)

    def attend(self, st: _State, L: Layer, lk: LayerKV, q, k, v) -> mx.array:
        c, b = self.cfg, st.b
        n, hd = len(b.tokens), c.head_dim
        rope = lambda x, heads: mx.fast.rope(x.reshape(n, heads, 1, hd), c.rope_dim, traditional=not c.rope_neox,
                                             base=None, scale=self.freq_scale, offset=st.positions,
                                             freqs=self._freqs[float(L.theta_scale)]).reshape(n, heads, hd)
        q, k = rope(q, c.n_head), rope(k, c.n_head_kv)
        # 1/sqrt(head_dim) on q (gemma3, as llama.cpp) or on the scores
        scale = hd ** -0.5
        if c.scale_q:
            q, scale = q * scale, 1.0
        q = q.astype(mx.float16).astype(mx.float32)     # llama.cpp's q meets f16 K as f16 (either -fa)
        lk.k.write(lk.slots, k.astype(mx.float16))
        lk.v.write(lk.slots, v.reshape(n, c.n_head_kv, hd).astype(mx.float16))
        st.written += [lk.k, lk.v]
        out = []
        for s in np.unique(b.seq):      # one sequence at a time: no row sees another's keys
            rows = np.flatnonzero(b.seq == s)
            logical = np.arange(lk.seq_slots[s])
            phys = lk.tables[s][logical // PAGE] * PAGE + logical % PAGE
            kpos, qpos = lk.pos[phys][None, :], b.positions[rows][:, None]
            seen = (kpos >= 0) & (kpos <= qpos) & ((lk.window == 0) | (qpos - kpos < lk.window))
            keep = seen.any(axis=0)
            phys, seen = phys[keep], seen[:, keep]
            ks = lk.k.read(phys).astype(mx.float32).transpose(1, 0, 2)[None]
            vs = lk.v.read(phys).astype(mx.float32).transpose(1, 0, 2)[None]
            qs = q[mx.array(rows)].transpose(1, 0, 2)[None]
            mask = None if seen.all() else mx.array(seen)
            o = mx.fast.scaled_dot_product_attention(qs, ks, vs, scale=scale, mask=mask)
            out.append((rows, o[0].transpose(1, 0, 2).reshape(len(rows), -1)))
        if len(out) == 1:
            return out[0][1]
        order = np.argsort(np.concatenate([r for r, _ in out]))
        return mx.concatenate([o for _, o in out])[mx.array(order)]

    def linear(self, st: _State, W: _Linear, x: mx.array) -> mx.array:
        return W(x)

    def rows(self, st: _State, x, o, rows):
        r = mx.array(rows)
        return x[r], o[r]

    @staticmethod
    def add(x: mx.array, o: mx.array) -> mx.array:
        return x + o

    def ffn(self, st: _State, L: Layer, h: mx.array) -> mx.array:
        g, u = _linears(h, L.gate, L.up)
        return L.down(_ACTIVATION[self.cfg.act](g, u))

    def head_out(self, st: _State, x: mx.array, hidden: bool) -> np.ndarray | mx.array:
        h = mx.fast.rms_norm(x, self.output_norm, self.cfg.norm_eps)
        out = h if hidden else self.output(h)
        if st.lazy:     # started, not awaited
            mx.async_eval(out, *(s.a for s in st.written))
            return out
        self.finish(st, out)
        return np.array(out, dtype=np.float32)

    def greedy(self, first: int, cache: KVCache) -> Iterator[int]:
        """first, then the tokens forward() and argmax would pick after it, with mlx-lm's overlap:
        the step that consumes a token is built and started (mx.async_eval, the argmax on the
        device too) before that token is handed out, so the device computes while the caller
        prints it and builds the next step. The cache runs one token ahead of the tokens handed
        out: emit() rolls it back at the end, as after speculation."""
        def step(y: mx.array) -> mx.array:
            positions, kv = cache.claim(1)
            b = Batch(y, positions, np.zeros(1, np.int64), [(0, 1, False)], np.zeros(1, np.int64))
            nxt = mx.argmax(self.run(b, kv), axis=-1)
            mx.async_eval(nxt)
            return nxt

        y = mx.array([first], mx.uint32)
        while True:
            nxt = step(y)
            yield int(y.item())
            y = nxt

    def finish(self, st: _State, *more) -> None:
        # the cache's arrays are evaluated with every forward, so their graphs never chain
        mx.eval(*more, *(s.a for s in st.written))
