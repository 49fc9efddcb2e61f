"""Batch files: a JSONL file of requests -> a JSONL file of answers, through the engine.

Input lines, mixed freely: OpenAI's batch request format (``custom_id``, ``method``, ``url``
"/v1/chat/completions" or "/v1/completions", ``body``) or a short form (``id`` with
``prompt`` or ``messages``). Each answer line has the shape of its request. Answers are
appended as they finish, one write per line, so a killed run loses only the requests in
flight; a rerun skips every key already answered and cuts a torn last line. A sidecar
``OUTPUT.meta.json`` holds what the answers depend on (model, defaults, run seed, shard):
a rerun with other settings is refused unless --overwrite.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from runner.engine import Request
from runner.sampler import SamplerConfig

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
LINE_CODES = ("invalid_json", "missing_id", "duplicate_id")     # errors keyed by line, not id
MAX_LINE = 4 << 20          # bytes: a longer line is an error record, never parsed


class BatchError(Exception):
    """A problem with the whole run (output file, settings): one line, nothing lost."""


@dataclass
class Defaults:
    """The flags: what a line's own fields override."""
    max_tokens: int = -1
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    seed: int | None = None         # the run's: records without a seed derive theirs from it
    system: str | None = None


@dataclass
class Record:
    line: int
    key: str                    # the id (custom_id), or "line:N" for a line without a usable one
    form: str = "short"         # "short" | "openai"
    url: str = CHAT_URL
    req: Request | None = None
    error: str | None = None
    code: str = "invalid_request"
    seeded: bool = False        # the seed was derived (written into the answer)
    shown_id: str | None = None     # a duplicate's id (its key is its line)


