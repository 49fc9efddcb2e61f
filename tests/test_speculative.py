"""Speculative decoding (runner/speculative.py).

- The acceptance rule, exactly: for random p and q, accepted guesses plus resampled
  rejections are distributed as p.
- End to end at temperature > 0 on bigram models, whose exact sequence probabilities can be
  enumerated: a chi-square test that passes for the rule and fails for wrong rules.
- Temperature 0 on tiny random GGUF models: the same events and the same KV cache as plain
  generate(), including stops inside an accepted run and the context end inside a draft.
- Draft/target compatibility, the CLI flags, and real models (marked ``real``).
"""
import dataclasses
import re
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from gguf_io.testing import write_tiny_model
from runner import speculative
from runner.chat import ChatSession
from runner.generate import Done, Notice, generate
from runner.kv_cache import KVCache
from runner.model import ModelError, load
from runner.sampler import Sampler, SamplerConfig
from runner.speculative import (DraftModel, PromptLookup, accept_prob, check_compatible, residual,
                                speculative_generate)

GREEDY = SamplerConfig(temp=0)


# ---------------------------------------------------------------- the rule, exactly

def _dist(rng, n: int, zeros: int) -> np.ndarray:
    """A random distribution over n ids, `zeros` of them impossible (as top-k/top-p/min-p make)."""
    p = rng.dirichlet(np.full(n, 0.7))
    p[rng.choice(n, zeros, replace=False)] = 0
    return p / p.sum()


@pytest.mark.parametrize("seed", range(30))
def test_rule_emits_the_target_distribution(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 12))
    p, q = _dist(rng, n, int(rng.integers(0, n - 1))), _dist(rng, n, int(rng.integers(0, n - 1)))
    out = np.zeros(n)
    for x in np.flatnonzero(q):            # a draft guess x, drawn from q
        a = accept_prob(p, q, x)
        out[x] += q[x] * a
        out += q[x] * (1 - a) * residual(p, q, x)
    np.testing.assert_allclose(out, p, atol=1e-12)
    for x in range(n):                     # a lookup guess: any fixed x (q a point mass on it)
        a = accept_prob(p, None, x)
        out = (1 - a) * residual(p, None, x)
        out[x] += a
        np.testing.assert_allclose(out, p, atol=1e-12)


# ---------------------------------------------------------------- temperature > 0, end to end

class Bigram:
    """A model whose next-token logits depend only on the current token, with the interface that
    generate() and speculative_generate() use (no real cache behind the positions)."""

    def __init__(self, name: str, table: np.ndarray, texts: list[str]):
        self.name, self.table, self.backend = name, table.astype(np.float32), self
        self.cfg = SimpleNamespace(n_vocab=len(table))
        self.tokenizer = SimpleNamespace(
            tokens=texts, kind="bpe", bos_id=None, eos_id=None, eog_ids=frozenset(),
            stream=lambda: SimpleNamespace(add=lambda t: texts[t], flush=lambda: ""))

    def make_cache(self, n_ctx, n_keep=0):
        return KVCache(1, 1, 1, n_ctx, [0], 16, n_keep)

    def forward(self, tokens, cache, logits="last"):
        cache.write_slots(len(tokens))
        out = self.table[np.asarray(tokens)]
        return out if logits == "all" else out[-1:]


# top-k makes p and q miss different ids; the penalty makes every step depend on the history
HOT = SamplerConfig(temp=1.0, top_k=3, top_p=1.0, min_p=0.0, repeat_penalty=1.5, seed=5)
PROMPT = [0, 1, 2, 0, 1]        # repeats, so lookup finds n-grams
N_OUT, N_RUNS = 4, 4000


