"""Quantized KV caches (-ctk/-ctv q8_0 | q4_0): the stored blocks against gguf.quants, the
forward on tiny models past a sliding window, rollback and context overflow, and perplexity
on the real models against llama.cpp's with the same cache types (flash attention on, its
Hadamard rotation), tests/fixtures/kv_types.json from tests/oracle/gen_model_fixtures.py."""
import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from gguf_io.testing import write_tiny_model
from runner.backends import kernels as K
from runner.kv_cache import _kv_arrays
from runner.model import load
from runner.perplexity import perplexity

FIXTURES = Path(__file__).parent / "fixtures"
CODE = {"f16": K.KV_F16, "q8_0": K.KV_Q8_0, "q4_0": K.KV_Q4_0}


def _stored(x: np.ndarray, t: str) -> np.ndarray:
    """Rows x (n, 1, d) through store_kv into a one-page cache; the bytes of each row."""
    n, _, d = x.shape
    kc, vc = _kv_arrays(1, d, 1, (t, t))
    K.store_kv(x, x, np.arange(n), kc, vc, CODE[t], CODE[t])
    assert (kc == vc).all()
    return kc[0, 0, :n]


@pytest.mark.parametrize("t,qt", [("q8_0", T.Q8_0), ("q4_0", T.Q4_0)])
def test_blocks_round_trip_through_gguf_quants(t, qt):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 1, 128)) * rng.uniform(0.01, 30, (64, 1, 1))).astype(np.float32)
    x[0, 0, :32] = 0                       # an all-zero block: d = 0
    raw = _stored(x, t)
    back = dequantize(raw, qt).reshape(x.shape)
    # gguf.quants reads our bytes as the blocks they are: our values, within the format's step
    step = np.abs(x).reshape(64, 4, 32).max(axis=2, keepdims=True) / (127 if t == "q8_0" else 7)
    assert (np.abs(back - x).reshape(64, 4, 32) <= step * 1.01).all()
    ref = quantize(x.reshape(64, 128), qt)
    if t == "q4_0":
        np.testing.assert_array_equal(raw, ref)   # ggml's CPU q4_0 quantizer is the reference one
    else:
        # ggml's CPU q8_0 quantizer (what llama.cpp's set_rows runs) multiplies by 127/amax and
        # rounds halves to even; the reference divides by amax/127 and rounds them away from 0
        same = (raw == ref).all(axis=1)
        assert same.mean() > 0.9 and not same.all() or same.all()
        tie = np.zeros((1, 1, 32), np.float32)
        tie[0, 0, :4] = [127, 0.5, 2.5, -1.5]
        q = _stored(tie, "q8_0")[0, 2:6].view(np.int8)
        np.testing.assert_array_equal(q, [127, 0, 2, -2])
        assert quantize(tie.reshape(1, 32), T.Q8_0)[0, 2:6].view(np.int8).tolist() == [127, 1, 3, -2]


def _tiny(tmp_path, types, arch="gemma3"):
    kw = dict(arch="gemma3", seed=14, n_layer=6, head_dim=32, sliding_window=8, tied_output=True) if arch == "gemma3" \
        else dict(arch="qwen3", seed=13, head_dim=32)
    path = write_tiny_model(tmp_path / f"{arch}.gguf", weight_type=T.F32, **kw)
    return load(str(path), cache_types=types)


IDS = [1] + np.random.default_rng(5).integers(3, 384, 39).tolist()


@pytest.mark.parametrize("t", ["q8_0", "q4_0"])
def test_quantized_cache_past_the_sliding_window(tmp_path, t):
    """gemma3's sliding layers (window 8) over 40 tokens, in prefill chunks of 5 that wrap
    their ring and token by token: each close to the f16 cache (the quantization's noise),
    and the quantized cache's own two runs within f16-accumulation noise of each other."""
    f16 = _tiny(tmp_path, ("f16", "f16"))
    m = _tiny(tmp_path, (t, t))
    ref = f16.backend.forward(IDS, f16.make_cache(64), logits="all")
    m.backend.chunk = 5         # sliding layers then hold 8 + 5 slots: the ring wraps
    assert min(lc.cap for lc in m.make_cache(64).layers) < len(IDS)
    chunked = m.backend.forward(IDS, m.make_cache(64), logits="all")
    cache = m.make_cache(64)
    steps = np.concatenate([m.backend.forward([i], cache).copy() for i in IDS])
    scale = np.abs(ref).max()
    err = np.abs(chunked - ref).max() / scale
    assert err < (0.05 if t == "q8_0" else 0.3), err
    assert np.abs(chunked - steps).max() / scale < 3e-3
    assert err > 1e-6     # the cache really is quantized