def record_seed(run_seed: int, key: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{run_seed}:{key}".encode(), digest_size=4).digest(), "little") & 0x7FFFFFFF


def shard_of(key: str, n: int) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") % n


# ---------------------------------------------------------------- parsing one line

class _Bad(Exception):
    pass


def _num(obj, name, lo=None, hi=None, integer=False):
    v = obj[name]
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        raise _Bad(f"{name} must be {'an integer' if integer else 'a number'}, got {json.dumps(v)[:40]}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise _Bad(f"{name} must be {rng}, got {v}")
    return v


def _stop(v):
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    if isinstance(v, list) and all(isinstance(s, str) for s in v) and len(v) <= 16:
        return tuple(v)
    raise _Bad("stop must be a string or a list of at most 16 strings")


def _messages(v):
    if not isinstance(v, list) or not v:
        raise _Bad("messages must be a non-empty list of {role, content}")
    out = []
    for i, msg in enumerate(v):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise _Bad(f"messages[{i}] must be an object with a role and a content")
        c = msg.get("content")
        if isinstance(c, list):     # OpenAI's content parts: the text ones, joined
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in c):
                raise _Bad(f"messages[{i}].content parts must all be {{\"type\": \"text\", \"text\": ...}}")
            c = "".join(p["text"] for p in c)
        if not isinstance(c, str):
            raise _Bad(f"messages[{i}].content must be a string")
        out.append({"role": msg["role"], "content": c})
    return out


def _sampling(src: dict, d: Defaults, names: dict) -> tuple[SamplerConfig, bool]:
    """The sampler settings of a line (names: our name -> the line's key), over the flags."""
    got = {k: src[n] for k, n in names.items() if src.get(n) is not None}
    cfg = dict(temp=d.temp, top_k=d.top_k, top_p=d.top_p, min_p=d.min_p, repeat_penalty=d.repeat_penalty, seed=None)
    checks = {"temp": (0, 100, False), "top_k": (0, None, True), "top_p": (0, 1, False), "min_p": (0, 1, False),
              "presence_penalty": (-2, 2, False), "frequency_penalty": (-2, 2, False), "seed": (0, 2**63 - 1, True)}
    for k in got:
        lo, hi, integer = checks[k]
        cfg[k] = _num(src, names[k], lo, hi, integer)
    if cfg["top_p"] == 0:
        raise _Bad(f"{names.get('top_p', 'top_p')} must be in (0, 1], got 0")
    return SamplerConfig(**cfg), "seed" in got


def parse_line(n: int, text: str, d: Defaults, model, model_names: set[str], run_seed: int) -> Record:
    """One input line -> a Record with a Request, or with the error to answer it with."""
    if len(text) > MAX_LINE:
        return Record(n, f"line:{n}", error=f"line {n} is longer than {MAX_LINE >> 20} MiB", code="invalid_json")
    try:
        obj = json.loads(text)
    except ValueError as e:
        return Record(n, f"line:{n}", error=f"line {n} is not JSON ({e}): fix or remove it", code="invalid_json")
    if not isinstance(obj, dict):
        return Record(n, f"line:{n}", error=f"line {n} is not a JSON object", code="invalid_json")
    openai = "custom_id" in obj or "body" in obj
    idk = "custom_id" if openai else "id"
    rid = obj.get(idk)
    if isinstance(rid, int) and not isinstance(rid, bool):
        rid = str(rid)
    if not isinstance(rid, str) or not rid:
        return Record(n, f"line:{n}", form="openai" if openai else "short", code="missing_id",
                      error=f"line {n}: {idk} is missing or not a string: every record needs a unique {idk}")
    rec = Record(n, rid, form="openai" if openai else "short")
    try:
        if openai:
            if obj.get("method", "POST") != "POST":
                raise _Bad(f"method must be POST, got {json.dumps(obj.get('method'))[:40]}")
            rec.url = obj.get("url", CHAT_URL)
            if rec.url not in (CHAT_URL, COMPLETIONS_URL):
                raise _Bad(f"url must be {CHAT_URL} or {COMPLETIONS_URL}, got {json.dumps(rec.url)[:60]}")
            body = obj.get("body")
            if not isinstance(body, dict):
                raise _Bad("body must be an object")
            if body.get("model") is not None and body["model"] not in model_names:
                raise _Bad(f"body.model is {json.dumps(body['model'])[:60]} but this run serves {model.name}: "
                           f"run that model on this record's file, or drop body.model")
            if body.get("n", 1) != 1:
                raise _Bad("n must be 1 (one completion per record)")
            src, raw = body, rec.url == COMPLETIONS_URL
            if raw:
                p = body.get("prompt")
                if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
                    p = p[0]
                if not isinstance(p, str) or not p:
                    raise _Bad("body.prompt must be a non-empty string")
                text_in, msgs = p, None
            else:
                text_in, msgs = None, _messages(body.get("messages"))
            mt = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
            names = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
                     "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
            system = d.system
        else:
            src, raw = obj, bool(obj.get("raw", False))
            if "raw" in obj and not isinstance(obj["raw"], bool):
                raise _Bad("raw must be true or false")
            if ("prompt" in obj) == ("messages" in obj):
                raise _Bad("give either prompt or messages")
            if "prompt" in obj:
                if not isinstance(obj["prompt"], str) or not obj["prompt"]:
                    raise _Bad("prompt must be a non-empty string")
                text_in, msgs = obj["prompt"], None
            else:
                if raw:
                    raise _Bad("raw needs a prompt, not messages")
                text_in, msgs = None, _messages(obj["messages"])
            mt = "max_tokens"
            names = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed"}
            system = obj.get("system", d.system)
            if system is not None and not isinstance(system, str):
                raise _Bad("system must be a string")
        max_tokens = _num(src, mt, -1, None, True) if src.get(mt) is not None else d.max_tokens
        stop = _stop(src.get("stop"))
        sampling, seeded = _sampling(src, d, names)
        if sampling.temp > 0 and not seeded:
            sampling = SamplerConfig(**{**asdict(sampling), "seed": record_seed(run_seed, rid)})
            rec.seeded = True
        spec = _constraint(src, openai)
        ids = model.encode_prompt(text_in, msgs, system, raw)
        rec.req = Request(rid, ids, sampling, max_tokens, stop, spec)
    except _Bad as e:
        rec.error = f"line {n}: {e}"
    except Exception as e:      # a template or tokenizer that refuses this input
        from runner.chat_template import TemplateError
        if not isinstance(e, (TemplateError, ValueError)):
            raise
        rec.error = f"line {n}: {e}"
    return rec


_specs: dict[tuple, object] = {}     # compiled constraints by their text: a file's records often share one


def _constraint(src: dict, openai: bool):
    """response_format (OpenAI) or schema / grammar / regex (short form) -> a constraint spec."""
    from runner import constrain
    if openai:
        kind, value = "response_format", src.get("response_format")
        if value is None:
            return None
    else:
        given = [k for k in ("schema", "grammar", "regex") if src.get(k) is not None]
        if len(given) > 1:
            raise _Bad("give at most one of schema, grammar, regex")
        if not given:
            return None
        kind, value = given[0], src[given[0]]
    key = (kind, json.dumps(value, sort_keys=True))
    if key not in _specs:
        try:
            _specs[key] = (constrain.parse_response_format(value) if kind == "response_format"
                           else constrain.parse_constraint(kind, value))
        except ValueError as e:
            raise _Bad(f"{kind}: {e}") from None
        if len(_specs) > 256:
            _specs.pop(next(iter(_specs)))
    return _specs[key]


# ---------------------------------------------------------------- answers

def answer(rec: Record, model_name: str, done=None, created: int | None = None) -> dict:
    """The output line of a record: its answer (done: the engine's Done) or its error."""
    if rec.form == "openai":
        rid = "batch_req_" + hashlib.sha256(rec.key.encode()).hexdigest()[:24]
        if done is None:
            return {"id": rid, "custom_id": None if rec.code in ("invalid_json", "missing_id") else rec.shown_id or rec.key,
                    "response": None, "error": {"code": rec.code, "message": rec.error, "line": rec.line}}
        s = done.stats
        usage = {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
                 "total_tokens": s.prompt_tokens + s.completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": s.cached_tokens}}
        chat = rec.url == CHAT_URL
        choice = ({"index": 0, "message": {"role": "assistant", "content": done.text}} if chat
                  else {"index": 0, "text": done.text})
        choice.update(finish_reason=done.finish_reason, logprobs=None)
        body = {"id": ("chatcmpl-" if chat else "cmpl-") + rid[10:], "object": "chat.completion" if chat else "text_completion",
                "created": created or int(time.time()), "model": model_name, "choices": [choice], "usage": usage}
        if rec.seeded:
            body["seed"] = rec.req.sampling.seed
        if s.incomplete:
            body["incomplete"] = True
        return {"id": rid, "custom_id": rec.key, "response": {"status_code": 200, "request_id": rid, "body": body},
                "error": None}
    if done is None:
        return {"id": None if rec.code in ("invalid_json", "missing_id") else rec.shown_id or rec.key, "error": rec.error,
                "code": rec.code, "line": rec.line}
    s = done.stats
    out = {"id": rec.key, "text": done.text, "finish_reason": done.finish_reason,
           "usage": {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
                     "cached_tokens": s.cached_tokens},
           "timings": s.timing.as_dict()}
    if rec.seeded:
        out["seed"] = rec.req.sampling.seed
    if s.incomplete:
        out["incomplete"] = True
    return out


def answered_key(obj: dict) -> str | None:
    """The key an output line answers (what a rerun skips)."""
    err = obj.get("error")
    if isinstance(err, dict):           # OpenAI form
        if err.get("code") in LINE_CODES:
            return f"line:{err.get('line')}"
        return obj.get("custom_id")
    if "custom_id" in obj:
        return obj["custom_id"]
    if obj.get("code") in LINE_CODES:
        return f"line:{obj.get('line')}"
    return obj.get("id")


# ---------------------------------------------------------------- the output file

@dataclass
class Output:
    path: Path
    meta: dict
    overwrite: bool = False
    done: set[str] = field(default_factory=set)
    repaired: int = 0           # bytes of a torn last line cut off

    def open(self) -> None:
        """Lock the file (one writer), check the settings against an existing run, cut a torn
        last line and read which keys are answered; then open for appending."""
        from filelock import FileLock, Timeout
        meta_path = self.path.with_name(self.path.name + ".meta.json")
        self._lock = FileLock(str(self.path) + ".lock")
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            raise BatchError(f"{self.path} is being written by another numbat batch: wait for it or use another -o") from None
        except OSError as e:
            raise BatchError(f"cannot lock {self.path}: {e.strerror}") from None
        exists = self.path.exists() and self.path.stat().st_size > 0
        if exists and not self.overwrite:
            try:
                old = json.loads(meta_path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                raise BatchError(f"{self.path} exists and was not written by numbat batch: "
                                 f"use --overwrite to replace it or give another -o") from None
            diff = [k for k in self.meta if k != "run_seed" and old.get(k) != self.meta[k]]
            if diff:
                k = diff[0]
                raise BatchError(f"{self.path} was written with {k}={json.dumps(old.get(k))}, this run has "
                                 f"{k}={json.dumps(self.meta[k])}: rerun with the same settings to resume, "
                                 f"or use --overwrite to start over")
            self.meta["run_seed"] = old.get("run_seed", self.meta["run_seed"])   # sampled answers stay reproducible
            self._read_done()
        try:
            if self.overwrite or not exists:
                self.path.write_bytes(b"")
            meta_path.write_text(json.dumps(self.meta, indent=1) + "\n", encoding="utf-8")
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        except OSError as e:
            raise BatchError(f"cannot write {self.path}: {e.strerror}") from None

    def _read_done(self) -> None:
        data = self.path.read_bytes()
        cut = data.rfind(b"\n") + 1
        if cut < len(data):     # a line torn by a kill: it is answered again
            self.repaired = len(data) - cut
            with open(self.path, "r+b") as f:
                f.truncate(cut)
            data = data[:cut]
        for i, line in enumerate(data.splitlines(), 1):
            try:
                key = answered_key(json.loads(line))
            except ValueError:
                raise BatchError(f"{self.path} line {i} is not JSON: fix or remove it, or use --overwrite") from None
            if key is not None:
                self.done.add(key)

    def write(self, obj: dict) -> None:
        data = (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8")
        while data:             # one call in practice; a rerun cuts what a kill tears
            data = data[os.write(self._fd, data):]

    def close(self) -> None:
        os.close(self._fd)
        self._lock.release()


# ---------------------------------------------------------------- the run

@dataclass
class Metrics:
    records: int = 0
    ok: int = 0
    failed: int = 0
    skipped: int = 0            # answered by an earlier run
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    latency: list = field(default_factory=list)
    ttft: list = field(default_factory=list)
    itl: list = field(default_factory=list)
    peak_kv_pages: int = 0
    kv_page_bytes: int = 0
    prefix_hit_rate: float = 0.0

    def as_dict(self) -> dict:
        import numpy as np

        def pct(xs):
            if not xs:
                return {"p50": 0.0, "p95": 0.0, "p99": 0.0}
            return {f"p{q}": round(float(np.percentile(xs, q)), 4) for q in (50, 95, 99)}
        w = self.wall_s or 1e-9
        return {"records": self.records, "ok": self.ok, "failed": self.failed, "skipped": self.skipped,
                "prompt_tokens": self.prompt_tokens, "cached_prompt_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens, "wall_s": round(self.wall_s, 3),
                "generation_tokens_per_s": round(self.completion_tokens / w, 2),
                "total_tokens_per_s": round((self.prompt_tokens + self.completion_tokens) / w, 2),
                "latency_s": pct(self.latency), "ttft_s": pct(self.ttft), "itl_s": pct(self.itl),
                "prefix_cache_hit_rate": round(self.prefix_hit_rate, 4), "peak_kv_pages": self.peak_kv_pages,
                "peak_kv_bytes": self.peak_kv_pages * self.kv_page_bytes}


def run(model, lines, out: Output, defaults: Defaults, n_ctx: int, parallel: int, shard: tuple[int, int] | None,
        prefix_cache: bool = True, n_pages: int | None = None, progress=None) -> Metrics:
    """Answer every line (an iterable of str) not yet answered in ``out``. ``progress(done,
    total, completion_tokens)`` is called as records finish. KeyboardInterrupt propagates
    with every finished answer already written."""
    from runner.engine import Engine, Failed
    from runner.generate import Done
    names = {model.name, model.path.name, model.path.stem}
    run_seed = out.meta["run_seed"]
    mt = Metrics()
    t0 = time.perf_counter()
    records, seen = {}, set()
    todo = []
    for n, text in enumerate(lines, 1):
        if not text.strip():
            continue
        rec = parse_line(n, text, defaults, model, names, run_seed)
        if shard and shard_of(rec.key, shard[1]) != shard[0]:
            continue
        mt.records += 1
        if rec.code not in LINE_CODES:
            if rec.key in seen:
                rec = Record(n, f"line:{n}", form=rec.form, code="duplicate_id", shown_id=rec.key,
                             error=f"line {n}: id {rec.key!r} was used before: ids must be unique (the first runs)")
            else:
                seen.add(rec.key)
        if rec.key in out.done:
            mt.skipped += 1
            continue
        todo.append(rec)
    engine = Engine(model, n_ctx, parallel, n_pages, prefix_cache)
    mt.kv_page_bytes = engine.kv.nbytes_per_page()
    pending = iter(todo)
    finished = mt.skipped

    def settle(rec, done=None):
        nonlocal finished
        out.write(answer(rec, model.name, done))
        finished += 1
        if done is None:
            mt.failed += 1
        else:
            mt.ok += 1
            s = done.stats
            mt.prompt_tokens += s.prompt_tokens
            mt.cached_tokens += s.cached_tokens
            mt.completion_tokens += s.completion_tokens
            t = s.timing
            mt.latency.append(t.done - t.admitted)
            mt.ttft.append(t.first - t.admitted)
            mt.itl += [b - a for a, b in zip(t.token_times, t.token_times[1:])]
        if progress:
            progress(finished, mt.records, mt.completion_tokens)

    live: dict[str, Record] = {}
    if progress:
        progress(finished, mt.records, 0)
    exhausted = False
    while True:
        while not exhausted and len(engine.waiting) < parallel:     # keep the queue topped up
            rec = next(pending, None)
            if rec is None:
                exhausted = True
                break
            if rec.error is not None:
                settle(rec)
                continue
            live[rec.key] = rec
            for rid, ev in engine.add(rec.req):
                rec.error, rec.code = f"line {rec.line}: {ev.message}", "invalid_request"
                settle(live.pop(rid))
        if not engine.has_work():
            break
        for rid, ev in engine.step():
            if isinstance(ev, Done):
                settle(live.pop(rid), ev)
            elif isinstance(ev, Failed):
                rec = live.pop(rid)
                rec.error = f"line {rec.line}: {ev.message}"
                settle(rec)
        mt.peak_kv_pages = max(mt.peak_kv_pages, engine.kv.pool.peak)
    mt.wall_s = time.perf_counter() - t0
    mt.prefix_hit_rate = engine.kv.hits / engine.kv.lookups if engine.kv.lookups else 0.0
    return mt