@pytest.fixture(scope="module")
def bigrams():
    rng = np.random.default_rng(3)
    table = rng.standard_normal((5, 5))
    target = Bigram("target", table, list("abcde"))
    # the draft knows one more token ('f', never proposed) and disagrees with the target a little
    dtable = np.pad(table, ((0, 1), (0, 1)), constant_values=0.5) + 0.8 * rng.standard_normal((6, 6))
    return target, Bigram("draft", dtable, list("abcdef"))


def _exact(model, cfg, prompt, n):
    """P(the next n tokens) for every sequence the target can emit, by enumeration."""
    s, probs = Sampler(cfg), {}

    def walk(seq, pr):
        if len(seq) == n:
            probs[tuple(seq)] = pr
            return
        hist = prompt + seq
        p = s.dist(model.table[hist[-1]], hist)
        for t in np.flatnonzero(p):
            walk(seq + [int(t)], pr * p[t])
    walk([], 1.0)
    return probs


def _chi2(counts: Counter, probs: dict, n: int) -> tuple[float, float]:
    """Pearson's statistic (cells expecting < 5 pooled; inf if an impossible sequence came
    out) and the 1 - 1e-4 quantile of its chi-square distribution (Wilson-Hilferty)."""
    if set(counts) - set(probs):
        return float("inf"), 0.0
    exp = np.array([probs[c] * n for c in probs])
    obs = np.array([counts[c] for c in probs], float)
    small = exp < 5
    exp, obs = np.append(exp[~small], exp[small].sum()), np.append(obs[~small], obs[small].sum())
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(exp) - 1
    return stat, df * (1 - 2 / (9 * df) + 3.719 * np.sqrt(2 / (9 * df))) ** 3


def _sample(target, proposer):
    """N_RUNS generations of N_OUT tokens after PROMPT: their counts, guesses checked and accepted."""
    s, counts, drafted, accepted = Sampler(HOT), Counter(), 0, 0
    for _ in range(N_RUNS):
        done = list(speculative_generate(target, PROMPT, s, target.make_cache(64), proposer, N_OUT))[-1]
        counts[tuple(done.tokens)] += 1
        drafted, accepted = drafted + done.stats.spec.drafted, accepted + done.stats.spec.accepted
    return counts, drafted, accepted


def _proposer(kind, target, draft):
    return DraftModel(target, draft, 64, k=3) if kind == "draft" else PromptLookup(ngram=2, k=3)


@pytest.mark.parametrize("kind", ["draft", "lookup"])
def test_sampled_sequences_follow_the_target(bigrams, kind):
    target, draft = bigrams
    proposer = _proposer(kind, target, draft)
    counts, drafted, accepted = _sample(target, proposer)
    assert 0 < accepted < drafted      # both branches of the rule ran
    stat, crit = _chi2(counts, _exact(target, HOT, PROMPT, N_OUT), N_RUNS)
    assert stat < crit, f"chi-square {stat:.1f} >= {crit:.1f}"


@pytest.mark.parametrize("kind", ["draft", "lookup"])
@pytest.mark.parametrize("wrong", ["always accept", "resample from p"])
def test_the_same_statistic_catches_a_wrong_rule(bigrams, kind, wrong, monkeypatch):
    target, draft = bigrams
    if wrong == "always accept":
        monkeypatch.setattr(speculative, "accept_prob", lambda p, q, x: 1.0)
    else:    # forgets to take q away from p after a rejection
        monkeypatch.setattr(speculative, "residual", lambda p, q, x: p)
    counts, _, _ = _sample(target, _proposer(kind, target, draft))
    stat, crit = _chi2(counts, _exact(target, HOT, PROMPT, N_OUT), N_RUNS)
    assert stat > crit, f"chi-square {stat:.1f} <= {crit:.1f}: the wrong rule went unnoticed"


