"""Kernel paths the default run skips on an AVX512-VNNI host, against llama.cpp's logits on
the tiny models (tests/test_tiny_models.py's fixtures and tolerances):
- NUMBAT_REPACK=0: the file-layout kernels (matvec per row for decode, gemm8 for batches);
- the tile + BLAS prefill (dequantize a tile, numpy matmul), which on a VNNI host only the
  types gemm8 lacks reach: forced here for the common types by a kernel-table row without
  gemm8 (quant.cpu), as a CPU kind without AVX-512 has.
They sum in their own orders, not llama.cpp's, so they are held to the rounding-noise
tolerances, as on CPUs without AVX-512."""
import dataclasses

import numpy as np
import pytest

import quant
from test_tiny_models import FIXTURES, build, check, cases

CASES = [(a, t) for a, t, fa in cases() if t in ("Q8_0", "Q4_0", "F16") and not fa]


@pytest.fixture(scope="module")
def fixture_data():
    out = {}
    for arch in {a for a, _ in CASES}:
        with np.load(FIXTURES / f"model_tiny_{arch}.npz") as z:
            out[arch] = {k: z[k] for k in z.files}
    return out


@pytest.mark.parametrize("path", ["file layout", "tile+BLAS"])
@pytest.mark.parametrize("arch,wtype", CASES)
def test_unpacked_paths_match_llama_cpp(tmp_path, monkeypatch, fixture_data, arch, wtype, path):
    monkeypatch.setenv("NUMBAT_REPACK", "0")
    if path == "tile+BLAS":
        monkeypatch.setattr(quant.cpu, "KIND", dataclasses.replace(quant.cpu.KIND, gemm8=frozenset()))
    fx = fixture_data[arch]
    m = build(tmp_path, fx, wtype, False)     # the fixtures with flash attention off
    layer = m.backend.layers[0]
    assert not isinstance(layer.wq.raw, quant.packed.Packed) and layer.qkv is None   # the file's layout
    ours = m.backend.forward(fx["ids"].tolist(), m.backend.make_cache(64), logits="all")
    check(ours, fx[wtype], f"{arch} {wtype} batch, {path}")
    cache = m.backend.make_cache(64)
    ours = np.concatenate([m.backend.forward([t], cache, logits="last").copy() for t in fx["ids"].tolist()])
    check(ours, fx[wtype], f"{arch} {wtype} token-by-token, {path}")


def test_gelu_mul_is_the_f16_table_lookup():
    """gemma's GELU kernel against the lookup written in numpy: the gate rounded to f16 and
    looked up in the table, 0 at or below -10, the gate itself at or above 10; every f16
    value, both neighbours of each in float32, the edges, and strided column views."""
    from runner.backends import kernels as K
    rng = np.random.default_rng(0)
    every = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    edges = np.array([-10, 10, -9.999999, 9.999999, -0.0, 0.0, np.inf, -np.inf, 65520, 1e-8, -6.1e-5], np.float32)
    g = np.concatenate([every, edges, (rng.standard_normal(50000) * 4).astype(np.float32)])
    with np.errstate(all="ignore"):
        g = np.concatenate([g, np.nextafter(g, np.float32(np.inf)), np.nextafter(g, np.float32(-np.inf))])
        gu = np.stack([g, rng.standard_normal(g.size).astype(np.float32)], axis=1).reshape(1, -1)
        gate, up = gu[:, 0::2], gu[:, 1::2]         # strided views, as the fused gate/up halves
        v = K._gelu_table()[gate.astype(np.float16).view(np.uint16)]
        want = np.where(gate <= -10, np.float32(0), np.where(gate >= 10, gate, v)) * up
        got = np.empty_like(want)
        K.gelu_tanh_mul(gate, up, got)
    nan = np.isnan(want)
    assert np.array_equal(nan, np.isnan(got))
    assert np.array_equal(want[~nan].view(np.uint32), got[~nan].view(np.uint32))


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("rows,n", [(1, 1), (1, 7), (1, 4864), (1, 8961), (3, 7), (5, 4864)])
def test_silu_of_rows_split_across_threads_is_the_serial_one(threads, rows, n):
    """SiLU of a fused [gate | up] output goes in column ranges, nth a row (decode's one row
    across the threads): to the bit the serial silu_mul of the halves, whatever the thread and
    row counts (ranges of 0 values included), and every value written (the output starts as
    NaN)."""
    from runner.backends import kernels as K
    rng = np.random.default_rng(n + rows)
    gu = (rng.standard_normal((rows, 2 * n)) * 6).astype(np.float32)
    want = np.empty((rows, n), np.float32)
    K.silu_mul(gu[:, :n].copy(), gu[:, n:].copy(), want)
    got = np.full((rows, n), np.nan, np.float32)
    K.silu_mul_halves(gu, got, threads)
    assert np.array_equal(want.view(np.uint32), got.view(np.uint32))
