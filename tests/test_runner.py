"""The runner on tiny random-weight models: cache semantics, prefill vs decode, rollback,
context overflow, sampler rules and generate()'s stop handling."""
import numpy as np
import pytest

from gguf_io.testing import write_tiny_model
from gguf_io.types import GGMLQuantizationType as T
from quant import packed
from runner.generate import ContextError, Done, Notice, Token, generate
from runner.kv_cache import KVCache
from runner.model import load
from runner.sampler import Sampler, SamplerConfig, apply_penalties


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load(str(write_tiny_model(tmp_path_factory.mktemp("m") / "llama.gguf", "llama", seed=1)))


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    p = write_tiny_model(tmp_path_factory.mktemp("m") / "gemma.gguf", "gemma3", n_layer=6, head_dim=32,
                         sliding_window=8, seed=2)
    return load(str(p))


IDS = [1, 300, 301, 302, 290, 310, 305, 299, 320, 330, 311, 312, 313, 340, 350, 360, 370, 371, 372, 373]


# ---------------------------------------------------------------- KV cache

def test_ring_keeps_the_first_tokens_and_overwrites_the_oldest():
    c = KVCache(1, 1, 4, n_ctx=8, windows=[0], chunk=4, n_keep=2)
    for _ in range(11):
        c.claim(1)
    lc = c.layers[0]
    assert c.dropped and c.n_past == 11
    assert sorted(lc.pos[:lc.cap].tolist()) == [0, 1, 5, 6, 7, 8, 9, 10]   # 2 kept + the 6 most recent
    assert lc.v.shape[0] * 64 == len(lc.pos) == 64 and (lc.pos[lc.cap:] == -1).all()   # arrays padded to 64 slots, never used


def test_sliding_layers_hold_window_plus_chunk():
    c = KVCache(2, 1, 4, n_ctx=100, windows=[8, 0], chunk=4)
    assert [lc.cap for lc in c.layers] == [12, 100]
    c.claim(30)
    assert not c.dropped            # a sliding layer wrapping is not a context overflow
    assert sorted(c.layers[0].pos[:12].tolist()) == list(range(18, 30))


def test_rollback_forgets_positions():
    c = KVCache(1, 1, 4, n_ctx=16, windows=[0], chunk=4)
    c.claim(10)
    c.rollback(3)
    assert c.n_past == 7 and (c.layers[0].pos >= 7).sum() == 0


# ---------------------------------------------------------------- forward

def _decode_logits(m, ids, n_ctx=64):
    cache = m.make_cache(n_ctx)
    return np.concatenate([m.backend.forward([i], cache).copy() for i in ids])


@pytest.mark.parametrize("name", ["tiny", "tiny_gemma"])
def test_prefill_equals_decode(name, request):
    """Chunked prefill (matmul path) and one-token decode (matvec path) are the same model;
    on F32 weights they differ by float summation order, which can flip the f16 rounding of
    a softmax weight (as in llama.cpp): 3e-4 of the largest logit covers that. With flash
    attention (the default) the value sums are rounded to f16 at every cell, as llama.cpp's
    are: 2e-3 (measured 1.2e-3)."""
    m = request.getfixturevalue(name)
    full = m.backend.forward(IDS, m.make_cache(64), logits="all")
    step = _decode_logits(m, IDS)
    tol = 2e-3 if m.backend.flash else 3e-4
    np.testing.assert_allclose(full, step, rtol=1e-4, atol=tol * np.abs(full).max())


