"""generate(): a generator of token events over a model and a KV cache.

Prefill runs the new prompt tokens through the backend in chunks (batched matmul); decode
then runs one token at a time. Text is streamed through the tokenizer's stream decoder, so
no event carries half a UTF-8 character, and text that might begin a stop string is held
back until it is known not to.

``emit`` turns any source of token ids into those events; plain decoding is one source,
speculative decoding (runner/speculative.py) another, so both stop in the same way.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator


from runner.sampler import Sampler


class ContextError(Exception):
    pass


@dataclass
class Stats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_s: float = 0.0
    gen_s: float = 0.0
    ttft_s: float = 0.0
    spec: object = None     # speculative.SpecStats when the tokens were speculated

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s else 0.0

    @property
    def gen_tps(self) -> float:
        # the first token comes out of prefill; the rest are decode steps
        return (self.completion_tokens - 1) / self.gen_s if self.gen_s and self.completion_tokens > 1 else 0.0

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "ttft_s": round(self.ttft_s, 4), "prompt_tokens_per_s": round(self.prompt_tps, 2),
                "generation_tokens_per_s": round(self.gen_tps, 2),
                **({"speculative": self.spec.as_dict()} if self.spec else {})}


@dataclass
class Token:
    id: int
    text: str


@dataclass
class Notice:
    text: str


@dataclass
class Done:
    finish_reason: str      # "stop" (end of generation token or stop string) | "length"
    text: str
    stats: Stats
    tokens: list[int] = field(default_factory=list)


def check_fits(n_prompt: int, cache) -> None:
    room = cache.n_ctx - min(cache.n_keep, cache.n_past)
    if n_prompt > room:
        raise ContextError(f"the prompt is {n_prompt} tokens but the context holds {cache.n_ctx}: "
                           f"raise it with -c/--ctx or shorten the prompt")


def generate(model, prompt_ids: list[int], sampler: Sampler, cache, max_tokens: int = -1,
             stop: tuple[str, ...] = (), history: list[int] | None = None) -> Iterator[Token | Notice | Done]:
    """Feed prompt_ids (the tokens not yet in cache) and sample up to max_tokens (-1: until an
    end-of-generation token, at most one context's worth). ``history`` is what penalties see."""
    def decode(logits, history):
        t = sampler.next(logits, history)
        ahead = getattr(model.backend, "greedy", None)
        if ahead is not None and sampler.plain_greedy:
            yield from ahead(t, cache)      # the same tokens, each step started before it is needed
        while True:
            yield t
            logits = model.backend.forward([t], cache)[-1]
            t = sampler.next(logits, history)
    return emit(model, prompt_ids, cache, decode, max_tokens, stop, history)


class TextOut:
    """One sequence's output as it streams: the detokenizer, stop strings held back, the end
    of generation and the token limit. ``push(t)`` returns the events of token t and sets
    ``finish`` once the sequence is done; ``close()`` returns the held-back tail. Shared by
    generate(), speculative decoding and the batch engine."""

    def __init__(self, tokenizer, max_tokens: int, stop: tuple[str, ...] = ()):
        self.stream, self.eog, self.stop = tokenizer.stream(), tokenizer.eog_ids, stop
        self.limit = max_tokens
        self.hold = max((len(s) for s in stop), default=1) - 1   # chars that could start a stop string
        self.text, self.pending, self.ids = "", "", []
        self.finish: str | None = None      # "stop" | "length" once done
        self._stop_string = False

    def push(self, t: int) -> list[Token]:
        self.ids.append(t)
        if t in self.eog:
            self.finish = "stop"
            return []
        self.pending += self.stream.add(t)
        cut = _find_stop(self.pending, self.stop)
        if cut is not None:
            self.pending, self.finish, self._stop_string = self.pending[:cut], "stop", True
            return []
        piece = ""
        if len(self.pending) > self.hold:
            n = len(self.pending) - self.hold
            piece, self.pending = self.pending[:n], self.pending[n:]
            self.text += piece
        if len(self.ids) >= self.limit:
            self.finish = "length"
        return [Token(t, piece)]   # one event per token; text may be "" while it is held back

    def close(self) -> list[Token]:
        if not self._stop_string:
            self.pending += self.stream.flush()
        tail, self.pending = self.pending, ""
        self.text += tail
        return [Token(-1, tail)] if tail else []   # the held-back tail: no new token


def emit(model, prompt_ids: list[int], cache, source, max_tokens: int = -1, stop: tuple[str, ...] = (),
         history: list[int] | None = None, stats: Stats | None = None) -> Iterator[Token | Notice | Done]:
    """Prefill, then turn the ids of ``source(prefill_logits, history)`` into events. The source
    is an endless generator; ``history`` (the tokens so far) grows by each id taken from it
    before it is resumed. A source may run the cache ahead of the ids taken (speculation):
    at the end the cache is rolled back to every id taken but the last, as plain decoding
    leaves it (the last one is fed first in the next turn)."""
    check_fits(len(prompt_ids), cache)
    history = list(history or []) + list(prompt_ids)
    out = TextOut(model.tokenizer, max_tokens if max_tokens >= 0 else cache.n_ctx, stop)
    stats = stats or Stats()
    stats.prompt_tokens = len(prompt_ids)
    dropped_before = cache.dropped
    t0 = time.perf_counter()
    logits = model.backend.forward(prompt_ids, cache)[-1] if prompt_ids else None
    stats.prompt_s = time.perf_counter() - t0
    n_prompt_end = cache.n_past
    t1 = time.perf_counter()
    tokens = source(logits, history) if logits is not None and out.limit > 0 else None
    if tokens is None:
        out.finish = "length"
    while out.finish is None:
        t = next(tokens)
        if not out.ids:
            stats.ttft_s = time.perf_counter() - t0
            t1 = time.perf_counter()
        if cache.dropped and not dropped_before:
            dropped_before = True
            yield Notice(f"context full ({cache.n_ctx} tokens): the earliest tokens were dropped "
                         f"(the first {cache.n_keep} are kept)")
        history.append(t)
        yield from out.push(t)
    if out.ids:
        cache.rollback(cache.n_past - (n_prompt_end + len(out.ids) - 1))
    yield from out.close()
    stats.completion_tokens = len(out.ids)
    stats.gen_s = time.perf_counter() - t1
    yield Done(out.finish, out.text, stats, out.ids)


def _find_stop(text: str, stop: tuple[str, ...]) -> int | None:
    hits = [text.find(s) for s in stop if s and s in text]
    return min(hits) if hits else None
