"""The paged KV pool and the batch engine on tiny random-weight models: page bookkeeping
(allocation, prefix hits, eviction, no leaks) and the engine's outputs against generate()
one request at a time, whatever the parallelism, the order and the prefix cache."""
import random

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from gguf_io.testing import write_tiny_model
from runner.backends import Batch
from runner.engine import MIN_TAIL, Engine, Failed, Request
from runner.generate import Done, generate
from runner.kv_cache import PAGE, BlockPool, PagedKV, PoolFull, SeqKV
from runner.model import load
from runner.sampler import Sampler, SamplerConfig


# ---------------------------------------------------------------- the pool

def test_pool_allocates_distinct_pages_and_refuses_when_full():
    pool = BlockPool(3)
    pages = [pool.allocate() for _ in range(3)]
    assert sorted(pages) == [0, 1, 2] and pool.available() == 0 and pool.peak == 3
    with pytest.raises(PoolFull):
        pool.allocate()
    pool.release(pages[1])
    assert pool.allocate() == pages[1]        # an unkeyed page goes straight back to the free list


def test_pool_keeps_released_keyed_pages_until_it_needs_them_oldest_first():
    pool = BlockPool(3)
    a, b, c = (pool.allocate() for _ in range(3))
    ka, kb = BlockPool.key(None, [1] * PAGE), BlockPool.key(None, [2] * PAGE)
    pool.register(a, ka)
    pool.register(b, kb)
    assert pool.lookup(ka) == a and pool.ref[a] == 2          # shared: referenced twice
    pool.release(a), pool.release(a), pool.release(b)
    assert pool.ref[a] == pool.ref[b] == 0 and pool.available() == 2   # cached, evictable
    assert pool.lookup(kb) == b and pool.ref[b] == 1                    # revived from the cache
    pool.release(b)                                                     # now b is the most recent
    assert pool.allocate() == a and pool.evictions == 1                 # a was released first
    assert pool.lookup(ka) is None and pool.lookup(kb) == b
    pool.release(b), pool.release(c), pool.release(a)
    assert (pool.ref == 0).all() and pool.available() == 3


def test_keys_chain_the_whole_prefix():
    k1 = BlockPool.key(None, range(PAGE))
    assert BlockPool.key(k1, range(PAGE)) != BlockPool.key(BlockPool.key(None, [0] * PAGE), range(PAGE))
    assert BlockPool.key(None, range(PAGE)) == k1


def test_paged_prefix_sharing_across_sequences_and_no_leak():
    kv = PagedKV(n_layer=1, n_kv=1, head_dim=4, n_pages=16, max_pages=8)
    prompt = list(range(3 * PAGE + 20))
    a = SeqKV()
    assert kv.attach(a, prompt, MIN_TAIL, set())
    assert a.n == 0                                   # nothing cached yet
    kv.grow(a, len(prompt))
    kv.share(a, prompt, len(prompt) - len(prompt) % 4)
    assert len(a.keys) == 3                           # the three full pages
    b = SeqKV()
    assert kv.attach(b, prompt[:2 * PAGE + 5] + [999] * 40, MIN_TAIL, set())
    assert b.n == b.cached_tokens == 2 * PAGE and b.pages == a.pages[:2]
    assert all(kv.pool.ref[p] == 2 for p in a.pages[:2])
    c = SeqKV()                                       # the whole prompt: at least MIN_TAIL tokens stay to compute
    assert kv.attach(c, prompt[:3 * PAGE + MIN_TAIL - 1], MIN_TAIL, set()) and c.n == 2 * PAGE
    slots = kv.grow(b, 7)
    assert (kv.pos[slots] == np.arange(2 * PAGE, 2 * PAGE + 7)).all()
    for s in (a, b, c):
        kv.free(s)
    assert (kv.pool.ref == 0).all() and kv.pool.available() == 16


def test_attach_waits_for_a_page_computed_in_the_same_step():
    kv = PagedKV(n_layer=1, n_kv=1, head_dim=4, n_pages=8, max_pages=4)
    prompt = list(range(2 * PAGE))
    computing = set()
    assert kv.attach(SeqKV(), prompt, MIN_TAIL, computing) and len(computing) == 1
    assert not kv.attach(SeqKV(), prompt, MIN_TAIL, computing)     # the same first page: wait a step


def test_recycled_pages_forget_their_positions():
    kv = PagedKV(n_layer=1, n_kv=1, head_dim=4, n_pages=1, max_pages=1)
    a = SeqKV()
    kv.grow(a, 40)
    kv.free(a)
    b = SeqKV()
    slots = kv.grow(b, 3)
    assert (kv.pos[slots] == [0, 1, 2]).all() and (kv.pos[3:PAGE] == -1).all()
    with pytest.raises(PoolFull):
        kv.grow(b, PAGE)                  # past its context


# ---------------------------------------------------------------- the forward over a batch

@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request, tmp_path_factory):
    kw = dict(n_layer=6, head_dim=32, sliding_window=8) if request.param == "gemma3" else dict(head_dim=64)
    p = write_tiny_model(tmp_path_factory.mktemp("m") / f"{request.param}.gguf", request.param, seed=3,
                         weight_type=T.Q8_0, n_ctx_train=512, **kw)
    return load(str(p))