@pytest.mark.skipif(not packed.enabled(), reason="repacking needs AVX512-VNNI (and NUMBAT_REPACK unset)")
def test_q_and_k_fused_where_v_has_another_type_keep_the_bits(tmp_path):
    """Half the layers of a Q4_K_M file have V in another type than Q and K: Q and K make one
    kernel call there. Its outputs are those of the two matrices apart, for decode, a
    speculative check's four tokens and a short batch."""
    p = write_tiny_model(tmp_path / "m.gguf", "qwen2", n_embd=256, n_ff=512, n_head=4, n_head_kv=2,
                         weight_type=T.Q8_0, tensor_types={"attn_v.weight": T.Q5_0}, seed=3)
    fused, apart = load(str(p)), load(str(p))
    assert all(L.qk is not None and L.qkv is None for L in fused.backend.layers)
    for L in apart.backend.layers:
        L.qk = None

    def run(m):
        cache = m.make_cache(64)
        return [m.backend.forward(IDS[:7], cache, logits="all"),
                m.backend.forward(IDS[7:11], cache, logits="all", one_by_one=True),
                m.backend.forward(IDS[11:12], cache)]
    for a, b in zip(run(fused), run(apart)):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("flash", [False, True])
def test_prefill_in_chunks_equals_one_chunk(tiny_gemma, flash):
    """Chunks smaller than the sliding window wrap its ring: other cells, in another order.
    Flash attention keeps its value sums in f16 cell by cell (llama.cpp's), so the order moves
    more bits there: f16's precision."""
    m = tiny_gemma
    chunk, was = m.backend.chunk, m.backend.flash
    try:
        m.backend.flash = flash
        one = m.backend.forward(IDS, m.make_cache(64), logits="all")
        m.backend.chunk = 3      # chunks smaller than the sliding window and not dividing the input
        several = m.backend.forward(IDS, m.make_cache(64), logits="all")
    finally:
        m.backend.chunk, m.backend.flash = chunk, was
    tol = 1e-3 if flash else 3e-4
    np.testing.assert_allclose(one, several, rtol=1e-4, atol=tol * np.abs(one).max())


def test_rollback_then_rerun_gives_the_same_logits(tiny):
    m = tiny
    cache = m.make_cache(64)
    m.backend.forward(IDS[:10], cache)
    a = m.backend.forward(IDS[10:14], cache, logits="all").copy()
    cache.rollback(4)
    m.backend.forward([5, 6, 7], cache)      # a rejected draft
    cache.rollback(3)
    b = m.backend.forward(IDS[10:14], cache, logits="all")
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(a).max())


def test_sliding_layers_cache_only_window_plus_chunk(tiny_gemma):
    m = tiny_gemma
    n_ctx = max(L.window for L in m.backend.layers) + m.backend.chunk + 88   # past the tiny training context
    cache = m.backend.make_cache(n_ctx)
    for L, lc in zip(m.backend.layers, cache.layers):
        assert lc.cap == (L.window + m.backend.chunk if L.window else n_ctx)


def _attention_case(window, d=128, cap=128, filled=100):
    """4 queries, 4 heads on 2 kv heads, over a wrapped ring of filled slots (the rest empty)."""
    rng = np.random.default_rng(0)
    n_tok, n_head, n_kv = 4, 4, 2
    q = rng.standard_normal((n_tok, n_head, d)).astype(np.float16).astype(np.float32)
    k = rng.standard_normal((n_kv, d, cap)).astype(np.float16).astype(np.float32)
    v = rng.standard_normal((n_kv, cap, d)).astype(np.float16).astype(np.float32)
    kpos = np.full(cap, -1)
    kpos[:filled] = (np.arange(filled) + 6) % filled          # slot 0 holds position 6, ...
    qpos = np.arange(filled - 4, filled)
    ok = (kpos[None] >= 0) & (kpos[None] <= qpos[:, None]) & ((qpos[:, None] - kpos[None] < window) if window else True)
    return q, k, v, kpos, qpos, ok


