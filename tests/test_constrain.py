"""Constrained output (runner/constrain.py, Sampler's mask): the tokenizer bridge on synthetic
and real vocabularies, one-line errors before any model loads, the matcher's mask and
end-of-generation rule, and on the real models: 52 extraction/classification prompts whose
completed outputs must all validate with jsonschema, GBNF grammars checked by parsers
written here, and greedy output unchanged by a constraint it already satisfies."""
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from runner import tokenizer as tk
from runner.constrain import (Constraint, ConstraintSpec, bridge, engine_token_bytes, from_flags,
                              parse_constraint, parse_response_format)
from runner.sampler import Sampler, SamplerConfig
from runner.tokenizer import Tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).resolve().parents[1]
QWEN, GEMMA = "qwen2.5-coder:0.5b", "gemma3:270m"


# ------------------------------------------------------------------ synthetic vocabularies

@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBAT_HOME", str(tmp_path))   # the SPM build cache goes there
    return tmp_path


def bpe_tok() -> Tokenizer:
    """Byte-level BPE: the 256 byte characters, a few merges, ChatML control tokens."""
    alphabet = list(tk._byte_decoder())
    tokens = alphabet + ["Ġt", "he", "Ġthe", "ab", "Ã©", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    types = [tk.NORMAL] * (len(tokens) - 3) + [tk.CONTROL] * 3
    return Tokenizer.from_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(types, np.int32),
        "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he", "a b", "Ã ©"],
        "tokenizer.ggml.eos_token_id": len(tokens) - 2, "tokenizer.ggml.add_bos_token": False})