# ---------------------------------------------------------------- temperature 0 on tiny models

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random target and its Q8_0 copy as the draft: mostly but not always the same argmax."""
    d = tmp_path_factory.mktemp("spec")
    target = load(str(write_tiny_model(d / "target.gguf", seed=1, n_ctx_train=1024)))
    draft = load(str(write_tiny_model(d / "draft.gguf", seed=1, n_ctx_train=1024,
                                      weight_type=GGMLQuantizationType.Q8_0)))
    return target, draft


PROPOSERS = {
    "draft k=4": lambda t, d, n_ctx: DraftModel(t, d, n_ctx, k=4),
    "draft k=1": lambda t, d, n_ctx: DraftModel(t, d, n_ctx, k=1),
    "self k=15": lambda t, d, n_ctx: DraftModel(t, t, n_ctx, k=15),   # every guess accepted
    "lookup": lambda t, d, n_ctx: PromptLookup(ngram=3, k=8),
}
PROMPTS = [[1] + np.random.default_rng(i).integers(259, 384, 3 + 3 * i % 28).tolist() for i in range(20)]


def _events(model, prompt, n_ctx, max_tokens, proposer=None, stop=()):
    """The events of one greedy generation, comparable with ==, and the cache it left."""
    cache = model.make_cache(n_ctx, n_keep=1)
    s = Sampler(GREEDY)
    evs = (generate(model, prompt, s, cache, max_tokens, stop) if proposer is None
           else speculative_generate(model, prompt, s, cache, proposer, max_tokens, stop))
    out = []
    for e in evs:
        out.append(("done", e.finish_reason, e.text, e.tokens) if isinstance(e, Done) else
                   ("notice", e.text) if isinstance(e, Notice) else ("token", e.id, e.text))
        if isinstance(e, Done):
            spec = e.stats.spec
    return out, cache, spec


def _same_cache(a: KVCache, b: KVCache):
    """The same positions, and bit-identical keys and values in every slot still in use."""
    assert (a.n_past, a.dropped) == (b.n_past, b.dropped)
    for la, lb in zip(a.layers, b.layers):
        np.testing.assert_array_equal(la.pos, lb.pos)
        live = la.pos >= 0
        np.testing.assert_array_equal(la.k[:, live], lb.k[:, live])
        np.testing.assert_array_equal(la.v[:, live], lb.v[:, live])


def _check_same(target, proposer, prompt, n_ctx, max_tokens, stop=()):
    plain, plain_cache, _ = _events(target, prompt, n_ctx, max_tokens, stop=stop)
    spec_evs, spec_cache, spec = _events(target, prompt, n_ctx, max_tokens, proposer, stop)
    assert spec_evs == plain
    _same_cache(spec_cache, plain_cache)
    return plain, spec


@pytest.mark.parametrize("name", PROPOSERS)
def test_greedy_is_plain_greedy(tiny, name):
    target, draft = tiny
    proposer = PROPOSERS[name](target, draft, 256)
    drafted = accepted = 0
    for prompt in PROMPTS:
        _, spec = _check_same(target, proposer, prompt, 256, 40)
        drafted, accepted = drafted + spec.drafted, accepted + spec.accepted
    assert accepted > 0
    if name == "self k=15":
        assert accepted == drafted
    else:
        assert accepted < drafted        # rejections and rollbacks happened too


@pytest.mark.parametrize("name", PROPOSERS)
def test_context_end_inside_a_draft(tiny, name):
    """A 24-token context: drafts shrink as the end nears, then tokens go one at a time and the
    ring drops the oldest ones, exactly as in plain decoding (the same notice, at the same place)."""
    target, draft = tiny
    proposer = PROPOSERS[name](target, draft, 24)
    asked, propose = [], proposer.propose
    proposer.propose = lambda context, k, sampler: asked.append(k) or propose(context, k, sampler)
    drafted = 0
    for prompt in [p for p in PROMPTS if len(p) <= 16] + [[1] + [300, 301, 302] * 4]:
        plain, spec = _check_same(target, proposer, prompt, 24, 40)
        assert [e for e in plain if e[0] == "notice"] and plain[-1][1] == "length"
        drafted += spec.drafted
    assert drafted > 0
    assert proposer.k == 1 or any(0 < k < proposer.k for k in asked)   # a draft cut short by the end


@pytest.mark.parametrize("name", PROPOSERS)
def test_stops_inside_an_accepted_run(tiny, name):
    """End of generation, a stop string and max tokens, each landing inside a run of accepted
    guesses: the same events, and the cache holds every token but the last."""
    target, draft = tiny
    prompt = PROMPTS[4]
    free, _, _ = _events(target, prompt, 256, 40)
    tokens, text = free[-1][3], free[-1][2]
    # an end-of-generation token: the first token that is new at step 5 or later
    i = next(i for i in range(5, len(tokens)) if tokens[i] not in tokens[:i])
    eog = [dataclasses.replace(m, tokenizer=dataclasses.replace(m.tokenizer, eog_ids=frozenset({tokens[i]})))
           for m in (target, draft)]
    evs, _ = _check_same(eog[0], PROPOSERS[name](*eog, 256), prompt, 256, 40)
    assert evs[-1][1] == "stop" and evs[-1][3] == tokens[:i + 1]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    evs, _ = _check_same(target, PROPOSERS[name](target, draft, 256), prompt, 256, 40, stop=(stop,))
    assert evs[-1][1] == "stop" and evs[-1][2] == text[:text.index(stop)]
    evs, _ = _check_same(target, PROPOSERS[name](target, draft, 256), prompt, 256, 7)
    assert evs[-1][1] == "length" and len(evs[-1][3]) == 7


def test_chat_turns_are_the_same(tiny):
    """A chat keeps the draft's cache across turns and resyncs it with the conversation."""
    target, draft = tiny
    plain = ChatSession(target, Sampler(GREEDY), 512, system="Be brief.")
    spec = ChatSession(target, Sampler(GREEDY), 512, system="Be brief.", proposer=DraftModel(target, draft, 512))
    for turn in ["hello there", "tell me more", "and then?"]:
        assert "".join(p for p, _ in spec.reply(turn, 16)) == "".join(p for p, _ in plain.reply(turn, 16))
        assert spec.fed == plain.fed
        _same_cache(spec.cache, plain.cache)
    assert spec.stats()["turns"][-1]["speculative"]["drafted"] > 0


