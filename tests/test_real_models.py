"""Real catalog models against llama.cpp (fixtures from tests/oracle/gen_model_fixtures.py):
tokenization of a long text, perplexity and top-1 predictions by llama.cpp's
tools/perplexity method, greedy continuations, and peak memory while generating."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runner.model import load
from runner.perplexity import perplexity

FIXTURES = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).resolve().parents[1]
MODELS = {"qwen2.5-coder:0.5b": "model_qwen2.5-coder-0.5b.json",
          "qwen2.5-coder:1.5b": "model_qwen2.5-coder-1.5b.json",
          "gemma3:270m": "model_gemma3-270m.json"}
NEAR_TIE = 0.05   # llama.cpp top-1 minus top-2 logit below which either choice is fair

pytestmark = pytest.mark.real


# each model with flash attention off (llama-cpp-python's default) and on (llama.cpp's tools'
# default), against llama.cpp's fixtures made the same way (2 threads: with flash attention a
# decode step past 256 cells splits its cells between the threads, so its bits depend on them)
@pytest.fixture(scope="module", params=[(name, fa) for name in MODELS for fa in (False, True)],
                ids=lambda p: f"{p[0]}-fa-{'on' if p[1] else 'off'}")
def real(request):
    name, flash = request.param
    file = MODELS[name].replace(".json", "_fa.json") if flash else MODELS[name]
    fx = json.loads((FIXTURES / file).read_text(encoding="utf-8"))
    fx.setdefault("text_ids", json.loads((FIXTURES / MODELS[name]).read_text(encoding="utf-8"))["text_ids"])
    fx.setdefault("add_bos", None)
    return load(name, threads=2, flash=flash), fx


@pytest.fixture(scope="module")
def ppl(real):
    m, fx = real
    # llama.cpp's ids, so a tokenizer difference cannot move the number (it has its own test)
    return perplexity(m, fx["text_ids"], n_ctx=fx["perplexity"]["n_ctx"])


def test_text_ids_match_llama_cpp(real):
    m, fx = real
    text = (FIXTURES / "ppl_text.txt").read_text(encoding="utf-8")
    ours, ref = m.tokenizer.encode(text), fx["text_ids"]
    assert fx["add_bos"] is None or m.tokenizer.add_bos == fx["add_bos"]
    assert len(ref) >= 5000
    first = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    assert ours == ref, f"{len(ours)} ids vs llama.cpp's {len(ref)}, first difference at {first}"


def test_perplexity_within_1_percent_of_llama_cpp(real, ppl):
    _, fx = real
    ref = fx["perplexity"]
    assert ppl.n_scored == ref["n_scored"]
    rel = ppl.ppl / ref["ppl"] - 1
    print(f"{fx['model']}: PPL {ppl.ppl:.4f} vs llama.cpp {ref['ppl']:.4f} ({rel:+.3%})")
    if fx.get("flash_attn"):    # bit-exact arithmetic: the printed digits are llama.cpp's
        assert f"{ppl.ppl:.4f}" == f"{ref['ppl']:.4f}", f"{fx['model']} -fa on: PPL {ppl.ppl:.6f} vs {ref['ppl']:.6f}"
    assert abs(rel) <= 0.01, (f"{fx['model']}: PPL {ppl.ppl:.4f} +/- {ppl.error:.4f} vs llama.cpp "
                              f"{ref['ppl']:.4f} +/- {ref['error']:.4f} ({rel:+.2%})")


# numbat follows llama.cpp's float steps (kernels' sum orders, f16 cache, ggml's exp, gelu
# table), so its logits here are llama.cpp's bit for bit: measured 100% on all three models.
def test_top1_agrees_with_llama_cpp(real, ppl):
    _, fx = real
    ref = np.asarray(fx["perplexity"]["top1"])
    agree = float((ppl.top1 == ref).mean())
    print(f"{fx['model']}: top-1 agreement {agree:.2%}")
    assert agree >= (1.0 if fx.get("flash_attn") else 0.99), \
        f"{fx['model']}: top-1 agrees at {agree:.2%} of {len(ref)} scored positions"


def greedy(m, prompt_ids: list[int], n: int, top: list) -> tuple[list[int], list[np.ndarray]]:
    """Prefill the prompt, then one token per forward, argmax: what llama.cpp's fixture did.
    Also our logits at llama.cpp's top ids of each step (top[j]: [id, logit] pairs)."""
    cache = m.backend.make_cache(512)
    logits = m.backend.forward(prompt_ids, cache, logits="last")
    out, at = [], []
    for j in range(n):
        out.append(int(logits[0].argmax()))
        at.append(logits[0][[i for i, _ in top[j]]].copy())
        logits = m.backend.forward([out[-1]], cache, logits="last")
    return out, at


