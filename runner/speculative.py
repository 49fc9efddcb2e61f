"""Speculative decoding, exact to the target model's distribution.

A proposer guesses the next tokens: a small draft model of the same vocabulary
(``DraftModel``) or the continuation of the latest earlier match of the text's last
n-gram (``PromptLookup``). The target runs its last token and k guesses in one forward
with logits="all"; the backend computes batches of up to CHECK_ROWS tokens bit-identically
to one-at-a-time decoding, so row i is exactly what plain decoding would see after the
i-th guess. Guess x is accepted with probability min(1, p(x)/q(x)) (p: the target's
sampling distribution, q: the one x was drawn from); the first rejected guess is replaced
by a draw from max(0, p - q) normalized, and when all k pass one more token is drawn
from the last row. Every emitted token is then distributed as p given the ones before it
(Leviathan et al. 2023; Chen et al. 2023). At temperature 0, p and q are one-hot and this
is greedy decoding, token for token.

Context end: a verification batch never writes past the context (k shrinks to what fits),
so a rejected guess never overwrites a ring slot that plain decoding would still attend
to; from the last position on, tokens go one at a time exactly as in generate(), and the
ring then drops the oldest tokens as it does there.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runner.generate import Stats, emit
from runner.model import ModelError
from runner.sampler import Sampler

# Guesses per target forward, measured on qwen2.5-coder:1.5b, greedy: with the 0.5b draft on
# three code completions, k = 1..4 were within 8% of each other and k = 3 within 3% of the
# best; with lookup on a code edit, k = 4 was best (k = 8 and 15 lost 15% and 38% to the
# cost of checking rejected guesses). With the draft's matrices in Q4_0 (session 20, in one
# process, four code prompts): k = 4 1.34x plain, k = 3 1.47x.
DRAFT_K = 3
# A draft may stop guessing at a guess it gives less than p_min (llama.cpp's --draft-p-min,
# 0.75 there). Not by default: on the four code prompts (1.5b, 0.5b draft, greedy, 128 tokens
# each) k = 3 took 148 checks and 444 draft forwards; k = 3 with 0.75 175 and 431, k = 8 with
# 0.75 119 and 531 (a third of its checks 9 tokens wide), and in-process A/B runs put k = 8 /
# 0.75 at 1.67x then 1.45x plain against k = 3's 1.53x then 1.61x: no gain within the noise.
DRAFT_P_MIN = 0.0
LOOKUP_K = 4
LOOKUP_NGRAM = 3
# The draft's output layer covers the first DRAFT_HEAD ids (BPE and SentencePiece vocabularies
# list tokens roughly from frequent to rare) and the ids it has read past them (DraftHead).
# The 0.5b's head is 37% of the bytes its step reads. Over the 21 prompts of the real-model
# tests, 96 tokens each, the 1.5b took 3.25 tokens a check with the whole head and 3.18 / 3.07
# / 2.90 with 32768 / 16384 / 8192 ids; on bench's code prompt 32768 ids lost no guess, and
# the speculative decode went from 1.46x to 1.69x plain decoding.
DRAFT_HEAD = 32768


@dataclass
class SpecStats:
    method: str            # the draft model's name, or "lookup"
    draft_max: int
    drafted: int = 0       # guesses the target checked
    accepted: int = 0      # of them, accepted
    forwards: int = 0      # target forwards after the prompt
    tokens: int = 0        # tokens those forwards produced and generation emitted

    def as_dict(self) -> dict:
        return {"method": self.method, "draft_max": self.draft_max, "drafted": self.drafted,
                "accepted": self.accepted,
                "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
                "target_forwards": self.forwards,
                "tokens_per_target_forward": round(self.tokens / self.forwards, 3) if self.forwards else 0.0}


def accept_prob(p: np.ndarray, q: np.ndarray | None, x: int) -> float:
    """min(1, p(x)/q(x)); q None is a point mass on x (a lookup guess)."""
    return float(p[x]) if q is None else min(1.0, float(p[x] / q[x]))


def residual(p: np.ndarray, q: np.ndarray | None, x: int) -> np.ndarray:
    """Where a rejected guess x is replaced from: max(0, p - q), normalized."""
    if q is None:
        r = p.copy()
        r[x] = 0.0
    else:
        r = np.maximum(p - q, 0.0)
    s = r.sum()
    # s is 0 only when p == q, where rejection has probability 0: only float rounding gets here
    return r / s if s > 0 else p


def verify(sampler: Sampler, rows: np.ndarray, history: list[int], guesses: list[int],
           qs: list[np.ndarray] | None) -> list[int]:
    """The tokens one verification emits: the accepted guesses, then one token of the target's.
    rows[i] are the target's logits after history + guesses[:i]."""
    out = []
    if sampler.greedy:      # p and q one-hot: a guess stands when it is the target's argmax,
        for i, x in enumerate(guesses):     # and max(0, p - q) is the target's argmax
            y = sampler.next(rows[i], history + out)
            if y != x:
                return out + [y]
            out.append(x)
        return out + [sampler.next(rows[len(guesses)], history + out)]
    for i, x in enumerate(guesses):
        p = sampler.dist(rows[i], history + out)
        q = qs[i] if qs else None
        if sampler.rng.random() < accept_prob(p, q, x):
            out.append(x)
        else:
            return out + [sampler.sample(residual(p, q, x))]
    return out + [sampler.next(rows[len(guesses)], history + out)]


