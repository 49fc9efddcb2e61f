"""Small numba kernels of the forward pass other than the matmuls: norms, RoPE, attention
over the ring cache, gated activations. Callers pass every output and scratch buffer."""
from __future__ import annotations

import math

import numpy as np
from numba import get_thread_id, njit, prange

from quant.act import f16_round


@njit(parallel=True, fastmath=False, cache=True)
def rms_norm(x, w, eps, out):
    """out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w, rows of x (..., n) flattened to 2-D.
    The sum is taken in float64, as ggml does."""
    for i in prange(x.shape[0]):
        s = 0.0
        for j in range(x.shape[1]):
            s += np.float64(x[i, j]) * x[i, j]
        scale = np.float32(1.0 / math.sqrt(s / x.shape[1] + eps))
        for j in range(x.shape[1]):
            out[i, j] = x[i, j] * scale * w[j]


@njit(parallel=True, cache=True)
def rope(x, positions, theta_scale, freq_scale, freq_factors, neox):
    """Rotate x (n_tok, n_heads, head_dim) in place. neox: pairs (i, i + d/2); else (2i, 2i+1).
    Angles as ggml computes them, in float32: theta starts at the position and is multiplied
    by theta_scale once per pair; cos/sin of theta / factor * freq_scale. Only the first
    2*len(freq_factors) dims rotate."""
    half = freq_factors.shape[0]
    for t in prange(x.shape[0]):
        theta = np.float32(positions[t])
        for i in range(half):
            ang = theta / freq_factors[i] * freq_scale
            c, s = np.float32(math.cos(ang)), np.float32(math.sin(ang))
            theta = theta * theta_scale
            a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
            for h in range(x.shape[1]):
                x0, x1 = x[t, h, a], x[t, h, b]
                x[t, h, a] = x0 * c - x1 * s
                x[t, h, b] = x0 * s + x1 * c


@njit(parallel=True, fastmath=True, cache=True)
def attention(q, qpos, k, v, kpos, n_slots, window, scale, out, scratch):
    """out[t, h] = softmax(scale * q[t, h] . k[g]) @ v[g] over the cached slots that hold a
    position p <= qpos[t] (and qpos[t] - p < window for sliding layers), g = h's kv head.
    q, out: (n_tok, n_head, d); k, v: (n_kv, cap, d); scratch: (threads, cap) float32.
    As llama.cpp's default (f16 cache, no flash attention): q, k and v hold f16 values (the
    caller rounds them) and the softmax weights are rounded to f16 before they meet v. With
    qwen's large key biases a score moves by whole units without this."""
    n_tok, n_head, d = q.shape
    group = n_head // k.shape[0]
    for th in prange(n_tok * n_head):
        t, h = th // n_head, th % n_head
        g = h // group
        sc = scratch[get_thread_id()]
        p1 = qpos[t]
        mx = -np.inf
        for s in range(n_slots):
            p0 = kpos[s]
            if p0 < 0 or p0 > p1 or (window > 0 and p1 - p0 >= window):
                sc[s] = -np.inf
                continue
            acc = np.float32(0)
            for j in range(d):
                acc += q[t, h, j] * k[g, s, j]
            acc *= scale
            sc[s] = acc
            mx = max(mx, acc)
        total = 0.0
        for s in range(n_slots):
            e = np.float32(math.exp(sc[s] - mx)) if sc[s] != -np.inf else np.float32(0)
            sc[s] = e
            total += e
        inv = np.float32(1.0 / total)
        for j in range(d):
            out[t, h, j] = 0
        for s in range(n_slots):
            if sc[s] > 0:
                wgt = f16_round(sc[s] * inv)
                for j in range(d):
                    out[t, h, j] += wgt * v[g, s, j]


@njit(parallel=True, fastmath=True, cache=True)
def silu_mul(gate, up, out):
    for i in prange(gate.shape[0]):
        for j in range(gate.shape[1]):
            g = gate[i, j]
            out[i, j] = g / (np.float32(1) + np.float32(math.exp(-g))) * up[i, j]


def _gelu_table() -> np.ndarray:
    """GELU (tanh form, float32) of every f16 value, rounded to f16: ggml's GGML_GELU_FP16 table."""
    x = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        g = np.float32(0.5) * x * (np.float32(1) + np.tanh(np.float32(0.7978845608028654) * x
                                                            * (np.float32(1) + np.float32(0.044715) * x * x)))
    return g.astype(np.float16).astype(np.float32)


GELU_F16 = _gelu_table()


def gelu_tanh_mul(gate, up, out):
    """out = gelu(gate) * up as llama.cpp computes it: the gate rounded to f16 and looked up
    in the f16 GELU table, except below -10 (0) and above 10 (identity)."""
    v = GELU_F16[gate.astype(np.float16).view(np.uint16)]
    v = np.where(gate <= -10, np.float32(0), np.where(gate >= 10, gate, v))
    np.multiply(v, up, out=out)
