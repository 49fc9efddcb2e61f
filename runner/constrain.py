"""Constrained output: JSON Schema, any JSON object, llama.cpp GBNF grammars and regexes.

The grammar engine is llguidance (Rust; also behind llama.cpp's, vLLM's and SGLang's
structured output). What is ours:

- The tokenizer bridge: the engine sees, for every token id, exactly the bytes numbat prints
  for it (``Tokenizer.piece``: GPT-2 byte-level BPE pieces decoded to bytes, SentencePiece
  pieces with '▁' as a space and ``<0xAB>`` byte-fallback tokens as that one byte). Tokens
  that print nothing (control, unknown, unused) are marked special (a 0xFF first byte, which
  no UTF-8 text contains), so no grammar over text can produce them; the end-of-generation
  ids are the engine's "EOS" set. Built once per tokenizer and cached (0.9 s for qwen's
  152k tokens, 1.9 s for gemma's 262k, measured on a busy 2-core machine).
- The spec/matcher split the batch engine needs: ``parse_constraint`` validates a schema,
  grammar or regex without any model (errors are one line), ``spec.start(tokenizer)``
  gives a per-sequence ``Constraint`` (a few milliseconds); many specs and constraints, on
  several tokenizers, can live in one process.

A ``Constraint`` is driven by ``runner.sampler.Sampler``: ``mask`` before sampling,
``advance`` with the chosen token. Speculative decoding is not combined with it (the CLI
refuses): a draft would have to be checked against the mask token by token.
"""
from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

KINDS = ("schema", "json_object", "grammar", "regex")
FLAGS = {"schema": "--schema", "json_object": "--json-object", "grammar": "--grammar", "regex": "--regex"}

# JSON whitespace between tokens as llama.cpp's json-schema-to-grammar allows it (nothing,
# one space, or one or two line breaks and an indent of up to 20): left with llguidance's
# default (any run of whitespace) a small model emitted 40 tabs in a row here.
JSON_WHITESPACE = r"( |\n{1,2}[ \t]{0,20})?"
_JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}

# By default llguidance lets only the canonical tokenization of text the grammar forces
# (a key name, a literal) through the mask. numbat masks by the language alone: any token
# whose bytes keep the output in the language is allowed, so the model's own choice stands
# (greedy output that already fits a constraint is unchanged by it).
_NO_FORCING = '%llguidance {"no_forcing": true}\n'

_SPECIAL = b"\xff"   # llguidance's marker of a special token: never part of a text match


def _one_line(msg: str) -> str:
    """llguidance's messages run over several lines (a caret under the source, its state):
    the first line names the problem."""
    lines = [s.strip() for s in str(msg).strip().splitlines() if s.strip()]
    if not lines:
        return "invalid"
    # regex errors put the message after the echoed source: "regex parse error: / (a / ^ / error: ..."
    why = next((s for s in lines if s.startswith("error:")), None)
    if why:
        return f"regex parse error: {why[6:].strip()}"
    # the grammar is numbat's Lark wrapper: its line/column and the compiler's name say nothing
    return re.sub(r"^at \d+\(\d+\): (failed to compile JSON schema: )?", "", lines[0])


def _llg():
    try:
        import llguidance
    except ImportError:   # a declared dependency; say which package is missing, in one line
        raise ValueError("constrained output needs the llguidance package: pip install llguidance") from None
    return llguidance


# -------------------------------------------------------------------------- the spec

@dataclass(frozen=True)
class ConstraintSpec:
    """A validated constraint, not yet bound to a tokenizer. ``grammar`` is llguidance's
    grammar text; ``source`` what the user gave (schema as JSON text, GBNF, regex)."""
    kind: str
    source: str
    grammar: str

    def start(self, tokenizer) -> Constraint:
        """A fresh matcher for one sequence, over ``tokenizer``'s tokens."""
        return Constraint(self, bridge(tokenizer))