def test_quantized_cache_rollback_and_overflow(tmp_path):
    m = _tiny(tmp_path, ("q8_0", "q4_0"), arch="qwen3")
    cache = m.make_cache(64)
    m.backend.forward(IDS[:10], cache)
    a = m.backend.forward(IDS[10:14], cache, logits="all").copy()
    cache.rollback(4)
    m.backend.forward([5, 6, 7], cache)       # a rejected draft
    cache.rollback(3)
    b = m.backend.forward(IDS[10:14], cache, logits="all")
    np.testing.assert_array_equal(a, b)       # the same blocks rewritten, the same bits
    # past the context: n_keep slots stay, the oldest others are overwritten
    small, big = m.make_cache(16, n_keep=2), m.make_cache(64)
    out_s = [m.backend.forward([i], small).copy() for i in IDS[:24]]
    out_b = [m.backend.forward([i], big).copy() for i in IDS[:24]]
    assert small.dropped and not big.dropped
    np.testing.assert_array_equal(out_s[:16], out_b[:16])    # identical until the ring wraps
    assert not np.array_equal(out_s[-1], out_b[-1]) and np.isfinite(out_s[-1]).all()


KV = json.loads((FIXTURES / "kv_types.json").read_text(encoding="utf-8")) if (FIXTURES / "kv_types.json").exists() else {}
MODEL_FIXTURE = {"qwen2.5-coder:0.5b": "model_qwen2.5-coder-0.5b.json", "gemma3:270m": "model_gemma3-270m.json"}


# (model, cache type, context): llama.cpp's perplexity with -ctk t -ctv t -c ctx (flash
# attention on) on the fixture text, by llama-cpp-python (tests/oracle/gen_model_fixtures.py).
# Bit-exact except gemma3 past 1024 tokens: llama-cpp-python's contexts default to a full-size
# sliding-window cache (swa_full), whose cells stay in position order, while llama.cpp's tools
# keep window + ubatch cells reused in turn, as numbat's ring does (test below); online softmax
# goes in cell order. Measured 13.0585 against 13.0241 (+0.26%), top-1 94.6%.
CASES = [("qwen2.5-coder:0.5b", "q8_0", 512), ("qwen2.5-coder:0.5b", "q4_0", 512), ("gemma3:270m", "q8_0", 512),
         ("qwen2.5-coder:0.5b", "q8_0", 4096), ("qwen2.5-coder:0.5b", "q4_0", 4096), ("gemma3:270m", "q8_0", 4096)]


@pytest.mark.real
@pytest.mark.parametrize("name,t,ctx", CASES)
def test_perplexity_with_quantized_cache_equals_llama_cpp(name, t, ctx):
    """The same digits as llama.cpp's perplexity with -ctk/-ctv t, and every top-1 (gemma3 at
    4096: within 0.5%, top-1 >= 90%)."""
    ref = KV[name][t][str(ctx)]
    ids = json.loads((FIXTURES / MODEL_FIXTURE[name]).read_text(encoding="utf-8"))["text_ids"]
    m = load(name, threads=2, cache_types=(t, t))
    r = perplexity(m, ids, n_ctx=ctx)
    top1 = (np.asarray(r.top1) == np.asarray(ref["top1"])).mean()
    print(f"{name} -ctk/-ctv {t} -c {ctx}: PPL {r.ppl:.4f} vs llama.cpp {ref['ppl']:.4f}, top-1 {top1:.1%}")
    assert r.n_scored == ref["n_scored"]
    if name == "gemma3:270m" and ctx > 1024:
        assert abs(r.ppl / ref["ppl"] - 1) <= 0.005 and top1 >= 0.9
    else:
        assert f"{r.ppl:.4f}" == f"{ref['ppl']:.4f}"
        assert top1 == 1.0


# llama.cpp's own tool, whose gemma3 sliding layers are a ring like numbat's (swa_full off):
# llama-perplexity -m gemma-3-270m-q4_k_m.gguf -f tests/fixtures/ppl_text.txt -c 2048 -t 2
# -fa on -ctk T -ctv T (llama-cpp-python 0.3.36's sdist, 2 chunks: each wraps the ring)
TOOL_2048 = {"f16": "16.4391", "q8_0": "16.3549"}


@pytest.mark.real
@pytest.mark.parametrize("t", TOOL_2048)
def test_gemma3_past_its_ring_equals_llama_perplexity(t):
    ids = json.loads((FIXTURES / MODEL_FIXTURE["gemma3:270m"]).read_text(encoding="utf-8"))["text_ids"]
    m = load("gemma3:270m", threads=2, cache_types=(t, t), flash=True)
    assert min(lc.cap for lc in m.backend.make_cache(2048).layers) < 2048      # the sliding layers' ring wraps
    r = perplexity(m, ids, n_ctx=2048)
    print(f"gemma3 -ctk/-ctv {t} -c 2048: PPL {r.ppl:.4f} vs llama-perplexity {TOOL_2048[t]}")
    assert f"{r.ppl:.4f}" == TOOL_2048[t]


