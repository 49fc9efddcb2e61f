"""numbat: run GGUF language models on your CPU.

Commands stay thin: they parse flags, call runner/ and render. Heavy modules (numba, the
kernels, tokenizers) are imported inside the commands so `numbat --help` is instant.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

import runner.env  # noqa: F401  (thread-pool defaults, before anything loads numpy)
from models import catalog

# numba imports scipy.linalg when it loads, only to learn whether compiled code may call
# np.dot (numbat's kernels never do): 0.4-0.6 s of every start where scipy is installed.
# This process never uses scipy; a library user of quant/runner keeps theirs.
sys.modules.setdefault("scipy", None)



def _kernel_cache_dir() -> Path:
    """Compiled kernels go to NUMBAT_HOME, so an installed (read-only) package caches them too.
    numba checks a cached kernel only against its own file, but kernels inline code from
    others (quant/intrin.py, quant/vnni.py): the directory is named by all of their sources,
    and the directories of other versions are removed when a new one is made."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for p in sorted([*(root / "quant").glob("*.py"), *(root / "runner" / "backends").glob("*.py")]):
        src = p.read_bytes()
        # what kernels compile from, and quant/cpu.py's kernel table (not graph.py, MLX)
        if any(w in src for w in (b"import numba", b"from numba", b"import llvmlite")):
            digest.update(src)
    base = catalog.home() / "numba-cache"
    path = base / digest.hexdigest()[:16]
    if not path.is_dir() and base.is_dir():
        for old in base.iterdir():
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)
    return path


if not os.environ.get("NUMBA_CACHE_DIR"):     # empty counts as unset, as numba reads it
    os.environ["NUMBA_CACHE_DIR"] = str(_kernel_cache_dir())

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="numbat: run GGUF language models locally (llama.cpp's answers, ollama's verbs).")
err = Console(stderr=True, highlight=False)
state = {"debug": False}

ModelArg = Annotated[Optional[str], typer.Argument(help=f"A catalog name or a path to a .gguf (default {catalog.DEFAULT_MODEL}).")]
# speculative decoding (runner/speculative.py); the defaults are DRAFT_K, LOOKUP_K, LOOKUP_NGRAM there
DraftOpt = Annotated[Optional[str], typer.Option(
    "--draft", help="Speculative decoding: a smaller model of the same vocabulary guesses, MODEL checks.")]
DraftMaxOpt = Annotated[Optional[int], typer.Option(
    "--draft-max", help="Guesses per check, 1-15 (default 3 with --draft, 4 with --lookup).")]
DraftPMinOpt = Annotated[Optional[float], typer.Option(
    "--draft-p-min", help="A draft stops guessing before a guess it gives less than this probability, 0-1 (default 0; llama.cpp's is 0.75).")]
LookupOpt = Annotated[bool, typer.Option(
    "--lookup", help="Speculative decoding without a draft: guess what followed the last n-gram earlier in the text.")]
LookupNgramOpt = Annotated[Optional[int], typer.Option("--lookup-ngram", help="Longest n-gram --lookup matches (default 3).")]
FlashOpt = Annotated[str, typer.Option(
    "--flash-attn", "-fa", help="Flash attention on|off|auto, as llama.cpp's (auto: on, as its CPU backend "
    "does); numbat follows either path's arithmetic to the bit.")]
BackendOpt = Annotated[str, typer.Option(
    "--backend", help="numba (CPU kernels, llama.cpp's bits) or mlx (Apple Silicon; mlx[cpu] on Linux); "
    "auto: mlx on an Apple-Silicon Mac with mlx installed, else numba.")]
CtkOpt = Annotated[str, typer.Option("--cache-type-k", "-ctk", help="KV cache type for K: f16, q8_0 or q4_0 (llama.cpp's).")]
CtvOpt = Annotated[str, typer.Option("--cache-type-v", "-ctv", help="KV cache type for V: f16, q8_0 or q4_0 (needs -fa on).")]


class UserError(Exception):
    """Bad input: printed as one line, exit code 1."""


@app.callback()
def _main(debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False):
    state["debug"] = debug


# ---------------------------------------------------------------- loading with progress

def _download_progress():
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
    bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   console=err, transient=True, disable=not err.is_terminal)
    task = None

    def update(done, total, what):      # a download, then (MLX) the weights' conversion
        nonlocal task, shown
        if task is None:
            task = bar.add_task(what, total=total)
        if not shown:
            bar.start()
            shown = True
        bar.update(task, completed=done, total=total, description=what)
        if done >= total:
            bar.stop()
            shown = False
    shown = False
    return update, bar


def _flash(fa: str) -> bool:
    if fa not in ("on", "off", "auto"):
        raise UserError(f"-fa/--flash-attn must be on, off or auto, got {fa!r}")
    return fa != "off"