def parse_constraint(kind: str, value) -> ConstraintSpec:
    """Validate a constraint without any model. kind: "schema" (a dict or JSON text),
    "json_object" (value ignored, may be None), "grammar" (llama.cpp GBNF text), "regex".
    Raises ValueError with a one-line message naming the problem, also for schema keywords
    the engine cannot enforce (``uniqueItems``, ``if``/``then``, ``not``, unknown formats)."""
    llg = _llg()
    M = llg.LLMatcher
    if kind in ("schema", "json_object"):
        schema = _schema_value(value) if kind == "schema" else {"type": "object"}
        source = json.dumps(schema, ensure_ascii=False)
        # the user's own "x-guidance" options (llguidance's) win over numbat's whitespace rule
        options = {**_JSON_OPTIONS, **(schema.get("x-guidance") or {})}
        if options.get("lenient"):   # llguidance would then skip keywords it cannot enforce, silently
            raise ValueError('the schema\'s "x-guidance": {"lenient": true} would ignore keywords silently: remove it')
        body, what = "start: %json " + json.dumps({**schema, "x-guidance": options}), "schema"
    elif kind == "grammar":
        source = _text(value, "grammar")
        from llguidance.gbnf_to_lark import any_to_lark   # llguidance's GBNF -> Lark converter
        try:
            body = any_to_lark(_plain_unicode_escapes(source))
        except Exception as e:   # its errors are GbnfToLarkError, but any failure is a bad grammar
            raise ValueError(f"invalid grammar: {_one_line(e)}") from None
        what = "grammar"
    elif kind == "regex":
        source = _text(value, "regex")
        body, what = "start: /" + llg.regex_to_lark(source) + "/", f"regex {_short(source)!r}"
    else:
        raise ValueError(f"unknown constraint kind {kind!r}: one of {', '.join(KINDS)}")
    grammar = M.grammar_from_lark(_NO_FORCING + body)
    problem = M.validate_grammar(grammar)
    if problem:
        keys = re.search(r"Unimplemented keys: \[(.*)\]", problem)
        if keys:   # llguidance refuses what it cannot enforce rather than ignore it: say so
            raise ValueError(f"the schema uses keywords numbat cannot enforce: {keys.group(1).replace(chr(34), '')}")
        raise ValueError(f"invalid {what}: {_one_line(problem)}")
    return ConstraintSpec(kind, source, grammar)


def _plain_unicode_escapes(gbnf: str) -> str:
    """GBNF's \\uXXXX and \\UXXXXXXXX escapes as \\xHH or the character itself. llguidance's
    converter (1.9) drops their leading zeros, and its regex engine rejects what is left:
    llama.cpp's own json.gbnf ([\\x5d-\\U0010FFFF]) failed with "invalid hexadecimal digit".
    Characters past U+00FF are never GBNF syntax, so they can stand for themselves."""
    def plain(m: re.Match) -> str:
        s = m.group(0)
        if s == "\\\\":   # an escaped backslash: the u after it is a letter
            return s
        cp = int(s[2:], 16)
        if cp <= 0xFF:
            return f"\\x{cp:02x}"
        if 0xD800 <= cp <= 0xDFFF or cp > 0x10FFFF:   # not a character: left for the converter to refuse
            return s
        return chr(cp)
    return re.sub(r"\\\\|\\u[0-9a-fA-F]{4}|\\U[0-9a-fA-F]{8}", plain, gbnf)


def _text(value, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"the {what} is empty")
    return value


def _schema_value(value) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"the schema is not JSON: {e}") from None
    if isinstance(value, bool):   # JSON Schema allows true/false; neither is useful output
        raise ValueError("the schema must be a JSON object, not a boolean")
    if not isinstance(value, dict):
        raise ValueError(f"the schema must be a JSON object, got {type(value).__name__}")
    return value


def parse_response_format(rf) -> ConstraintSpec | None:
    """OpenAI's ``response_format``: {"type": "text"} (None), {"type": "json_object"} or
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}. For the batch engine."""
    if not isinstance(rf, dict) or "type" not in rf:
        raise ValueError('response_format must be an object with a "type"')
    t = rf["type"]
    if t == "text":
        return None
    if t == "json_object":
        return parse_constraint("json_object", None)
    if t == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise ValueError('response_format json_schema needs {"json_schema": {"schema": {...}}}')
        return parse_constraint("schema", js["schema"])
    raise ValueError(f"unknown response_format type {t!r}: text, json_object or json_schema")


def from_flags(schema: str | None = None, json_object: bool = False, grammar: str | None = None,
               regex: str | None = None) -> ConstraintSpec | None:
    """The CLI's flags: --schema FILE|JSON, --json-object, --grammar FILE, --regex RE (at most one)."""
    given = [f for f, v in (("--schema", schema), ("--json-object", json_object), ("--grammar", grammar),
                            ("--regex", regex)) if v not in (None, False)]
    if len(given) > 1:
        raise ValueError(f"give only one of {', '.join(given)}")
    if schema is not None:
        text = schema
        if not schema.lstrip().startswith("{"):   # not inline JSON: a file
            text = _read(schema, "--schema")
        try:
            return parse_constraint("schema", text)
        except ValueError as e:
            raise ValueError(f"--schema {_short(schema)}: {e}") from None
    if json_object:
        return parse_constraint("json_object", None)
    if grammar is not None:
        try:
            return parse_constraint("grammar", _read(grammar, "--grammar"))
        except ValueError as e:
            raise ValueError(f"--grammar {grammar}: {e}") from None
    if regex is not None:
        return parse_constraint("regex", regex)
    return None


