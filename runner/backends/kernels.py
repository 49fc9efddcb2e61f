"""Small numba kernels of the forward pass other than the matmuls: norms, RoPE, attention
over the ring cache, gated activations. Callers pass every output and scratch buffer."""
from __future__ import annotations

import functools
import math
from decimal import Decimal

import numba
import numpy as np
from numba import get_thread_id, njit, prange, types

from quant.legacy import q4_0_row
from quant.intrin import (add16, c_array, call_c, bits_f32, bits_f64, dotq4_row, dotq8_row, f2h, f32_bits, f64_bits, fma16, fma16h, fma32,
                          fma64, h2f, mul16, mul16h, pv16, pv_tile, scores16)

f32 = np.float32
_C = [f32(float.fromhex(h)) for h in ("0x1.8p23", "0x1.715476p+0", "0x1.7f7d1cp-20", "0x1.62e4p-1", "0x1.0e4020p-7",
                                      "0x1.573e2ep-5", "0x1.555e66p-3", "0x1.fffdb6p-2", "0x1.ffffecp-1")]
_R, _LOG2E, _LN2LO, _LN2HI, _P5, _P4, _P3, _P2, _P1 = _C


# The parallel kernels parallelize their prange loops only: numba would otherwise turn each
# np.zeros / np.full in them into a parallel loop of its own, each compiled on the first run
# (~0.3 s) and started at run time; with its other passes off too, a kernel without them
# (rms_norm) compiles in 0.57-0.60 s against 0.64-0.73.
PRANGE = dict(numpy=False, comprehension=False, setitem=False, inplace_binop=False, reduction=False, stencil=False)


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


# glibc's expf (since 2.28; x86-64 runs its FMA build where the CPU has FMA): x * 32/ln2 split
# into k + r, 2**(k/32) from a table of 32 doubles, a cubic in r, all in float64.
_EXPF_T = np.array([np.float64(float(Decimal(2) ** (Decimal(i) / 32))).view(np.int64) - (i << 47) for i in range(32)], np.int64)
_EXPF_N = float.fromhex("0x1.71547652b82fep+5")         # 32 / ln 2
_EXPF_C = (float.fromhex("0x1.c6af84b912394p-20"), float.fromhex("0x1.ebfce50fac4f3p-13"), float.fromhex("0x1.62e42ff0c52d6p-6"))
_EXPF_SHIFT = float.fromhex("0x1.8p+52")
_EXPF_HI, _EXPF_LO = f32(float.fromhex("0x1.62e42ep6")), f32(float.fromhex("-0x1.9fe368p6"))


@njit(inline="always")
def libm_expf(x):
    """expf(x) as glibc computes it, bit for bit (all 2**32 inputs checked against the C
    library's in tests/test_runner.py): the expf llama.cpp's scalar online softmax
    calls, inlined, so a kernel keeps its vector registers across it instead of a call
    that clobbers them all."""
    top = (f32_bits(x) >> 20) & 0x7ff
    if top >= 0x42b:                # |x| >= 88, inf or nan
        if f32_bits(x) == np.int32(-8388608):
            return f32(0)
        if top >= 0x7f8:
            return x + x
        if x > _EXPF_HI:
            return f32(np.inf)
        if x < _EXPF_LO:
            return f32(0)
    xd = np.float64(x)
    kd = _EXPF_N * xd + _EXPF_SHIFT        # round to an integer k, its bits in the mantissa
    ki = f64_bits(kd)
    kd = kd - _EXPF_SHIFT
    r = fma64(_EXPF_N, xd, -kd)             # the FMA build fuses z - kd with z = x * 32/ln2
    s = bits_f64(_EXPF_T[ki & 31] + (ki << 47))
    c0, c1, c2 = _EXPF_C
    return f32(fma64(fma64(c0, r, c1), r * r, fma64(c2, r, 1.0)) * s)


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
def rope_store(q, k, v, positions, theta_scale, freq_scale, freq_factors, neox, slots, kc, vc, q_scale, round_q, store):
    """One layer's new tokens into its cache: RoPE on q (n, n_head, d) and k (n, n_kv, d),
    q times q_scale (and, with round_q, rounded to f16: the mul_mat path's conversion) in
    place, and (with store) k and v (n, n_kv, d) stored as float16
    (uint16 bits) at their slots of kc and vc, as llama.cpp's f16 cache holds them. One
    serial call: decode's few tokens do not pay for starting threads, nor for five numpy
    steps. Slot s is row s % 64 of page s // 64 (kc: (pages, n_kv, d, >= 64), vc: (pages,
    n_kv, 64, d))."""
    _rope_pairs(q, k, positions, theta_scale, freq_scale, freq_factors, neox)
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            for j in range(q.shape[2]):
                x = q[t, h, j] * q_scale
                q[t, h, j] = f16_round(x) if round_q else x
        if not store:       # a quantized cache: store_kv writes it
            continue
        p, o = slots[t] >> 6, slots[t] & 63
        for h in range(k.shape[1]):
            for j in range(k.shape[2]):
                kc[p, h, j, o] = f2h(k[t, h, j])
                vc[p, h, o, j] = f2h(v[t, h, j])


@njit(parallel=PRANGE, fastmath=False, cache=True)
def rms_norm(x, w, eps, out):
    """out[i] = x[i] * (1 / sqrt(mean(x[i]^2) + eps)) * w, rows of x (..., n) flattened to
    2-D, in ggml's steps: squares in float32 summed in float64, the mean, eps, sqrt and
    reciprocal in float32."""
    e = np.float32(eps)
    if x.shape[0] <= 16:    # decode, checks, head norms: a parallel region cost 3 us against
        for i in range(x.shape[0]):     # one row's 1.4 (15 against 5 for a check's four rows
            rms_row(x[i], w, e, out[i])    # inside a forward, the other thread asleep)
        return
    for i in prange(x.shape[0]):
        rms_row(x[i], w, e, out[i])


@njit(inline="always")
def rms_row(x, w, e, out):
    s = 0.0
    for j in range(x.shape[0]):
        s += np.float64(x[j] * x[j])
    scale = np.float32(1) / np.sqrt(np.float32(s / x.shape[0]) + e)
    for j in range(x.shape[0]):
        out[j] = x[j] * scale * w[j]