def spm_tok() -> Tokenizer:
    """SentencePiece with byte fallback: specials, 256 byte tokens, scored pieces, an unused one."""
    tokens = ["<unk>", "<s>", "</s>", "<ctl>", "<ud>", "<unused0>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [tk.UNKNOWN, tk.CONTROL, tk.CONTROL, tk.CONTROL, tk.USER_DEFINED, tk.UNUSED] + [tk.BYTE] * 256
    pieces = ["▁", "a", "b", "▁a", "ab", "▁ab", "é", "{", "}", "\"", ":"]
    tokens += pieces
    types += [tk.NORMAL] * len(pieces)
    scores = [0.0] * 262 + [-float(i) for i in range(len(pieces))]
    return Tokenizer.from_metadata({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(types, np.int32),
        "tokenizer.ggml.scores": np.array(scores, np.float32),
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2})


def test_bridge_bpe_bytes(home):
    tok = bpe_tok()
    data, special = engine_token_bytes(tok)
    i = tok.tokens.index
    assert data[i("Ġthe")] == b" the" and data[i("Ċ")] == b"\n"
    assert data[i("Ã")] == b"\xc3" and data[i("Ã©")] == "é".encode()   # byte-level: a lone UTF-8 lead byte
    for name in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert special[i(name)] and data[i(name)] == b"\xff" + name.encode()
    b = bridge(tok)
    assert b is bridge(tok)                     # built once per tokenizer
    assert set(b.eog_ids) == set(tok.eog_ids) == {i("<|im_end|>"), i("<|endoftext|>")}
    assert b.excluded[i("<|im_start|>")] and not b.excluded[b.eog_ids].any()
    assert not special[:256].any()


def test_bridge_spm_bytes_with_byte_fallback(home):
    tok = spm_tok()
    data, special = engine_token_bytes(tok)
    i = tok.tokens.index
    assert data[i("▁ab")] == b" ab" and data[i("▁")] == b" "
    assert data[i("<0x41>")] == b"A" and data[i("<0x0A>")] == b"\n" and data[i("<0xE2>")] == b"\xe2"
    assert data[i("<ud>")] == b"<ud>" and not special[i("<ud>")]      # user-defined tokens print as text
    for name in ("<unk>", "<s>", "</s>", "<ctl>", "<unused0>"):        # print nothing or end generation
        assert special[i(name)]
    b = bridge(tok)
    assert list(b.eog_ids) == [i("</s>")] and b.excluded[[i("<s>"), i("<ctl>"), i("<unk>")]].all()


def _ids_of(c: Constraint) -> set[int]:
    return set(np.flatnonzero(c.allowed()).tolist())


def test_matcher_byte_fallback_and_end_of_generation(home):
    tok = spm_tok()
    i = tok.tokens.index
    c = parse_constraint("regex", "(ab|é)+").start(tok)
    first = _ids_of(c)
    # é is reachable whole or as its two UTF-8 bytes through byte-fallback tokens
    assert {i("é"), i("<0xC3>"), i("a"), i("ab"), i("<0x61>")} <= first
    assert i("</s>") not in first and i("b") not in first and i("▁a") not in first
    c.advance(i("<0xC3>"))
    assert _ids_of(c) == {i("<0xA9>")} and not c.is_complete()
    c.advance(i("<0xA9>"))
    assert c.is_complete() and i("</s>") in _ids_of(c)   # complete: EOG allowed, and more may follow
    c.advance(i("ab"))
    with pytest.raises(ValueError, match="not allowed"):
        c.advance(i("b"))
    c.advance(i("</s>"))


def test_mask_and_sampler(home):
    tok = bpe_tok()
    spec = parse_constraint("regex", "the|ab")
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(tok.vocab_size + 5).astype(np.float32)   # output wider than the vocab
    c = spec.start(tok)
    masked = c.mask(logits)
    allowed = np.isfinite(masked)
    assert not allowed[tok.vocab_size:].any() and (masked[allowed] == logits[allowed]).all()
    assert {tok.piece(int(t)) for t in np.flatnonzero(allowed)} <= {b"t", b"th", b"the", b"a", b"ab", b"he"}
    # sampling flags act on the allowed tokens only: top-k 1 is the best allowed token
    s = Sampler(SamplerConfig(temp=1.0, top_k=1, seed=0), constraint=spec.start(tok))
    assert s.next(logits) == int(np.argmax(masked))
    for seed in range(20):
        s = Sampler(SamplerConfig(temp=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=seed), constraint=spec.start(tok))
        p = s.dist(logits)
        assert p[~allowed].sum() == 0 and abs(p.sum() - 1) < 1e-9
        out = []
        while True:
            t = s.next(rng.standard_normal(tok.vocab_size).astype(np.float32) * 3)
            if t in tok.eog_ids:
                break
            out.append(t)
        assert tok.decode(out) in ("the", "ab") and s.constraint.is_complete()


class _AllowAll:
    """A constraint that allows everything: the masked path must then sample as the plain one."""
    def mask(self, logits):
        return np.asarray(logits, np.float32).copy()

    def advance(self, t):
        pass


@pytest.mark.parametrize("cfg", [SamplerConfig(temp=0), SamplerConfig(seed=3),
                                 SamplerConfig(temp=0.7, top_k=0, top_p=0.9, min_p=0.0, repeat_penalty=1.3, seed=5)])
def test_sampler_masked_path_matches_plain_path(cfg):
    rng = np.random.default_rng(1)
    plain, masked = Sampler(cfg), Sampler(cfg, constraint=_AllowAll())
    history = [3, 4, 5]
    for _ in range(30):
        logits = rng.standard_normal(1000).astype(np.float32)
        assert np.array_equal(plain.dist(logits, history), masked.dist(logits, history))
        t = plain.next(logits, history)
        assert masked.next(logits, history) == t
        history.append(t)


def test_several_constraints_on_several_tokenizers_interleaved(home):
    a, b = bpe_tok(), spm_tok()
    specs = [parse_constraint("regex", "ab"), parse_constraint("regex", "(ab)+"), parse_constraint("json_object", None)]
    cs = [specs[0].start(a), specs[1].start(b), specs[2].start(b), specs[0].start(b)]
    cs[0].advance(a.tokens.index("a"))
    cs[1].advance(b.tokens.index("ab"))
    cs[2].advance(b.tokens.index("{"))
    cs[3].advance(b.tokens.index("ab"))
    cs[0].advance(a.tokens.index("b"))
    assert cs[0].is_complete() and cs[1].is_complete() and not cs[2].is_complete() and cs[3].is_complete()
    cs[2].advance(b.tokens.index("}"))
    assert cs[2].is_complete()
    assert bridge(a) is not bridge(b)


def test_gbnf_unicode_escapes(home):
    """llama.cpp grammars write code points as \\xHH, \\uXXXX and \\UXXXXXXXX (its json.gbnf:
    [\\x20\\x21\\x23-\\x5b\\x5d-\\U0010FFFF]); an escaped backslash before a u stays a backslash."""
    tok = spm_tok()
    i = tok.tokens.index
    spec = parse_constraint("grammar", 'root ::= [\\x20\\x21\\x23-\\x5b\\x5d-\\U0010FFFF]+ "\\u00e9" "\\\\u"\n')
    c = spec.start(tok)
    for t in (i("a"), i("<0xF0>"), i("<0x9F>"), i("<0x99>"), i("<0x82>"), i("é"), i("<0x5C>")):   # a, 🙂, é, backslash
        c.advance(t)
    assert not c.is_complete()
    assert _ids_of(c) == {i("<0x75>")}   # then a literal u
    c.advance(i("<0x75>"))
    assert c.is_complete()
    with pytest.raises(ValueError, match="invalid grammar"):
        parse_constraint("grammar", 'root ::= "\\uD800"\n')


# ------------------------------------------------------------------ errors, before any model

@pytest.mark.parametrize("kind,value,message", [
    ("schema", "{bad", r"^the schema is not JSON: Expecting property name"),
    ("schema", "[1, 2]", r"^the schema must be a JSON object, got list$"),
    ("schema", {"type": "strin"}, r"^invalid schema: Invalid type: strin$"),
    ("schema", {"type": "array", "uniqueItems": True}, r"^the schema uses keywords numbat cannot enforce: uniqueItems$"),
    ("schema", {"type": "object", "if": {}, "then": {}}, r"cannot enforce: if, then$"),
    ("schema", {"not": {"type": "string"}}, r"cannot enforce: not$"),
    ("schema", {"type": "string", "format": "zipcode"}, r"^invalid schema: Unknown format: zipcode$"),
    ("schema", {"type": "string", "pattern": "[a-"}, r"^invalid schema: regex parse error: unclosed character class$"),
    ("schema", {"$ref": "#/$defs/missing"}, r"^invalid schema: .*/\$defs/missing.* does not exist$"),
    ("schema", {"type": "integer", "minimum": 5, "maximum": 1}, r"minimum \(5\) is greater than maximum \(1\)"),
    ("schema", {"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}}, r"lenient.*would ignore"),
    ("regex", "(ab", r"^invalid regex '\(ab': regex parse error: unclosed group$"),
    ("regex", "(?=x)y", r"^invalid regex .*look-around.*not supported$"),
    ("regex", "", r"^the regex is empty$"),
    ("grammar", 'root ::= item\n', r"^invalid grammar: Rule 'item' not found$"),
    ("grammar", 'root := "a"\n', r"^invalid grammar: Expected ::= at line 1"),
    ("grammar", "", r"^the grammar is empty$"),
    ("yaml", "x", r"^unknown constraint kind 'yaml': one of schema, json_object, grammar, regex$"),
])
def test_invalid_constraints_are_one_line_errors(kind, value, message):
    with pytest.raises(ValueError) as e:
        parse_constraint(kind, value)
    text = str(e.value)
    assert "\n" not in text and re.search(message, text), text


def test_supported_schema_features_compile():
    fx = json.loads((FIXTURES / "constrain_prompts.json").read_text(encoding="utf-8"))
    for name, schema in fx["schemas"].items():
        spec = parse_constraint("schema", schema)
        assert isinstance(spec, ConstraintSpec) and spec.kind == "schema", name
    for f in ("json", "arithmetic", "list"):
        parse_constraint("grammar", (FIXTURES / f"constrain_{f}.gbnf").read_text(encoding="utf-8"))


def test_from_flags_and_response_format(tmp_path):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    f = tmp_path / "s.json"
    f.write_text(json.dumps(schema))
    assert from_flags() is None
    assert json.loads(from_flags(schema=str(f)).source) == schema
    assert json.loads(from_flags(schema=json.dumps(schema)).source) == schema
    assert from_flags(json_object=True).kind == "json_object"
    assert from_flags(regex="[0-9]+").kind == "regex"
    with pytest.raises(ValueError, match=r"^give only one of --schema, --regex$"):
        from_flags(schema=str(f), regex="a")
    with pytest.raises(ValueError, match=r"^--schema: cannot read /nonexistent/s.json: No such file"):
        from_flags(schema="/nonexistent/s.json")
    with pytest.raises(ValueError, match=r"^--grammar /nonexistent/g.gbnf: .*cannot read"):
        from_flags(grammar="/nonexistent/g.gbnf")
    assert parse_response_format({"type": "text"}) is None
    assert parse_response_format({"type": "json_object"}).kind == "json_object"
    rf = parse_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert json.loads(rf.source) == schema
    with pytest.raises(ValueError, match="json_schema needs"):
        parse_response_format({"type": "json_schema"})
    with pytest.raises(ValueError, match="unknown response_format type 'xml'"):
        parse_response_format({"type": "xml"})


@pytest.mark.parametrize("flags,needle", [
    (["--schema", "{nope"], "--schema {nope: the schema is not JSON"),
    (["--schema", '{"type": "array", "uniqueItems": true}'], "cannot enforce: uniqueItems"),
    (["--regex", "(a"], "invalid regex '(a'"),
    (["--grammar", "/nonexistent/x.gbnf"], "cannot read /nonexistent/x.gbnf"),
    (["--json-object", "--regex", "a"], "give only one of --json-object, --regex"),
    (["--json-object", "--lookup"], "--json-object does not combine with speculative decoding"),
])
@pytest.mark.parametrize("cmd", ["prompt", "chat"])
def test_cli_rejects_bad_constraints_before_loading(cmd, flags, needle):
    # the model does not exist: the constraint's error coming first shows it is checked before loading
    args = [cmd, "/nonexistent/model.gguf"] + (["hi"] if cmd == "prompt" else []) + flags
    r = subprocess.run([sys.executable, "-m", "cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr


# ------------------------------------------------------------------ real models

@pytest.fixture(scope="module")
def models():
    from runner.model import load
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = load(name)
        return cache[name]
    return get


def answer(m, spec, prompt, n, system=None):
    """Greedy reply under spec (or none): (Done, the sampler's constraint)."""
    from runner.generate import Done, generate
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    ids = m.template.encode(m.tokenizer, msgs)
    s = Sampler(SamplerConfig(temp=0), constraint=spec.start(m.tokenizer) if spec else None)
    done = [ev for ev in generate(m, ids, s, m.make_cache(512), n) if isinstance(ev, Done)][0]
    return done, s.constraint


@pytest.mark.real
@pytest.mark.parametrize("name", [QWEN, GEMMA])
def test_bridge_on_real_vocabularies(models, name):
    tok = models(name).tokenizer
    data, special = engine_token_bytes(tok)
    assert len(data) == tok.vocab_size
    for i in range(tok.vocab_size):   # the engine sees exactly what numbat prints
        assert data[i] == tok.piece(i) or (special[i] and (not tok.piece(i) or i in tok.eog_ids)), i
    text = 'Él dijo: {"naïve": [1, 2.5e3], "emoji": "🙂"}\n\tcafé'
    assert b"".join(data[i] for i in tok.encode(text, add_bos=False)) == text.encode()
    b = bridge(tok)
    assert set(b.eog_ids) == set(tok.eog_ids) and not b.excluded[b.eog_ids].any()
    assert all(b.excluded[i] for i in tok.control if i not in tok.eog_ids)
    if tok.kind == "spm":   # gemma: byte-fallback tokens are the bytes themselves
        assert data[tok.tokens.index("<0x0A>")] == b"\n" and data[tok.tokens.index("<0xF0>")] == b"\xf0"
    else:
        assert data[tok.tokens.index("Ċ")] == b"\n" and data[tok.tokens.index("ĠĠ")] == b"  "


@pytest.mark.real
@pytest.mark.parametrize("name", [QWEN, GEMMA])
def test_extraction_prompts_validate(models, name):
    """All completed outputs parse and validate; most prompts complete within the budget."""
    m = models(name)
    fx = json.loads((FIXTURES / "constrain_prompts.json").read_text(encoding="utf-8"))
    specs = {k: parse_constraint("schema", v) for k, v in fx["schemas"].items()}
    completed, bad = 0, []
    for p in fx["prompts"]:
        done, c = answer(m, specs[p["schema"]], p["prompt"], fx["max_tokens"].get(p["schema"], fx["max_tokens"]["*"]))
        if done.finish_reason != "stop":
            assert not c.is_complete() or done.finish_reason == "length"
            continue
        assert c.is_complete()   # an end-of-generation token only when the schema is complete
        completed += 1
        try:
            jsonschema.validate(json.loads(done.text), fx["schemas"][p["schema"]])
        except (ValueError, jsonschema.ValidationError) as e:
            bad.append((p["prompt"], done.text, str(e).splitlines()[0]))
    n = len(fx["prompts"])
    print(f"{name}: {completed}/{n} completed, {len(bad)} invalid")
    assert n >= 50
    assert not bad, bad
    assert completed >= 0.7 * n, f"only {completed}/{n} outputs completed within the token budget"


def parse_arithmetic(text: str) -> list[tuple[str, str]]:
    """Lines 'expr = int\\n' whose expr is integers, + - * / and parentheses only."""
    assert text.endswith("\n")
    lines = text[:-1].split("\n")
    assert 1 <= len(lines) <= 3
    out = []
    allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.USub)
    for line in lines:
        lhs, rhs = line.split(" = ")
        assert re.fullmatch(r"-?[0-9]{1,6}", rhs), line
        assert "**" not in lhs and "//" not in lhs, line
        for node in ast.walk(ast.parse(lhs, mode="eval")):
            assert isinstance(node, allowed), (line, node)
            assert not isinstance(node, ast.Constant) or type(node.value) is int, line
        out.append((lhs, rhs))
    return out


def parse_list(text: str) -> list[str]:
    assert text.endswith("\n")
    items = text[:-1].split("\n")
    assert 1 <= len(items) <= 5 and all(re.fullmatch(r"- [^\r\n]{1,60}", s) for s in items), text
    return items


def parse_json_object(text: str) -> dict:
    v = json.loads(text)
    assert isinstance(v, dict)
    return v


GRAMMAR_CASES = [
    ("json", parse_json_object, "Describe a cat as a JSON object with its name, age and colors."),
    ("json", parse_json_object, "Give the coordinates of Paris as JSON."),
    ("arithmetic", parse_arithmetic, "Write two arithmetic exercises with their results, one per line."),
    ("arithmetic", parse_arithmetic, "What is 12 times 7?"),
    ("list", parse_list, "List three fruits."),
    ("list", parse_list, "Name some planets of the solar system."),
]


@pytest.mark.real
@pytest.mark.parametrize("name", [QWEN, GEMMA])
def test_gbnf_grammars_constrain_to_their_language(models, name):
    m = models(name)
    completed = 0
    for grammar, parse, prompt in GRAMMAR_CASES:
        spec = parse_constraint("grammar", (FIXTURES / f"constrain_{grammar}.gbnf").read_text(encoding="utf-8"))
        done, c = answer(m, spec, prompt, 48)
        print(name, grammar, done.finish_reason, repr(done.text))
        if done.finish_reason == "stop":
            completed += 1
            parse(done.text)
        else:   # cut by -n: still a prefix the matcher accepted token by token
            assert not c.is_complete() or grammar != "json"
    assert completed >= 2, f"only {completed} of {len(GRAMMAR_CASES)} grammar outputs completed"


# (system, prompt, constraint kind, value): qwen's plain greedy answer already satisfies each
SATISFIED = [
    (None, "What is the capital of France? Answer with one word.", "regex", r"[A-Z][a-z]+\.?"),
    (None, "Is 17 a prime number? Answer yes or no.", "regex", r"(Yes|No|yes|no)[.!]?"),
    (None, "Compute 12*7. Reply with the number only.", "grammar", 'root ::= [0-9]+\n'),
    ("Reply with a JSON object only, no code fences, no prose.", "Give name and age of: Bob is 42 years old.",
     "schema", {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
                "required": ["name", "age"]}),
    ("Reply with a JSON object only, no code fences, no prose.",
     'Classify the sentiment of "I love it" as positive or negative, in a key "label".', "json_object", None),
    (None, "Write a bulleted list of three fruits, one per line starting with '- ', nothing else.",
     "regex", r"(- [A-Za-z ]+\n?){1,5}"),
]


@pytest.mark.real
def test_greedy_unchanged_by_a_constraint_it_satisfies(models):
    m = models(QWEN)
    for system, prompt, kind, value in SATISFIED:
        spec = parse_constraint(kind, value)
        plain, _ = answer(m, None, prompt, 48, system)
        assert plain.finish_reason == "stop", plain.text
        check = spec.start(m.tokenizer)   # the plain answer is in the language, token by token
        for t in plain.tokens:
            check.advance(t)
        constrained, c = answer(m, spec, prompt, 48, system)
        assert constrained.text == plain.text and constrained.tokens == plain.tokens, (plain.text, constrained.text)
        assert c.is_complete()


@pytest.mark.real
def test_cli_reports_incomplete_output(models):
    from typer.testing import CliRunner

    import cli
    models(GEMMA)   # loaded (and compiled) once in this process
    r = CliRunner().invoke(cli.app, ["prompt", GEMMA, "Describe a cat as JSON.", "--json-object", "--temp", "0",
                                     "-n", "4", "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    out = json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])
    assert out["finish_reason"] == "length" and out["incomplete"] is True and out["completion_tokens"] == 4
    assert "the output is incomplete: -n/--max-tokens ran out before the json object was complete" in r.stderr
    r = CliRunner().invoke(cli.app, ["prompt", GEMMA, "Is the sky blue? yes or no", "--regex", "(yes|no)",
                                     "--temp", "0", "--json"], catch_exceptions=False)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["text"] in ("yes", "no") and out["finish_reason"] == "stop" and "incomplete" not in out


@pytest.mark.real
def test_chat_constrains_every_reply(models):
    """Each turn starts the constraint afresh: both replies are whole JSON objects."""
    from typer.testing import CliRunner

    import cli
    models(QWEN)
    r = CliRunner().invoke(cli.app, ["chat", QWEN, "--json-object", "--temp", "0", "-n", "48"],
                           input="Describe a cat with name and age.\nNow a dog.\n/exit\n", catch_exceptions=False)
    assert r.exit_code == 0, r.output
    replies = [part.split("\n>>>")[0].strip() for part in r.stdout.split(">>> ")[1:3]]
    assert len(replies) == 2 and all(isinstance(json.loads(x), dict) for x in replies), r.stdout
