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
import json
import re
from collections import Counter
from types import SimpleNamespace

import numba
import numpy as np
import pytest
import typer
from gguf import GGMLQuantizationType

import cli
from gguf_io.testing import write_tiny_model
from quant import packed
from runner import speculative
from runner.chat import ChatSession
from runner.generate import Done, Notice, generate
from runner.kv_cache import KVCache
from runner.model import ModelError, load
from runner.sampler import Sampler, SamplerConfig
from runner.speculative import (DRAFT_K, DRAFT_P_MIN, LOOKUP_K, LOOKUP_NGRAM, DraftHead, DraftModel, PromptLookup,
                                accept_prob, check_compatible, residual, speculative_generate)
from test_cli import assert_one_line_error, call_main, invoke, run

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

    def forward(self, tokens, cache, logits="last", one_by_one=False):
        cache.claim(len(tokens))
        out = self.table[np.asarray(tokens)]
        return out if logits == "all" else out[-1:]


# top-k makes p and q miss different ids; the penalties make every step depend on the history
HOT = SamplerConfig(temp=1.0, top_k=3, top_p=1.0, min_p=0.0, repeat_penalty=1.5, frequency_penalty=0.4, seed=5)
PROMPT = [0, 1, 0, 1]           # repeats, so lookup finds n-grams
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
    if small.any():
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
    # k = 2: the first check covers tokens 2-4 of N_OUT = 4, the extra token when both pass included
    return DraftModel(target, draft, 64, k=2) if kind == "draft" else PromptLookup(ngram=2, k=2)


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
    """A random target and its Q8_0 copy as the draft (loaded as one: Q4_0 where the weights
    repack, as the CLI loads a draft): mostly but not always the same argmax."""
    d = tmp_path_factory.mktemp("spec")
    target = load(str(write_tiny_model(d / "target.gguf", seed=1, n_ctx_train=1024)))
    draft = load(str(write_tiny_model(d / "draft.gguf", seed=1, n_ctx_train=1024,
                                      weight_type=GGMLQuantizationType.Q8_0)), draft=True)
    return target, draft


@pytest.mark.skipif(not packed.enabled(), reason="a draft is requantized where weights repack (AVX512-VNNI)")
def test_a_draft_runs_its_wider_matrices_as_q4_0(tiny):
    target, draft = tiny
    as_file = load(str(draft.path))
    mats = lambda m: [w for L in m.backend.layers for w in vars(L).values() if hasattr(w, "raw")] + [m.backend.output]
    assert {(w.type_id, w.raw.type_id) for w in mats(as_file)} == {(GGMLQuantizationType.Q8_0,) * 2}
    assert {(w.type_id, w.raw.type_id) for w in mats(draft)} == {(GGMLQuantizationType.Q4_0,) * 2}
    ids = [1, 300, 301, 302]
    a, b = (m.backend.forward(ids, m.make_cache(64)) for m in (as_file, draft))
    assert not np.array_equal(a, b) and np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.9


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="compares one thread with two")
def test_a_drafts_attention_takes_the_tiled_path(tiny):
    """A draft's guesses need not be llama.cpp's bits: every query of it goes through flash
    attention's tiled path, whose bits do not depend on the thread count, where a target's
    decode past 512 cells splits its cells between the threads as llama.cpp does."""
    prompt = [1] + np.random.default_rng(3).integers(259, 384, 600).tolist()
    old = numba.get_num_threads()
    for m, same in ((tiny[1], True), (tiny[0], False)):
        cache = m.make_cache(1024)
        m.backend.forward(prompt, cache)
        rows = []
        try:
            for n in (2, 1):
                numba.set_num_threads(n)
                rows.append(m.backend.forward([300], cache).copy())
                cache.rollback(1)
        finally:
            numba.set_num_threads(old)
        assert np.array_equal(*rows) == same, m.path