@njit(cache=True)
def rope(x, positions, theta_scale, freq_scale, freq_factors, neox):
    """Rotate x (n_tok, n_heads, head_dim) in place. neox: pairs (i, i + d/2); else (2i, 2i+1).
    Angles as ggml computes them, in float32: theta starts at the position and is multiplied
    by theta_scale once per pair; cos/sin of theta / factor * freq_scale. Only the first
    2*len(freq_factors) dims rotate."""
    _rope_pairs(x, x[:, :0], positions, theta_scale, freq_scale, freq_factors, neox)


@njit(inline="always")
def _rope_pairs(x, y, positions, theta_scale, freq_scale, freq_factors, neox):
    """rope of x and y (q and k: the same positions) with each angle's cos and sin computed
    once for both (they were a third of rope_store's time)."""
    half = freq_factors.shape[0]
    for t in range(x.shape[0]):
        theta = np.float32(positions[t])
        for i in range(half):
            ang = theta / freq_factors[i] * freq_scale
            c, s = np.float32(math.cos(ang)), np.float32(math.sin(ang))
            theta = theta * theta_scale
            a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
            _rotate(x, t, a, b, c, s)
            _rotate(y, t, a, b, c, s)


@njit(inline="always")
def _rotate(z, t, a, b, c, s):
    for h in range(z.shape[1]):    # the fused multiply-adds GCC makes of ggml's rotation
        x0, x1 = z[t, h, a], z[t, h, b]
        z[t, h, a] = fma32(x0, c, -(x1 * s))
        z[t, h, b] = fma32(x0, s, x1 * c)


@njit(inline="always")
def _tree(x, o, width):
    """Rows 0-15 of x[o:] (flat, rows of width floats, width a multiple of 16) summed into row
    0 in _mm512_reduce_add_ps's tree (lanes r and r + 8, then r and r + 4, then 0 + 2 and
    1 + 3, then the two), width sums at once."""
    for half in (8, 4, 2, 1):
        for r in range(half):
            for c in range(0, width, 16):
                add16(x, o + r * width + c, x, o + r * width + c, x, o + (r + half) * width + c)


@njit(inline="always")
def _fold(x, o, width):
    """ggml_vec_dot_f16's four accumulators of 16 lanes (rows 16i..16i+15 of x[o:]) to one,
    (0 + 2) + (1 + 3), into rows 0-15."""
    for r in range(16):
        for c in range(0, width, 16):
            add16(x, o + r * width + c, x, o + r * width + c, x, o + (32 + r) * width + c)
            add16(x, o + (16 + r) * width + c, x, o + (16 + r) * width + c, x, o + (48 + r) * width + c)
            add16(x, o + r * width + c, x, o + r * width + c, x, o + (16 + r) * width + c)


def attention_scratch(cap: int, head_dim: int, group: int) -> int:
    """Floats of scratch per thread that attention() needs for sequences of up to cap logical
    slots and group query heads per kv head."""
    return group * (cap + 64 * 16 + 64 * head_dim)


_S64_16, _S64_64, _S128_16, _S128_64, _S256_16, _S256_64 = (scores16(d, lanes) for d in (64, 128, 256) for lanes in (16, 64))


@njit(inline="always")
def _scores(d, batch, kf, ko, cap, qf, qo, out, oo):
    """16 scores by scores16 for the head sizes it is built for; False for others."""
    if d == 64:
        _S64_16(kf, ko, cap, qf, qo, out, oo) if batch else _S64_64(kf, ko, cap, qf, qo, out, oo)
    elif d == 128:
        _S128_16(kf, ko, cap, qf, qo, out, oo) if batch else _S128_64(kf, ko, cap, qf, qo, out, oo)
    elif d == 256:
        _S256_16(kf, ko, cap, qf, qo, out, oo) if batch else _S256_64(kf, ko, cap, qf, qo, out, oo)
    else:
        return False
    return True


@njit(inline="always")
def _visible(p0, p1, window):
    return (p0 >= 0) & (p0 <= p1) & ((window == 0) | (p1 - p0 < window))


@njit(inline="always")
def _row(table, s):
    """The physical slot of logical slot s: pages of 64 slots, table[page] the page's index."""
    return table[s >> 6] * 64 + (s & 63)


