"""The kernel table (quant.cpu): which row a CPU gets, and that the runner follows the row."""
import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import quant
from quant import cpu

AMD = {"avx512f": True, "avx512bw": True, "avx512vnni": True, "avx2": True}      # Zen 4
XEON = {**AMD, "amx-int8": True, "amx-tile": True, "amx-bf16": True}              # Sapphire Rapids
AVX2 = {"avx2": True, "fma": True, "avx512f": False}


def test_each_cpu_gets_its_row():
    assert cpu.pick(XEON).name == "avx512-amx"
    assert cpu.pick(AMD).name == "avx512-vnni"
    assert cpu.pick(AMD, "znver5").name == "avx512-vnni"
    assert cpu.pick(AMD, "znver4").name == "avx512-vnni-zen4"
    assert cpu.pick(XEON, "znver4").name == "avx512-amx"
    assert cpu.pick(AVX2).name == "portable"
    assert cpu.pick({}).name == "portable"
    assert not cpu.pick(AVX2).repack and not cpu.pick(AVX2).gemm8 and not cpu.pick(AVX2).vnni


def test_kernel_by_type_and_batch(monkeypatch):
    monkeypatch.setattr(cpu, "KIND", cpu.pick(AMD))
    assert cpu.repacked(T.Q4_K, 896) and not cpu.repacked(T.Q4_K, 40) and not cpu.repacked(T.Q5_K, 896)
    assert cpu.linear(T.Q4_K, True, 1, True, True) == "packed"
    assert cpu.linear(T.Q5_K, False, 1, True, False) == "matvec"
    assert cpu.linear(T.Q6_K, False, 16, True, True) == "rows"
    assert cpu.linear(T.Q6_K, False, 17, False, True) == "rows"      # one token's steps each
    assert cpu.linear(T.Q5_K, False, 17, True, False) == "gemm8"
    assert cpu.linear(T.F16, False, 17, True, False) == "tile"
    monkeypatch.setattr(cpu, "KIND", cpu.pick(AVX2))
    assert not cpu.repacked(T.Q4_K, 896)
    assert cpu.linear(T.Q5_K, False, 17, True, False) == "tile"
    monkeypatch.setenv("NUMBAT_REPACK", "0")
    monkeypatch.setattr(cpu, "KIND", cpu.pick(AMD))
    assert not cpu.repacked(T.Q4_K, 896)


def _q8_layer(monkeypatch):
    """A Q8_0 weight (32 x 256) as the runner holds it in the file's layout, 20 tokens, the exact
    product, and a list that records gemm8's calls."""
    from runner.backends.numba_cpu import Linear
    rng = np.random.default_rng(0)
    raw = quant.quantize(rng.standard_normal((32, 256)).astype(np.float32), T.Q8_0)
    X = rng.standard_normal((20, 256)).astype(np.float32)
    calls, real = [], quant.gemm8.matmul
    monkeypatch.setattr(quant.gemm8, "matmul", lambda *a, **k: (calls.append(1), real(*a, **k)))
    return Linear(T.Q8_0, raw, 256, 32), X, X @ quant.dequantize(T.Q8_0, raw, 256).T, calls


def _run(lin, X, ref):
    Y = np.zeros((X.shape[0], lin.n_out), np.float32)
    lin(X, Y)
    np.testing.assert_allclose(Y, ref, rtol=0, atol=2e-2 * np.abs(ref).max())


def test_runner_follows_a_row_without_gemm8(monkeypatch):
    """A row without gemm8 (a CPU kind without AVX-512) sends a prompt to the tile kernel."""
    lin, X, ref, calls = _q8_layer(monkeypatch)
    monkeypatch.setattr(cpu, "KIND", dataclasses.replace(cpu.KIND, gemm8=frozenset()))
    _run(lin, X, ref)
    assert calls == []


@pytest.mark.skipif(not cpu.KIND.vnni, reason="gemm8 needs AVX512-VNNI")
def test_runner_follows_a_row_with_gemm8(monkeypatch):
    lin, X, ref, calls = _q8_layer(monkeypatch)
    _run(lin, X, ref)
    assert calls == [1]


def test_a_cpu_without_avx512_imports_and_gets_the_portable_row():
    """On a CPU with none of the row's features (simulated: LLVM reports none), the kernels
    import, nothing is repacked and prompts take the tile kernel."""
    import subprocess
    import sys
    code = ("import llvmlite.binding as l\n"
            "real = l.get_host_cpu_features()\n"
            "class NoFeatures(dict):    # numba still builds its target string from the real ones\n"
            "    flatten = lambda self: real.flatten()\n"
            "l.get_host_cpu_features = NoFeatures\n"
            "import quant, quant.packed, quant.cpu as c\n"
            "from gguf import GGMLQuantizationType as T\n"
            "assert c.KIND.name == 'portable' and not quant.packed.enabled(), c.KIND\n"
            "assert c.linear(T.Q4_0, False, 64, True, False) == 'tile'\n"
            "assert quant.qtype(T.Q4_K).matvec_rows is None\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_packed_kernels_are_cached_by_the_cpu_row():
    """numba keys a cached kernel on its code and closure only: the row's plan must be in the
    group kernel's closure, or an edited row (another prefetch distance) would load the
    kernels compiled for the old one."""
    from numba.core.caching import FunctionCache
    from quant import packed
    if not packed.enabled():
        pytest.skip("no repacking on this CPU")
    row = cpu.KIND
    assert packed.PLAN == packed.plan(row)
    assert packed.plan(dataclasses.replace(row, prefetch={**row.prefetch, 1: (4096, 1)})) != packed.PLAN
    fn = packed._kernel(packed.Q4_K)
    cells = [c for c in fn._pyfunc.__closure__ if c.cell_contents == packed.PLAN]
    assert cells
    key = lambda: FunctionCache(fn._pyfunc)._index_key(fn._sig.args, fn._library.codegen)
    before = key()
    cells[0].cell_contents = packed.PLAN + 1        # as if compiled for another row
    try:
        assert key() != before
    finally:
        cells[0].cell_contents = packed.PLAN