def _load(model: str | None, threads: int | None = None, fa: str = "auto", types: tuple[str, str] = ("f16", "f16"),
          backend: str = "auto", draft: bool = False):
    from runner import backends
    from runner.kv_cache import CACHE_TYPES
    from runner.model import load
    if threads is not None and threads < 1:
        raise UserError(f"-t/--threads must be at least 1, got {threads}")
    flash = _flash(fa)
    if backend not in (*backends.BACKENDS, "auto"):
        raise UserError(f"--backend must be numba, mlx or auto, got {backend!r}")
    backend = backends.default() if backend == "auto" else backend
    if backend == "mlx" and types != ("f16", "f16"):
        raise UserError("--backend mlx keeps an f16 KV cache: drop -ctk/-ctv or use --backend numba")
    for flag, t in zip(("-ctk/--cache-type-k", "-ctv/--cache-type-v"), types):
        if t not in CACHE_TYPES:
            raise UserError(f"{flag} must be one of {', '.join(CACHE_TYPES)}, got {t!r}")
    if types[1] != "f16" and fa == "off":
        raise UserError("a quantized V cache needs flash attention: drop -fa off or -ctv (llama.cpp refuses it too)")
    name = model or catalog.DEFAULT_MODEL
    pulling = name in catalog.CATALOG and not catalog.is_cached(name)
    if pulling:
        err.print(f"pulling {name} (first use)")
    update, bar = _download_progress()
    mark = _warm_mark(name, flash, types, draft)
    first = backend == "numba" and not mark.exists()
    try:
        if first:
            with err.status("compiling kernels for this model and settings (first use, up to half a minute)"):
                warm = backends.first_run(flash, types)
                try:
                    if name in catalog.CATALOG and catalog.CATALOG[name].facts:     # compiling while it downloads
                        warm.expect(catalog.CATALOG[name].facts, draft, pulling)
                    m = load(name, update, threads, flash, types, backend, draft, first=warm)
                    warm.warm(m.backend, m.tokenizer.bos_id or 0)
                finally:
                    warm.close()
            try:
                mark.parent.mkdir(parents=True, exist_ok=True)
                mark.touch()
            except OSError:     # an unwritable cache: the next load warms again
                pass
        else:
            m = load(name, update, threads, flash, types, backend, draft)
    finally:
        bar.stop()
    from runner.kv_cache import kv_cost_warning
    warning = kv_cost_warning(name, types)
    if warning and not state.get("kv_warned"):      # once per process (a draft loads too)
        state["kv_warned"] = True
        err.print(warning, soft_wrap=True)
    return m


def _warm_mark(name: str, flash: bool, types: tuple[str, str], draft: bool = False) -> Path:
    """Kernels compile on the first use of a model and settings (its types and activation, the
    attention path, the cache types, as a draft: other weight types): that load compiles them
    in two processes behind a spinner, then leaves this mark beside the compiled kernels."""
    key = hashlib.sha256(repr((name, flash, types) + (("draft",) if draft else ())).encode()).hexdigest()[:16]
    return Path(os.environ["NUMBA_CACHE_DIR"]) / "warm" / key


def _sampler(temp, top_k, top_p, min_p, repeat_penalty, seed):
    from runner.sampler import Sampler, SamplerConfig
    if seed is not None and not 0 <= seed < 2**64:
        raise UserError(f"--seed must be in 0..2^64-1, got {seed}")
    try:
        return Sampler(SamplerConfig(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                                     repeat_penalty=repeat_penalty, seed=seed))
    except ValueError as e:
        raise UserError(str(e)) from None


def _speculation(draft, draft_max, lookup, lookup_ngram, draft_p_min=None):
    """Check the speculation flags before any model loads; returns a function that builds the
    proposer for a loaded target and context length, or None."""
    if draft is None and not lookup:
        if draft_max is not None or lookup_ngram is not None:
            raise UserError("--draft-max and --lookup-ngram need --draft MODEL or --lookup")
        if draft_p_min is not None:
            raise UserError("--draft-p-min needs --draft MODEL")
        return None
    if draft is not None and lookup:
        raise UserError("give --draft MODEL or --lookup, not both")
    from runner.backends import CHECK_ROWS
    from runner.speculative import DRAFT_K, DRAFT_P_MIN, LOOKUP_K, LOOKUP_NGRAM, DraftModel, PromptLookup
    k = draft_max if draft_max is not None else DRAFT_K if draft else LOOKUP_K
    # the last token and the guesses are checked in one batch, exact only up to CHECK_ROWS tokens
    if not 1 <= k < CHECK_ROWS:
        raise UserError(f"--draft-max must be in 1..{CHECK_ROWS - 1}, got {k}")
    if lookup and draft_p_min is not None:
        raise UserError("--draft-p-min needs --draft MODEL (a lookup guess has no probability)")
    p_min = DRAFT_P_MIN if draft_p_min is None else draft_p_min
    if not 0 <= p_min <= 1:
        raise UserError(f"--draft-p-min must be in 0..1, got {p_min}")
    if lookup:
        n = lookup_ngram if lookup_ngram is not None else LOOKUP_NGRAM
        if n < 1:
            raise UserError(f"--lookup-ngram must be at least 1, got {n}")
        return lambda m, n_ctx, threads: PromptLookup(n, k)
    if lookup_ngram is not None:
        raise UserError("--lookup-ngram needs --lookup")
    return lambda m, n_ctx, threads: DraftModel(m, _load(draft, threads, 'on' if m.backend.flash else 'off', m.backend.cache_types,
                                                         "mlx" if m.backend.name == "mlx" else "numba", draft=True), n_ctx, k,
                                                p_min=p_min)


def _spec_line(spec) -> str:
    return (f" | {spec.method}: {spec.accepted}/{spec.drafted} guesses accepted, "
            f"{spec.tokens / spec.forwards if spec.forwards else 0:.2f} tok/forward")


def _model_and_text(args: list[str]) -> tuple[str | None, str | None]:
    """[MODEL] TEXT: a lone argument that names a catalog model or a .gguf file is the MODEL
    (the text is then missing), anything else is the text."""
    if len(args) > 2:
        raise UserError("give at most MODEL and TEXT (quote the text)")
    if len(args) == 2:
        return args[0], args[1]
    if args and (args[0] in catalog.CATALOG or args[0].endswith(".gguf")):
        return args[0], None
    return None, (args[0] if args else None)


def _read_text(text: str) -> str:
    """The prompt from argv or stdin ('-'). Bytes that are not UTF-8 become U+FFFD, as
    llama.cpp's tokenizer treats them, instead of failing inside the tokenizer (argv arrives
    with them as lone surrogates, stdin as a decode error)."""
    if text == "-":
        stdin = getattr(sys.stdin, "buffer", None)   # a test's StringIO has no bytes under it
        return stdin.read().decode("utf-8", errors="replace") if stdin else sys.stdin.read()
    return text.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="replace")