def _run_attention(q, k, v, kpos, qpos, window, batch):
    from runner.backends.kernels import KV_F16, attention, attention_scratch
    out = np.zeros(q.shape, np.float32)
    n_kv, d, cap = k.shape
    scratch = np.zeros((8, attention_scratch(cap, d, q.shape[1] // n_kv)), np.float32)
    # the cache's layout: pages of 64 slots, k padded by 16 per dim row; one sequence over its pages in order
    kp = np.zeros((cap // 64, n_kv, d, 80), np.float32)
    kp[..., :64] = k.reshape(n_kv, d, cap // 64, 64).transpose(2, 0, 1, 3)
    vp = np.ascontiguousarray(v.reshape(n_kv, cap // 64, 64, d).transpose(1, 0, 2, 3))
    n = len(qpos)
    attention(q, qpos, np.zeros(n, np.int64), np.full(n, batch), kp, vp, kpos, np.arange(cap // 64)[None],
              np.array([int((kpos >= 0).sum())]), window, np.float32(d ** -0.5), out, scratch, 2, KV_F16)
    return out


@pytest.mark.parametrize("batch", [False, True])
@pytest.mark.parametrize("window", [0, 3])
def test_attention_kernel_masks_by_position_and_window(window, batch):
    """Against numpy: causal softmax attention with GQA over the slots' positions (a wrapped
    ring, empty slots), the weights rounded to f16 before they meet v, as llama.cpp does."""
    q, k, v, kpos, qpos, ok = _attention_case(window)
    out = _run_attention(q, k, v, kpos, qpos, window, batch)
    d = q.shape[2]
    for t in range(len(qpos)):
        for h in range(q.shape[1]):
            g = h // 2
            s = np.where(ok[t], (k[g].T @ q[t, h]) * d ** -0.5, -np.inf)
            w = np.exp(s - s.max())
            w = (w / w.sum()).astype(np.float16).astype(np.float64)
            np.testing.assert_allclose(out[t, h], w @ v[g], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flash, types", [(True, ("f16", "f16")), (True, ("q8_0", "q8_0")), (True, ("q4_0", "f16")),
                                          (False, ("f16", "f16")), (False, ("q8_0", "f16"))])
def test_attention_splits_a_kv_heads_queries_without_changing_their_bits(flash, types):
    """One token over one kv head with four query heads (gemma3's decode) is one work item:
    on two threads its heads are split between two items, in each attention kernel: flash
    attention over an f16 cache (flash_attention) or a quantized one (flash_attention_q), and
    -fa off's (attention). Every head keeps the bits it gets on one thread and computed alone."""
    import numba
    from runner.backends import kernels as K
    from runner.kv_cache import _kv_arrays
    rng = np.random.default_rng(5)
    d, n_head, cells = 64, 4, 100
    k, v = _kv_arrays(1, d, 2, types)
    slots = np.arange(cells)
    kk, vv = (rng.standard_normal((cells, 1, d)).astype(np.float32) for _ in "kv")
    codes = {"f16": K.KV_F16, "q8_0": K.KV_Q8_0, "q4_0": K.KV_Q4_0}
    kt, vt = codes[types[0]], codes[types[1]]
    if types == ("f16", "f16"):
        K.rope_store(np.zeros((cells, n_head, d), np.float32), kk, vv, slots, np.float32(1), np.float32(0),
                     np.ones(d // 2, np.float32), False, slots, k, v, np.float32(1), False, True)
    else:
        K.store_kv(kk, vv, slots, k, v, kt, vt)
    kpos = np.full(128, -1, np.int64)
    kpos[:cells] = slots
    q = rng.standard_normal((1, n_head, d)).astype(np.float32)
    scratch = np.zeros((max(2, numba.config.NUMBA_NUM_THREADS), K.attention_scratch(128, d, n_head)), np.float32)
    kern, fn = K.flash_attention(d, False), K.fa_items(d, False).address
    where = (np.array([cells - 1]), np.zeros(1, np.int64))
    table = (k, v, kpos, np.arange(2)[None], np.array([cells]), 0, np.float32(d ** -0.5))

    def run(qh, nth):
        out = np.zeros_like(qh)
        if not flash:
            K.attention(qh, *where, np.zeros(1, np.bool_), *table, out, scratch, nth, kt)
        elif types == ("f16", "f16"):
            kern(qh, *where, np.full(1, K.FA_ONE, np.int8), *table, out, scratch, nth, fn)
        else:
            K.flash_attention_q(qh, *where, *table, out, scratch, nth, kt, vt)
        return out

    split = run(q, 2)
    assert np.abs(split).min() > 0
    np.testing.assert_array_equal(split, run(q, 1))
    for h in range(n_head):
        np.testing.assert_array_equal(split[:, h], run(np.ascontiguousarray(q[:, h:h + 1]), 1)[:, 0])


def _fma(a, b, c):
    """float32 fma (the float64 product is exact; its double rounding is negligibly rare)."""
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


def _mm512_reduce(x):
    """_mm512_reduce_add_ps's tree over 16 float32 lanes."""
    x = [np.float32(a) for a in x]
    for half in (8, 4, 2, 1):
        x = [np.float32(x[r] + x[r + half]) for r in range(half)]
    return x[0]


def _ggml_dot(a, b, batch):
    """llama.cpp's f16 dot: tinyBLAS in a batch (16 lanes, one fma chain each), else
    ggml_vec_dot_f16 (4 x 16 lanes over steps of 64, folded (0 + 2) + (1 + 3)); then the
    reduction tree."""
    lanes = 16 if batch else 64
    acc = [np.float32(0)] * lanes
    for i in range(len(a)):
        acc[i % lanes] = _fma(a[i], b[i], acc[i % lanes])
    if not batch:
        acc = [np.float32(np.float32(acc[r] + acc[32 + r]) + np.float32(acc[16 + r] + acc[48 + r])) for r in range(16)]
    return _mm512_reduce(acc)


@pytest.mark.parametrize("batch", [False, True])
def test_attention_kernel_sums_in_llamas_order(batch):
    """Bit for bit against a plain Python statement of llama.cpp's steps (non-flash path, f16
    cache): kq = the f16 dot over dims, scaled, masked; softmax with ggml's exp, summed 16
    slots at a time into float64; weights times 1/sum, rounded to f16; then the f16 dot of
    each value dim over the slots, empty slots included as zeros. The real-model tests check
    the whole forward against llama.cpp itself."""
    from numba import njit
    from runner.backends.kernels import expf, f16_round_pos
    exp1 = njit(lambda x: expf(x))
    q, k, v, kpos, qpos, ok = _attention_case(0)
    out = _run_attention(q, k, v, kpos, qpos, 0, batch)
    assert (out != _run_attention(q, k, v, kpos, qpos, 0, not batch)).any()    # the two orders differ here
    d, n = q.shape[2], 128                      # llama.cpp's padded cells: the 100 slots rounded up to 64
    scale = np.float32(d ** -0.5)
    for t in range(len(qpos)):
        for h in range(q.shape[1]):
            g = h // 2
            sc = [np.float32(_ggml_dot(k[g, :, s], q[t, h], batch) * scale) if ok[t, s] else np.float32(-np.inf) for s in range(n)]
            mx = max(sc)
            e = [np.float32(exp1(np.float32(x - mx))) for x in sc]
            total = sum(np.float64(_mm512_reduce(e[c:c + 16])) for c in range(0, n, 16))
            w = [np.float32(f16_round_pos(np.float32(x * np.float32(1.0 / total)))) for x in e]
            want = [_ggml_dot(v[g, :, j], w, batch) for j in range(d)]
            np.testing.assert_array_equal(out[t, h], np.array(want, np.float32))


def test_exp_and_f16_rounding_kernels():
    """expf follows exp to float32 accuracy (and gives 0 at -inf); f16_round_pos rounds as
    numpy's float16 conversion does, subnormals and ties included."""
    from numba import njit
    from runner.backends.kernels import expf, f16_round_pos

    @njit
    def apply(x, e, r):
        for i in range(x.shape[0]):
            e[i], r[i] = expf(x[i]), f16_round_pos(-x[i])
    rng = np.random.default_rng(0)
    x = -np.concatenate([rng.uniform(0, 90, 20000), rng.uniform(0, 1e-4, 20000), [0, np.inf, 2.0 ** -25, 3 * 2.0 ** -25]]).astype(np.float32)
    e, r = np.empty_like(x), np.empty_like(x)
    apply(x, e, r)
    ref = np.exp(x.astype(np.float64))
    assert e[-3] == 0 and e[-4] == 1
    np.testing.assert_allclose(e[:-4], ref[:-4], rtol=3e-7, atol=1e-38)
    np.testing.assert_array_equal(r, (-x).astype(np.float16).astype(np.float32))


def test_libm_expf_is_the_c_librarys_expf_on_every_float():
    """The inlined expf of the online softmax returns the C library's expf (what llama.cpp
    calls, and what numba's math.exp calls) on all 2**32 float32 inputs: nans as nans,
    infinities, subnormal results, and the two inputs where an unfused z - kd would round
    the other way. Probed through ctypes too, so the reference is the library, not numba."""
    import ctypes
    import ctypes.util
    import math
    from numba import njit, prange
    from quant.intrin import bits_f32, f32_bits
    from runner.backends.kernels import libm_expf

    @njit(parallel=True)
    def mismatches(chunks):
        bad = np.zeros(chunks, np.int64)
        n = (1 << 32) // chunks
        for c in prange(chunks):
            for i in range(c * n, (c + 1) * n):
                x = bits_f32(np.int32(i - (1 << 32) if i >= 1 << 31 else i))
                a, e = libm_expf(x), np.float32(math.exp(x))
                if f32_bits(a) != f32_bits(e) and not (a != a and e != e):
                    bad[c] += 1
        return bad.sum()
    assert mismatches(64) == 0
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.expf.restype, libm.expf.argtypes = ctypes.c_float, [ctypes.c_float]
    one = njit(lambda x: libm_expf(x))
    for h in ("0x1.04845ep+5", "-0x1.f8cbb2p+5", "-0x1.9fe368p6", "-0x1.9d1d9ep6", "0x1.62e42ep6", "-0x1p-30", "-0x1.5p4"):
        x = np.float32(float.fromhex(h))
        assert np.float32(one(x)).view(np.uint32) == np.float32(libm.expf(x)).view(np.uint32), h
    assert one(np.float32(-np.inf)) == 0 and one(np.float32(np.inf)) == np.inf and np.isnan(one(np.float32(np.nan)))


def test_rope_store_is_rope_then_f16_rounding_into_the_slots():
    """The fused kernel equals its numpy steps bit for bit: RoPE, q scaled and rounded to f16,
    k and v rounded to f16 at their slots (k stored dim-major), other slots untouched; f16
    rounding at the edges of the range (signs, -0, subnormals, 65504, overflow to inf) as
    numpy's; the cache holds float16 bits. With flash attention q is scaled, not rounded."""
    from runner.backends.kernels import rope, rope_store
    rng = np.random.default_rng(1)
    n, n_head, n_kv, d = 5, 4, 2, 8
    edges = np.array([0.0, -0.0, 1e-8, -3e-6, 6.1e-5, 65504, 65519, 65520, -7e4, 1e30], np.float32)
    q = (rng.standard_normal((n, n_head, d)) * 10.0 ** rng.integers(-7, 5, (n, n_head, d))).astype(np.float32)
    k = (rng.standard_normal((n, n_kv, d)) * 10.0 ** rng.integers(-7, 5, (n, n_kv, d))).astype(np.float32)
    v = rng.standard_normal((n, n_kv, d)).astype(np.float32)
    v.reshape(-1)[:len(edges)] = edges
    pos, slots = np.arange(20, 20 + n), np.array([61, 62, 63, 64, 65])      # across a page boundary
    args = (np.float32(10000 ** -0.25), np.float32(1), np.ones(d // 2, np.float32), True)
    kc, vc = np.full((2, n_kv, d, 80), 3, np.uint16), np.full((2, n_kv, 64, d), 3, np.uint16)   # float16 bits
    q2, k2, q3 = q.copy(), k.copy(), q.copy()
    rope_store(q, k, v, pos, *args, slots, kc, vc, np.float32(0.0625), True, True)
    rope_store(q3, k.copy(), v, pos, *args, slots, kc.copy(), vc.copy(), np.float32(0.0625), False, True)
    rope(q2, pos, *args)
    rope(k2, pos, *args)
    np.testing.assert_array_equal(q3.view(np.int32), (q2 * np.float32(0.0625)).view(np.int32))   # flash: q scaled, not rounded
    with np.errstate(over="ignore"):    # the overflow to inf is what is tested
        q2 = (q2 * np.float32(0.0625)).astype(np.float16).astype(np.float32)
        k2, v2 = k2.astype(np.float16).view(np.uint16), v.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(q.view(np.int32), q2.view(np.int32))     # q scaled, then rounded
    pg, off = slots // 64, slots % 64       # slot s: row s % 64 of page s // 64
    np.testing.assert_array_equal(kc[pg, :, :, off], k2)
    np.testing.assert_array_equal(vc[pg, :, off], v2)
    written = np.zeros((2, 64), bool)
    written[pg, off] = True
    assert (kc.transpose(0, 3, 1, 2)[:, :64][~written] == 3).all() and (vc.transpose(0, 2, 1, 3)[~written] == 3).all()
    assert (kc[..., 64:] == 3).all()        # the pad is never written
    f = vc[0, :, 61].view(np.float16)
    assert np.isinf(f[0, 7]) and np.isinf(f[1, 0]) and f[0, 5] == 65504   # 65520 and -7e4 overflow


# ---------------------------------------------------------------- generate

def test_generate_streams_decoded_text_and_stops_on_length(tiny):
    m = tiny
    evs = list(generate(m, IDS[:5], Sampler(SamplerConfig(temp=0)), m.make_cache(64), max_tokens=12))
    done = evs[-1]
    assert isinstance(done, Done) and done.finish_reason in ("length", "stop")
    text = "".join(e.text for e in evs if isinstance(e, Token))
    assert text == done.text
    if done.finish_reason == "length":
        assert len(done.tokens) == 12
        assert text == m.tokenizer.decode(done.tokens)


def test_stop_string_cuts_the_text(tiny):
    m = tiny
    free = list(generate(m, IDS[:5], Sampler(SamplerConfig(temp=0)), m.make_cache(64), max_tokens=20))[-1]
    assert len(free.text) > 6
    stop = free.text[3:6]
    evs = list(generate(m, IDS[:5], Sampler(SamplerConfig(temp=0)), m.make_cache(64), max_tokens=20, stop=(stop,)))
    done = evs[-1]
    assert done.finish_reason == "stop"
    assert done.text == free.text[:free.text.index(stop)]
    assert "".join(e.text for e in evs if isinstance(e, Token)) == done.text


def test_context_overflow_goes_on_and_says_so_once(tiny):
    # no end-of-generation ids, so the tiny model's greedy text cannot stop early and the
    # test always reaches the overflow (as the speculative tests replace the end ids)
    import dataclasses
    m = dataclasses.replace(tiny, tokenizer=dataclasses.replace(tiny.tokenizer, eog_ids=frozenset()))
    cache = m.make_cache(16, n_keep=1)
    evs = list(generate(m, IDS[:6], Sampler(SamplerConfig(temp=0)), cache, max_tokens=30))
    notices = [e for e in evs if isinstance(e, Notice)]
    done = evs[-1]
    assert done.finish_reason == "length"
    assert len(done.tokens) == 30 and cache.n_past > 16
    assert len(notices) == 1 and "dropped" in notices[0].text


def test_prompt_longer_than_context_is_an_error(tiny):
    with pytest.raises(ContextError, match="context holds 16"):
        list(generate(tiny, IDS, Sampler(SamplerConfig(temp=0)), tiny.make_cache(16)))


# ---------------------------------------------------------------- sampler

def _logits(rng, n=50):
    return rng.standard_normal(n).astype(np.float32) * 3


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    lg = _logits(np.random.default_rng(0))
    assert Sampler(SamplerConfig(temp=0)).sample(Sampler(SamplerConfig(temp=0)).dist(lg)) == lg.argmax()
    s = Sampler(SamplerConfig(temp=1.0, top_k=1, seed=3))
    assert all(s.sample(s.dist(lg)) == lg.argmax() for _ in range(20))


def test_next_is_a_draw_from_dist():
    """next() skips building the distribution at temperature 0: the same token as sampling
    dist(), penalties included (the history's argmax is pushed down)."""
    rng = np.random.default_rng(4)
    for cfg in (SamplerConfig(temp=0), SamplerConfig(temp=0, repeat_penalty=1.5, presence_penalty=2.0)):
        for _ in range(20):
            lg = _logits(rng)
            hist = [int(lg.argmax()), 3, 3]
            s = Sampler(cfg)
            assert s.next(lg, hist) == s.sample(s.dist(lg, hist))
    s = Sampler(SamplerConfig(temp=0, presence_penalty=100.0))
    assert s.next(lg, [int(lg.argmax())]) != lg.argmax()
    a, b = Sampler(SamplerConfig(temp=0.9, seed=5)), Sampler(SamplerConfig(temp=0.9, seed=5))
    assert [a.next(lg) for _ in range(10)] == [b.sample(b.dist(lg)) for _ in range(10)]


def test_plain_temperature_is_softmax():
    lg = _logits(np.random.default_rng(1))
    p = Sampler(SamplerConfig(temp=0.7, top_k=0, top_p=1.0, min_p=0.0)).dist(lg)
    ref = np.exp(lg / 0.7 - (lg / 0.7).max())
    np.testing.assert_allclose(p, ref / ref.sum(), rtol=1e-5)   # float32 logits vs float64


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    lg = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    p = Sampler(SamplerConfig(temp=1.0, top_k=0, top_p=0.8, min_p=0.0)).dist(lg)
    np.testing.assert_allclose(p, [0.5 / 0.8, 0.3 / 0.8, 0, 0], rtol=1e-6)


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    lg = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    p = Sampler(SamplerConfig(temp=1.0, top_k=0, top_p=1.0, min_p=0.2)).dist(lg)
    np.testing.assert_allclose(p, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], rtol=1e-6)


def test_penalties_follow_llama_cpp():
    lg = np.array([2.0, -2.0, 1.0, 0.5], np.float32)
    out = apply_penalties(lg, [0, 1, 1], SamplerConfig(repeat_penalty=2.0, frequency_penalty=0.1, presence_penalty=0.3))
    np.testing.assert_allclose(out, [2.0 / 2 - 0.1 - 0.3, -2.0 * 2 - 0.2 - 0.3, 1.0, 0.5], rtol=1e-6)


def test_seed_makes_sampling_reproducible():
    lg = _logits(np.random.default_rng(2))
    draw = lambda: [s.sample(s.dist(lg)) for s in [Sampler(SamplerConfig(temp=1.5, seed=7))] for _ in range(30)]
    assert draw() == draw()


def test_sampling_frequencies_follow_the_distribution():
    lg = np.log(np.array([0.6, 0.3, 0.1], np.float32))
    s = Sampler(SamplerConfig(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11))
    counts = np.bincount([s.sample(s.dist(lg)) for _ in range(6000)], minlength=3) / 6000
    np.testing.assert_allclose(counts, [0.6, 0.3, 0.1], atol=0.02)


@pytest.mark.parametrize("bad", [dict(temp=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=2), dict(top_k=-1)])
def test_bad_sampler_values_are_refused(bad):
    with pytest.raises(ValueError):
        Sampler(SamplerConfig(**bad))
