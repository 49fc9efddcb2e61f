"""runner/perplexity.py: llama.cpp's method, scored one prompt batch at a time."""
from types import SimpleNamespace

import numpy as np

from gguf_io import open_gguf
from gguf_io.config import config_from_gguf
from gguf_io.testing import write_tiny_model
from runner.backends.numba_cpu import NumbaCPU
from runner.perplexity import log_softmax_at, perplexity


def test_batches_scored_as_they_come_equal_the_whole_chunk(tmp_path):
    """A context of four prompt batches: the same NLLs and top tokens as scoring the logits
    of the whole chunk at once (forward over all of it), bit for bit."""
    f = open_gguf(write_tiny_model(tmp_path / "m.gguf", "llama", n_ctx_train=256))
    cfg = config_from_gguf(f)
    be = NumbaCPU(f, cfg, chunk=16)
    model = SimpleNamespace(backend=be, tokenizer=SimpleNamespace(add_bos=True, bos_id=1))
    ids = np.random.default_rng(0).integers(3, cfg.n_vocab, 200).tolist()
    n_ctx, first = 64, 32
    r = perplexity(model, ids, n_ctx=n_ctx)
    nll, top = [], []
    cache = be.make_cache(n_ctx)
    for c in range(len(ids) // n_ctx):
        chunk = [1] + ids[c * n_ctx + 1:(c + 1) * n_ctx]
        cache.reset()
        logits = be.forward(chunk, cache, logits="all")[first:n_ctx - 1]
        nll.append(-log_softmax_at(logits, np.asarray(ids[c * n_ctx + first + 1:(c + 1) * n_ctx])))
        top.append(logits.argmax(axis=1))
    assert r.n_chunks == 3 and r.n_scored == 3 * 31
    assert np.array_equal(r.nll, np.concatenate(nll)) and np.array_equal(r.top1, np.concatenate(top))


def test_log_softmax_blocks_change_no_bit():
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((100, 5000)) * 8).astype(np.float32)
    targets = rng.integers(0, 5000, 100)
    lg = logits.astype(np.float64)
    m = lg.max(axis=1, keepdims=True)
    want = lg[np.arange(100), targets] - (m[:, 0] + np.log(np.exp(lg - m).sum(axis=1)))
    for rows in (1, 7, 64, 1000):
        assert np.array_equal(log_softmax_at(logits, targets, rows), want)