def _read(path: str, flag: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{flag}: {path} is not UTF-8 text") from None


def _short(s: str) -> str:
    return s if len(s) <= 40 else s[:37] + "..."


# -------------------------------------------------------------------------- the bridge

@dataclass(eq=False)
class TokenBridge:
    """numbat's tokens as the engine sees them, for one tokenizer."""
    tokens: list[bytes]          # per id: printed bytes, or 0xFF + name for excluded ids
    excluded: np.ndarray         # bool per id: never allowed by a mask (prints nothing, not EOG)
    eog_ids: np.ndarray          # end-of-generation ids: allowed exactly when complete
    engine: object               # llguidance.LLTokenizer


def engine_token_bytes(tokenizer) -> tuple[list[bytes], np.ndarray]:
    """(bytes per token id, special flags): a token is special when it prints nothing (control,
    unknown, unused; SentencePiece's BYTE tokens print their byte and are text) or ends
    generation. Special tokens get 0xFF + their name: unique, and outside any text grammar."""
    n = tokenizer.vocab_size
    eog = tokenizer.eog_ids
    out, special = [], np.zeros(n, bool)
    for i in range(n):
        b = tokenizer.piece(i)   # what numbat prints for the id (b"" for hidden tokens)
        if not b or i in eog:
            special[i] = True
            b = _SPECIAL + tokenizer.tokens[i].encode("utf-8", errors="replace")
        out.append(b)
    return out, special


class _Wrapper:
    """What llguidance's TokenizerWrapper reads: token bytes, EOS/BOS, specials, and an encode
    function (it tokenizes text only for fast-forwarded tokens, which numbat does not use)."""

    def __init__(self, tokenizer, tokens, special_ids):
        self.eos_token_id = min(tokenizer.eog_ids) if tokenizer.eog_ids else tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = tokens
        self.special_token_ids = special_ids
        self._tok = tokenizer

    def __call__(self, text):
        if isinstance(text, bytes):   # llguidance probes with bytes first; numbat encodes str
            raise TypeError("str only")
        return self._tok.encode(text, add_bos=False, add_eos=False)


_BRIDGES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def bridge(tokenizer) -> TokenBridge:
    """The cached bridge of a tokenizer (built on first use)."""
    b = _BRIDGES.get(tokenizer)
    if b is None:
        llg = _llg()
        tokens, special = engine_token_bytes(tokenizer)
        eog = np.array(sorted(tokenizer.eog_ids), np.int64)
        if not len(eog):
            raise ValueError("the model has no end-of-generation token: a constraint could never finish")
        wrap = _Wrapper(tokenizer, tokens, np.flatnonzero(special).tolist())
        engine = llg.LLTokenizer(llg.TokenizerWrapper(wrap), n_vocab=len(tokens), eos_token=eog.tolist())
        excluded = special.copy()
        excluded[eog] = False
        b = _BRIDGES[tokenizer] = TokenBridge(tokens, excluded, eog, engine)
    return b


# -------------------------------------------------------------------------- the matcher

class Constraint:
    """One sequence's position in a constraint: ``mask`` the logits, ``advance`` with the
    chosen id, ``is_complete`` once the output is a whole sentence of the language."""

    def __init__(self, spec: ConstraintSpec, bridge: TokenBridge):
        llg = _llg()
        self.spec, self._b = spec, bridge
        self._m = llg.LLMatcher(bridge.engine, spec.grammar, log_level=0)
        if self._m.is_error():
            raise ValueError(f"invalid {spec.kind}: {_one_line(self._m.get_error())}")
        self._n = len(bridge.tokens)
        self._bits = np.zeros((self._n + 31) // 32, np.int32)
        self._allowed = None          # this position's mask, until advance()
        self.n_tokens = 0

    def allowed(self) -> np.ndarray:
        """Bool per token id: may come next. End-of-generation ids exactly when complete."""
        if self._allowed is None:
            self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            if self._m.is_error():
                raise RuntimeError(f"constraint failed: {_one_line(self._m.get_error())}")
            a = np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=self._n).view(bool)
            a &= ~self._b.excluded
            a[self._b.eog_ids] = self._m.is_accepting()
            if not a.any():   # cannot happen for a valid grammar; never sample from nothing
                raise RuntimeError("constraint allows no token here")
            self._allowed = a
        return self._allowed

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of logits with disallowed ids at -inf (ids past the tokenizer's too)."""
        a = self.allowed()
        logits = np.asarray(logits, np.float32)
        if logits.shape[0] != self._n:   # an output layer wider than the vocabulary: pad
            a = np.concatenate([a, np.zeros(max(0, logits.shape[0] - self._n), bool)])[:logits.shape[0]]
        return np.where(a, logits, np.float32(-np.inf))

    def advance(self, token_id: int) -> None:
        token_id = int(token_id)
        if not (0 <= token_id < self._n and self.allowed()[token_id]):
            raise ValueError(f"token {token_id} is not allowed by the {self.spec.kind} constraint here")
        if not self._m.consume_token(token_id):
            raise RuntimeError(f"constraint failed: {_one_line(self._m.get_error())}")
        self._allowed = None
        self.n_tokens += 1

    def is_complete(self) -> bool:
        """The output so far is a whole sentence of the language (EOG may end it)."""
        return self._m.is_accepting()
