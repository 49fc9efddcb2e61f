"""The whole forward on tiny random-weight models against llama.cpp's logits.

tests/oracle/gen_model_fixtures.py wrote each model with write_tiny_model and stored the
writer's arguments, the id sequence and llama.cpp's logits at every position (one batch,
default f16 KV cache) per weight type; here the same files are rebuilt and run by numbat.
"""
import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from gguf_io.testing import write_tiny_model
from runner.backends.numba_cpu import NumbaCPU
from runner.model import load

FIXTURES = Path(__file__).parent / "fixtures"
ARCHS = ["llama", "qwen2", "qwen3", "gemma3"]

# Errors are max |ours - llama.cpp| at a position, relative to the largest |logit| of the
# sequence. numbat rounds what llama.cpp rounds (Q, K, V and softmax weights to f16,
# activations to Q8_0 blocks before quantized matmuls, to f16 before F16 ones), so what
# is left is float32 summation order, ~1e-7. But at some position that noise eventually
# pushes a value across a rounding boundary (measured: one f16 flip of K or V in layer 0
# of llama-Q8_0 at position 6), and in a 64-wide model one such step moves everything
# after it (later positions see it through the cache) by the activation rounding noise
# itself: ~1e-3 relative where only f16 rounding happens, ~1e-2 where activations are
# rounded to 8 bits (measured up to 1.3e-2). So two checks:
# - the first position sees only its own V, which nothing amplifies: it must match to
#   float rounding whatever the weight type. Not rounding activations as llama.cpp does
#   shows here as 1e-2, an exact-tanh GELU instead of ggml's f16 table as 1e-4..1e-2.
POS0_TOL = 1e-5
# - every position within the rounding-noise level of its type, with margin. Structural
#   errors are far above: measured 0.24 (qwen3 without q_norm) to 0.9 (wrong rope pairing)
#   and 0.5 (gemma3 without its sliding window).
TOL = {"F32": 1e-3, "F16": 3e-3, "Q8_0": 5e-2, "Q4_0": 5e-2}


# fixtures with flash attention off (model_tiny_<arch>.npz) and on (..._fa.npz)
FA = {False: "", True: "_fa"}


def cases():
    out = []
    for arch in ARCHS:
        for fa, suffix in FA.items():
            with np.load(FIXTURES / f"model_tiny_{arch}{suffix}.npz") as z:
                out += [(arch, t, fa) for t in z.files if t not in ("ids", "kwargs")]
    return out


@pytest.fixture(scope="module")
def fixtures():
    data = {}
    for arch in ARCHS:
        for fa, suffix in FA.items():
            with np.load(FIXTURES / f"model_tiny_{arch}{suffix}.npz") as z:
                data[arch, fa] = {k: z[k] for k in z.files}
    return data


def build(tmp_path, fx, wtype, flash):
    kw = json.loads(str(fx["kwargs"]))
    path = write_tiny_model(tmp_path / f"{kw['arch']}-{wtype}.gguf", weight_type=GGMLQuantizationType[wtype], **kw)
    return load(str(path), flash=flash)


def check(ours: np.ndarray, ref: np.ndarray, label: str) -> None:
    assert ours.shape == ref.shape
    err = np.abs(ours - ref).max(axis=1) / np.abs(ref).max()
    wtype = label.split()[1]
    assert err[0] <= POS0_TOL, f"{label}: first-position relative logit error {err[0]:.2e}"
    assert err.max() <= TOL[wtype], f"{label}: max relative logit error {err.max():.2e} at position {err.argmax()}"


@pytest.mark.parametrize("arch,wtype,fa", cases())
def test_batch_logits_match_llama_cpp(tmp_path, fixtures, arch, wtype, fa):
    fx = fixtures[arch, fa]
    m = build(tmp_path, fx, wtype, fa)
    ours = m.backend.forward(fx["ids"].tolist(), m.backend.make_cache(64), logits="all")
    check(ours, fx[wtype], f"{arch} {wtype} batch")


@pytest.mark.parametrize("arch,wtype,fa", cases())
def test_token_by_token_logits_match_llama_cpp(tmp_path, fixtures, arch, wtype, fa):
    fx = fixtures[arch, fa]
    m = build(tmp_path, fx, wtype, fa)
    cache = m.backend.make_cache(64)
    ours = np.concatenate([m.backend.forward([t], cache, logits="last").copy() for t in fx["ids"].tolist()])
    assert cache.n_past == len(fx["ids"])
    check(ours, fx[wtype], f"{arch} {wtype} token-by-token")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fa", [False, True])
def test_small_chunks_and_wrapping_window_match_llama_cpp(tmp_path, fixtures, arch, fa):
    # prefill chunks of 5 (not a divisor of 24): each chunk attends to keys cached by the
    # previous ones; gemma3's sliding layers then hold 8 + 5 slots, so the ring wraps
    fx = fixtures[arch, fa]
    m = build(tmp_path, fx, "F32", fa)
    backend = NumbaCPU(m.file, m.cfg, chunk=5, flash=fa)
    cache = backend.make_cache(64)
    if arch == "gemma3":
        assert min(lc.cap for lc in cache.layers) < len(fx["ids"])
    ours = backend.forward(fx["ids"].tolist(), cache, logits="all")
    check(ours, fx["F32"], f"{arch} F32 chunk=5 fa={fa}")


def test_fixture_logits_are_informative(fixtures):
    # near-constant logits would let a broken forward pass
    for key, fx in fixtures.items():
        for k, v in fx.items():
            if k not in ("ids", "kwargs"):
                assert v.std(axis=1).min() > 0.5, (key, k)
                assert len(set(v.argmax(1).tolist())) > len(v) // 2, (key, k)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("split_v", [False, True])
def test_compiled_decode_layers_are_the_ops_bit_for_bit(tmp_path, fixtures, arch, split_v):
    """A one-token forward runs each layer as two compiled calls around the attention op
    (NumbaCPU._decode): the bits of graph.run's ops, on every architecture, with Q/K/V as
    one matrix and with V apart from [q | k] (as the real files' layers of two types)."""
    m = build(tmp_path, fixtures[arch, True], "Q8_0", True)
    be = m.backend
    if split_v:
        nq, nk = be.q.shape[1], be.k.shape[1]
        for L in be.layers:
            L.qkv, L.qk = None, L.qkv.first(nq + nk)
    assert be._decode_layers(), "the tiny model's layers do not take the compiled decode"
    caches = {k: be.make_cache(64) for k in (False, True)}
    for t in fixtures[arch, True]["ids"].tolist():
        out = {}
        for k, cache in caches.items():
            be.compiled_step = k
            hidden = be.forward([t], cache, logits="hidden").copy()     # a draft's head reads these
            cache.rollback(1)
            out[k] = be.forward([t], cache).copy(), hidden
        for a, b in zip(out[False], out[True]):
            assert np.array_equal(a, b)