def speculative_generate(model, prompt_ids: list[int], sampler: Sampler, cache, proposer,
                         max_tokens: int = -1, stop: tuple[str, ...] = (), history: list[int] | None = None):
    """generate() with tokens guessed by ``proposer`` and checked by ``model``: the same events
    and stopping rules, the same distribution (at temperature 0, the same tokens)."""
    spec = SpecStats(proposer.name, proposer.k)

    def source(logits, history):
        first = sampler.next(logits, history)
        if cache.n_past < cache.n_ctx - 1:          # else no draft will ever be asked for
            proposer.propose(history, 0, sampler)   # a draft reads the prompt now: time to first token
        yield first
        while True:
            # history ends with the last token taken, which the cache does not hold yet
            k = min(proposer.k, cache.n_ctx - 1 - cache.n_past)
            guesses, qs = proposer.propose(history, k, sampler) if k > 0 else ([], None)
            rows = model.backend.forward([history[-1], *guesses], cache, logits="all", one_by_one=True)
            out = verify(sampler, rows, history, guesses, qs)
            spec.forwards += 1
            spec.drafted += len(guesses)
            spec.accepted += len(out) - 1
            cache.rollback(len(guesses) + 1 - len(out))   # keep the last token + accepted guesses
            for x in out:
                spec.tokens += 1
                yield x   # emit() rolls back the accepted guesses it did not take

    return emit(model, prompt_ids, cache, source, max_tokens, stop, history, Stats(spec=spec))


class PromptLookup:
    """Guesses that the text goes on as it did after the latest earlier occurrence of its last
    n tokens (n from ``ngram`` down to 1). A guess is a point mass: q(x) = 1."""

    name = "lookup"

    def __init__(self, ngram: int = LOOKUP_NGRAM, k: int = LOOKUP_K):
        self.ngram, self.k = ngram, k

    def propose(self, context: list[int], k: int, sampler: Sampler) -> tuple[list[int], None]:
        a = np.asarray(context)
        for n in range(min(self.ngram, len(a) - 1), 0, -1):
            hit = np.ones(len(a) - n, bool)     # hit[i]: a[i:i+n] equals the last n tokens
            for j in range(n):
                hit &= a[j:len(a) - n + j] == a[len(a) - n + j]
            starts = np.flatnonzero(hit)
            if len(starts):
                i = int(starts[-1]) + n
                return a[i:i + k].tolist(), None
        return [], None