PROPOSERS = {
    # p_min=0 (the default, written out): every draft guesses k (a random model's guesses are doubtful)
    "draft k=4": lambda t, d, n_ctx: DraftModel(t, d, n_ctx, k=4, p_min=0),
    "draft k=1": lambda t, d, n_ctx: DraftModel(t, d, n_ctx, k=1, p_min=0),
    "draft head 64": lambda t, d, n_ctx: DraftModel(t, d, n_ctx, k=4, head=64, p_min=0),   # ids past 64 from the context
    "draft k=8 p_min": lambda t, d, n_ctx: DraftModel(t, d, n_ctx, k=8, p_min=0.3),      # stops at doubtful guesses
    "self k=15": lambda t, d, n_ctx: DraftModel(t, t, n_ctx, k=15, p_min=0),   # every guess accepted
    "lookup": lambda t, d, n_ctx: PromptLookup(ngram=3, k=8),
}
PROMPTS = [[1] + np.random.default_rng(i).integers(259, 384, 3 + 3 * i % 28).tolist() for i in range(20)]


def _events(model, prompt, n_ctx, max_tokens, proposer=None, stop=()):
    """One greedy generation: its events (comparable with ==), the cache it left, and the
    speculation counters."""
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
        live = np.flatnonzero(la.pos >= 0)
        pg, off = live // 64, live % 64     # slot s: row s % 64 of page s // 64
        np.testing.assert_array_equal(la.k[pg, :, :, off], lb.k[pg, :, :, off])   # k: (pages, kv heads, dims, 64 + pad)
        np.testing.assert_array_equal(la.v[pg, :, off], lb.v[pg, :, off])


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
    """End of generation, a stop string and max tokens: the same events, and the cache holds
    every token but the last. With the target as its own draft (runs of 16 accepted tokens)
    each stop lands inside an accepted run."""
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


def test_draft_head_covers_the_first_ids_and_what_it_was_fed(tiny):
    """The first n logits as the full head computes them (the same kernel, bit for bit), the
    fed ids and ``always`` past n to rounding (the file's rows, another kernel), -inf elsewhere;
    and a hot draft then guesses only covered ids."""
    _, draft = tiny
    prompt = PROMPTS[7]
    full = draft.backend.forward(prompt, draft.make_cache(64))[-1].copy()
    head = DraftHead(draft.backend, 64, always=[383])
    head.cover(prompt)
    part = head(draft.backend.forward(prompt, draft.make_cache(64), logits="hidden"))
    extra = sorted({t for t in prompt if t >= 64} | {383})
    assert head.extra_ids.tolist() == extra and len(extra) > 3
    np.testing.assert_array_equal(part[:64], full[:64])
    np.testing.assert_allclose(part[extra], full[extra], rtol=1e-5, atol=1e-5)
    rest = np.setdiff1d(np.arange(64, len(full)), extra)
    assert np.isneginf(part[rest]).all()
    proposer = DraftModel(draft, draft, 64, k=4, head=64)
    hot = Sampler(dataclasses.replace(HOT, top_k=0))
    guesses = [t for _ in range(20) for t in proposer.propose(prompt, 4, hot)[0]]
    assert len(set(guesses)) > 5 and set(guesses) <= set(range(64)) | set(extra)
    assert set(guesses) & set(extra)        # fed ids are guessed too


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


# ---------------------------------------------------------------- CLI

SPEC_FIELDS = {"method", "draft_max", "drafted", "accepted", "acceptance_rate", "target_forwards",
               "tokens_per_target_forward"}


def test_prompt_with_draft_json(tiny):
    target, draft = (str(m.path) for m in tiny)
    args = ("prompt", target, "hello world", "--raw", "--temp", 0, "-n", 24, "--json")
    plain = json.loads(invoke(*args).stdout)
    r = invoke(*args, "--draft", draft)
    assert r.exit_code == 0
    d = json.loads(r.stdout)
    assert (d["text"], d["completion_tokens"], d["finish_reason"]) == \
        (plain["text"], plain["completion_tokens"], plain["finish_reason"])
    s = d["speculative"]
    assert set(s) == SPEC_FIELDS and "speculative" not in plain
    assert s["method"] == draft and s["draft_max"] == DRAFT_K
    assert 0 < s["accepted"] <= s["drafted"] and s["acceptance_rate"] == round(s["accepted"] / s["drafted"], 4)
    # every token but the first (from the prompt's forward) came out of a target forward
    assert s["tokens_per_target_forward"] == round((d["completion_tokens"] - 1) / s["target_forwards"], 3)


