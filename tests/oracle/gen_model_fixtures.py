"""Write the model fixtures from llama.cpp (the oracle):

- tests/fixtures/model_<name>.json for each real catalog model: llama.cpp's ids of
  ppl_text.txt (add_bos as the model says), its perplexity at ctx 512 and top-1 id at
  every scored position, and greedy continuations (chosen id, top-1/top-2 logit gap and
  the top 8 logits as exact float32 values, per step) of a few raw prompts;
- tests/fixtures/model_tiny_<arch>.npz for tiny random-weight models written by
  gguf_io.testing.write_tiny_model: llama.cpp's logits for every position of a fixed id
  sequence, per weight type. The writer's arguments are stored with them, so the test
  rebuilds the very same files.

Dev-only (needs llama-cpp-python==0.3.36). Run from the repo root:
    python tests/oracle/gen_model_fixtures.py [--real-only | --tiny-only | --greedy-top | --flash | --kv-types]
(--greedy-top adds only the top logits of each greedy step to the real-model fixtures).
"""
from __future__ import annotations

import json
import math
import re
import sys
import tempfile
from pathlib import Path

import llama_cpp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gguf import GGMLQuantizationType  # noqa: E402

from gguf_io.testing import write_tiny_model  # noqa: E402
from models.catalog import fetch  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"
N_CTX = 512
N_GREEDY = 64
REAL = {"qwen2.5-coder:0.5b": "model_qwen2.5-coder-0.5b.json",
        "qwen2.5-coder:1.5b": "model_qwen2.5-coder-1.5b.json",
        "gemma3:270m": "model_gemma3-270m.json"}
PROMPTS = ["def quicksort(arr):",
           "#include <stdio.h>\n\nint main(int argc, char **argv) {\n",
           "The history of the Roman Empire",
           "Once upon a time, in a small village by the sea,"]

# Tiny models: writer arguments per arch and the weight types to store. gemma3 has 6 layers
# so that layer 5 is global (llama.cpp's pattern: every 6th) and the rest slide over 8
# tokens, shorter than the sequence; qwen3 and gemma3 have head_dim != n_embd / n_head.
TINY = {
    "llama": (dict(arch="llama", seed=11), ["F32", "F16", "Q8_0", "Q4_0"]),
    "qwen2": (dict(arch="qwen2", seed=12, tied_output=True), ["F32", "Q8_0"]),
    "qwen3": (dict(arch="qwen3", seed=13, head_dim=32), ["F32", "Q8_0"]),
    "gemma3": (dict(arch="gemma3", seed=14, n_layer=6, head_dim=32, sliding_window=8, tied_output=True),
               ["F32", "Q8_0"]),
}
TINY_LEN = 24