def test_a_token_gets_the_same_bits_whatever_shares_its_forward(tiny):
    """Two prompts as two segments of one forward, then both next tokens in one decode
    segment, over scattered pages: each row bit-identical to its sequence run alone."""
    be, rng = tiny.backend, np.random.default_rng(5)
    pa, pb = rng.integers(3, 380, 70).tolist(), rng.integers(3, 380, 21).tolist()
    alone = {}
    for name, p in (("a", pa), ("b", pb)):
        cache = be.make_cache(256)
        first = be.forward(p, cache)[0]
        alone[name] = (first, be.forward([int(first.argmax())], cache)[0])
    kv = be.make_store(16, 256)
    filler = SeqKV()
    kv.grow(filler, 3 * PAGE)           # the two sequences' pages are not the first ones
    a, b = SeqKV(), SeqKV()
    sa, sb = kv.grow(a, len(pa)), kv.grow(b, len(pb))
    kv.free(filler)
    batch = Batch(np.array(pa + pb), np.r_[np.arange(len(pa)), np.arange(len(pb))],
                  np.r_[np.zeros(len(pa), np.int64), np.ones(len(pb), np.int64)],
                  [(0, len(pa), True), (len(pa), len(pa) + len(pb), True)], np.array([len(pa) - 1, len(pa) + len(pb) - 1]))
    first = be.run(batch, kv.view([a, b], np.r_[sa, sb], be.windows))
    assert np.array_equal(first[0], alone["a"][0]) and np.array_equal(first[1], alone["b"][0])
    nxt = [int(first[0].argmax()), int(first[1].argmax())]
    slots = np.r_[kv.grow(b, 1), kv.grow(a, 1)]          # the other order, for once
    batch = Batch(np.array(nxt[::-1]), np.array([len(pb), len(pa)]), np.array([0, 1]), [(0, 2, False)], np.array([0, 1]))
    second = be.run(batch, kv.view([b, a], slots, be.windows))
    assert np.array_equal(second[1], alone["a"][1]) and np.array_equal(second[0], alone["b"][1])


# ---------------------------------------------------------------- the engine

def _requests(m, sampling, n=9):
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 380, 2 * PAGE + 9).tolist()     # a long shared "system prompt"
    reqs = []
    for i in range(n):
        tail = rng.integers(3, 380, int(rng.integers(1, 90))).tolist()
        ids = (shared + tail) if i % 3 else tail              # every third one shares nothing
        cfg = SamplerConfig(**{**sampling, "seed": sampling.get("seed") and sampling["seed"] + i})
        reqs.append(Request(f"r{i}", ids, cfg, max_tokens=int(rng.integers(1, 40))))
    return reqs


def _alone(m, r, n_ctx):
    for ev in generate(m, r.prompt, Sampler(r.sampling), m.make_cache(n_ctx), r.max_tokens):
        if isinstance(ev, Done):
            return ev.tokens


def _alone_logits(m, r, tokens, n_ctx):
    """The logits each of r's tokens was sampled from, run alone."""
    cache = m.make_cache(n_ctx)
    rows = [m.backend.forward(r.prompt, cache)[0]]
    return rows + [m.backend.forward([t], cache)[0] for t in tokens[:-1]]


def _engine(m, reqs, n_ctx, rows=None, **kw):
    e = Engine(m, n_ctx, trace=(lambda rid, row: rows.setdefault(rid, []).append(row.copy())) if rows is not None else None, **kw)
    got = {}
    for r in reqs:
        assert e.add(r) == []
    while e.has_work():
        for rid, ev in e.step():
            if isinstance(ev, Done):
                assert rid not in got
                got[rid] = ev.tokens
    assert (e.kv.pool.ref == 0).all() and e.kv.pool.available() == e.kv.pool.n_pages   # nothing leaked
    return got, e


@pytest.mark.parametrize("sampling", [{"temp": 0}, {"temp": 0.9, "top_k": 0, "min_p": 0, "seed": 11}],
                         ids=["greedy", "seeded"])
def test_engine_gives_each_request_what_it_gets_alone(tiny, sampling):
    n_ctx = 256
    reqs = _requests(tiny, sampling)
    want = {r.id: _alone(tiny, r, n_ctx) for r in reqs}
    assert len({tuple(v) for v in want.values()}) > 3       # the requests differ
    bits = {r.id: _alone_logits(tiny, r, want[r.id], n_ctx) for r in reqs}
    for parallel, prefix, order in ((1, True, 0), (3, True, 1), (8, False, 2), (8, True, 3)):
        rs = list(reqs)
        random.Random(order).shuffle(rs)
        rows = {}
        got, e = _engine(tiny, rs, n_ctx, rows, parallel=parallel, prefix_cache=prefix)
        assert got == want, (parallel, prefix)
        assert (e.kv.hits > 0) == prefix
        for rid, ref in bits.items():        # every sampled row, bit for bit
            assert len(rows[rid]) == len(ref) and all(np.array_equal(a, b) for a, b in zip(rows[rid], ref)), rid


def test_cancel_frees_pages_and_leaves_the_others_alone(tiny):
    reqs = _requests(tiny, {"temp": 0}, n=4)
    want = {r.id: _alone(tiny, r, 256) for r in reqs}
    e = Engine(tiny, 256, parallel=4)
    for r in reqs:
        e.add(r)
    e.step()
    assert e.cancel("r1") and not e.cancel("nope")
    got = {}
    while e.has_work():
        got.update({rid: ev.tokens for rid, ev in e.step() if isinstance(ev, Done)})
    assert "r1" not in got and got == {k: v for k, v in want.items() if k != "r1"}
    assert (e.kv.pool.ref == 0).all()


def test_requests_that_cannot_run_fail_at_once(tiny):
    e = Engine(tiny, 64, parallel=2)
    (rid, ev), = e.add(Request("long", list(range(3, 70))))
    assert rid == "long" and isinstance(ev, Failed) and "-c/--ctx" in ev.message
    (_, ev), = e.add(Request("empty", []))
    assert isinstance(ev, Failed) and "empty" in ev.message
    assert not e.has_work()
