"""The first run's two compile processes (runner.backends.numba_cpu.FirstRun): what each
compiles ahead must be the signatures the forward then calls, or the forward compiles them
again and the first run is as slow as with one process."""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import quant
from gguf_io import open_gguf
from gguf_io.config import config_from_gguf
from gguf_io.testing import _patch, header_fields, write_tiny_model
from runner.backends import kernels as K
from runner.backends import numba_cpu

AHEAD = [quant.packed._run, quant.packed._quantize_0, quant.packed._quantize_k, K.rms_norm, K.silu_mul,
         K.silu_mul_halves, K._gelu_mul, K.rope_store, K.flash_attention(64, False), K.flash_attention(64, True), K._fa_run, K.attention, K.flash_attention_q, K.store_kv, K.fwht,
         numba_cpu._layer_in, numba_cpu._layer_out]


EMBED = {T.Q8_0: quant.legacy._dq_q8_0, T.Q4_K: quant.kquants.dequant_rows_q4_K, T.Q6_K: quant.kquants.dequant_rows_q6_K}


def signatures():
    """Each dispatcher's compiled signatures, the packed kinds whose group kernel (a cfunc,
    compiled when made) exists and the (head size, path) of flash attention's work items (also
    cfuncs)."""
    out = {d: set(d.signatures) for d in AHEAD + list(EMBED.values())}
    out["group kernels"] = set(quant.packed._kernels)
    out["attention items"] = set(K._fa_compiled)
    return out


def grown(ahead, after):
    return {d.py_func.__name__ if hasattr(d, "py_func") else d: after[d] - ahead[d]
            for d in after if after[d] - ahead[d]}


def tiny(path, weights, arch="qwen2"):
    """A tiny model of Q8_0 matrices, relabelled as weights (gguf-py cannot quantize to K
    types; their blocks are smaller, so they stay inside the file; random bits suffice to see
    which kernels run)."""
    p = write_tiny_model(path, arch, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, weight_type=T.Q8_0)
    if weights != T.Q8_0:
        _, dims, types = header_fields(p)
        for name, field in types.items():
            if dims[name].end - dims[name].start == 16:        # the matrices (two dims)
                _patch(p, field.start, struct.pack("<I", weights))
    return p


CASES = [("qwen2", w, flash, types) for w in (T.Q8_0, T.Q4_K, T.Q6_K)
         for flash, types in ((True, ("f16", "f16")), (False, ("f16", "f16")), (True, ("q8_0", "q4_0")))]


@pytest.mark.parametrize("arch,weights,flash,types", CASES + [("gemma3", T.Q8_0, True, ("f16", "f16"))])
def test_ahead_of_time_signatures_are_the_forwards(tmp_path, arch, weights, flash, types):
    f = open_gguf(tiny(tmp_path / "m.gguf", weights, arch))
    need = numba_cpu.needs(numba_cpu.facts(f, config_from_gguf(f)))     # told before the backend is built
    be = numba_cpu.NumbaCPU(f, config_from_gguf(f), flash=flash, cache_types=types)
    assert need == dict(head_dim=64, embd_type=int(weights), kinds=sorted(be.packed_kinds()), silu=arch != "gemma3")
    # both processes' jobs (gemma3's GELU: no SiLU kernels ahead); the tiny model's head size 64
    for _, job in numba_cpu.jobs(flash, types, **need):
        job()
    ahead = signatures()
    assert ahead[EMBED[weights]], "the helper did not compile the embedding's row lookup"
    attention = {(True, True): K.flash_attention(64, False), (True, False): K.flash_attention_q, (False, True): K.attention}
    assert ahead[attention[flash, types == ("f16", "f16")]], "the helper compiled no attention kernel"
    if quant.packed.enabled():
        assert be.packed_kinds() == {quant.packed.KINDS[weights]}
        assert quant.packed.KINDS[weights] in ahead["group kernels"], "no matmul kernel compiled for the model's kind"
        assert ahead[quant.packed._run], "the parallel loop over groups was not compiled"
    cache = be.make_cache(128)
    be.compiled_step = False                 # as FirstRun.warm leaves the first run's process
    be.forward(np.arange(1, 9), cache)       # a batch
    be.forward([9], cache)                   # decode
    new = grown(ahead, signatures())
    assert not new, f"the forward compiled signatures the first run did not: {new}"
    # what the helper compiles after its share: the path of batches of 64 tokens and more,
    # and the compiled decode layer the next processes run
    numba_cpu.compile_attention(flash, types, 64, ns=(64,))
    numba_cpu.compile_step()
    ahead = signatures()
    assert ahead[numba_cpu._layer_in] and ahead[numba_cpu._layer_out]
    be.forward(np.arange(10, 80), cache)
    be.compiled_step = True
    assert be._decode_layers() == quant.packed.enabled()
    be.forward([80], cache)
    new = grown(ahead, signatures())
    assert not new, f"a long batch or the compiled decode compiled signatures the helper did not: {new}"


