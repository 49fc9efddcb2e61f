"""`numbat bench -d` (llama-bench's context depth) and `numbat info --ctx` (the KV cache's
bytes per cache type), checked against the caches the backend really allocates."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import cli
from gguf_io import open_gguf
from gguf_io.config import config_from_gguf
from gguf_io.testing import write_tiny_model
from models import catalog
from runner.kv_cache import CACHE_TYPES, KVCache

ROOT = Path(__file__).resolve().parent.parent
QWEN15 = "qwen2.5-coder:1.5b"
GEMMA = "gemma3:270m"


def invoke(*args):
    return CliRunner().invoke(cli.app, [str(a) for a in args], env={"COLUMNS": "160"}, catch_exceptions=False)


def run(*args):
    """The installed program, as a user runs it (errors are cli.main's: one line, exit 1)."""
    env = {**os.environ, "COLUMNS": "160"}
    env["NUMBA_CACHE_DIR"] = os.environ.get("NUMBA_CACHE_DIR", str(catalog.home() / "numba-cache"))
    return subprocess.run([sys.executable, "-m", "cli", *map(str, args)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    # head size 32: the quantized cache types need blocks of 32 along a head; six gemma3
    # layers: five with a sliding window of 8, one global
    return {"llama": write_tiny_model(d / "tiny.gguf", head_dim=32),
            "gemma3": write_tiny_model(d / "tiny-gemma3.gguf", "gemma3", n_layer=6, head_dim=32)}


def kv_info(model, n_ctx) -> dict:
    r = invoke("info", model, "--ctx", n_ctx, "--json")
    assert r.exit_code == 0, r.output
    kv = json.loads(r.stdout)["kv_cache"]
    assert kv["n_ctx"] == n_ctx and set(kv) == {"n_ctx", *CACHE_TYPES}
    return kv


# ------------------------------------------------------------------------------ info --ctx

@pytest.mark.real
def test_info_kv_cache_is_the_allocation_qwen_1_5b():
    n_ctx = 4096
    kv = kv_info(QWEN15, n_ctx)
    cfg = config_from_gguf(open_gguf(catalog.fetch(QWEN15)))
    windows = [0] * cfg.n_layer                    # qwen2: every layer attends to the whole context
    for t in CACHE_TYPES:
        cache = KVCache(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, n_ctx, windows, 512, types=(t, t))
        assert kv[t]["bytes"] == cache.nbytes(), t
        assert kv[t]["bytes_per_token"] == cache.nbytes() / n_ctx
    # the values at llama.cpp's sizes: 28 layers * 2 KV heads * 128 dims * (K and V) * 2 bytes
    assert kv["f16"]["data_bytes"] == 28 * 2 * 128 * 2 * 2 * n_ctx
    assert kv["q8_0"]["data_bytes"] == kv["f16"]["data_bytes"] * 17 // 32
    assert kv["q8_0"]["data_bytes"] * 32 == kv["f16"]["data_bytes"] * 17      # exactly
    assert kv["q4_0"]["data_bytes"] * 32 == kv["f16"]["data_bytes"] * 9
    # quantized rows are unpadded: their allocation is their values
    assert kv["q8_0"]["bytes"] == kv["q8_0"]["data_bytes"] and kv["q4_0"]["bytes"] == kv["q4_0"]["data_bytes"]


def _backend_nbytes(model_path, n_ctx, t):
    from runner.model import load
    m = load(str(model_path), flash=True, cache_types=(t, t))
    return m.backend.make_cache(n_ctx).nbytes()


@pytest.mark.parametrize("n_ctx", [1, 100, 520, 521, 1000, 4096])
def test_info_kv_cache_is_the_allocation_sliding_window(tiny, n_ctx):
    """gemma3's ring layers (window + one chunk) and pages of 64, as the loaded backend makes them."""
    kv = kv_info(tiny["gemma3"], n_ctx)
    for t in CACHE_TYPES:
        assert kv[t]["bytes"] == _backend_nbytes(tiny["gemma3"], n_ctx, t), t


@pytest.mark.real
def test_info_kv_cache_is_the_allocation_gemma3():
    from runner.model import load
    m = load(GEMMA)
    c = m.cfg
    assert 0 in m.backend.windows and any(m.backend.windows)          # both kinds of layer
    for n_ctx in (4096, 32768):
        kv = kv_info(GEMMA, n_ctx)
        for t in CACHE_TYPES:
            cache = KVCache(c.n_layer, c.n_head_kv, c.head_dim, n_ctx, m.backend.windows, m.backend.chunk, types=(t, t))
            assert kv[t]["bytes"] == cache.nbytes(), (n_ctx, t)


def test_info_kv_cache_table_and_absence(tiny):
    r = invoke("info", tiny["llama"], "--ctx", 4096)
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("kv_cache"))
    assert "4096 tokens" in lines[i]
    kv = kv_info(tiny["llama"], 4096)
    for t, ln in zip(CACHE_TYPES, lines[i + 1:i + 4]):
        assert ln.split()[0] == t and f"{kv[t]['bytes'] / 2**20:.2f} MiB" in ln and "KiB/token" in ln
    # without --ctx there is no kv section
    assert "kv_cache" not in json.loads(invoke("info", tiny["llama"], "--json").stdout)
    assert "kv_cache" not in invoke("info", tiny["llama"]).stdout


def test_info_bad_ctx(tiny):
    r = run("info", tiny["llama"], "--ctx", 0)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines() == ["error: -c/--ctx must be at least 1, got 0"]


# ------------------------------------------------------------------------------- bench -d

def bench_rows(*args) -> list[dict]:
    r = invoke("bench", *args, "--json")
    assert r.exit_code == 0, r.output
    return [json.loads(ln) for ln in r.stdout.splitlines()]


def test_bench_depths(tiny):
    # 300 is past the tiny model's training context (256): llama-bench's context is depth +
    # test tokens whatever the model says
    rows = bench_rows(tiny["llama"], "-p", 8, "-n", 2, "-d", "0,40,300", "-r", 1)
    assert [(r["test"], r["n_depth"]) for r in rows] == [
        ("pp8", 0), ("tg2", 0), ("pp8", 40), ("tg2", 40), ("pp8", 300), ("tg2", 300)]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["stddev"] == 0.0
        assert r["flash_attn"] is True and r["type_k"] == r["type_v"] == "f16"
    # no -d: one depth, 0
    assert [r["n_depth"] for r in bench_rows(tiny["llama"], "-p", 4, "-n", 0, "-r", 1)] == [0]


def test_bench_depth_types_and_flash(tiny):
    rows = bench_rows(tiny["llama"], "-p", 4, "-n", 2, "-d", 16, "-r", 2, "-fa", "on", "-ctk", "q8_0", "-ctv", "q4_0")
    assert [(r["test"], r["n_depth"], r["type_k"], r["type_v"], r["flash_attn"]) for r in rows] == [
        ("pp4", 16, "q8_0", "q4_0", True), ("tg2", 16, "q8_0", "q4_0", True)]
    rows = bench_rows(tiny["llama"], "-p", 4, "-n", 0, "-d", 16, "-r", 1, "-fa", "off")
    assert rows[0]["flash_attn"] is False and rows[0]["n_depth"] == 16


def test_bench_depth_on_sliding_window_rings(tiny):
    """gemma3's window-8 rings: a test within one chunk rolls back to the depth; a longer one
    (600 > 512) refills it for every run."""
    for p in (16, 600):
        rows = bench_rows(tiny["gemma3"], "-p", p, "-n", 2, "-d", "0,700", "-r", 1)
        assert [(r["test"], r["n_depth"]) for r in rows] == [(f"pp{p}", 0), ("tg2", 0), (f"pp{p}", 700), ("tg2", 700)]


def test_bench_depth_table(tiny):
    r = invoke("bench", tiny["llama"], "-p", 4, "-n", 2, "-d", "0,8", "-r", 1)
    assert r.exit_code == 0
    assert "pp4 @ d8" in r.stdout and "tg2 @ d8" in r.stdout
    assert "@ d0" not in r.stdout                       # llama-bench names depth 0 plainly


@pytest.mark.parametrize("depth", ["-1", "1.5", "0,-4096", "4k", "0,,8", "", "²"])
def test_bench_bad_depth(tiny, depth):
    r = run("bench", tiny["llama"], "-d", depth, "-r", 1)
    assert r.returncode == 1, r.stderr
    assert r.stdout == "" and "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: -d/--n-depth must be integers >= 0"), lines
    assert repr(depth) in lines[0]