class DraftModel:
    """A smaller model of the same vocabulary guesses by sampling its own distribution under
    the same sampler rules, with its own KV cache: up to k guesses, stopping before one it
    gives less than p_min (its greedy guess's softmax probability, or the largest of the
    distribution it samples from). Where it stops depends only on the draft, so every
    emitted token keeps the target's distribution."""

    def __init__(self, target, draft, n_ctx: int, k: int = DRAFT_K, head: int = DRAFT_HEAD,
                 p_min: float = DRAFT_P_MIN):
        check_compatible(target, draft)
        self.m, self.name, self.k, self.p_min = draft, draft.name, k, p_min
        self.n_vocab = target.cfg.n_vocab
        self.cache = draft.backend.make_cache(n_ctx)   # positions follow the target's, never past n_ctx
        self.fed: list[int] = []                       # the tokens in self.cache, in order
        # backends without a separate output layer (test doubles) give full logits
        self.head = DraftHead(draft.backend, head, draft.tokenizer.eog_ids) if head and hasattr(draft.backend, "head") else None

    def propose(self, context: list[int], k: int, sampler: Sampler) -> tuple[list[int], list[np.ndarray]]:
        logits = self._sync(context)
        out, qs = [], []
        for i in range(k):
            if sampler.greedy:      # verify() needs no q then; a draft-only id ends the guesses
                x = sampler.next(logits, context + out)
                if x >= self.n_vocab or (self.p_min and self._prob(logits, x) < self.p_min):
                    break
                out.append(x)
            else:
                q = self._over_target_vocab(sampler.dist(logits, context + out))
                if q is None or (self.p_min and q.max() < self.p_min):
                    break
                out.append(sampler.sample(q))
                qs.append(q)
            if i + 1 < k:
                logits = self._feed(out[-1:])
        return out, qs

    def _sync(self, context: list[int]) -> np.ndarray:
        """Make the cache hold exactly ``context`` and return the logits after it. The common
        prefix stays; at least one token is rerun, for its logits."""
        keep = min(_common_prefix(self.fed, context), len(context) - 1)
        # n_past, not len(fed): an interrupted forward may have claimed positions
        self.cache.rollback(self.cache.n_past - keep)
        del self.fed[keep:]
        return self._feed(context[keep:])

    def _feed(self, ids: list[int]) -> np.ndarray:
        if self.head:       # what the draft reads, it may guess
            self.head.cover(ids)
            logits = self.head(self.m.backend.forward(ids, self.cache, logits="hidden"))
        else:
            logits = self.m.backend.forward(ids, self.cache)[-1]
        self.fed += ids
        return logits

    def _prob(self, logits: np.ndarray, x: int) -> float:
        """The draft's softmax probability of its guess x over the ids its head covers (26 us
        for the prefix's 32768, where the whole vocabulary's -inf cells would take 0.8 ms)."""
        parts = [logits] if self.head is None else [logits[:self.head.n], logits[self.head.extra_ids]]
        top = np.float32(max(float(p.max()) for p in parts if len(p)))
        return float(np.exp(logits[x] - top)) / sum(float(np.exp(p - top).sum()) for p in parts)

    def _over_target_vocab(self, q: np.ndarray) -> np.ndarray | None:
        """q over the target's ids. Draft-only ids are never proposed: their mass is dropped
        (None if that was all of it)."""
        if len(q) < self.n_vocab:
            return np.pad(q, (0, self.n_vocab - len(q)))
        q = q[:self.n_vocab]
        s = q.sum()
        return q / s if s > 0 else None


class DraftHead:
    """The draft's logits over the first n ids, the ids it has been fed past them and
    ``always`` (the ends of generation); the other ids get -inf, so the draft never proposes
    them. Exactness does not depend on the draft (a guess is only ever checked against the
    target), so this trades a few guesses the draft can no longer make for reading far fewer
    bytes of its output matrix a step."""

    def __init__(self, backend, n: int, always=()):
        total = backend.cfg.n_vocab
        self.n = n if n % 16 == 0 and 2 * n <= total else total
        self.backend, self.total, self.prefix = backend, total, backend.head(self.n)
        self.logits = np.full(total, -np.inf, np.float32)
        self.covered: set[int] = set()              # the ids >= n covered
        self.extra_ids, self.extra = np.zeros(0, np.int64), None
        self.cover(always)

    def cover(self, ids) -> None:
        new = {t for t in ids if self.n <= t < self.total} - self.covered
        if new:     # the rows of the covered ids, gathered again (rare: new ids only)
            self.covered |= new
            self.extra_ids = np.array(sorted(self.covered), np.int64)
            self.extra = self.backend.head(self.extra_ids)

    def __call__(self, h: np.ndarray) -> np.ndarray:
        self.logits[:self.n] = self.prefix(h)
        if self.extra is not None:
            self.logits[self.extra_ids] = self.extra(h)
        return self.logits


def check_compatible(target, draft) -> None:
    """The draft must read every token the target writes as the same text, and agree on the
    special tokens; it may have more tokens (never proposed)."""
    t, d = target.tokenizer, draft.tokenizer
    why = None
    if d.kind != t.kind:
        why = f"its tokenizer is {d.kind}, the target's is {t.kind}"
    elif len(d.tokens) < len(t.tokens):
        why = f"it has {len(d.tokens)} tokens, the target {len(t.tokens)}"
    elif d.tokens[:len(t.tokens)] != t.tokens:
        i = _common_prefix(d.tokens, t.tokens)
        why = f"token {i} is {d.tokens[i]!r} in the draft and {t.tokens[i]!r} in the target"
    elif (d.bos_id, d.eos_id) != (t.bos_id, t.eos_id):
        why = f"BOS/EOS ids are {d.bos_id}/{d.eos_id} in the draft and {t.bos_id}/{t.eos_id} in the target"
    elif {i for i in d.eog_ids if i < len(t.tokens)} != set(t.eog_ids):
        why = f"end-of-generation ids differ ({sorted(d.eog_ids)} vs the target's {sorted(t.eog_ids)})"
    if why:
        raise ModelError(f"draft model {draft.name} cannot draft for {target.name}: {why} "
                         f"(a draft must share the target's vocabulary)")


def _common_prefix(a: list, b: list) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n
