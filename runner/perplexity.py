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


def log_softmax_at(logits: np.ndarray, targets: np.ndarray, rows: int = 64) -> np.ndarray:
    """log p(target) of each row, in float64, a block of rows at a time: the float64 copies
    stay ~80 MB whatever the rows (each row's sums are its own, so blocks change no bit)."""
    out = np.empty(len(targets))
    for s in range(0, len(targets), rows):
        lg = logits[s:s + rows].astype(np.float64)
        m = lg.max(axis=1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(lg - m).sum(axis=1))
        out[s:s + rows] = lg[np.arange(len(lg)), targets[s:s + rows]] - lse
    return out


def perplexity(model, ids: list[int], n_ctx: int = 512,
               progress: Callable[[int, int, float], None] | None = None) -> PerplexityResult:
    n_chunks = len(ids) // n_ctx
    if n_chunks == 0:
        raise ValueError(f"the text is {len(ids)} tokens; perplexity needs at least {n_ctx} (one chunk of --ctx)")
    first = n_ctx // 2
    cache = model.backend.make_cache(n_ctx)
    step = model.backend.chunk
    nlls, tops = [], []
    for c in range(n_chunks):
        chunk = list(ids[c * n_ctx:(c + 1) * n_ctx])
        if model.tokenizer.add_bos:
            chunk[0] = model.tokenizer.bos_id
        cache.reset()
        # the backend's prompt batches one at a time (what forward does with the whole
        # chunk), each scored as it comes: one batch's logits in memory, not n_ctx rows
        for s in range(0, n_ctx, step):
            logits = model.backend.forward(chunk[s:s + step], cache, logits="all")
            lo, hi = max(s, first), min(s + len(logits), n_ctx - 1)     # scored: first .. n_ctx - 2
            if lo < hi:
                scored = logits[lo - s:hi - s]
                targets = np.asarray(ids[c * n_ctx + lo + 1:c * n_ctx + hi + 1], np.int64)
                nlls.append(-log_softmax_at(scored, targets))
                tops.append(scored.argmax(axis=1))
        if progress:
            progress(c + 1, n_chunks, math.exp(np.concatenate(nlls).mean()))
    nll = np.concatenate(nlls)
    ppl, err = ppl_and_error(nll)
    return PerplexityResult(ppl, err, n_chunks, len(nll), nll, np.concatenate(tops))


def ppl_and_error(nll: np.ndarray) -> tuple[float, float]:
    """exp(mean NLL) and its error (the standard error of the mean NLL, times PPL)."""
    mean = nll.mean()
    var = (nll ** 2).mean() - mean ** 2
    ppl = math.exp(mean)
    return ppl, math.sqrt(var / (len(nll) - 1)) * ppl if var > 0 and len(nll) > 1 else 0.0
