"""Perplexity by llama.cpp's method (tools/perplexity): the text is cut into chunks of n_ctx
tokens, each evaluated from an empty cache with its first token replaced by BOS when the model
adds one; only the second half of each chunk is scored, so every scored token has at least
n_ctx/2 tokens of context. The error is the standard error of the mean NLL, times PPL."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass
class PerplexityResult:
    ppl: float
    error: float
    n_chunks: int
    n_scored: int
    nll: np.ndarray         # per scored token
    top1: np.ndarray        # argmax of the logits at each scored position


def log_softmax_at(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    lg = logits.astype(np.float64)
    m = lg.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(lg - m).sum(axis=1))
    return lg[np.arange(len(targets)), targets] - lse


def perplexity(model, ids: list[int], n_ctx: int = 512,
               progress: Callable[[int, int, float], None] | None = None) -> PerplexityResult:
    n_chunks = len(ids) // n_ctx
    if n_chunks == 0:
        raise ValueError(f"the text is {len(ids)} tokens; perplexity needs at least {n_ctx} (one chunk of --ctx)")
    first = n_ctx // 2
    cache = model.backend.make_cache(n_ctx)
    nlls, tops = [], []
    for c in range(n_chunks):
        chunk = list(ids[c * n_ctx:(c + 1) * n_ctx])
        if model.tokenizer.add_bos:
            chunk[0] = model.tokenizer.bos_id
        cache.reset()
        logits = model.backend.forward(chunk, cache, logits="all")
        targets = np.asarray(ids[c * n_ctx + first + 1:(c + 1) * n_ctx], np.int64)
        scored = logits[first:n_ctx - 1]
        nlls.append(-log_softmax_at(scored, targets))
        tops.append(scored.argmax(axis=1))
        if progress:
            progress(c + 1, n_chunks, math.exp(np.concatenate(nlls).mean()))
    nll = np.concatenate(nlls)
    mean = nll.mean()
    var = (nll ** 2).mean() - mean ** 2
    ppl = math.exp(mean)
    err = math.sqrt(var / (len(nll) - 1)) * ppl if var > 0 and len(nll) > 1 else 0.0
    return PerplexityResult(ppl, err, n_chunks, len(nll), nll, np.concatenate(tops))