def test_helper_process_runs_from_any_directory(tmp_path):
    """The command FirstRun starts (its output is hidden from the user) exits cleanly, even
    from a directory holding a `runner` package of its own (`python -m` imported that one)."""
    (tmp_path / "runner").mkdir()
    (tmp_path / "runner" / "__init__.py").write_text("raise ImportError('the wrong runner')\n")
    told = json.dumps({"claims": str(tmp_path), "head_dim": 128, "embd_type": 8, "kinds": [], "silu": True})
    r = subprocess.run(numba_cpu.helper_command(True, ("q8_0", "q8_0")), cwd=tmp_path, input=told + "\n",
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout == "ready\n", r.stderr


def test_close_stops_a_running_helper(monkeypatch):
    import subprocess as sp
    real = sp.Popen
    monkeypatch.setattr(sp, "Popen", lambda cmd, **kw: real([sys.executable, "-c", "import time; time.sleep(60)"], **kw))
    run = numba_cpu.FirstRun(True, ("f16", "f16"))
    assert run.helper.poll() is None
    run.close()
    assert run.helper.poll() is not None


def test_helper_outlives_warm_to_finish_the_long_batches(tmp_path, monkeypatch):
    """Once the helper says its share is done, warm() runs the forward and close() leaves the
    helper to compile the long batches' attention on its own."""
    import subprocess as sp
    real = sp.Popen
    code = "import sys, time; sys.stdin.readline(); print('ready', flush=True); time.sleep(60)"
    monkeypatch.setattr(sp, "Popen", lambda cmd, **kw: real([sys.executable, "-c", code], **kw))
    f = open_gguf(tiny(tmp_path / "m.gguf", T.Q8_0))
    run = numba_cpu.FirstRun(True, ("f16", "f16"))
    try:
        run.tell(f, config_from_gguf(f))
        claims = run.claims
        run.warm(numba_cpu.NumbaCPU(f, config_from_gguf(f)), 1)
        run.close()
        assert run.ready and run.helper.poll() is None
        assert not os.path.exists(claims)
    finally:
        run.helper.kill()
        run.helper.wait()


def test_expect_tells_the_helper_before_the_file_and_tell_only_this_process(tmp_path, monkeypatch):
    """A catalog model's facts reach the helper before the download (expect); tell() then
    gives this process the file's own needs without telling the helper twice."""
    import subprocess as sp
    real = sp.Popen
    seen = tmp_path / "seen"
    code = f"import sys; open({str(seen)!r}, 'w').write(sys.stdin.read()); print('ready', flush=True)"
    monkeypatch.setattr(sp, "Popen", lambda cmd, **kw: real([sys.executable, "-c", code], **kw))
    f = open_gguf(tiny(tmp_path / "m.gguf", T.Q8_0))
    cfg = config_from_gguf(f)
    known = numba_cpu.facts(f, cfg)
    assert known["matrices"] and all(t == T.Q8_0 for t, _, _ in known["matrices"])
    run = numba_cpu.FirstRun(True, ("f16", "f16"))
    try:
        run.expect(dict(known, head_dim=128), download=True)       # an entry saying other than the file
        run.helper.wait(timeout=60)
        told = json.loads(seen.read_text())
        assert told["head_dim"] == 128 and told["kinds"] == numba_cpu.needs(known)["kinds"] and told["repack"] is True
        run.tell(f, cfg)
        assert run.need == numba_cpu.needs(known) and run.need["head_dim"] == 64
        assert seen.read_text().count("\n") == 1
    finally:
        run.close()


@pytest.mark.skipif(not quant.packed.enabled(), reason="this CPU runs no repacked kernels")
def test_repack_job_compiles_the_loads_repacking(tmp_path, monkeypatch):
    """The job a helper runs first while the file downloads is the repacking the load then
    runs (the file's read-only blocks), and only when told the file is yet to come."""
    need = dict(head_dim=64, embd_type=int(T.Q8_0), kinds=[quant.packed.Q8_0], silu=True)
    assert [n for n, _ in numba_cpu.jobs(True, ("f16", "f16"), **need, repack=True)][:2] == ["repack", "attention"]
    assert "repack" not in dict(numba_cpu.jobs(True, ("f16", "f16"), **need))
    import numba
    real, calls = quant.packed._repack, []

    def record(*args):      # the numba types of each call's arguments: the signature it compiles
        calls.append(tuple(numba.typeof(a) for a in args))
        return real(*args)
    monkeypatch.setattr(quant.packed, "_repack", record)
    dict(numba_cpu.jobs(True, ("f16", "f16"), **need, repack=True))["repack"]()
    ahead, calls[:] = set(calls), []
    f = open_gguf(tiny(tmp_path / "m.gguf", T.Q8_0))
    be = numba_cpu.NumbaCPU(f, config_from_gguf(f))
    assert be.packed_kinds() == {quant.packed.Q8_0}
    assert calls and set(calls) == ahead


@pytest.mark.real
@pytest.mark.parametrize("name", ["qwen2.5-coder:0.5b", "qwen2.5-coder:1.5b", "gemma3:270m"])
def test_catalog_facts_are_the_files(name):
    """What a first run tells the helper before the download ends (models.catalog) is what
    the downloaded file says."""
    from models import catalog
    f = open_gguf(catalog.fetch(name))
    assert catalog.CATALOG[name].facts == numba_cpu.facts(f, config_from_gguf(f))

@pytest.mark.real
@pytest.mark.parametrize("name,draft", [("qwen2.5-coder:0.5b", False), ("qwen2.5-coder:0.5b", True), ("gemma3:270m", False)])
def test_needs_told_early_are_the_backends(name, draft):
    """FirstRun.tell computes the kinds from the file before the backend repacks: the same
    kinds (a draft's requantized to Q4_0), head size and embedding type."""
    from models import catalog
    f = open_gguf(catalog.fetch(name))
    cfg = config_from_gguf(f)
    need = numba_cpu.needs(numba_cpu.facts(f, cfg), draft)
    be = numba_cpu.NumbaCPU(f, cfg, draft=draft)
    assert need == dict(head_dim=int(cfg.head_dim), embd_type=int(be.embd.type_id),
                        kinds=sorted(be.packed_kinds()), silu=cfg.act == "silu")
    assert (quant.packed.KINDS[T.Q4_0] in need["kinds"]) == draft or not quant.packed.enabled()


def test_jobs_are_shared_not_repeated(tmp_path):
    """Each job runs in exactly one of the processes that go down the list (a claim file per
    job), whatever the other has taken."""
    ran = {"a": [], "b": []}
    todo = lambda who: [(name, lambda name=name: ran[who].append(name)) for name in ("x", "y", "z")]
    (tmp_path / "y").touch()                      # taken by the other process already
    numba_cpu.run_jobs(todo("a"), str(tmp_path))
    numba_cpu.run_jobs(todo("b"), str(tmp_path))
    assert ran == {"a": ["x", "z"], "b": []}
    numba_cpu.run_jobs(todo("b"), str(tmp_path / "gone"))     # no claims directory: run them all
    assert ran["b"] == ["x", "y", "z"]


def test_write_bytecode_compiles_numbats_modules_even_where_python_would_not(tmp_path, monkeypatch):
    """The helper's last job: bytecode for numbat's own modules, also under
    PYTHONDONTWRITEBYTECODE (sys.dont_write_bytecode), and for nothing else in the folder."""
    import importlib.util
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    (tmp_path / "runner" / "backends").mkdir(parents=True)
    mine = [tmp_path / "cli.py", tmp_path / "runner" / "__init__.py", tmp_path / "runner" / "backends" / "k.py"]
    other = tmp_path / "other.py"
    for i, p in enumerate(mine + [other]):
        p.write_text(f"X = {i}\n")
    numba_cpu.write_bytecode(tmp_path)
    for p in mine:
        pyc = importlib.util.cache_from_source(str(p))
        assert os.path.isfile(pyc), p
        assert os.path.getmtime(pyc) >= os.path.getmtime(p)
    assert not os.path.exists(importlib.util.cache_from_source(str(other)))


def test_a_second_process_loads_the_cfuncs_from_the_cache(tmp_path):
    """Every packed kind's group kernel and flash attention's work items (cached cfuncs, made
    by factories) compiled by one process are loaded, not compiled again, by the next: numba
    keys them on their closure's pickle, which must not change from process to process (a
    dispatcher in the group kernels' closure carried its process's uuid, and every warm start
    compiled every kind again: 5 s for `prompt Hi -n 1`)."""
    code = ("import runner.env, json; from quant import packed as P; from runner.backends import kernels as K; "
            "print(json.dumps([P._kernel(k).cache_hits for k in sorted(set(P.KINDS.values()))] "
            "+ [K.fa_items(64, False).cache_hits]))")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    hits = [json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                      check=True, cwd=os.path.dirname(os.path.dirname(__file__))).stdout) for _ in range(2)]
    assert hits == [[0] * 6, [1] * 6]