# llama.cpp's own tool with flash attention off and a quantized K (its mul_mat + soft_max path;
# V stays f16, which llama.cpp requires there): llama-perplexity -m FILE -f
# tests/fixtures/ppl_text.txt -c 512 -b 512 -t 2 -fa off -ctk T -ctv f16 (llama-cpp-python
# 0.3.36's sdist). -b 512: one sequence per batch, as numbat and llama-cpp-python run; with its
# default -b 2048 four sequences share one cache and -fa off's last digits move there (f16 too:
# 5.9872 against 5.9853 at -b 512, which the fixtures and numbat give).
TOOL_FA_OFF = {("qwen2.5-coder:0.5b", "q8_0"): "6.2079", ("qwen2.5-coder:0.5b", "q4_0"): "36.6590",
               ("gemma3:270m", "q8_0"): "14.8995"}


@pytest.mark.real
@pytest.mark.parametrize("name,t", TOOL_FA_OFF)
def test_fa_off_with_quantized_k_equals_llama_perplexity(name, t):
    ids = json.loads((FIXTURES / MODEL_FIXTURE[name]).read_text(encoding="utf-8"))["text_ids"]
    m = load(name, threads=2, cache_types=(t, "f16"), flash=False)
    r = perplexity(m, ids, n_ctx=512)
    print(f"{name} -fa off -ctk {t}: PPL {r.ppl:.4f} vs llama-perplexity {TOOL_FA_OFF[name, t]}")
    assert f"{r.ppl:.4f}" == TOOL_FA_OFF[name, t]


@pytest.mark.parametrize("t", ["q8_0", "q4_0"])
def test_fa_off_quantized_k_on_a_tiny_model(tmp_path, t):
    """-fa off with a quantized K, in prefill chunks and token by token, against the same
    model with flash attention on and the same K: both within the quantization's noise of
    the f16 cache, and apart from each other (the two paths' softmax steps differ)."""
    f16 = _tiny(tmp_path, ("f16", "f16"), arch="qwen3")
    ref = f16.backend.forward(IDS, f16.make_cache(64), logits="all")
    path = tmp_path / "qwen3.gguf"
    off, on = load(str(path), cache_types=(t, "f16"), flash=False), load(str(path), cache_types=(t, "f16"), flash=True)
    a = off.backend.forward(IDS, off.make_cache(64), logits="all")
    cache = off.make_cache(64)
    steps = np.concatenate([off.backend.forward([i], cache).copy() for i in IDS])
    b = on.backend.forward(IDS, on.make_cache(64), logits="all")
    scale = np.abs(ref).max()
    tol = 0.02 if t == "q8_0" else 0.2
    for x in (a, steps, b):
        assert np.abs(x - ref).max() <= tol * scale
    assert np.abs(a - steps).max() <= 1e-3 * scale
    assert not np.array_equal(a, b)


def test_cli_cache_type_flags(tmp_path):
    from test_cli import assert_one_line_error, run
    path = write_tiny_model(tmp_path / "q3.gguf", arch="qwen3", seed=13, head_dim=32, weight_type=T.F32)
    r = run("prompt", path, "hi", "--raw", "-n", "2", "-ctk", "q4_0", "-ctv", "q4_0")
    assert r.returncode == 0, r.stderr
    assert "warning: a q4_0 KV cache was not measured" in r.stderr    # once, one line
    assert r.stderr.count("warning") == 1
    r = run("prompt", path, "hi", "--raw", "-n", "2", "-ctv", "q8_0", "-fa", "off")
    assert r.returncode == 1
    assert_one_line_error(r.stderr, "flash attention")
    r = run("prompt", path, "hi", "--raw", "-n", "2", "-ctk", "q8_0", "-fa", "off")    # llama.cpp allows a quantized K
    assert r.returncode == 0, r.stderr
    r = run("prompt", path, "hi", "--raw", "-n", "2", "-ctk", "q5_1")
    assert r.returncode == 1
    assert_one_line_error(r.stderr, "-ctk/--cache-type-k", "q5_1")
    r = run("prompt", path, "hi", "--raw", "-n", "2", "-fa", "maybe")
    assert r.returncode == 1
    assert_one_line_error(r.stderr, "-fa/--flash-attn")


def test_kv_cost_warning_figures():
    from runner.kv_cache import kv_cost_warning
    assert kv_cost_warning("qwen2.5-coder:1.5b", ("q8_0", "q8_0")) is None        # 0.1%: no warning
    w = kv_cost_warning("qwen2.5-coder:0.5b", ("q8_0", "q8_0"))
    assert w and "3.4%" in w
    assert "715.7x" in kv_cost_warning("qwen2.5-coder:1.5b", ("q8_0", "q4_0"))   # the worse of the two types
    assert kv_cost_warning("qwen2.5-coder:0.5b", ("f16", "f16")) is None
