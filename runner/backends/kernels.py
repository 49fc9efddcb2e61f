"""Small numba kernels of the forward pass other than the matmuls: norms, RoPE, attention
over the ring cache, gated activations. Callers pass every output and scratch buffer."""
from __future__ import annotations

import math

import numpy as np
from numba import get_thread_id, njit, prange

from quant.intrin import bits_f32, f32_bits, fma32

f32 = np.float32
_C = [f32(float.fromhex(h)) for h in ("0x1.8p23", "0x1.715476p+0", "0x1.7f7d1cp-20", "0x1.62e4p-1", "0x1.0e4020p-7",
                                      "0x1.573e2ep-5", "0x1.555e66p-3", "0x1.fffdb6p-2", "0x1.ffffecp-1")]
_R, _LOG2E, _LN2LO, _LN2HI, _P5, _P4, _P3, _P2, _P1 = _C


@njit(inline="always")
def _pow2(k):
    return bits_f32(np.int32((k + 127) << 23))      # 2**k for -126 <= k <= 127


@njit(inline="always")
def expf(x):
    """exp(x) in float32 as ggml's vectorized softmax computes it (ggml_v_expf: Cody-Waite
    reduction, degree-5 polynomial, scale by 2**n); branch-free, so loops of it vectorize."""
    n = fma32(x, _LOG2E, _R) - _R
    b = fma32(-n, _LN2LO, fma32(-n, _LN2HI, x))
    u = b * b
    j = fma32(fma32(fma32(_P5, b, _P4), u, fma32(_P3, b, _P2)), u, fma32(_P1, b, f32(1)))
    ni = np.int32(max(min(n, f32(192)), f32(-192)))
    h = ni >> 1
    res = j * _pow2(h) * _pow2(ni - h)
    return res if abs(n) <= 192 else (f32(0) if n <= 0 else f32(np.inf))


@njit(inline="always")
def f16_round_pos(x):
    """The nearest float16 (ties to even) of a float32 x in [0, 65504], as float32: the
    softmax weights llama.cpp converts to f16 before they meet V. Branch-free."""
    sub = np.rint(x * f32(16777216)) * f32(1 / 16777216)      # below 2**-14: steps of 2**-24
    b = f32_bits(x)
    b = (b + np.int32(0xFFF) + ((b >> 13) & 1)) & np.int32(-8192)
    return sub if x < f32(6.103515625e-05) else bits_f32(b)


@njit(inline="always")
def f16_round(x):
    """x rounded to the nearest float16 as float32, as numpy's astype(float16) gives it:
    signs, subnormals, ties to even, inf past 65519.99 and NaN kept."""
    a = abs(x)
    r = f16_round_pos(a) if a < f32(65520) else (f32(np.inf) if a == a else a)
    return -r if f32_bits(x) < 0 else r       # the sign bit: -0.0 stays -0.0


@njit(cache=True)
def rope_store(q, k, v, positions, theta_scale, freq_scale, freq_factors, neox, slots, kc, vc):
    """One layer's new tokens into its cache: RoPE on q (n, n_head, d) and k (n, n_kv, d),
    q rounded to f16 in place, and k and v (n, n_kv, d) stored f16-rounded at their slots of
    kc, vc (n_kv, cap, d), as llama.cpp's f16 cache holds them. One serial call: decode's
    few tokens do not pay for starting threads, nor for five numpy steps."""
    rope(q, positions, theta_scale, freq_scale, freq_factors, neox)
    rope(k, positions, theta_scale, freq_scale, freq_factors, neox)
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            for j in range(q.shape[2]):
                q[t, h, j] = f16_round(q[t, h, j])
        s = slots[t]
        for h in range(k.shape[1]):
            for j in range(k.shape[2]):
                kc[h, s, j] = f16_round(k[t, h, j])
                vc[h, s, j] = f16_round(v[t, h, j])


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