def log_softmax_at(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    lg = logits.astype(np.float64)
    m = lg.max(axis=1, keepdims=True)
    return lg[np.arange(len(targets)), targets] - (m[:, 0] + np.log(np.exp(lg - m).sum(axis=1)))


def oracle_perplexity(llm, ids: list[int], add_bos: bool, bos: int) -> dict:
    """tools/perplexity's method: chunks of N_CTX from a fresh state, BOS replaces the first
    token when the model adds one, the second half of each chunk is scored."""
    first = N_CTX // 2
    nlls, tops = [], []
    for c in range(len(ids) // N_CTX):
        chunk = list(ids[c * N_CTX:(c + 1) * N_CTX])
        if add_bos:
            chunk[0] = bos
        llm.reset()   # n_tokens = 0: eval() then clears the whole KV cache
        llm.eval(chunk)
        scored = np.asarray(llm.scores[first:N_CTX - 1])
        targets = np.asarray(ids[c * N_CTX + first + 1:(c + 1) * N_CTX])
        nlls.append(-log_softmax_at(scored, targets))
        tops.append(scored.argmax(axis=1))
        print(f"  chunk {c + 1}: ppl so far {math.exp(np.concatenate(nlls).mean()):.4f}", flush=True)
    nll = np.concatenate(nlls)
    mean, var = nll.mean(), (nll ** 2).mean() - nll.mean() ** 2
    ppl = math.exp(mean)
    return {"n_ctx": N_CTX, "ppl": ppl, "error": math.sqrt(var / (len(nll) - 1)) * ppl,
            "n_scored": len(nll), "top1": np.concatenate(tops).tolist()}


N_TOP = 8   # logits kept per greedy step: the top ids and their exact float32 values


def oracle_greedy(llm, prompt_ids: list[int]) -> dict:
    """Prefill the prompt as one batch, then one token per eval, as llama.cpp generation does."""
    llm.reset()
    llm.eval(prompt_ids)
    chosen, gaps, top = [], [], []
    for _ in range(N_GREEDY):
        row = np.asarray(llm.scores[llm.n_tokens - 1], np.float32)
        top2 = np.sort(np.partition(row, -2)[-2:])
        chosen.append(int(row.argmax()))
        gaps.append(round(float(top2[1] - top2[0]), 4))
        best = np.argsort(-row, kind="stable")[:N_TOP]
        top.append([[int(i), float(row[i])] for i in best])     # float(float32) is exact in JSON
        llm.eval([chosen[-1]])
    return {"prompt_ids": prompt_ids, "ids": chosen, "gaps": gaps, "top": top}


def greedy_top_logits() -> None:
    """Add the top logits of every greedy step to the existing real-model fixtures (the
    rest is left as it is; the greedy ids must come out the same). With logits_all, as the
    ids were made: llama.cpp then runs the last layer's FFN and the output matrix over the
    whole prompt as a batch, so step 0's logits come from batch kernels (numbat, like a
    generation that asks for the last token's logits only, runs that row alone)."""
    for name, filename in REAL.items():
        out = FIXTURES / filename
        fixture = json.loads(out.read_text(encoding="utf-8"))
        llm = llama_cpp.Llama(model_path=str(fetch(name)), n_ctx=N_CTX, n_threads=2, logits_all=True, flash_attn=False,
                              verbose=False)
        for case in fixture["greedy"]:
            new = oracle_greedy(llm, case["prompt_ids"])
            assert new["ids"] == case["ids"], (name, case["prompt"])
            case["top"] = new["top"]
        _write(out, fixture)
        del llm


def _write(out: Path, fixture: dict) -> None:
    body = json.dumps(fixture, ensure_ascii=False, indent=1)
    body = re.sub(r"(?<=[\[,])\n\s+(?=-?\d)|(?<=\d)\n\s+(?=\])", "", body)   # number lists on one line
    out.write_text(body + "\n", encoding="utf-8")
    print(f"wrote {out} ({out.stat().st_size} bytes)", flush=True)


def real_fixtures() -> None:
    text = (FIXTURES / "ppl_text.txt").read_text(encoding="utf-8")
    for name, filename in REAL.items():
        print(name, flush=True)
        llm = llama_cpp.Llama(model_path=str(fetch(name)), n_ctx=N_CTX, n_threads=2, logits_all=True, flash_attn=False,
                              verbose=False)
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
        bos = int(llama_cpp.llama_vocab_bos(vocab))
        ids = llm.tokenize(text.encode(), add_bos=add_bos, special=False)
        fixture = {
            "model": name,
            "oracle": f"llama-cpp-python {llama_cpp.__version__}",
            "add_bos": add_bos,
            "text_ids": ids,
            "perplexity": oracle_perplexity(llm, ids, add_bos, bos),
            "greedy": [{"prompt": p, **oracle_greedy(llm, llm.tokenize(p.encode(), add_bos=add_bos, special=False))}
                       for p in PROMPTS],
        }
        print(f"  ppl {fixture['perplexity']['ppl']:.4f}", flush=True)
        _write(FIXTURES / filename, fixture)
        del llm


LONG_PROMPT = 300   # a greedy prompt of the text's first ids: its decode steps see 512 cells (split over threads)


def flash_fixtures() -> None:
    """tests/fixtures/model_<name>_fa.json: perplexity and greedy continuations with flash
    attention on (llama.cpp's tools' default), 2 threads (its one-token steps past 256 cells
    split the cells between threads); the greedy prompts and one of LONG_PROMPT text ids."""
    for name, filename in REAL.items():
        base = json.loads((FIXTURES / filename).read_text(encoding="utf-8"))
        llm = llama_cpp.Llama(model_path=str(fetch(name)), n_ctx=N_CTX, n_threads=2, n_threads_batch=2,
                              logits_all=True, flash_attn=True, verbose=False)
        ids, bos = base["text_ids"], int(llama_cpp.llama_vocab_bos(llama_cpp.llama_model_get_vocab(llm.model)))
        prompts = [(c["prompt"], c["prompt_ids"]) for c in base["greedy"]] + [(None, ids[:LONG_PROMPT])]
        fixture = {"model": name, "oracle": f"llama-cpp-python {llama_cpp.__version__}", "flash_attn": True,
                   "n_threads": 2, "perplexity": oracle_perplexity(llm, ids, base["add_bos"], bos),
                   "greedy": [{"prompt": p, **oracle_greedy(llm, pids)} for p, pids in prompts]}
        print(f"  ppl {fixture['perplexity']['ppl']:.4f}", flush=True)
        _write(FIXTURES / filename.replace(".json", "_fa.json"), fixture)
        del llm


KV_TYPES = {"q8_0": 8, "q4_0": 2}     # ggml type ids


def kv_type_fixtures(contexts=(512, 4096)) -> None:
    """tests/fixtures/kv_types.json: perplexity and top-1 with quantized K and V caches
    (-ctk/-ctv q8_0 | q4_0, flash attention on, as llama.cpp needs for V), per model and
    context, by tools/perplexity's method on the runner's text."""
    global N_CTX
    out, path = {}, FIXTURES / "kv_types.json"
    for name, filename in REAL.items():
        base = json.loads((FIXTURES / filename).read_text(encoding="utf-8"))
        ids = base["text_ids"]
        for t, tid in KV_TYPES.items():
            for n_ctx in contexts:
                N_CTX = n_ctx
                llm = llama_cpp.Llama(model_path=str(fetch(name)), n_ctx=n_ctx, n_batch=512, n_threads=2,
                                      n_threads_batch=2, logits_all=True, flash_attn=True, type_k=tid, type_v=tid,
                                      verbose=False)
                bos = int(llama_cpp.llama_vocab_bos(llama_cpp.llama_model_get_vocab(llm.model)))
                r = oracle_perplexity(llm, ids, base["add_bos"], bos)
                out.setdefault(name, {}).setdefault(t, {})[str(n_ctx)] = r
                print(f"{name} {t} ctx {n_ctx}: ppl {r['ppl']:.4f}", flush=True)
                del llm
    _write(path, out)


def tiny_ids(seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [1] + rng.integers(3, 384, TINY_LEN - 1).tolist()   # BOS, then anything but controls


def tiny_fixtures(flash: bool = False) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for arch, (kw, types) in TINY.items():
            ids = tiny_ids(kw["seed"])
            arrays = {"ids": np.asarray(ids, np.int32), "kwargs": np.asarray(json.dumps(kw))}
            for t in types:
                path = write_tiny_model(Path(tmp) / f"{arch}-{t}.gguf", weight_type=GGMLQuantizationType[t], **kw)
                llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=2, logits_all=True,
                                      flash_attn=flash, verbose=False)
                llm.eval(ids)
                arrays[t] = np.asarray(llm.scores[:len(ids)], np.float32).copy()
                del llm
            out = FIXTURES / f"model_tiny_{arch}{'_fa' if flash else ''}.npz"
            np.savez_compressed(out, **arrays)
            print(f"wrote {out} ({out.stat().st_size} bytes)", flush=True)


if __name__ == "__main__":
    if "--kv-types" in sys.argv:    # the quantized-cache fixtures only
        kv_type_fixtures()
        sys.exit()
    if "--flash" in sys.argv:       # the flash-attention fixtures only
        tiny_fixtures(flash=True)
        flash_fixtures()
        sys.exit()
    if "--greedy-top" in sys.argv:
        greedy_top_logits()
        sys.exit()
    if "--real-only" not in sys.argv:
        tiny_fixtures()
    if "--tiny-only" not in sys.argv:
        real_fixtures()