def test_prompt_with_lookup_verbose(tiny):
    target = str(tiny[0].path)
    r = invoke("prompt", target, "the cat the cat the cat", "--raw", "--temp", 0, "-n", 16, "--verbose",
               "--lookup", "--draft-max", 5, "--lookup-ngram", 2)
    assert r.exit_code == 0
    line = r.stderr.strip().splitlines()[-1]
    assert re.search(r"generation 16 tok, [\d.]+ tok/s \| length \| lookup: (\d+)/(\d+) guesses accepted, "
                     r"[\d.]+ tok/forward$", line), line


def test_chat_with_draft_reports_speculation(tiny):
    target, draft = (str(m.path) for m in tiny)
    r = invoke("chat", target, "--temp", 0, "-n", 8, "--draft", draft, input="hello\n/stats\n")
    assert r.exit_code == 0
    stats = json.loads(r.stdout[r.stdout.index('{"turns"'):].splitlines()[0])
    assert set(stats["turns"][0]["speculative"]) == SPEC_FIELDS
    assert stats["turns"][0]["speculative"]["method"] == draft


def test_bench_with_lookup(tiny):
    target = str(tiny[0].path)
    r = invoke("bench", target, "-p", 8, "-n", 8, "-r", 1, "--json", "--lookup")
    assert r.exit_code == 0
    rows = [json.loads(ln) for ln in r.stdout.splitlines()]
    assert [row["test"] for row in rows] == ["pp8", "tg8", "tg8 code", "tg8 code, lookup"]
    assert rows[2]["tokens_per_s"] > 0 and "speculative" not in rows[2]
    assert rows[3]["tokens_per_s"] > 0 and rows[3]["speculative"]["method"] == "lookup"
    r = invoke("bench", target, "-p", 0, "-n", 8, "-r", 1, "--draft", str(tiny[1].path), "--draft-max", 2)
    assert r.exit_code == 0 and "accepted" in r.stdout and "tok/forward" in r.stdout


def test_help_states_the_defaults():
    """cli.py does not import runner/ to build its help, so the defaults are written twice."""
    for cmd in ("prompt", "chat", "bench"):
        helps = {p.name: p.help for p in typer.main.get_command(cli.app).commands[cmd].params}
        assert f"default {DRAFT_K} with --draft, {LOOKUP_K} with --lookup" in helps["draft_max"]
        assert f"default {LOOKUP_NGRAM}" in helps["lookup_ngram"]
        assert f"(default {DRAFT_P_MIN:g};" in helps["draft_p_min"]


@pytest.mark.parametrize("args,needle", [
    (["prompt", "--lookup", "--draft-max", "16", "hi"], "--draft-max must be in 1..15, got 16"),
    (["prompt", "--draft", "d.gguf", "--lookup", "hi"], "give --draft MODEL or --lookup, not both"),
    (["chat", "--draft-max", "2"], "--draft-max and --lookup-ngram need --draft MODEL or --lookup"),
    (["bench", "--lookup", "--lookup-ngram", "0"], "--lookup-ngram must be at least 1, got 0"),
    (["prompt", "--draft", "d.gguf", "--lookup-ngram", "2", "hi"], "--lookup-ngram needs --lookup"),
    (["prompt", "--draft", "d.gguf", "--draft-p-min", "1.5", "hi"], "--draft-p-min must be in 0..1, got 1.5"),
    (["prompt", "--lookup", "--draft-p-min", "0.5", "hi"], "--draft-p-min needs --draft MODEL"),
    (["chat", "--draft-p-min", "0.5"], "--draft-p-min needs --draft MODEL"),
])
def test_bad_speculation_flags(monkeypatch, capsys, args, needle):
    code, out, err = call_main(monkeypatch, capsys, *args)
    assert code == 1 and out == ""
    assert_one_line_error(err, needle)


@pytest.mark.real
def test_incompatible_draft_is_a_one_line_error():
    r = run("prompt", "qwen2.5-coder:0.5b", "hi", "-n", 4, "--draft", "gemma3:270m")
    assert r.returncode == 1
    assert_one_line_error(r.stderr, "draft model gemma3:270m cannot draft for qwen2.5-coder:0.5b",
                          "its tokenizer is spm, the target's is bpe")


# ---------------------------------------------------------------- real models