# ---------------------------------------------------------------- model management

@app.command()
def pull(name: Annotated[str, typer.Argument(help="A catalog name, e.g. qwen2.5-coder:0.5b.")],
         verify: Annotated[bool, typer.Option("--verify", help="Hash the downloaded file again and say whether it is intact.")] = False):
    """Download a catalog model into NUMBAT_HOME (sha256-checked, never half-written)."""
    if name not in catalog.CATALOG:
        raise UserError(catalog.unknown_name_message(name))
    if verify:
        path = catalog.model_path(name)
        if not path.is_file():
            raise UserError(f"{name} is not downloaded: run `numbat pull {name}`")
        if not catalog.verify(name):
            raise UserError(f"{path} does not match {name}'s size and sha256 (it changed after download): "
                            f"run `numbat pull {name}` to fetch it again")
        print(f"{name}: {path} verified (sha256 {catalog.CATALOG[name].sha256})")
        return
    update, bar = _download_progress()
    try:
        path = catalog.fetch(name, update)
    finally:
        bar.stop()
    print(f"{name}: {path}")


@app.command("list")
def list_models():
    """The catalog, and which models are downloaded."""
    from rich.table import Table
    t = Table("name", "downloaded", "size", "path", box=None)
    for name, e in catalog.CATALOG.items():
        here = catalog.is_cached(name)
        t.add_row(name, "yes" if here else "no", f"{e.size / 2**20:.0f} MiB", str(catalog.model_path(name)) if here else "")
    Console().print(t)


@app.command()
def rm(name: Annotated[str, typer.Argument(help="A downloaded catalog model.")]):
    """Delete a downloaded model."""
    if name not in catalog.CATALOG:
        raise UserError(catalog.unknown_name_message(name))
    if not catalog.remove(name):
        raise UserError(f"{name} is not downloaded (see `numbat list`)")
    print(f"removed {name}")