def test_greedy_continuations_match_llama_cpp(real):
    """The 64-token greedy continuations are llama.cpp's (a divergence would be accepted only
    after a near-tie), and so are the logits on the way: at every decode step llama.cpp's
    top 8 logits, compared as float32 bit patterns."""
    m, fx = real
    report = []
    for case in fx["greedy"]:
        if case["prompt"] is not None:      # None: the text's first ids (decode past 256 cells)
            assert m.tokenizer.encode(case["prompt"]) == case["prompt_ids"], case["prompt"]
        ref, gaps = case["ids"], case["gaps"]
        ours, at = greedy(m, case["prompt_ids"], len(ref), case["top"])
        if ours == ref:
            # step 0 is the prompt's last token: the fixture's llama.cpp ran with logits_all,
            # i.e. its last layer's FFN and output matrix over the whole prompt as a batch,
            # where numbat (as a generation asking for the last logits only) runs one row
            want = np.array([[v for _, v in step] for step in case["top"]], np.float32)
            np.testing.assert_allclose(at[0], want[0], rtol=1e-5)
            same = np.array([(a.view(np.int32) == w.view(np.int32)).all() for a, w in zip(at[1:], want[1:])])
            assert same.all(), (f"{fx['model']} {case['prompt']!r}: logits differ from llama.cpp's from step "
                                f"{int(np.argmin(same)) + 1} on (max diff {np.abs(np.array(at) - want).max():.3g})")
            report.append(f"{case['prompt']!r}: identical ids, top-8 logits bit-identical at steps 1-{len(ref) - 1}"
                          f"{'' if (at[0] == want[0]).all() else ' (step 0 within 1e-5)'}")
            continue
        i = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
        assert ours[:i] == ref[:i]
        ties = [j for j in range(i + 1) if gaps[j] < NEAR_TIE]
        assert ties, (f"{fx['model']} {case['prompt']!r}: diverges at step {i} ({ours[i]} vs llama.cpp's "
                      f"{ref[i]}), llama.cpp's top-2 gaps up to there are all >= {NEAR_TIE} "
                      f"(min {min(gaps[:i + 1]):.4f})")
        report.append(f"{case['prompt']!r}: diverges at step {i} after a near-tie at step {ties[-1]} "
                      f"(gap {gaps[ties[-1]]:.4f})")
    print("\n".join(report))


# Peak RSS is VmHWM, the high-water mark of this process's own address space. Not
# ru_maxrss: Linux carries it across exec from the forking process, so under pytest it
# reports the suite's RSS at fork time (measured: 4.9 GB in the suite, 1.38 GB alone).
RSS_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
from runner.model import load
m = load("qwen2.5-coder:1.5b")
cache = m.make_cache()
logits = m.backend.forward(m.tokenizer.encode("def quicksort(arr):"), cache, logits="last")
for _ in range(32):
    logits = m.backend.forward([int(logits[0].argmax())], cache, logits="last")
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(m.path.stat().st_size, cache.nbytes(), hwm * 1024)
"""


def test_peak_rss_generating_with_1_5b():
    # a fresh process, so the peak is this model's alone
    # run twice: a first run may compile kernels (LLVM's memory is not generation's)
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(ROOT)], capture_output=True, text=True, check=True)
    file_bytes, cache_bytes, peak = map(int, out.stdout.split()[-3:])
    budget = file_bytes + cache_bytes + 300 * 2**20
    mb = lambda b: f"{b / 2**20:.0f} MB"
    print(f"peak RSS {mb(peak)}, file {mb(file_bytes)}, KV cache {mb(cache_bytes)}")
    assert peak <= budget, (f"peak RSS {mb(peak)} > file {mb(file_bytes)} + KV cache {mb(cache_bytes)} + 300 MB")