# (text, through the chat template, stop strings, context room after the prompt or None):
# code and prose, answers that end with <|im_end|> within 32 tokens, stop strings, and two
# contexts that end inside the generation
REAL_PROMPTS = [
    ("Write a Python function that checks whether a number is prime.", True, (), None),
    ("What is 2 + 2? Reply with only the number.", True, (), None),
    ("Name the capital of France in one word.", True, (), None),
    ("Explain what a hash map is in two sentences.", True, (), None),
    ("Write a haiku about the sea.", True, (), None),
    ("Rewrite as a list comprehension:\nresult = []\nfor x in range(10):\n    if x % 2 == 0:\n"
     "        result.append(x * x)", True, (), None),
    ("Rename the variable tmp to total:\ndef add(a, b):\n    tmp = a + b\n    return tmp", True, (), None),
    ("Say hello.", True, (), None),
    ("Write a SQL query that selects all users older than 30.", True, (), None),
    ("Translate 'good morning' into Spanish. Answer with the translation only.", True, (), None),
    ("def fibonacci(n):\n", False, (), None),
    ("import numpy as np\n\ndef softmax(x):\n", False, (), None),
    ("class Stack:\n    def __init__(self):\n", False, (), None),
    ("#include <stdio.h>\n\nint main(void) {\n", False, (), None),
    ("function debounce(fn, ms) {\n", False, (), None),
    ("The history of the printing press begins", False, (), None),
    ("Once upon a time, in a small village,", False, (), None),
    ("def is_even(n):\n", False, ("\n\n",), None),
    ("List three colors, one per line.", True, ("\n",), None),
    ("def bubble_sort(items):\n", False, (), 16),
    ("Write a function that sums a list.", True, (), 20),
]


def _check_real(target, proposer):
    """Every REAL_PROMPTS generation (greedy, 32 tokens) is the same with speculation, and
    together they end in every way a generation can."""
    ends = Counter()
    for text, chat, stop, room in REAL_PROMPTS:
        ids = (target.template.encode(target.tokenizer, [{"role": "user", "content": text}]) if chat
               else target.tokenizer.encode(text))
        plain, _ = _check_same(target, proposer, ids, len(ids) + room if room else 512, 32, stop)
        finish, tokens = plain[-1][1], plain[-1][3]
        ends["end of generation" if tokens[-1] in target.tokenizer.eog_ids else
             "stop string" if finish == "stop" else "length"] += 1
        ends["context end"] += any(e[0] == "notice" for e in plain)
    assert all(ends[k] for k in ("end of generation", "stop string", "length", "context end")), ends


@pytest.fixture(scope="module")
def qwen05():
    return load("qwen2.5-coder:0.5b")


@pytest.mark.real
def test_real_greedy_with_draft_is_plain_greedy():
    target = load("qwen2.5-coder:1.5b")
    _check_real(target, DraftModel(target, load("qwen2.5-coder:0.5b", draft=True), 512))


@pytest.mark.real
def test_real_greedy_with_lookup_is_plain_greedy(qwen05):
    _check_real(qwen05, PromptLookup())


def test_a_draft_stops_before_a_doubtful_guess(tiny):
    """propose() guesses up to the first guess the draft gives less than p_min, its softmax
    probability computed here from a plain forward of the draft."""
    target, draft = tiny
    lengths = set()
    for ctx in PROMPTS[:6]:
        guesses, _ = DraftModel(target, draft, 64, k=8, p_min=0).propose(ctx, 8, Sampler(GREEDY))
        assert len(guesses) == 8
        probs = []
        for i, g in enumerate(guesses):
            x = draft.backend.forward(ctx + guesses[:i], draft.make_cache(64))[-1].astype(np.float64)
            e = np.exp(x - x.max())
            probs.append(e[g] / e.sum())
        for p_min in [0.0, 1.0] + [(a + b) / 2 for a, b in zip(sorted(probs), sorted(probs)[1:])]:
            expect = next((i for i, p in enumerate(probs) if p < p_min), 8)
            got, _ = DraftModel(target, draft, 64, k=8, p_min=p_min).propose(ctx, 8, Sampler(GREEDY))
            assert got == guesses[:expect], p_min
            lengths.add(expect)
    assert len(lengths) >= 4        # stops at none, all and some guesses
