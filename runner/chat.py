"""A chat session whose history lives in the KV cache.

Each turn renders the whole conversation with the chat template, keeps the longest prefix
that is already in the cache (token-level, as llama.cpp's server does) and runs only the rest.
When the context fills, the ring cache drops the oldest turns but keeps the system prompt
(n_keep), and the user is told once.
"""
from __future__ import annotations

from typing import Iterator

from runner.generate import ContextError, Done, Notice, Token, check_fits, generate
from runner.speculative import speculative_generate


class ChatSession:
    def __init__(self, model, sampler, n_ctx: int, system: str | None = None, proposer=None):
        self.m, self.sampler, self.n_ctx = model, sampler, n_ctx
        self.proposer = proposer    # speculative decoding (runner/speculative.py) when set
        self.cache = None
        self.reset(system)

    def reset(self, system: str | None = None) -> None:
        self.messages = [{"role": "system", "content": system}] if system else []
        tok = self.m.tokenizer
        n_keep = len(self.m.template.encode(tok, self.messages, add_generation_prompt=False)) if system \
            else int(tok.add_bos)
        if self.cache is None or self.cache.n_keep != n_keep:
            self.cache = self.m.make_cache(self.n_ctx, n_keep)
        self.cache.reset()
        self.fed: list[int] = []      # exactly the tokens in the cache, in order
        self.turns: list[dict] = []
        self._pending = None

    def reply(self, text: str, max_tokens: int = -1) -> Iterator[tuple[str, str | None]]:
        """Yields (text piece, notice) pairs while the reply streams."""
        self.messages.append({"role": "user", "content": text})
        ids = self.m.template.encode(self.m.tokenizer, self.messages)
        try:
            check_fits(len(ids) - self._cached_prefix(ids), self.cache)
        except ContextError:
            self.messages.pop()     # the turn never happened
            raise
        k = self._cached_prefix(ids)
        if k < len(self.fed):
            self.cache.rollback(len(self.fed) - k)
            del self.fed[k:]
        new = ids[k:]
        self._pending = (new, [])
        parts = []
        if self.proposer is None:
            events = generate(self.m, new, self.sampler, self.cache, max_tokens, history=self.fed)
        else:
            events = speculative_generate(self.m, new, self.sampler, self.cache, self.proposer, max_tokens,
                                          history=self.fed)
        for ev in events:
            if isinstance(ev, Token):
                if ev.id >= 0:
                    self._pending[1].append(ev.id)
                parts.append(ev.text)
                if ev.text:
                    yield ev.text, None
            elif isinstance(ev, Notice):
                yield "", ev.text
            elif isinstance(ev, Done):
                self._finish("".join(parts), ev.tokens, ev.stats.as_dict())
        self._pending = None

    def _cached_prefix(self, ids: list[int]) -> int:
        k = 0
        while k < min(len(ids), len(self.fed)) and ids[k] == self.fed[k]:
            k += 1
        return k

    def interrupted(self) -> None:
        """Ctrl-C mid-reply: keep what was said, and make the cache agree with ``fed``."""
        if self._pending is None:
            return
        new, gen = self._pending
        text = self.m.tokenizer.decode(gen)
        # the prompt is surely in the cache once a token was sampled; the last sampled token
        # may be half-run through the layers, so it is dropped and rerun next turn
        ok = len(self.fed) + (len(new) + len(gen) - 1 if gen else 0)
        self.cache.rollback(self.cache.n_past - ok)
        self._finish(text, gen, {"prompt_tokens": len(new), "completion_tokens": len(gen), "interrupted": True})
        self._pending = None

    def _finish(self, text: str, gen: list[int], stats: dict) -> None:
        new = self._pending[0]
        # every generated token but the last was fed back through the model
        self.fed += new + gen[:-1] if gen else new
        del self.fed[self.cache.n_past:]
        self.messages.append({"role": "assistant", "content": text})
        self.turns.append(stats)

    def stats(self) -> dict:
        return {"turns": self.turns, "context": {"n_ctx": self.cache.n_ctx, "used": self.cache.n_past,
                                                 "dropped": self.cache.dropped, "kept": self.cache.n_keep}}
