"""The forward graph, written once for every architecture (llama, qwen2, qwen3, gemma3) and
every backend: the config's flags pick the steps, the backend's ops compute them (numba
kernels over buffers it owns, or mx arrays). Which kernel runs for which type and batch
size is the ops' business, never the graph's. The numba backend runs a one-token forward's
layers as two compiled calls around the attention op (NumbaCPU._decode: these steps, the
same kernels in the same order; tests/test_tiny_models.py holds the two to the bit)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from gguf_io.config import ModelConfig
from gguf_io.reader import GGUFError, GGUFFile
from runner.backends import Batch


@dataclass
class Layer:
    """One block's weights, in the backend's own form (a numba Linear, an MLX weight)."""
    attn_norm: Any
    wq: Any
    wk: Any
    wv: Any
    wo: Any
    ffn_norm: Any
    gate: Any
    up: Any
    down: Any
    q_norm: Any = None
    k_norm: Any = None
    post_attn_norm: Any = None
    post_ffn_norm: Any = None
    theta_scale: np.float32 = np.float32(1)   # ggml's powf(base, -2/n_dims), per layer
    window: int = 0
    # numba only: wq, wk, wv (gate, up) as one matrix where they share a repacked type, or
    # wq and wk where only they do
    qkv: Any = None
    qk: Any = None
    gate_up: Any = None


def build_layers(f: GGUFFile, cfg: ModelConfig, lin: Callable, vec: Callable) -> list[Layer]:
    """The layers of f, with lin(name, bias_name) making a matrix and vec(name) a small float
    vector (None when the file has no such tensor)."""
    out = []
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        b = (lambda n: p + n + ".bias") if cfg.qkv_bias else (lambda n: None)
        theta_scale = np.float32(cfg.rope_base_for(i)) ** np.float32(-2.0 / cfg.rope_dim)
        out.append(Layer(
            attn_norm=vec(p + "attn_norm.weight"), wq=lin(p + "attn_q.weight", b("attn_q")),
            wk=lin(p + "attn_k.weight", b("attn_k")), wv=lin(p + "attn_v.weight", b("attn_v")),
            wo=lin(p + "attn_output.weight"), ffn_norm=vec(p + "ffn_norm.weight"),
            gate=lin(p + "ffn_gate.weight"), up=lin(p + "ffn_up.weight"), down=lin(p + "ffn_down.weight"),
            q_norm=vec(p + "attn_q_norm.weight"), k_norm=vec(p + "attn_k_norm.weight"),
            post_attn_norm=vec(p + "post_attention_norm.weight"), post_ffn_norm=vec(p + "post_ffw_norm.weight"),
            theta_scale=theta_scale, window=cfg.window(i)))
    return out


def require(f: GGUFFile, name: str) -> None:
    if name not in f.tensors:
        raise GGUFError(f"{f.path}: tensor {name} is missing")


def run(ops, layers: list[Layer], b: Batch, kv: list, hidden: bool = False) -> np.ndarray | None:
    """One forward over the tokens of b with the K/V views kv (one per layer): a fresh
    (len(b.out), vocab) float32 array of logits (final normed states with hidden), None when
    no row needs output. ops: the backend (NumbaCPU, MLX), whose methods below are its ops."""
    st = ops.begin(b)
    x = ops.embed(st)
    for L, lk in zip(layers, kv):
        h = ops.norm(st, x, L.attn_norm)
        q, k, v = ops.qkv(st, L, h)
        if L.q_norm is not None:
            q, k = ops.head_norm(st, q, L.q_norm), ops.head_norm(st, k, L.k_norm)
        a = ops.attend(st, L, lk, q, k, v)     # RoPE, K/V into the cache, attention
        o = ops.linear(st, L.wo, a)
        if L is layers[-1] and b.out is not None:
            # as llama.cpp, the last layer's FFN runs only for the rows that give output,
            # each with one token's float steps
            if not len(b.out):
                ops.finish(st)
                return None
            x, o = ops.rows(st, x, o, b.out)
        if L.post_attn_norm is not None:
            o = ops.norm(st, o, L.post_attn_norm, inplace=True)
        x = ops.add(x, o)
        h = ops.norm(st, x, L.ffn_norm)
        o = ops.ffn(st, L, h)
        if L.post_ffn_norm is not None:
            o = ops.norm(st, o, L.post_ffn_norm, inplace=True)
        x = ops.add(x, o)
    return ops.head_out(st, x, hidden)


def forward(backend, tokens, cache, logits: str = "last", one_by_one: bool = False) -> np.ndarray:
    """One sequence's tokens at positions cache.n_past... (see Backend.forward). Longer inputs
    go in chunks of llama.cpp's batch size, each computed with llama.cpp's float steps for a
    batch that size, or with one_by_one the steps of one token at a time for every token."""
    tokens = np.asarray(tokens, np.int64)
    outs, out = [], None
    chunk = backend.chunk
    for s in range(0, len(tokens), chunk):
        part = tokens[s:s + chunk]
        n, last = len(part), s + chunk >= len(tokens)
        positions, kv = cache.claim(n)
        rows = None if logits == "all" else np.arange(n - 1, n) if last else np.zeros(0, np.int64)
        b = Batch(part, positions, np.zeros(n, np.int64), [(0, n, n > 1 and not one_by_one)], rows)
        out = backend.run(b, kv, hidden=logits == "hidden")
        if logits == "all":
            outs.append(out)
    if logits != "all":
        return out
    # one chunk (a speculative check, a short prompt): its array as it is, not a 2.4 MB copy
    return outs[0] if len(outs) == 1 else np.concatenate(outs)