@app.command()
def info(model: ModelArg = None,
         ctx: Annotated[Optional[int], typer.Option("--ctx", "-c", help="Also the KV cache's size for a context of N "
                                                    "tokens, for each cache type (K and V of one type).")] = None,
         as_json: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False):
    """Architecture, size, tensor types, context length and tokenizer of a model."""
    from collections import Counter

    from gguf_io import GGUFError, open_gguf
    from gguf_io.config import config_from_gguf
    from runner.model import ModelError, resolve
    if ctx is not None and ctx < 1:
        raise UserError(f"-c/--ctx must be at least 1, got {ctx}")
    try:
        path = resolve(model or catalog.DEFAULT_MODEL, _download_progress()[0])
        f = open_gguf(path)
    except (GGUFError, ModelError) as e:
        raise UserError(str(e)) from None
    types = Counter(t.type_name for t in f.tensors.values())
    d = {"path": str(path), "architecture": f.architecture, "name": f.get("general.name", ""),
         "parameters": f.n_params(), "file_size": f.file_size, "gguf_version": f.version,
         "tensor_types": dict(types.most_common()), "tensors": len(f.tensors),
         "context_length": f.get(f"{f.architecture}.context_length"),
         "tokenizer": f.get("tokenizer.ggml.model"), "tokenizer_pre": f.get("tokenizer.ggml.pre"),
         "vocab_size": len(f.get("tokenizer.ggml.tokens") or ()), "chat_template": "tokenizer.chat_template" in f.metadata}
    import quant
    cfg = None
    try:
        cfg = config_from_gguf(f)
        for t in f.tensors.values():
            quant.qtype(t.type_id)
        d["supported"] = True
    except (GGUFError, quant.UnsupportedType) as e:
        d["supported"], d["why_not"] = False, str(e)
    if ctx is not None and cfg is not None:
        # what the backend's KVCache allocates (runner/kv_cache.py), without loading it: a
        # sliding-window layer (as NumbaCPU sets Layer.window) holds a ring of its window
        # plus one prompt chunk, a global layer the context; slots in pages of PAGE
        from runner.kv_cache import CACHE_TYPES, PAGE, KVCache, _kv_arrays
        chunk = 512                 # NumbaCPU's chunk (llama.cpp's batch for one sequence)
        caps = KVCache.caps(ctx, [cfg.window(i) for i in range(cfg.n_layer)], chunk)
        pages = sum(-(-cap // PAGE) for cap in caps)
        d["kv_cache"] = {"n_ctx": ctx}
        for t in CACHE_TYPES:
            if t != "f16" and cfg.head_dim % 32:       # llama.cpp's blocks of 32 along a head
                d["kv_cache"][t] = None
                continue
            k, v = _kv_arrays(cfg.n_head_kv, cfg.head_dim, 1, (t, t))     # one page of one layer
            total = pages * (k.nbytes + v.nbytes)
            d["kv_cache"][t] = {"bytes": total, "bytes_per_token": total / ctx,
                                # the values alone at llama.cpp's sizes (f16 K rows carry padding here)
                                "data_bytes": pages * PAGE * cfg.n_head_kv * cfg.head_dim * 2 * CACHE_TYPES[t] // 32}
    if as_json:
        print(json.dumps(d))
        return
    for k, v in d.items():
        if k == "kv_cache":
            beyond = d["context_length"] and ctx > d["context_length"]
            print(f"{k:15s} {ctx} tokens, K and V of one type" + (" (past the training context)" if beyond else ""))
            for t, s in v.items():
                if t == "n_ctx":
                    continue
                if s is None:
                    print(f"  {t:13s} needs a head size that is a multiple of 32")
                    continue
                print(f"  {t:13s} {s['bytes'] / 2**20:.2f} MiB, {s['bytes_per_token'] / 2**10:.2f} KiB/token" +
                      (f" (the values alone {s['data_bytes'] / 2**20:.2f} MiB, {s['data_bytes'] / ctx / 2**10:.2f} "
                       f"KiB/token: f16 K rows are padded)" if s["data_bytes"] != s["bytes"] else ""))
            continue
        if k == "tensor_types":
            v = ", ".join(f"{n} x{c}" for n, c in v.items())
        elif k in ("parameters",):
            v = f"{v / 1e6:.1f} M"
        elif k == "file_size":
            v = f"{v / 2**20:.1f} MiB"
        print(f"{k:15s} {v}")


# ---------------------------------------------------------------- running

@app.command()
def tokenize(args: Annotated[Optional[list[str]], typer.Argument(help="[MODEL] TEXT; TEXT '-' reads stdin.", show_default=False)] = None,
             file: Annotated[Optional[Path], typer.Option("--file", "-f", help="Read the text from a file.")] = None,
             ids: Annotated[bool, typer.Option("--ids", help="Print only the ids, as one JSON list.")] = False):
    """Token ids of a text as the model's tokenizer splits it (BOS as the model says; no special tokens)."""
    from gguf_io import GGUFError, open_gguf
    from runner.model import ModelError, resolve
    from runner.tokenizer import Tokenizer
    model, text = _model_and_text(args or [])
    if file and text is not None:
        raise UserError("give TEXT or --file F, not both")
    if text is None and file is None:
        raise UserError("give TEXT or --file F")
    try:
        src = file.read_text(encoding="utf-8") if file else _read_text(text)
    except OSError as e:
        raise UserError(f"cannot read {file}: {e.strerror}") from None
    try:
        f = open_gguf(resolve(model or catalog.DEFAULT_MODEL, _download_progress()[0]))
        tok = Tokenizer.from_metadata(f.metadata)
    except (GGUFError, ModelError, ValueError) as e:
        raise UserError(str(e)) from None
    out = tok.encode(src)
    if ids:
        print(json.dumps(out))
    else:
        for i in out:
            print(f"{i:8d}  {tok.piece(i, special=True).decode('utf-8', errors='replace')!r}")


@app.command()
def perplexity(model: ModelArg = None,
               file: Annotated[Path, typer.Option("--file", "-f", help="Text file to score.")] = ...,
               ctx: Annotated[int, typer.Option("--ctx", "-c", help="Chunk size in tokens.")] = 512,
               threads: Annotated[Optional[int], typer.Option("--threads", "-t")] = None, fa: FlashOpt = "auto", ctk: CtkOpt = "f16", ctv: CtvOpt = "f16", backend: BackendOpt = "auto"):
    """Perplexity of a text, by llama.cpp's method (last line: PPL = value +/- error)."""
    from runner.perplexity import perplexity as ppl
    if ctx < 8:
        raise UserError(f"--ctx must be at least 8, got {ctx}")
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as e:
        raise UserError(f"cannot read {file}: {e.strerror}") from None
    m = _load(model, threads, fa, (ctk, ctv), backend)
    ids = m.tokenizer.encode(text)
    try:
        r = ppl(m, ids, ctx, progress=lambda c, n, p: err.print(f"[{c}/{n}] {p:.4f}"))
    except ValueError as e:
        raise UserError(str(e)) from None
    print(f"PPL = {r.ppl:.4f} +/- {r.error:.5f}")


# constrained output (runner/constrain.py): checked before any model loads
SchemaOpt = Annotated[Optional[str], typer.Option(
    "--schema", help="Output fits this JSON Schema: a file, or the JSON itself.")]
JsonObjectOpt = Annotated[bool, typer.Option("--json-object", help="Output is one JSON object.")]
GrammarOpt = Annotated[Optional[Path], typer.Option(
    "--grammar", help="Output is in the language of this llama.cpp GBNF grammar file.")]
RegexOpt = Annotated[Optional[str], typer.Option("--regex", help="Output matches this regular expression (whole).")]


def _constraint(schema, json_object, grammar, regex, speculation):
    """The ConstraintSpec of the flags, or None; one-line errors before the model loads."""
    from runner.constrain import FLAGS, from_flags
    try:
        spec = from_flags(schema, json_object, str(grammar) if grammar is not None else None, regex)
    except ValueError as e:
        raise UserError(str(e)) from None
    if spec is not None and speculation is not None:
        # a draft's guesses would have to be checked against the mask one by one: not built
        raise UserError(f"{FLAGS[spec.kind]} does not combine with speculative decoding (--draft, --lookup)")
    return spec


def _start(spec, sampler, tokenizer):
    """A fresh matcher for the next reply on the sampler."""
    try:
        sampler.constraint = spec.start(tokenizer)
    except ValueError as e:
        raise UserError(str(e)) from None


def _incomplete(spec, why: str) -> None:
    err.print(f"[yellow]the output is incomplete: {why} before the {spec.kind.replace('_', ' ')} was complete[/]",
              soft_wrap=True)


@app.command()
def prompt(args: Annotated[list[str], typer.Argument(help="[MODEL] TEXT; TEXT '-' reads stdin.", show_default=False)],
           max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Tokens to generate (-1: until end of turn).")] = -1,
           temp: Annotated[float, typer.Option("--temp", help="Temperature; 0 is greedy.")] = 0.8,
           top_k: Annotated[int, typer.Option("--top-k")] = 40,
           top_p: Annotated[float, typer.Option("--top-p")] = 0.95,
           min_p: Annotated[float, typer.Option("--min-p")] = 0.05,
           repeat_penalty: Annotated[float, typer.Option("--repeat-penalty")] = 1.0,
           seed: Annotated[Optional[int], typer.Option("--seed", help="Makes sampling reproducible.")] = None,
           ctx: Annotated[Optional[int], typer.Option("--ctx", "-c", help="Context length (default 4096).")] = None,
           threads: Annotated[Optional[int], typer.Option("--threads", "-t")] = None, fa: FlashOpt = "auto", ctk: CtkOpt = "f16", ctv: CtvOpt = "f16", backend: BackendOpt = "auto",
           stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop at this text (repeatable).")] = None,
           system: Annotated[Optional[str], typer.Option("--system", help="System prompt.")] = None,
           raw: Annotated[bool, typer.Option("--raw", help="Plain continuation, no chat template.")] = False,
           as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object at the end.")] = False,
           verbose: Annotated[bool, typer.Option("--verbose", "-v", help="End with a stats line.")] = False,
           draft: DraftOpt = None, draft_max: DraftMaxOpt = None, lookup: LookupOpt = False,
           lookup_ngram: LookupNgramOpt = None, draft_p_min: DraftPMinOpt = None,
           schema: SchemaOpt = None, json_object: JsonObjectOpt = False, grammar: GrammarOpt = None,
           regex: RegexOpt = None):
    """One reply to TEXT, streamed as it is generated."""
    from runner.generate import ContextError, Done, Notice, Token, generate
    from runner.speculative import speculative_generate
    model, text = _model_and_text(args)
    if text is None:
        raise UserError("give the TEXT to answer (quote it; '-' reads stdin)")
    if max_tokens < -1:
        raise UserError(f"-n/--max-tokens must be -1 or more, got {max_tokens}")
    if ctx is not None and ctx < 16:
        raise UserError(f"-c/--ctx must be at least 16, got {ctx}")
    sampler = _sampler(temp, top_k, top_p, min_p, repeat_penalty, seed)
    speculation = _speculation(draft, draft_max, lookup, lookup_ngram, draft_p_min)
    spec = _constraint(schema, json_object, grammar, regex, speculation)
    text = _read_text(text)
    m = _load(model, threads, fa, (ctk, ctv), backend)
    if spec:
        _start(spec, sampler, m.tokenizer)
    ids = m.encode_prompt(text, system=system, raw=raw)
    cache = m.make_cache(ctx, n_keep=1 if m.tokenizer.add_bos else 0)
    if speculation:
        events = speculative_generate(m, ids, sampler, cache, speculation(m, cache.n_ctx, threads), max_tokens,
                                      tuple(stop or ()))
    else:
        events = generate(m, ids, sampler, cache, max_tokens, tuple(stop or ()))
    done = None
    try:
        for ev in events:
            if isinstance(ev, Token) and not as_json:
                sys.stdout.write(ev.text)
                sys.stdout.flush()
            elif isinstance(ev, Notice):
                err.print(f"[yellow]{ev.text}[/]")
            elif isinstance(ev, Done):
                done = ev
    except ContextError as e:
        raise UserError(str(e)) from None
    s = done.stats
    # a stop string or -n can end the reply before the constraint is satisfied
    incomplete = spec is not None and not sampler.constraint.is_complete()
    if as_json:
        print(json.dumps({"model": m.name, "text": done.text, "finish_reason": done.finish_reason, **s.as_dict(),
                          **({"incomplete": True} if incomplete else {})}))
    else:
        print()
    if incomplete:
        _incomplete(spec, "-n/--max-tokens ran out" if done.finish_reason == "length" else "a --stop string ended it")
    if verbose:
        err.print(f"ttft {s.ttft_s * 1000:.0f} ms | prompt {s.prompt_tokens} tok, {s.prompt_tps:.1f} tok/s | "
                  f"generation {s.completion_tokens} tok, {s.gen_tps:.1f} tok/s | {done.finish_reason}"
                  + (_spec_line(s.spec) if s.spec else ""), soft_wrap=True)   # one line, for scripts too


CHAT_HELP = """commands: /help  /reset  /system TEXT  /stats  /save FILE  /exit (or Ctrl-D)
Ctrl-C stops a reply and stays in the chat."""


@app.command()
def chat(model: ModelArg = None,
         system: Annotated[Optional[str], typer.Option("--system", help="System prompt.")] = None,
         max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Tokens per reply (-1: until end of turn).")] = -1,
         temp: Annotated[float, typer.Option("--temp")] = 0.8,
         top_k: Annotated[int, typer.Option("--top-k")] = 40,
         top_p: Annotated[float, typer.Option("--top-p")] = 0.95,
         min_p: Annotated[float, typer.Option("--min-p")] = 0.05,
         repeat_penalty: Annotated[float, typer.Option("--repeat-penalty")] = 1.0,
         seed: Annotated[Optional[int], typer.Option("--seed")] = None,
         ctx: Annotated[Optional[int], typer.Option("--ctx", "-c", help="Context length (default 4096).")] = None,
         threads: Annotated[Optional[int], typer.Option("--threads", "-t")] = None, fa: FlashOpt = "auto", ctk: CtkOpt = "f16", ctv: CtvOpt = "f16", backend: BackendOpt = "auto",
         draft: DraftOpt = None, draft_max: DraftMaxOpt = None, lookup: LookupOpt = False,
         lookup_ngram: LookupNgramOpt = None, draft_p_min: DraftPMinOpt = None,
         schema: SchemaOpt = None, json_object: JsonObjectOpt = False, grammar: GrammarOpt = None,
         regex: RegexOpt = None):
    """A multi-turn chat in the terminal. History stays in the KV cache: each turn runs only its new tokens.
    With a constraint, every reply is constrained."""
    from runner.chat import ChatSession
    from runner.generate import ContextError
    if max_tokens < -1:
        raise UserError(f"-n/--max-tokens must be -1 or more, got {max_tokens}")
    sampler = _sampler(temp, top_k, top_p, min_p, repeat_penalty, seed)
    speculation = _speculation(draft, draft_max, lookup, lookup_ngram, draft_p_min)
    spec = _constraint(schema, json_object, grammar, regex, speculation)
    m = _load(model, threads, fa, (ctk, ctv), backend)
    n_ctx = m.context_length(ctx)
    s = ChatSession(m, sampler, n_ctx, system, speculation(m, n_ctx, threads) if speculation else None)
    out = Console(highlight=False)
    out.print(f"[dim]{m.name} ({m.cfg.arch}, context {s.cache.n_ctx}). /help for commands.[/]")
    if hasattr(sys.stdin, "reconfigure"):       # bytes that are not UTF-8 read as U+FFFD, as in prompt
        sys.stdin.reconfigure(errors="replace")
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print()
            return
        except KeyboardInterrupt:
            print()
            continue
        cmd, _, arg = line.strip().partition(" ")
        if cmd in ("/exit", "/bye", "/quit"):
            return
        if cmd == "/help":
            out.print(CHAT_HELP)
        elif cmd == "/reset":
            s.reset()
            out.print("[dim]conversation cleared[/]")
        elif cmd == "/system":
            s.reset(arg or None)
            out.print("[dim]system prompt set; conversation cleared[/]")
        elif cmd == "/stats":
            print(json.dumps(s.stats()), flush=True)
        elif cmd == "/save":
            if not arg:
                out.print("[red]usage: /save FILE[/]")
                continue
            try:
                Path(arg).write_text(json.dumps({"model": m.name, "messages": s.messages}, indent=2, ensure_ascii=False))
                out.print(f"[dim]saved {len(s.messages)} messages to {arg}[/]")
            except OSError as e:
                out.print(f"[red]cannot write {arg}: {e.strerror}[/]")
        elif cmd.startswith("/"):
            out.print(f"[red]unknown command {cmd}[/]; /help lists them")
        elif line.strip():
            if spec:
                _start(spec, sampler, m.tokenizer)   # each reply starts the constraint afresh
            try:
                for piece, notice in s.reply(line, max_tokens):
                    if notice:
                        err.print(f"[yellow]{notice}[/]")
                    else:
                        sys.stdout.write(piece)
                        sys.stdout.flush()
            except KeyboardInterrupt:
                s.interrupted()
                out.print("[dim] (stopped)[/]", end="")
            except ContextError as e:
                err.print(f"[red]error:[/] {e}")
            print()
            if spec and 0 < max_tokens <= sampler.constraint.n_tokens and not sampler.constraint.is_complete():
                _incomplete(spec, "-n/--max-tokens ran out")


@app.command()
def bench(model: ModelArg = None,
          n_prompt: Annotated[int, typer.Option("--n-prompt", "-p", help="Prompt tokens (test ppN).")] = 512,
          n_gen: Annotated[int, typer.Option("--n-gen", "-n", help="Generated tokens (test tgN).")] = 128,
          n_depth: Annotated[str, typer.Option("--n-depth", "-d", help="Tokens already in the cache when each test runs, "
                                               "as llama-bench's -d; a comma-separated list runs every test at each.")] = "0",
          reps: Annotated[int, typer.Option("--repetitions", "-r", help="Runs per test.")] = 3,
          threads: Annotated[Optional[int], typer.Option("--threads", "-t")] = None, fa: FlashOpt = "auto", ctk: CtkOpt = "f16", ctv: CtvOpt = "f16", backend: BackendOpt = "auto",
          as_json: Annotated[bool, typer.Option("--json", help="One JSON object per test, per line.")] = False,
          draft: DraftOpt = None, draft_max: DraftMaxOpt = None, lookup: LookupOpt = False,
          lookup_ngram: LookupNgramOpt = None, draft_p_min: DraftPMinOpt = None):
    """Prompt processing and generation speed, as llama-bench measures them (random tokens, empty context,
    or with -d a context already holding that many random tokens).
    With --draft or --lookup, also greedy generation on a fixed code prompt, plain and speculative."""
    import numba
    import numpy as np
    if n_prompt < 0 or n_gen < 0 or reps < 1:
        raise UserError("-p and -n must be >= 0 and -r >= 1")
    depths = []
    for part in n_depth.split(","):
        part = part.strip()
        if not (part.isascii() and part.isdigit()):      # no sign, no point: a count of tokens
            raise UserError(f"-d/--n-depth must be integers >= 0, comma-separated (as 0,4096), got {n_depth!r}")
        depths.append(int(part))
    speculation = _speculation(draft, draft_max, lookup, lookup_ngram, draft_p_min)
    m = _load(model, threads, fa, (ctk, ctv), backend)
    rng = np.random.default_rng(0)
    rows = []
    from quant.cpu import CPU_NAME, KIND      # which row of the kernel table ran (numba; MLX: none)
    cpu_kind = f"{KIND.name}, {CPU_NAME}" if m.backend.name == "numba-cpu" else None

    def add(test, rates, depth=0, **extra):   # rates[0] warmed up and is not counted
        r = np.array(rates[1:])
        rows.append({"model": m.name, "size_bytes": m.file.file_size, "params": m.file.n_params(),
                     "backend": m.backend.name, "cpu_kind": cpu_kind, "threads": numba.get_num_threads(),
                     "flash_attn": m.backend.flash, "type_k": m.backend.cache_types[0], "type_v": m.backend.cache_types[1],
                     "test": test, "n_depth": depth,
                     "tokens_per_s": round(float(r.mean()), 2), "stddev": round(float(r.std()), 2), **extra})

    longest = max(n_prompt, n_gen)
    for depth in depths:                # llama-bench's order: the tests of one depth together
        if longest == 0:
            break
        # the backend's own cache (m.make_cache caps at the training context): llama-bench's
        # context of depth + test tokens, whatever the model was trained for
        n_ctx = depth + longest + 1
        cache = m.backend.make_cache(n_ctx)
        fill = rng.integers(0, m.tokenizer.vocab_size, depth).tolist()
        # a sliding-window layer's ring holds w + chunk slots: after a test of k tokens is
        # rolled back it still has the window before the depth only while k <= chunk; past
        # that (or at depth 0) every run starts from a fresh cache, refilled untimed
        refill = depth == 0 or any(w and min(n_ctx, w + m.backend.chunk) - longest < min(w, depth)
                                   for w in m.backend.windows)

        def at_depth():                 # the cache holds the depth's tokens and nothing after
            if refill or cache.n_past < depth:
                cache.reset()
                if fill:
                    m.backend.forward(fill, cache)
            else:
                cache.rollback(cache.n_past - depth)

        for test, n in (("pp", n_prompt), ("tg", n_gen)):
            if n == 0:
                continue
            rates = []
            for _ in range(reps + 1):   # the first run warms up and is not counted
                ids = rng.integers(0, m.tokenizer.vocab_size, n).tolist()
                at_depth()
                t = time.perf_counter()
                if test == "pp":
                    m.backend.forward(ids, cache)
                else:
                    for i in ids:
                        m.backend.forward([i], cache)
                rates.append(n / (time.perf_counter() - t))
            add(f"{test}{n}", rates, depth)
        del cache
    if speculation and n_gen:
        _bench_speculation(m, n_gen, reps, speculation, threads, add)
    if as_json:
        for row in rows:
            print(json.dumps(row))
        return
    from rich.table import Table
    t = Table("model", "size", "params", "backend", "threads", "fa", "type_k", "type_v", "test", "t/s")
    for row in rows:
        spec = row.get("speculative")
        test = row["test"] + (f" @ d{row['n_depth']}" if row["n_depth"] else "")
        test += (f" ({spec['acceptance_rate']:.0%} accepted, {spec['tokens_per_target_forward']:.2f} "
                 f"tok/forward)" if spec else "")
        t.add_row(row["model"], f"{row['size_bytes'] / 2**20:.2f} MiB", f"{row['params'] / 1e6:.2f} M", row["backend"] + (f" ({row['cpu_kind']})" if row["cpu_kind"] else ""),
                  str(row["threads"]), "on" if row["flash_attn"] else "off", row["type_k"], row["type_v"], test,
                  f"{row['tokens_per_s']:.2f} ± {row['stddev']:.2f}")
    Console().print(t)


# Random tokens are never guessed right, so speculation is measured on code, which drafts and
# lookups can continue: the start of a module for the model to go on with.
BENCH_CODE = '''import json
from dataclasses import dataclass, field


@dataclass
class Item:
    name: str
    price: float
    quantity: int = 0
    tags: list[str] = field(default_factory=list)


class Inventory:
    """Items by name, with their stock."""

    def __init__(self):
        self.items: dict[str, Item] = {}

    def add(self, item: Item) -> None:
        """Add an item, or add to its quantity if it is already here."""
'''


def _bench_speculation(m, n_gen, reps, speculation, threads, add):
    """tgN on BENCH_CODE, greedy, plain and speculative runs alternating (this machine's speed
    drifts over minutes: one after the other, a drift lands in the ratio); generation speed as
    generate() reports it (tokens after the first, over the time after the first). The first
    pair warms up."""
    from runner.generate import generate
    from runner.sampler import Sampler, SamplerConfig
    from runner.speculative import speculative_generate
    ids = m.tokenizer.encode(BENCH_CODE)
    cache = m.make_cache(len(ids) + n_gen)
    proposer = speculation(m, cache.n_ctx, threads)
    rates = {False: [], True: []}
    for _ in range(reps + 1):
        for speculate in (False, True):
            cache.reset()
            greedy = Sampler(SamplerConfig(temp=0))
            events = (speculative_generate(m, ids, greedy, cache, proposer, n_gen) if speculate
                      else generate(m, ids, greedy, cache, n_gen))
            done = list(events)[-1]
            rates[speculate].append(done.stats.gen_tps)
    add(f"tg{n_gen} code", rates[False])
    add(f"tg{n_gen} code, {proposer.name}", rates[True], speculative=done.stats.spec.as_dict())


# ---------------------------------------------------------------- batch files

@app.command()
def batch(args: Annotated[list[str], typer.Argument(help="[MODEL] INPUT.jsonl; INPUT '-' reads stdin.", show_default=False)],
          output: Annotated[Path, typer.Option("--output", "-o", help="Answers, one JSON line per record (appended; a rerun resumes).")],
          parallel: Annotated[int, typer.Option("--parallel", "-np", help="Sequences decoded together.")] = 8,
          max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Tokens per answer (-1: until end of turn).")] = -1,
          temp: Annotated[float, typer.Option("--temp", help="Temperature; 0 is greedy.")] = 0.8,
          top_k: Annotated[int, typer.Option("--top-k")] = 40,
          top_p: Annotated[float, typer.Option("--top-p")] = 0.95,
          min_p: Annotated[float, typer.Option("--min-p")] = 0.05,
          repeat_penalty: Annotated[float, typer.Option("--repeat-penalty")] = 1.0,
          seed: Annotated[Optional[int], typer.Option("--seed", help="Run seed: records without their own seed derive one from it and their id.")] = None,
          system: Annotated[Optional[str], typer.Option("--system", help="System prompt for records without one.")] = None,
          ctx: Annotated[Optional[int], typer.Option("--ctx", "-c", help="Context per record (default 4096).")] = None,
          threads: Annotated[Optional[int], typer.Option("--threads", "-t")] = None, fa: FlashOpt = "auto", ctk: CtkOpt = "f16", ctv: CtvOpt = "f16", backend: BackendOpt = "auto",
          metrics: Annotated[Optional[Path], typer.Option("--metrics", help="Write the run's metrics as JSON here.")] = None,
          shard: Annotated[Optional[str], typer.Option("--shard", help="I/N: only the records whose id hashes to shard I of N (1-based).")] = None,
          no_prefix_cache: Annotated[bool, typer.Option("--no-prefix-cache", help="Compute every prompt in full.")] = False,
          kv_pages: Annotated[Optional[int], typer.Option("--kv-pages", help="KV pool size in pages of 64 tokens (default: (parallel + 1) contexts).")] = None,
          overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUTPUT instead of resuming it.")] = False):
    """Answer a JSONL file of requests (OpenAI batch lines or {"id", "prompt"|"messages"}) with continuous batching.
    Answers are appended as they finish; rerun the same command to resume after a crash or Ctrl-C."""
    import secrets
    from runner import batch as B
    model, path = _model_and_text(args)
    if path is None:
        raise UserError("give the INPUT.jsonl file ('-' reads stdin)")
    if not 1 <= parallel <= 64:
        raise UserError(f"--parallel must be in 1..64, got {parallel}")
    if max_tokens < -1:
        raise UserError(f"-n/--max-tokens must be -1 or more, got {max_tokens}")
    if ctx is not None and ctx < 16:
        raise UserError(f"-c/--ctx must be at least 16, got {ctx}")
    if kv_pages is not None and kv_pages < 1:
        raise UserError(f"--kv-pages must be at least 1, got {kv_pages}")
    sh = None
    if shard is not None:
        i, _, n = shard.partition("/")
        if not (i.isdigit() and n.isdigit() and 1 <= int(i) <= int(n)):
            raise UserError(f"--shard must be I/N with 1 <= I <= N, got {shard!r}")
        sh = (int(i) - 1, int(n))
    _sampler(temp, top_k, top_p, min_p, repeat_penalty, seed)      # the flags' own checks
    if path != "-" and not Path(path).is_file():
        raise UserError(f"input file {path} does not exist")
    if output.is_dir():
        raise UserError(f"-o {output} is a directory: give a file path")
    m = _load(model, threads, fa, (ctk, ctv), backend)
    n_ctx = m.context_length(ctx)
    defaults = B.Defaults(max_tokens, temp, top_k, top_p, min_p, repeat_penalty, seed, system)
    meta = {"model": m.name, "model_bytes": m.path.stat().st_size, "defaults": vars(defaults) | {"ctx": n_ctx},
            "shard": shard, "run_seed": seed if seed is not None else secrets.randbits(31)}
    out = B.Output(output, meta, overwrite)
    try:
        out.open()
    except B.BatchError as e:
        raise UserError(str(e)) from None
    if out.repaired:
        err.print(f"[yellow]cut a torn last line ({out.repaired} bytes) from {output}: that record runs again[/]",
                  soft_wrap=True)
    lines = sys.stdin if path == "-" else open(path, encoding="utf-8", errors="replace")
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
    bar = Progress(TextColumn("batch"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                   TimeRemainingColumn(), console=err, transient=False, disable=not err.is_terminal)
    task, t0 = None, time.perf_counter()

    def progress(done, total, gen_tokens):
        nonlocal task
        if task is None:
            task = bar.add_task("batch", total=total, rate="")
        bar.update(task, completed=done, total=total, rate=f"{gen_tokens / max(time.perf_counter() - t0, 1e-9):.1f} tok/s")
    try:
        with bar:
            mt = B.run(m, lines, out, defaults, n_ctx, parallel, sh, not no_prefix_cache, kv_pages, progress)
    except KeyboardInterrupt:
        out.close()
        err.print(f"interrupted: every finished record is in {output}; run the same command again to resume",
                  soft_wrap=True)
        sys.exit(130)
    finally:
        if lines is not sys.stdin:
            lines.close()
    out.close()
    d = mt.as_dict()
    if metrics:
        metrics.write_text(json.dumps(d, indent=1) + "\n", encoding="utf-8")
    err.print(f"{mt.ok} ok, {mt.failed} failed" + (f", {mt.skipped} answered before" if mt.skipped else "")
              + f" of {mt.records} records in {d['wall_s']:.1f} s | generation {d['generation_tokens_per_s']:.1f} tok/s"
              f" | prefix cache {100 * d['prefix_cache_hit_rate']:.0f}% of prompt tokens | {output}", soft_wrap=True)
    if mt.failed:
        sys.exit(1)


def entry():
    """The `numbat` program: main(), then the process ends without Python's teardown
    (freeing numba's and LLVM's object graphs took 0.4 s after every command's last output
    here; nothing of numbat's runs at exit: its files are closed and renamed in place before)."""
    try:
        main()
    except SystemExit as e:
        _exit(e.code)
    _exit(0)


def _exit(code) -> None:
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):      # a closed pipe: what was written stays written
            code = code or 1
    os._exit(code or 0)


def main():
    """Usage errors are click's (exit 2); our errors are one line and exit 1."""
    try:
        app()
    except UserError as e:
        if state["debug"]:
            raise
        _fail(str(e))
    except Exception as e:
        if state["debug"]:
            raise
        if isinstance(e, _known_errors()):
            _fail(str(e))
        _fail(f"{type(e).__name__}: {e} (run with --debug for the traceback)")


def _known_errors() -> tuple[type, ...]:
    from gguf_io import GGUFError
    from quant import UnsupportedType
    from runner.chat_template import TemplateError
    from runner.generate import ContextError
    from runner.model import ModelError
    return (GGUFError, catalog.FetchError, UnsupportedType, ModelError, ContextError, TemplateError)


def _fail(msg: str):
    err.print(f"[red]error:[/] {msg}", soft_wrap=True)
    sys.exit(1)


if __name__ == "__main__":
    entry()