def test_a_draft_with_more_tokens_never_proposes_them(tmp_path, tiny):
    target, _ = tiny
    big = load(str(write_tiny_model(tmp_path / "big.gguf", seed=1, n_vocab=400, n_ctx_train=1024)))
    for prompt in PROMPTS[:5]:
        _check_same(target, DraftModel(target, big, 256), prompt, 256, 24)
    with pytest.raises(ModelError, match="cannot draft for .*: it has 384 tokens, the target 400"):
        DraftModel(big, target, 256)


# ---------------------------------------------------------------- compatibility

def _fake(name, **tok):
    base = dict(kind="bpe", tokens=["a", "b", "c"], bos_id=0, eos_id=1, eog_ids=frozenset({1}))
    return SimpleNamespace(name=name, tokenizer=SimpleNamespace(**{**base, **tok}))


@pytest.mark.parametrize("draft,needle", [
    (_fake("d", kind="spm"), "its tokenizer is spm, the target's is bpe"),
    (_fake("d", tokens=["a", "x", "c"]), "token 1 is 'x' in the draft and 'b' in the target"),
    (_fake("d", eos_id=2), "BOS/EOS ids are 0/2 in the draft and 0/1 in the target"),
    (_fake("d", eog_ids=frozenset({1, 2})), "end-of-generation ids differ"),
])
def test_incompatible_drafts_are_refused(draft, needle):
    with pytest.raises(ModelError, match=re.escape(f"draft model d cannot draft for t: {needle}")):
        check_compatible(_fake("t"), draft)
    check_compatible(_fake("t"), _fake("d", tokens=["a", "b", "c", "extra"]))
