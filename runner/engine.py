"""The engine: many sequences decoded together over one paged KV store (continuous batching).

``Engine.add(request)`` queues a request, ``Engine.step()`` runs one batched forward and
returns the events it produced as (request id, event) pairs, ``Engine.cancel(id)`` drops a
request wherever it is. A scheduler admits waiting requests while fewer than ``parallel``
run and the pool can hold everything each running one may still write (so no sequence is
ever preempted), and fills each step with the next token of every decoding sequence plus
whole prompt chunks under a token budget. One thread owns the engine: the backend's
buffers are not reentrant.

Determinism: a request's tokens do not depend on what else runs. Every generated token is
computed with one token's float steps (as plain decoding computes it); a prompt is computed
in the chunks ``numbat prompt`` uses (512 tokens from position 0), each with the float steps
of one llama.cpp batch of that size, whatever else shares the step; attention lanes go by
logical slot, so where a page lives changes no bit. Shared prompt pages are only those whose
every token took a full batch's steps (positions below L - L % 4 of a prompt of L tokens),
and a request reuses shared pages only while at least MIN_TAIL prompt tokens are left to
compute: then the rest of its prompt takes the same steps as in a cold run (see
``_prefill_plan``), and flash attention the path of the cold chunk's size. So a request's output equals ``numbat prompt``'s on the same input, bit
for bit, with or without the prefix cache, at any --parallel.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from runner.backends import Batch
from runner.generate import Done, TextOut, Token
from runner.kv_cache import PAGE, SeqKV
from runner.sampler import Sampler, SamplerConfig

# A prompt chunk of fewer than 8 tokens takes other float steps (Q6_K's lanes; one token:
# decode's attention) than the same tokens inside a longer chunk: reused pages always leave
# at least this many prompt tokens to compute.
MIN_TAIL = 8


@dataclass
class Request:
    id: str
    prompt: list[int]
    sampling: SamplerConfig = field(default_factory=SamplerConfig)
    max_tokens: int = -1             # -1: until an end of generation, at most the context
    stop: tuple[str, ...] = ()
    constraint: object = None        # a runner.constrain spec, or None


@dataclass
class Failed:
    """A request that could not run; the message says why and what to do."""
    message: str


@dataclass
class Timing:
    added: float = 0.0
    admitted: float = 0.0
    first: float = 0.0
    done: float = 0.0
    token_times: list[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        itl = np.diff(self.token_times) if len(self.token_times) > 1 else np.zeros(0)
        return {"queue_s": round(self.admitted - self.added, 4), "ttft_s": round(self.first - self.admitted, 4),
                "latency_s": round(self.done - self.admitted, 4),
                "itl_mean_s": round(float(itl.mean()), 5) if len(itl) else 0.0}


class _Seq:
    def __init__(self, req: Request, tokenizer, n_ctx: int, prefix_cache: bool):
        self.req = req
        self.kv = SeqKV()
        self.sampler = Sampler(req.sampling, req.constraint.start(tokenizer) if req.constraint is not None else None)
        L = len(req.prompt)
        room = n_ctx - L + 1            # the last sampled token is never fed
        self.limit = min(req.max_tokens, room) if req.max_tokens >= 0 else room
        self.out = TextOut(tokenizer, self.limit, req.stop)
        self.history = list(req.prompt)
        self.done = 0                   # prompt tokens computed
        self.next: int | None = None    # sampled, not yet fed
        self.shareable = L - L % 4 if prefix_cache else 0
        self.attached = False           # shared prompt pages looked up (at its first chunk)
        self.t = Timing(added=time.perf_counter())
        self.cancelled = False

    def pages_needed(self) -> int:
        return -(-(len(self.req.prompt) + self.limit - 1) // PAGE)


class Engine:
    def __init__(self, model, n_ctx: int, parallel: int = 8, n_pages: int | None = None,
                 prefix_cache: bool = True, trace=None):
        self.m, self.n_ctx, self.parallel = model, n_ctx, parallel
        self.trace = trace      # trace(request id, logits row) before each sample (tests compare bits)
        self.backend = model.backend
        self.chunk = self.backend.chunk
        self.budget = self.backend.max_tokens       # tokens one forward takes
        if parallel + 1 > self.budget - self.chunk:
            raise ValueError(f"--parallel must be at most {self.budget - self.chunk - 1}")
        per_seq = -(-n_ctx // PAGE)
        self.kv = self.backend.make_store(n_pages or (parallel + 1) * per_seq, n_ctx)
        self.prefix_cache = prefix_cache
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.steps = 0

    # ------------------------------------------------------------------ requests

    def add(self, req: Request) -> list[tuple[str, object]]:
        """Queue a request; a request that can never run is answered at once (Failed)."""
        L = len(req.prompt)
        if L == 0:
            return [(req.id, Failed("the prompt is empty"))]
        if L >= self.n_ctx:
            return [(req.id, Failed(f"the prompt is {L} tokens but the context holds {self.n_ctx}: "
                                    f"raise it with -c/--ctx or shorten the prompt"))]
        try:
            s = _Seq(req, self.m.tokenizer, self.n_ctx, self.prefix_cache)
        except ValueError as e:         # a constraint the tokenizer cannot serve
            return [(req.id, Failed(str(e)))]
        if s.pages_needed() > self.kv.pool.n_pages:
            return [(req.id, Failed(f"the request needs {s.pages_needed()} KV pages, the pool has "
                                    f"{self.kv.pool.n_pages}: lower -n or raise --kv-pages"))]
        self.waiting.append(s)
        return []

    def cancel(self, rid: str) -> bool:
        for q in (self.waiting, self.running):
            for s in q:
                if s.req.id == rid:
                    q.remove(s)
                    self.kv.free(s.kv)
                    return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ scheduling

    def _reserved(self) -> int:
        """Pages the running sequences may still claim."""
        return sum(s.pages_needed() - len(s.kv.pages) for s in self.running)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.parallel:
            s = self.waiting[0]
            if self.kv.pool.available() - self._reserved() < s.pages_needed():
                break
            self.waiting.popleft()
            s.t.admitted = time.perf_counter()
            self.running.append(s)

    def _prefill_plan(self, s: _Seq) -> int:
        """The end of s's next prompt chunk: the next multiple of the chunk size, or the
        prompt's end, so chunks fall where a cold run's do (after reused pages, the first
        chunk is the rest of a cold chunk: a multiple of 64 tokens, or the prompt's last
        >= MIN_TAIL tokens, either way the same float steps for each token)."""
        return min((s.done // self.chunk + 1) * self.chunk, len(s.req.prompt))

    def step(self) -> list[tuple[str, object]]:
        """One forward: every decoding sequence's next token and whole prompt chunks of the
        admitted ones, as many as the token budget holds (at least one)."""
        self._admit()
        if not self.running:
            return []
        seqs, toks, pos, segs, out_rows, owners, slots = [], [], [], [], [], [], []
        decoding = [s for s in self.running if s.next is not None]
        for s in decoding:                  # one token each, one token's float steps
            seqs.append(s)
            toks.append(s.next)
            pos.append(s.kv.n)
            slots.append(self.kv.grow(s.kv, 1))
            out_rows.append(len(toks) - 1)
            owners.append(s)
            s.history.append(s.next)
            s.next = None
        if decoding:
            segs.append((0, len(toks), False))
        budget = self.budget - len(toks)
        computing: set[bytes] = set()       # keys of the shareable pages this step computes
        for s in self.running:
            if s.done >= len(s.req.prompt):
                continue
            if not s.attached:              # reuse shared pages, or wait for the ones computed now
                if self.prefix_cache and not self.kv.attach(s.kv, s.req.prompt, MIN_TAIL, computing):
                    continue
                s.done, s.attached = s.kv.n, True
            end = self._prefill_plan(s)
            n = end - s.done
            if n > budget:
                break
            a = len(toks)
            seqs.append(s)
            toks.extend(s.req.prompt[s.done:end])
            pos.extend(range(s.done, end))
            slots.append(self.kv.grow(s.kv, n))
            # the cold chunk's size: flash attention's path goes by it, not by the reused tail's
            segs.append((a, a + n, n > 1, end - s.done // self.chunk * self.chunk))
            if end == len(s.req.prompt):
                out_rows.append(a + n - 1)
                owners.append(s)
            s.done = end
            budget -= n
        # a sequence is in a step once: decoding or with one prompt chunk
        seq_of = np.concatenate([np.full(len(sl), i, np.int64) for i, sl in enumerate(slots)])
        b = Batch(np.asarray(toks, np.int64), np.asarray(pos, np.int64), seq_of, segs, np.asarray(out_rows, np.int64))
        kv = self.kv.view([s.kv for s in seqs], np.concatenate(slots), self.backend.windows)
        logits = self.backend.run(b, kv)
        self.steps += 1
        for s in seqs:                       # pages whose every token took a full batch's steps
            if s.shareable:
                self.kv.share(s.kv, s.req.prompt, min(s.done, s.shareable))
        now = time.perf_counter()
        events = []
        for row, s in zip(range(len(out_rows)), owners):
            if self.trace:
                self.trace(s.req.id, logits[row])
            t = s.sampler.next(logits[row], s.history)
            if not s.out.ids:
                s.t.first = now
            s.t.token_times.append(now)
            evs = s.out.push(t)
            events += [(s.req.id, e) for e in evs]
            if s.out.finish is None:
                s.next = t
            else:
                events += self._finish(s, now)
        return events

    def _finish(self, s: _Seq, now: float) -> list[tuple[str, object]]:
        self.running.remove(s)
        self.kv.free(s.kv)
        s.t.done = now
        evs = [(s.req.id, e) for e in s.out.close()]
        return evs + [(s.req.id, Done(s.out.finish, s.out.text, SeqStats(s), s.out.ids))]


class SeqStats:
    """What a finished request reports (Done.stats in the engine)."""

    def __init__(self, s: _Seq):
        self.prompt_tokens = len(s.req.prompt)
        self.cached_tokens = s.kv.cached_tokens
        self.completion_tokens = len(s.out.ids)
        self.timing = s.t
        self.seed = s.req.sampling.seed
        c = s.sampler.constraint
        self.incomplete = c is not None and not c.is_complete()     # ended before its grammar did

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens, **self.timing.as_dict()}
