"""Chat templates: the GGUF's ``tokenizer.chat_template`` (Jinja, as Hugging Face renders it)
or a built-in one, rendered in a sandbox.

Keeping control tokens out of user text
---------------------------------------
A rendered prompt must be tokenized with special-token parsing, so that the template's own
``<|im_start|>`` becomes one control id. But the same parsing would turn a ``<|im_start|>``
that a user typed into a control token too, letting user text forge turns. ``encode`` prevents
that without assuming anything about what the template does with the text:

1. Before rendering, every control-token text inside the message strings is replaced by a
   private-use character that occurs nowhere else (not in the messages, the template or any
   special token), one character per distinct control text.
2. The template is rendered; it may trim, concatenate or quote the text freely, since the
   stand-ins are ordinary non-space characters.
3. The result is partitioned with special parsing: only control tokens the template wrote are
   found, because user text no longer spells any.
4. In each remaining text piece the stand-ins are turned back into the original text, which is
   then tokenized as plain text (special=False), exactly like any other user input.
"""
from __future__ import annotations

import contextlib
import functools
import json
import re
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from runner.tokenizer import Tokenizer


class TemplateError(Exception):
    """The chat template is invalid or unsafe, or refused the conversation."""


GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif -%}
    {{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}
    {{- first_user_prefix if loop.first else '' }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""

CHATML_TEMPLATE = """{%- for message in messages -%}
    {{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<|im_start|>assistant\n' }}
{%- endif -%}
"""

# Markers that close a turn in the common template families.
_END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|eom_id|>", "<|endoftext|>")


# A template comes with the model file and is as untrusted as the file. Besides the attribute
# sandbox, rendering is bounded: MAX_CHARS of output (a prompt that long is past any context
# numbat runs) and MAX_SECONDS of time. Every operation that can make a large value from small
# ones is checked before it runs (a 10 GB string is allocated by one `*`, before any output
# could be measured): * + % ** and ~, calls and filters with huge counts, join, replace,
# expandtabs, format widths. Time is checked by a trace function on every template line and
# Python call while rendering.
MAX_CHARS = 1 << 22
MAX_SECONDS = 1.0
_WIDE_FORMAT = re.compile(r"%[^a-zA-Z%]*?(\*|\d{7,})|\{[^{}]*:[^{}]*?\d{7,}")


def _too_big(n: int, what: str):
    if n > MAX_CHARS:
        raise TemplateError(f"chat template {what} would make {n} characters or items (at most {MAX_CHARS})")


def _length(v) -> int:
    return len(v) if isinstance(v, (str, list, tuple, dict)) else 0


def _check_call(fn, args, kwargs):
    """Before a method or filter runs: no count past MAX_CHARS, and the few that multiply
    their input (join, replace, expandtabs, indent, format) checked for their result."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_CHARS:
            _too_big(abs(a), f"call of {getattr(fn, '__name__', 'a function')}")
    name, owner = getattr(fn, "__name__", ""), getattr(fn, "__self__", None)
    if owner is None:   # jinja's sandbox wraps str.format (functools.update_wrapper: no __self__)
        owner = getattr(getattr(fn, "__wrapped__", None), "__self__", None)
    if isinstance(owner, str):   # a bound str method: the string is its first input
        args = (owner, *args)
    if not args:
        return
    s = args[0]
    if name in ("join", "do_join") and isinstance(owner, str):
        seq = args[1] if len(args) > 1 else ()
        if isinstance(seq, (list, tuple)):
            _too_big(sum(len(str(x)) for x in seq) + len(s) * len(seq), "join")
    elif name == "do_join" and len(args) > 1 and isinstance(args[1], (list, tuple)):
        sep = str(args[2]) if len(args) > 2 else str(kwargs.get("d", ""))
        _too_big(sum(len(str(x)) for x in args[1]) + len(sep) * len(args[1]), "join")
    elif name in ("replace", "do_replace") and isinstance(s, str) and len(args) > 2:
        if name == "do_replace":
            s, args = args[1], args[1:]
        old, new = str(args[1]), str(args[2])
        _too_big(len(s) + (s.count(old) if old else len(s) + 1) * len(new), "replace")
    elif name == "expandtabs" and isinstance(s, str):
        width = args[1] if len(args) > 1 else kwargs.get("tabsize", 8)
        _too_big(len(s) + s.count("\t") * max(int(width), 0), "expandtabs")
    elif name == "do_indent" and isinstance(s, str):
        width = args[1] if len(args) > 1 else kwargs.get("width", 4)
        _too_big(len(s) + (s.count("\n") + 1) * (width if isinstance(width, int) else len(str(width))), "indent")
    elif name in ("format", "format_map", "do_format") and isinstance(s, str) and _WIDE_FORMAT.search(s):
        raise TemplateError("chat template format width is too large")


def _guarded(fn):
    @functools.wraps(fn)   # keeps jinja's pass_context / pass_eval_context marks
    def guarded(*args, **kwargs):
        _check_call(fn, args, kwargs)
        out = fn(*args, **kwargs)
        _too_big(_length(out), f"filter {fn.__name__}")
        return out
    return guarded


class _CheckedConcat(CodeGenerator):
    """`a ~ b` compiles to a join jinja does not route through the sandbox: route it."""
    def visit_Concat(self, node, frame):
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "+", "%", "**"])
    code_generator_class = _CheckedConcat

    # Jinja's sandbox turns an unsafe attribute into a silent Undefined; fail loudly instead.
    def unsafe_undefined(self, obj: Any, attribute: str):
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context, operator: str, left, right):
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "**" and ints and right > 0 and abs(left) > 1:
            _too_big(left.bit_length() * right // 16, "power")    # digits-ish: 2**(16 * MAX_CHARS) refused
        elif operator == "*" and not ints:
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(n, int) and isinstance(seq, (str, list, tuple)):
                _too_big(len(seq) * n, "repetition")
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            _too_big(len(left) + len(right), "concatenation")
        elif operator == "%" and isinstance(left, str) and _WIDE_FORMAT.search(left):
            raise TemplateError("chat template format width is too large")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        _check_call(__obj, args, kwargs)
        out = super().call(__context, __obj, *args, **kwargs)
        _too_big(_length(out), f"call of {getattr(__obj, '__name__', 'a function')}")
        return out

    def checked_concat(self, values) -> str:
        parts = [str(v) for v in values]
        _too_big(sum(map(len, parts)), "concatenation (~)")
        return "".join(parts)


def _raise_exception(message: str):
    raise TemplateError(f"chat template refused the conversation: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Hugging Face's tojson: plain json.dumps, unlike Jinja's HTML-escaping filter.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> jinja2.Environment:
    # The options Hugging Face's apply_chat_template uses.
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.filters = {name: _guarded(fn) for name, fn in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@dataclass(eq=False)
class ChatTemplate:
    source: str
    bos_token: str
    eos_token: str
    builtin: str | None = None   # "gemma" or "chatml" when the file had no template
    _template: jinja2.Template = field(init=False, repr=False)

    def __post_init__(self):
        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"invalid chat template (line {e.lineno}): {e.message}") from None

    @classmethod
    def from_metadata(cls, meta: Mapping) -> ChatTemplate:
        tokens = meta["tokenizer.ggml.tokens"]

        def text(key: str) -> str:
            i = meta.get(key)
            return tokens[i] if i is not None and 0 <= i < len(tokens) else ""

        bos, eos = text("tokenizer.ggml.bos_token_id"), text("tokenizer.ggml.eos_token_id")
        source = meta.get("tokenizer.chat_template")
        if source:
            return cls(source, bos, eos)
        if str(meta.get("general.architecture", "")).startswith("gemma"):
            return cls(GEMMA_TEMPLATE, bos, eos, builtin="gemma")
        return cls(CHATML_TEMPLATE, bos, eos, builtin="chatml")

    @property
    def end_of_turn(self) -> tuple[str, ...]:
        """Turn-closing markers this template writes (e.g. ``<|im_end|>``)."""
        return tuple(m for m in _END_OF_TURN if m in self.source)

    def render(self, messages: Sequence[Mapping], add_generation_prompt: bool = True,
               tools: Sequence[Mapping] | None = None, **extra) -> str:
        """The prompt text; at most MAX_CHARS, in at most MAX_SECONDS, else TemplateError."""
        try:
            with _deadline(MAX_SECONDS):
                out, n = [], 0
                for chunk in self._template.generate(
                        messages=list(messages), add_generation_prompt=add_generation_prompt, tools=tools,
                        bos_token=self.bos_token, eos_token=self.eos_token, **extra):
                    n += len(chunk)
                    _too_big(n, "output")
                    out.append(chunk)
                return "".join(out)
        except TemplateError:
            raise
        except SecurityError as e:
            raise TemplateError(f"unsafe chat template: {e}") from None
        except jinja2.TemplateError as e:
            raise TemplateError(f"invalid chat template: {e}") from None
        except RecursionError:
            raise TemplateError("chat template recursed too deeply") from None
        except Exception as e:   # e.g. a TypeError from an operation on the wrong type
            raise TemplateError(f"chat template failed: {type(e).__name__}: {str(e)[:200]}") from None

    def encode(self, tokenizer: Tokenizer, messages: Sequence[Mapping], add_generation_prompt: bool = True,
               tools: Sequence[Mapping] | None = None, **extra) -> list[int]:
        """Render and tokenize: template control tokens become ids, user text stays text.

        See the module docstring for how. A BOS is added if the model wants one and the
        template did not write it.
        """
        strings = list(_strings(messages))
        controls = {tokenizer.tokens[i] for i in tokenizer.control}
        found = sorted({c for c in controls if any(c in s for s in strings)}, key=len, reverse=True)
        stand_in = dict(zip(found, _unused_chars(len(found), [self.source, *strings, *controls])))

        def protect(s: str) -> str:
            for c in found:   # longest first, so a control text inside a longer one is not split
                s = s.replace(c, stand_in[c])
            return s

        rendered = self.render(_map_strings(messages, protect), add_generation_prompt, tools, **extra)
        restore = str.maketrans({ch: c for c, ch in stand_in.items()})
        frags: list[str | int] = []
        for frag in tokenizer.partition(rendered, special=True):
            frags.extend([frag] if isinstance(frag, int) else tokenizer.partition(frag.translate(restore)))
        ids = tokenizer.encode_fragments(frags, add_bos=False, add_eos=False)
        if tokenizer.add_bos and tokenizer.bos_id is not None and ids[:1] != [tokenizer.bos_id]:
            ids.insert(0, tokenizer.bos_id)
        return ids


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _map_strings(value, fn):
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, Mapping):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_strings(v, fn) for v in value]
    return value


def _unused_chars(n: int, texts: Sequence[str]) -> list[str]:
    """n private-use characters that appear in none of ``texts``."""
    seen = set().union(*texts)
    out = []
    cp = 0x10FFFD   # top of Supplementary Private Use Area-B, downwards
    while len(out) < n:
        if chr(cp) not in seen:
            out.append(chr(cp))
        cp -= 1
    return out


@contextlib.contextmanager
def _deadline(seconds: float):
    """Raise TemplateError in the rendering thread once `seconds` have passed: a trace
    function sees every Python call and every line of the compiled template (loops too)."""
    end = time.monotonic() + seconds
    previous = sys.gettrace()

    def tracer(frame, event, arg):
        if time.monotonic() > end:
            raise TemplateError(f"chat template took more than {seconds:g} s to render")
        return tracer if event == "call" and frame.f_code.co_filename == "<template>" else None

    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(previous)