@njit(inline="always")
def _shares(group, items, threads):
    """How many work items a kv head's group of query heads is split among (the three
    attention kernels): one, unless a call has fewer items (a query, a kv head, a chunk of
    cells) than threads, as gemma3's decode with its one kv head. Each head's float steps are
    its own whichever item takes it, so the split changes no bit."""
    return min(group, -(-threads // items)) if 0 < items < threads else 1


@njit(inline="always")
def _share(group, shares, p):
    """The query heads [e0, e1) of a group that share p of shares takes."""
    return group * p // shares, group * (p + 1) // shares


@njit(parallel=PRANGE, cache=True)
def attention(q, qpos, qseq, qbatch, k, v, kpos, tables, seq_slots, window, scale, out, scratch, threads, kt):
    """out[t, h] = softmax(scale * q[t, h] . k[g]) @ v[g] over the slots of token t's sequence
    that hold a position p <= qpos[t] (and qpos[t] - p < window for sliding layers), g = h's
    kv head. q, out: (n_tok, n_head, d); k: (pages, n_kv, d, >= 64), each page a dim's 64
    slots in a row; v: (pages, n_kv, 64, d); kpos (pages * 64,): the position each physical
    slot holds (-1 empty). Token t belongs to sequence qseq[t], whose logical slots s <
    seq_slots[qseq[t]] live in page tables[qseq[t], s // 64], row s % 64: a block table (a
    ring cache is one sequence with the identity table). A page's K and V are contiguous, so
    memory is touched page by page (huge pages too). scratch: (threads, attention_scratch(64 *
    tables.shape[1], ...)).

    In llama.cpp's float steps (f16 cache, no flash attention), so that the bits agree: q
    holds f16 values (the caller rounds them), k and v are float16 (uint16 bits). q . k and weights . v are sums of fma
    chains, one per lane, reduced in _mm512_reduce_add_ps's tree: 16 lanes as tinyBLAS runs a
    batch (qbatch[t]), 64 folded to 16 as ggml_vec_dot_f16 runs one token (decode, and
    speculative verification, which must match decode). Softmax with ggml's exp, summed 16 at
    a time into float64; the weights rounded to f16 before they meet v. Lanes go by logical
    slot (the cell index in llama.cpp), so where a page lives changes no bit; slots a query
    cannot see add nothing (a zero weight leaves a lane as it was). Pages of 64 slots line up
    with the 64 lanes and the 16-slot score groups. head_dim a multiple of 64 (16 in a batch):
    llama.cpp's kernels on other sizes are not followed exactly (their tails add in float64).

    A quantized K (kt KV_Q8_0 / KV_Q4_0: llama.cpp's -ctk with -fa off; k then holds a slot's
    row of blocks, as flash_attention_q reads it): each score is ggml_vec_dot_q8_0_q8_0 /
    _q4_0_q8_0 of the row with q quantized to q8_0 (what ggml's mul_mat converts q to, and
    tinyBLAS's q8_0 kernel sums in the same lanes and order); q is not rounded to f16.

    A work item is one query, one kv head and its group's query heads (a share of them when
    there are fewer such items than threads): each row of k and v, read once, serves all of
    those heads (the cache is read from L2 once per group, not per head)."""
    n_tok, n_head, d = q.shape
    n_kv, stride = k.shape[1], k.shape[3]          # k's row length (64 slots and a pad)
    kpage, vpage = n_kv * d * stride, n_kv * 64 * d
    cap = tables.shape[1] * 64                     # logical slots a sequence can have
    group = n_head // n_kv
    kf, vf, qf = k.ravel(), v.ravel(), q.ravel()
    Ps, Vs = 64 * 16, 64 * d                       # per head: score lanes, value lanes (at most 64)
    top = np.zeros(n_tok, np.int64)                # per query: its sums stop after the last slot it sees
    for t in range(n_tok):
        tab = tables[qseq[t]]
        for s in range(seq_slots[qseq[t]]):
            if _visible(kpos[_row(tab, s)], qpos[t], window):
                top[t] = s + 1
    # work items: a query, a kv head, and a share of its group's heads (one share unless
    # there are fewer query-kv pairs than threads (numba's): a decode step with one kv head)
    shares = _shares(group, n_tok * n_kv, threads)
    for i in prange(n_tok * n_kv * shares):
        u, g = i // (n_kv * shares), (i // shares) % n_kv
        e0, e1 = _share(group, shares, i % shares)
        t = u // 2 if u % 2 == 0 else n_tok - 1 - u // 2     # early and late queries alternate: even work
        batch = qbatch[t]
        lanes = 16 if batch else 64
        tab = tables[qseq[t]]
        n = -(-top[t] // 16) * 16
        buf = scratch[get_thread_id()]
        sc, P, pv = buf[:group * cap], buf[group * cap:group * (cap + Ps)], buf[group * (cap + Ps):group * (cap + Ps + Vs)]
        p1 = qpos[t]
        mx = np.full(group, -np.inf, np.float32)
        if d < lanes:               # lanes no dim reaches stay zero
            P[:] = 0
        nb = d // 32
        quant_k = kt != KV_F16
        qq = np.zeros(group * d if quant_k else 0, np.int8)      # q as q8_0, for a quantized K
        qd = np.empty(group * nb if quant_k else 0, np.float32)
        if quant_k:
            qraw = np.empty(nb * 34, np.uint8)
            for e in range(e0, e1):
                _q8_codes(q[t, g * group + e], qraw, qq, e * d, qd, e * nb)
        for b0 in range(0, n, 16):          # scores of 16 slots at once, lane j % lanes
            r0 = _row(tab, b0)              # 16 slots in a row of one page
            k0 = tab[b0 >> 6] * kpage + g * d * stride + (b0 & 63)
            for e in range(e0, e1):
                if quant_k:
                    for c in range(16):
                        ko = (((r0 + c) >> 6) * n_kv + g) * 64 + ((r0 + c) & 63)
                        P[e * Ps + c] = _dot_q(kf, ko * stride, kt, qq, e * d, qd, e * nb, nb)
                elif not _scores(d, batch, kf, k0, stride, qf, (t * n_head + g * group + e) * d, P, e * Ps):
                    for j in range(d):      # other head sizes: the same sums, through memory
                        ko = k0 + j * stride
                        if j < lanes:       # a lane's first product: fma onto zero
                            mul16(P, e * Ps + j * 16, kf, ko, q[t, g * group + e, j])
                        else:
                            fma16(P, e * Ps + (j % lanes) * 16, kf, ko, q[t, g * group + e, j])
                    if not batch:
                        _fold(P, e * Ps, 16)
                    _tree(P, e * Ps, 16)
            for e in range(e0, e1):
                for c in range(16):
                    if _visible(kpos[r0 + c], p1, window):
                        w = P[e * Ps + c] * scale
                        sc[e * cap + b0 + c] = w
                        mx[e] = max(mx[e], w)
                    else:
                        sc[e * cap + b0 + c] = -np.inf
        for e in range(e0, e1):
            total = 0.0
            for b0 in range(0, n, 16):
                x = sc[e * cap + b0:e * cap + b0 + 16]      # a slice: plain indices, so the loop vectorizes
                for c in range(16):
                    x[c] = expf(x[c] - mx[e])               # exp(-inf) = 0
                total += np.float64(((x[8] + x[0]) + (x[12] + x[4])) + ((x[10] + x[2]) + (x[14] + x[6]))
                                    + (((x[9] + x[1]) + (x[13] + x[5])) + ((x[11] + x[3]) + (x[15] + x[7]))))
            inv = f32(1.0 / total)
            for b0 in range(0, n, 16):
                x = sc[e * cap + b0:e * cap + b0 + 16]
                for c in range(16):
                    x[c] = f16_round_pos(x[c] * inv)
        for e in range(e0, e1):      # weights . v, lane s % lanes, 16 dims at a time
            for c in range(0, d, 16):
                pv16(vf, g * 64 * d + c, d, n, sc, e * cap, lanes, pv, e * Vs + c, d, tab, vpage)
        for e in range(e0, e1):
            if not batch:
                _fold(pv, e * Vs, d)
            _tree(pv, e * Vs, d)
            for j in range(d):
                out[t, g * group + e, j] = pv[e * Vs + j]


@njit(inline="always")
def silu_mul_row(g, u, out):
    for j in range(g.shape[0]):
        out[j] = g[j] / (f32(1) + expf(-g[j])) * u[j]     # ggml_v_silu


@njit(parallel=PRANGE, cache=True)
def silu_mul(gate, up, out):
    for i in prange(gate.shape[0]):
        silu_mul_row(gate[i], up[i], out[i])


@njit(parallel=PRANGE, cache=True)
def silu_mul_halves(gu, out, nth):
    """silu_mul of gu's row halves [gate | up] (a fused gate/up output): row slices of a
    contiguous array, so the loop vectorizes (column views would not). Each row goes in nth
    column ranges: on one thread the 1.5b's 8960 values of a decode row took ~28 us inside a
    step, and the down matrix's parallel region after them found the OpenMP worker asleep
    (past its spin, runner/env.py): 47-62 sleeps a step, 21-24 split. Each value's float steps
    are its own, so no split changes a bit. One loop for every row count: a second prange
    loop (one row apart) took the first run's compile of this kernel from 1.0 to 1.8 s."""
    n = out.shape[1]
    for p in prange(gu.shape[0] * nth):
        i, k = p // nth, p % nth
        a, b = n * k // nth, n * (k + 1) // nth
        silu_mul_row(gu[i, a:b], gu[i, n + a:n + b], out[i, a:b])


@njit(cache=True)
def _gelu_f32(x, out):
    """ggml_gelu_f32 in float32 as GCC compiles it: tanhf, and 1 + (A x) x as one fma."""
    for i in range(x.shape[0]):
        v = x[i]
        inner = f32(0.7978845608028654) * v * fma32(f32(0.044715) * v, v, f32(1))
        out[i] = f32(0.5) * v * (f32(1) + math.tanh(inner))


@functools.cache
def _gelu_table() -> np.ndarray:
    """GELU (tanh form) of every f16 value, rounded to f16: ggml's GGML_GELU_FP16 table. Built
    on first use (gemma's): loading _gelu_f32 costs the other models' start ~0.15 s."""
    x = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    g = np.zeros_like(x)
    with np.errstate(over="ignore", invalid="ignore"):
        _gelu_f32(x, g)
        return g.astype(np.float16).astype(np.float32)


def gelu_tanh_mul(gate, up, out):
    """out = gelu(gate) * up as llama.cpp computes it: the gate rounded to f16 and looked up
    in the f16 GELU table, except below -10 (0) and above 10 (identity)."""
    _gelu_mul(gate, up, out, _gelu_table())


@njit(cache=True)
def _gelu_mul(gate, up, out, table):
    # one pass (the numpy form's six passes and temporaries took 20 us for a 2048-wide row)
    for i in range(gate.shape[0]):
        gelu_mul_row(gate[i], up[i], out[i], table)


@njit(inline="always")
def gelu_mul_row(g, u, out, table):
    for j in range(g.shape[0]):
        x = g[j]
        v = f32(0) if x <= f32(-10) else x if x >= f32(10) else table[f2h(x)]
        out[j] = v * u[j]


_T64, _T128, _T256 = (scores16(d, 1) for d in (64, 128, 256))
_PV64, _PV128, _PV256 = (pv_tile(d) for d in (64, 128, 256))


@njit(inline="always")
def _pv_tile(d, vf, v0, P, acc):
    """acc += the tile's 64 value rows (f16, from vf[v0:]) weighted by P, cell after cell."""
    if d == 64:
        _PV64(vf, v0, P, 0, acc, 0)
    elif d == 128:
        _PV128(vf, v0, P, 0, acc, 0)
    elif d == 256:
        _PV256(vf, v0, P, 0, acc, 0)
    else:
        for cc in range(64):
            w = P[cc]
            for j in range(d):
                acc[j] = fma32(h2f(vf[v0 + cc * d + j]), w, acc[j])


@njit(inline="always")
def _scores_tile(d, kf, ko, cap, qf, qo, out, oo):
    """A tile's 64 scores, each one fma chain over the dims in order (simd_gemm's), any head
    size (the built sizes run the four blocks' chains side by side)."""
    if d == 64:
        _T64(kf, ko, cap, qf, qo, out, oo)
    elif d == 128:
        _T128(kf, ko, cap, qf, qo, out, oo)
    elif d == 256:
        _T256(kf, ko, cap, qf, qo, out, oo)
    else:
        for c16 in range(0, 64, 16):
            mul16(out, oo + c16, kf, ko + c16, qf[qo])
            for j in range(1, d):
                fma16(out, oo + c16, kf, ko + c16 + j * cap, qf[qo + j])


@njit(inline="always")
def _scores_one(d, kf, k0, stride, qb, P):
    """16 scores of one f16 query against 16 slots in ggml_vec_dot_f16's order into P[:16]
    (P: 64 * 16 floats): scores16's for the head sizes it is built for, through memory for
    others."""
    if not _scores(d, False, kf, k0, stride, qb, 0, P, 0):
        for j in range(d):
            if j < 64:
                mul16(P, j * 16, kf, k0 + j * stride, qb[j])
            else:
                fma16(P, (j % 64) * 16, kf, k0 + j * stride, qb[j])
        if d < 64:
            P[d * 16:] = 0
        _fold(P, 0, 16)
        _tree(P, 0, 16)


# a query's path through llama.cpp's CPU flash attention (ggml_compute_forward_flash_attn_ext_f16)
FA_ONE, FA_VEC, FA_TILE = 0, 1, 2


# flash_attention's two paths for one work item. d arrives as a literal (fa_items(d, tile)), so
# numba prunes the other head sizes' code.
@njit
def _fa_tile(d, e0, e1, g, kf, vf, kpage, vpage, stride, tab, top, kpos, p1, window, scale, qs, accs, P, Ms, Ss):
    """FA_TILE: the group's heads e0..e1 one after the other through 64-cell tiles of cells [0, top)."""
    for e in range(e0, e1):
        qb, acc = qs[e * d:(e + 1) * d], accs[e * d:(e + 1) * d]
        M, S = Ms[e], Ss[e]
        for b0 in range(0, top, 64):          # a tile of 64 cells (one page)
            k0 = tab[b0 >> 6] * kpage + g * d * stride
            tmax = f32(-np.inf)
            _scores_tile(d, kf, k0, stride, qb, 0, P, 0)
            for cc in range(64):
                if b0 + cc < top and _visible(kpos[_row(tab, b0 + cc)], p1, window):
                    P[cc] = P[cc] * scale
                    tmax = max(tmax, P[cc])
                else:
                    P[cc] = f32(-np.inf)
            if tmax == -np.inf:
                continue
            if tmax > M:
                ms = libm_expf(M - tmax)
                for j in range(d):
                    acc[j] = acc[j] * ms
                S = S * ms
                M = tmax
            total = 0.0
            for c16 in range(0, 64, 16):
                x = P[c16:c16 + 16]
                for cc in range(16):
                    x[cc] = expf(x[cc] - M)
                total += np.float64(((x[8] + x[0]) + (x[12] + x[4])) + ((x[10] + x[2]) + (x[14] + x[6]))
                                    + (((x[9] + x[1]) + (x[13] + x[5])) + ((x[11] + x[3]) + (x[15] + x[7]))))
            S = f32(np.float64(S) + total)
            _pv_tile(d, vf, tab[b0 >> 6] * vpage + g * 64 * d, P, acc)
        Ms[e], Ss[e] = M, S


@njit
def _fa_vec(d, e0, e1, g, kf, vf, kpage, vpage, stride, tab, c0, c1, kpos, p1, window, scale, qs, accs, P, Ms, Ss, Pe):
    """FA_VEC / FA_ONE: the group's heads e0..e1 over cells [c0, c1)."""
    # 16 cells at a time for the item's heads (the group's, or a share), cell by cell across them:
    # a cell's K and V rows are read from memory once and from L1 for the other heads,
    # and the heads' f16 value sums are independent chains the core overlaps (one
    # head's chain of convert-fma-convert per cell is latency-bound). Each head's float
    # steps are its own, in cell order, as before.
    for b0 in range(c0 - (c0 & 15), c1, 16):
        k0 = tab[b0 >> 6] * kpage + g * d * stride + (b0 & 63)
        for e in range(e0, e1):
            _scores_one(d, kf, k0, stride, qs[e * d:(e + 1) * d], P)
            for cc in range(16):
                Pe[e * 16 + cc] = P[cc] * scale
        for cc in range(16):
            s = b0 + cc
            if s < c0 or s >= c1 or not _visible(kpos[_row(tab, s)], p1, window):
                continue
            r = _row(tab, s)
            v0 = (r >> 6) * vpage + g * 64 * d + (r & 63) * d
            for e in range(e0, e1):
                a0, M, sv = e * d, Ms[e], Pe[e * 16 + cc]     # offsets, not slices: no view per cell
                ms, vs = f32(1), f32(1)
                if sv > M:
                    ms = libm_expf(M - sv)
                    M = sv
                    if d % 16 == 0:
                        for j in range(0, d, 16):
                            mul16h(accs, a0 + j, ms)
                    else:
                        for j in range(d):
                            accs[a0 + j] = h2f(f2h(accs[a0 + j] * ms))
                else:
                    vs = libm_expf(sv - M)
                if d % 16 == 0:
                    for j in range(0, d, 16):
                        fma16h(accs, a0 + j, vf, v0 + j, vs)
                else:
                    for j in range(d):
                        accs[a0 + j] = h2f(f2h(fma32(h2f(vf[v0 + j]), vs, accs[a0 + j])))
                Ms[e], Ss[e] = M, fma32(Ss[e], ms, vs)


# the work items' C signature (fa_items): items [i0, i1) on scratch row th; it, q, qpos, qseq, kf,
# vf, kpos, tables, part, out, scratch (each its data and length); n_head, n_kv, stride (k's row
# length), the tables' width, nth, the scratch row's length, window, scale
_A = c_array
_FA_SIG = types.void(types.int64, types.int64, types.int64, *_A(types.int64), *_A(types.float32), *_A(types.int64),
                     *_A(types.int64), *_A(types.uint16), *_A(types.uint16), *_A(types.int64), *_A(types.int64),
                     *_A(types.float32), *_A(types.float32), *_A(types.float32), types.int64, types.int64, types.int64,
                     types.int64, types.int64, types.int64, types.int64, types.float32)
_fa_compiled: dict[tuple[int, bool], object] = {}     # (head_dim, tile) -> its compiled work items (a cfunc)


def fa_items(head_dim: int, tile: bool):
    """Work items [i0, i1) of flash_attention(head_dim, tile) (each a query, a kv head and a
    chunk of cells; the rows of it: t, g, c, c0, c1, the query's row of part or -1 and the
    group's heads e0..e1 it takes), one after
    the other in scratch row th: a C function of its own (numba's cfunc, cached), called through
    its address by the parallel loop _fa_run. A jit callee's code would be linked, optimized
    and compiled again in the loop's gufunc, its two wrappers and the kernel, and numba's
    parallel passes copy and rewrite a prange body whole: that was most of the first run's
    attention compile."""
    if (head_dim, tile) in _fa_compiled:
        return _fa_compiled[head_dim, tile]
    d = head_dim

    def items(i0, i1, th, it_, nit, q_, nq, qpos_, nqp, qseq_, nqs, kf_, nk, vf_, nv, kpos_, npos, tables_, ntab,
              part_, npart, out_, nout, scr_, nscr, n_head, n_kv, stride, width, nth, row, window, scale):
        it, q, qpos, qseq = numba.carray(it_, (nit // 8, 8)), numba.carray(q_, nq), numba.carray(qpos_, nqp), numba.carray(qseq_, nqs)
        kf, vf, kpos = numba.carray(kf_, nk), numba.carray(vf_, nv), numba.carray(kpos_, npos)
        tables, part, out = numba.carray(tables_, ntab), numba.carray(part_, npart), numba.carray(out_, nout)
        buf = numba.carray(scr_, nscr)[th * row:(th + 1) * row]
        kpage, vpage = n_kv * d * stride, n_kv * 64 * d
        group = n_head // n_kv
        # per query head of the group: q, its value sums, M and S; P: 64 lanes of 16 scores
        gd = group * d
        o1 = 2 * gd + 64 * 16
        qs, accs, P = buf[:gd], buf[gd:2 * gd], buf[2 * gd:o1]
        Ms, Ss, Pe = buf[o1:o1 + group], buf[o1 + group:o1 + 2 * group], buf[o1 + 2 * group:o1 + 18 * group]
        for i in range(i0, i1):
            t, g, c, c0, c1, pr, e0, e1 = it[i, 0], it[i, 1], it[i, 2], it[i, 3], it[i, 4], it[i, 5], it[i, 6], it[i, 7]
            tab = tables[qseq[t] * width:(qseq[t] + 1) * width]
            p1 = qpos[t]
            for e in range(e0, e1):
                h = g * group + e
                for j in range(d):
                    x = q[(t * n_head + h) * d + j]
                    qs[e * d + j] = x if tile else h2f(f2h(x))
                    accs[e * d + j] = 0
                Ms[e], Ss[e] = f32(-np.inf), f32(0)     # float32 throughout: exp of a float64 would round differently
            if tile:
                _fa_tile(d, e0, e1, g, kf, vf, kpage, vpage, stride, tab, c1, kpos, p1, window, scale, qs, accs, P, Ms, Ss)
            else:
                _fa_vec(d, e0, e1, g, kf, vf, kpage, vpage, stride, tab, c0, c1, kpos, p1, window, scale, qs, accs, P, Ms, Ss, Pe)
            for e in range(e0, e1):
                h = g * group + e
                M, S = Ms[e], Ss[e]
                if pr >= 0:         # a chunk of a split query: its M, S and value sums, merged later
                    o = ((pr * n_head + h) * nth + c) * (d + 2)
                    part[o], part[o + 1] = M, S
                    for j in range(d):
                        part[o + 2 + j] = accs[e * d + j]
                else:
                    inv = f32(0) if S == 0 else f32(1) / S
                    for j in range(d):
                        out[(t * n_head + h) * d + j] = accs[e * d + j] * inv
    _fa_compiled[head_dim, tile] = numba.cfunc(_FA_SIG, cache=True)(items)
    return _fa_compiled[head_dim, tile]


@njit(parallel=PRANGE, cache=True)
def _fa_run(fn, nth, it, q, qpos, qseq, kf, vf, kpos, tables, part, out, scratch, n_head, n_kv, stride, window, scale):
    """The work items of it on nth threads, an even run each (as numba's prange splits them),
    by the compiled items at fn; one parallel loop for every head size and path."""
    n = it.shape[0]
    for j in prange(nth):
        if n * j // nth < n * (j + 1) // nth:
            call_c(fn, np.int64(n * j // nth), np.int64(n * (j + 1) // nth), np.int64(j), it, q, qpos, qseq, kf, vf,
                   kpos, tables, part, out, scratch, np.int64(n_head), np.int64(n_kv), np.int64(stride),
                   np.int64(tables.shape[1]), np.int64(nth), np.int64(scratch.shape[1]), np.int64(window), f32(scale))


@functools.cache
def flash_attention(head_dim: int, tile: bool):
    """Attention in the float steps of llama.cpp's CPU flash-attention kernel, f16 cache, to the
    bit: the kernel for one head size and either the FA_TILE queries (tile) or the others,
    whose last argument is the address of the compiled work items, fa_items(head_dim,
    tile).address; a first run that meets only short batches compiles one path of one size.
    Arguments as attention()'s (q (n_tok, n_head, d) float32, not rounded); queries of the
    other path are left as they are.
    Per query the path llama.cpp takes for it: qmode FA_TILE (a batch
    of >= 64 tokens: q in float32, 64-cell tiles, scores one fma chain over the dims, the tile's
    softmax with ggml's exp summed in float64, values summed in float32 fma chains), FA_VEC (a
    smaller batch: q rounded to f16, ggml_vec_dot_f16 scores, online softmax cell by cell with
    libm's expf and the value sum kept in f16) or FA_ONE (one token: FA_VEC, but once the view
    has 512 cells or more its cells are split into nth chunks whose partial sums are merged in
    order, as llama.cpp's nth threads do; its bits depend on nth as llama.cpp's do).

    The cells llama.cpp's view holds are the sequence's slots written so far, padded to a
    multiple of 256 (at least 256); for FA_ONE, those written up to the query's own token, so
    that speculative verification (a query per draft token) splits each as its decode did.
    Cells past them, or that a query may not see, are skipped as their -inf mask makes
    llama.cpp skip them. Work items: a query, a kv head and
    a chunk of cells; the group's query heads go through each block of 16 cells together
    (FA_TILE: one head after the other), or some of them each where there are fewer items
    than threads (gemma3's decode: its one kv head's four query heads, two a thread)."""
    def flash_attention_kernel(q, qpos, qseq, qmode, k, v, kpos, tables, seq_slots, window, scale, out, scratch, nth, fn):
        d = head_dim
        n_tok, n_head = q.shape[0], q.shape[1]
        n_kv, stride = k.shape[1], k.shape[3]
        nek = np.empty(n_tok, np.int64)     # cells in llama.cpp's view
        nch = np.ones(n_tok, np.int64)      # chunks they are split into
        top = np.zeros(n_tok, np.int64)     # one past the last cell the query sees
        pidx = np.full(n_tok, -1, np.int64) # its rows of part (split queries only)
        n_split, n_items = 0, 0
        for t in range(n_tok):
            if (qmode[t] == FA_TILE) != tile:
                continue
            tab = tables[qseq[t]]
            used = 0        # cells a decode of this token alone would have written: not later tokens'
            for s in range(seq_slots[qseq[t]]):
                p0 = kpos[_row(tab, s)]
                if _visible(p0, qpos[t], window):
                    top[t] = s + 1
                if 0 <= p0 <= qpos[t]:
                    used = s + 1
            nek[t] = max(256, -(-used // 256) * 256)
            if qmode[t] == FA_ONE and nek[t] >= 512:
                nch[t] = nth
                pidx[t] = n_split
                n_split += 1
            n_items += n_kv * nch[t]
        part = np.zeros((max(n_split, 1), n_head, nth, d + 2), np.float32)   # per chunk: M, S, values
        # fewer items than threads (gemma3's decode: one kv head, one chunk): heads split
        group = n_head // n_kv
        hs = _shares(group, n_items, nth)
        it = np.empty((n_items * hs, 8), np.int64)
        i = 0
        for t in range(n_tok):
            if (qmode[t] == FA_TILE) != tile:
                continue
            size = -(-nek[t] // nch[t])
            for g in range(n_kv):
                for c in range(nch[t]):
                    for p in range(hs):
                        it[i, 0], it[i, 1], it[i, 2] = t, g, c
                        it[i, 3], it[i, 4] = c * size, top[t] if tile else min((c + 1) * size, nek[t], top[t])
                        it[i, 5] = pidx[t]
                        it[i, 6], it[i, 7] = _share(group, hs, p)
                        i += 1
        _fa_run(fn, nth, it, q, qpos, qseq, k.ravel(), v.ravel(), kpos, tables, part, out, scratch, n_head, n_kv, stride,
                window, scale)
        for t in range(n_tok):          # merge the chunks of split queries, in order
            if pidx[t] < 0:
                continue
            for h in range(n_head):
                M, S = f32(-np.inf), f32(0)
                acc = np.zeros(d, np.float32)
                for c in range(nch[t]):
                    pr = part[pidx[t], h, c]
                    if pr[1] == 0:
                        continue
                    mn = max(M, pr[0])
                    so, sn = libm_expf(M - mn), libm_expf(pr[0] - mn)
                    for j in range(d):
                        acc[j] = fma32(acc[j], so, pr[2 + j] * sn)
                    S = fma32(S, so, pr[1] * sn)
                    M = mn
                inv = f32(1) / S if S != 0 else f32(1)
                for j in range(d):
                    out[t, h, j] = acc[j] * inv
    return njit(cache=True)(flash_attention_kernel)


# cache element types inside the kernels
KV_F16, KV_Q8_0, KV_Q4_0 = 0, 1, 2


@njit(inline="always")
def _put_f16(row, o, x):
    b = f2h(x)
    row[o], row[o + 1] = np.uint8(b & 0xFF), np.uint8(b >> 8)


@njit(inline="always")
def _get_f16(row, o):
    return h2f(np.uint16(row[o]) | (np.uint16(row[o + 1]) << np.uint16(8)))


@njit(inline="always")
def q8_0_row(x, out):
    """x (float32, a multiple of 32) to block_q8_0 bytes as ggml's CPU quantize_row_q8_0
    (AVX): d = amax / 127 stored f16, codes round(x * (127 / amax)) to nearest even."""
    for b in range(x.shape[0] // 32):
        amax = f32(0)
        for j in range(32):
            amax = max(amax, abs(x[b * 32 + j]))
        _put_f16(out, b * 34, amax / f32(127))
        inv = f32(127) / amax if amax != 0 else f32(0)
        for j in range(32):
            out[b * 34 + 2 + j] = np.uint8(np.int32(np.rint(x[b * 32 + j] * inv)) & 0xFF)


@njit(cache=True)
def store_kv(k, v, slots, kc, vc, kt, vt):
    """k and v (n, n_kv, d) float32 into their slots of a cache of types kt/vt: f16 values in
    the f16 layouts, quantized rows of blocks (ggml's CPU from_float, as llama.cpp's
    set_rows) in the others."""
    for t in range(k.shape[0]):
        p, o = slots[t] >> 6, slots[t] & 63
        for h in range(k.shape[1]):
            if kt == KV_F16:        # f16 K: a row of slots per dim
                for j in range(k.shape[2]):
                    kc[p, h, j, o] = f2h(k[t, h, j])
            else:
                _put_q(k[t, h], kc[p, h, o], kt)
            if vt == KV_F16:
                for j in range(v.shape[2]):
                    vc[p, h, o, j] = f2h(v[t, h, j])
            else:
                _put_q(v[t, h], vc[p, h, o], vt)


@njit(inline="always")
def _put_q(x, out, t):
    if t == KV_Q8_0:
        q8_0_row(x, out)
    else:
        q4_0_row(x, out)


@njit(inline="always")
def _q8_codes(x, raw, qq, qo, qd, qdo):
    """x in q8_0 as quantize_row_q8_0 makes it (raw: its block bytes): the int8 codes into
    qq[qo:], the block scales into qd[qdo:]."""
    q8_0_row(x, raw)
    for b in range(x.shape[0] // 32):
        qd[qdo + b] = _get_f16(raw, b * 34)
        for j in range(32):
            c = np.int32(raw[b * 34 + 2 + j])
            qq[qo + b * 32 + j] = np.int8(c - (c >> 7 << 8))


@njit(inline="always")
def _dot_q(kf, ko, kt, qq, qo, qd, qdo, nb):
    """ggml_vec_dot_q8_0_q8_0 / _q4_0_q8_0 of the cached row at kf[ko:] with q in q8_0 (codes
    qq[qo:], block scales qd[qdo:])."""
    return dotq8_row(kf, ko, qq, qo, qd, qdo, nb) if kt == KV_Q8_0 else dotq4_row(kf, ko, qq, qo, qd, qdo, nb)


@njit(inline="always")
def _deq_row(vr, vt, nb, out):
    """A cached q8_0 / q4_0 row to float32 (ggml's dequantize_row: code * d)."""
    for b in range(nb):
        if vt == KV_Q8_0:
            dv = _get_f16(vr, b * 34)
            for j in range(32):
                out[b * 32 + j] = f32(np.int8(vr[b * 34 + 2 + j])) * dv
        else:
            dv = _get_f16(vr, b * 18)
            for j in range(16):
                byte = np.int32(vr[b * 18 + 2 + j])
                out[b * 32 + j] = f32((byte & 15) - 8) * dv
                out[b * 32 + 16 + j] = f32((byte >> 4) - 8) * dv


@njit(parallel=PRANGE, cache=True)
def flash_attention_q(q, qpos, qseq, k, v, kpos, tables, seq_slots, window, scale, out, scratch, threads, kt, vt):
    """flash_attention with a quantized K or V (llama.cpp's -ctk/-ctv q8_0 | q4_0): every query
    takes the one-chunk kernel (llama.cpp's tiled and split paths need f16 K and V). q is
    converted to K's dot type (f16, or q8_0 blocks as quantize_row_q8_0 makes them); scores
    by ggml_vec_dot_f16 or the quantized dots; online softmax cell by cell with libm's expf;
    values summed in f16 (f16 V) or in float32 fma from the dequantized row (quantized V).
    A work item is a query, a kv head and its group's query heads, or a share of them where
    there are fewer such items than threads (numba's): gemma3's decode has one kv head."""
    n_tok, n_head, d = q.shape
    n_kv = k.shape[1]
    group = n_head // n_kv
    nb = d // 32
    kf, vf = k.ravel(), v.ravel()
    row = k.shape[3]        # f16 K: a dim's slots (and a pad); quantized K: a slot's blocks
    shares = _shares(group, n_tok * n_kv, threads)
    for i in prange(n_tok * n_kv * shares):
        u = i // shares
        t, g = u // n_kv, u % n_kv
        e0, e1 = _share(group, shares, i % shares)
        hb, ng = g * group + e0, e1 - e0        # this item's heads: hb, hb + 1, ...
        tab = tables[qseq[t]]
        top = 0
        for s in range(seq_slots[qseq[t]]):
            if _visible(kpos[_row(tab, s)], qpos[t], window):
                top = s + 1
        buf = scratch[get_thread_id()]
        # per query head of the group: q (f16 K), value sums, scores of 16 cells, M and S. The
        # heads go cell by cell together, so a cell's K and V rows are read (and a quantized V
        # row dequantized) once for the group; each head's float steps stay its own, in order
        gd, o1 = group * d, 2 * group * d + d + 64 * 16
        qbs, accs, vrow, P = buf[:gd], buf[gd:2 * gd], buf[2 * gd:2 * gd + d], buf[2 * gd + d:o1]
        Pe, Ms, Ss = buf[o1:o1 + 16 * group], buf[o1 + 16 * group:o1 + 17 * group], buf[o1 + 17 * group:o1 + 18 * group]
        qq = np.zeros(gd, np.int8)
        qd = np.empty(group * nb, np.float32)
        qraw = np.empty(nb * 34, np.uint8)
        p1 = qpos[t]
        for e in range(ng):
            h = hb + e
            if kt == KV_F16:
                for j in range(d):
                    qbs[e * d + j] = h2f(f2h(q[t, h, j]))
            else:
                _q8_codes(q[t, h], qraw, qq, e * d, qd, e * nb)
            for j in range(d):
                accs[e * d + j] = 0
            Ms[e], Ss[e] = f32(-np.inf), f32(0)
        for b0 in range(0, top, 16):
            if kt == KV_F16:
                k0 = tab[b0 >> 6] * (n_kv * d * row) + g * d * row + (b0 & 63)
                for e in range(ng):
                    _scores_one(d, kf, k0, row, qbs[e * d:(e + 1) * d], P)
                    for cc in range(16):
                        Pe[e * 16 + cc] = P[cc]
            else:       # the block's dots first, apart from the softmax's dependency chains
                for cc in range(16):
                    r = _row(tab, b0 + cc)
                    k0 = ((r >> 6) * n_kv + g) * 64 + (r & 63)
                    for e in range(ng):
                        Pe[e * 16 + cc] = _dot_q(kf, k0 * row, kt, qq, e * d, qd, e * nb, nb)
            for cc in range(16):
                s = b0 + cc
                if s >= top or not _visible(kpos[_row(tab, s)], p1, window):
                    continue
                r = _row(tab, s)
                pg, o = r >> 6, r & 63
                if vt != KV_F16:
                    _deq_row(v[pg, g, o], vt, nb, vrow)
                slot = (pg * n_kv + g) * 64 + o         # its row in quantized K, f16 V
                v0 = slot * d
                for e in range(ng):
                    a0, M, S = e * d, Ms[e], Ss[e]       # offsets, not slices: no view per cell
                    sv = Pe[e * 16 + cc] * scale
                    ms, vs = f32(1), f32(1)
                    if sv > M:
                        ms = libm_expf(M - sv)
                        M = sv
                        if d % 16 == 0:
                            for j in range(0, d, 16):
                                if vt == KV_F16:
                                    mul16h(accs, a0 + j, ms)
                                else:
                                    mul16(accs, a0 + j, accs, a0 + j, ms)
                        else:
                            for j in range(d):
                                accs[a0 + j] = h2f(f2h(accs[a0 + j] * ms)) if vt == KV_F16 else accs[a0 + j] * ms
                    else:
                        vs = libm_expf(sv - M)
                    if d % 16 == 0:
                        for j in range(0, d, 16):
                            if vt == KV_F16:
                                fma16h(accs, a0 + j, vf, v0 + j, vs)
                            else:
                                fma16(accs, a0 + j, vrow, j, vs)
                    elif vt == KV_F16:
                        for j in range(d):
                            accs[a0 + j] = h2f(f2h(fma32(h2f(vf[v0 + j]), vs, accs[a0 + j])))
                    else:
                        for j in range(d):
                            accs[a0 + j] = fma32(vrow[j], vs, accs[a0 + j])
                    Ms[e], Ss[e] = M, fma32(S, ms, vs)
        for e in range(ng):
            h = hb + e
            S = Ss[e]
            inv = f32(0) if S == 0 else f32(1) / S
            for j in range(d):
                out[t, h, j] = accs[e * d + j] * inv


@njit(parallel=PRANGE, cache=True)
def fwht(x, n):
    """Each run of n values of x (flat length a multiple of n, n a power of 2) times the
    normalized Hadamard matrix, in place, as ggml's CPU fwht (the Hadamard mul_mat that
    llama.cpp applies to q, k, v and the attention output around a quantized KV cache): the
    values times 1/sqrtf(n), then butterflies (u + v, u - v) of widths 1, 2, 4, ... in order."""
    f = x.reshape(-1)
    scale = f32(1) / np.sqrt(f32(n))
    for r in prange(f.shape[0] // n):
        row = f[r * n:(r + 1) * n]
        for j in range(n):
            row[j] = row[j] * scale
        w = 1
        while w < n:
            for i in range(0, n, 2 * w):
                for j in range(w):
                    u, v = row[i + j], row[i + w + j]
                    row[i + j] = u + v
                    row[i + w + j] = u - v
            w *= 2