@njit(cache=True)
def rope(x, positions, theta_scale, freq_scale, freq_factors, neox):
    """Rotate x (n_tok, n_heads, head_dim) in place. neox: pairs (i, i + d/2); else (2i, 2i+1).
    Angles as ggml computes them, in float32: theta starts at the position and is multiplied
    by theta_scale once per pair; cos/sin of theta / factor * freq_scale. Only the first
    2*len(freq_factors) dims rotate."""
    half = freq_factors.shape[0]
    for t in range(x.shape[0]):
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
            e = expf(sc[s] - mx) if sc[s] != -np.inf else np.float32(0)
            sc[s] = e
            total += e
        inv = np.float32(1.0 / total)
        for j in range(d):
            out[t, h, j] = 0
        for s in range(n_slots):
            if sc[s] > 0:
                wgt = f16_round_pos(sc[s] * inv)
                for j in range(d):
                    out[t, h, j] += wgt * v[g, s, j]


@njit(parallel=True, cache=True)
def softmax_rows(S, group, qpos, kpos, window, scale):
    """Rows of raw scores S (n_tok * group, n_slots), row r for query r // group, -> the f16
    weights of attention(): scaled, masked by position and window, softmax, rounded.
    The loops are branch-free so that they vectorize."""
    win = window if window > 0 else np.iinfo(np.int64).max
    for r in prange(S.shape[0]):
        p1 = qpos[r // group]
        row = S[r]
        mx = f32(-np.inf)
        for s in range(row.shape[0]):
            p0 = kpos[s]
            v = row[s] * scale if (p0 >= 0) & (p0 <= p1) & (p1 - p0 < win) else f32(-np.inf)
            row[s] = v
            mx = max(mx, v)
        total = 0.0
        for s in range(row.shape[0]):
            e = expf(row[s] - mx)      # exp(-inf) = 0
            row[s] = e
            total += e
        inv = f32(1.0 / total)
        for s in range(row.shape[0]):
            row[s] = f16_round_pos(row[s] * inv)


def attention_batched(q, qpos, k, v, kpos, n_slots, window, scale, out, S):
    """attention() for a prefill chunk: per kv head and block of queries, the scores of all
    its query heads in one BLAS product, softmax_rows, then one product with V. S: flat
    float32 scratch of at least group * n_slots (queries per block: as many as fit). Sums
    run in BLAS's order, not attention()'s."""
    n_tok, n_head, d = q.shape
    group = n_head // k.shape[0]
    step = max(1, S.shape[0] // (group * n_slots))
    for t0 in range(0, n_tok, step):
        t1 = min(n_tok, t0 + step)
        m = (t1 - t0) * group
        # slots past the last one these queries may see are all masked: leave them out (in
        # a prefill from empty, half of all scores)
        seen = np.flatnonzero((kpos[:n_slots] >= 0) & (kpos[:n_slots] <= qpos[t1 - 1]))
        n = int(seen[-1]) + 1 if len(seen) else 1
        sc = S[:m * n].reshape(m, n)
        for g in range(k.shape[0]):
            heads = slice(g * group, (g + 1) * group)
            np.matmul(q[t0:t1, heads].reshape(m, d), k[g, :n].T, out=sc)
            softmax_rows(sc, group, qpos[t0:t1], kpos[:n], window, scale)
            out[t0:t1, heads] = (sc @ v[g, :n]).reshape(t1 - t0, group, d)


@njit(inline="always")
def _silu_mul_row(g, u, out):
    for j in range(g.shape[0]):
        out[j] = g[j] / (f32(1) + expf(-g[j])) * u[j]     # ggml_v_silu


@njit(parallel=True, cache=True)
def silu_mul(gate, up, out):
    for i in prange(gate.shape[0]):
        _silu_mul_row(gate[i], up[i], out[i])


@njit(parallel=True, cache=True)
def silu_mul_halves(gu, out):
    """silu_mul of gu's row halves [gate | up] (a fused gate/up output): row slices of a
    contiguous array, so the loop vectorizes (column views would not)."""
    n = out.shape[1]
    for i in prange(gu.shape[0]):
        _silu_mul_row(gu[i, :n], gu[i, n:], out[i])


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
