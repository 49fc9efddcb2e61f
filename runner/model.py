"""Loading a model: a catalog name or a path -> the memory-mapped file, its config, tokenizer,
chat template and a backend ready to run."""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import quant  # first: it sets the OpenMP wait policy before numba starts its threads
import numpy as np
import gguf_io.reader
import gguf_io.validate
from gguf_io import GGUFError, GGUFFile, open_gguf
from gguf_io.config import ModelConfig, config_from_gguf
from gguf_io.validate import validate
from models import catalog, derived
import runner.tokenizer
from runner.chat_template import ChatTemplate
from runner.tokenizer import Tokenizer

DEFAULT_CTX = 4096
# what kept string arrays depend on: how the reader decodes them and what validation proved
_STRINGS_KEY = hashlib.sha256(b"".join(Path(m.__file__).read_bytes() for m in (gguf_io.reader, gguf_io.validate))).hexdigest()
_MERGES_KEY = hashlib.sha256(Path(runner.tokenizer.__file__).read_bytes()).hexdigest()


def _kept_strings(path: Path) -> dict | None:
    """The string arrays an earlier load of this file kept (models.derived), if well formed."""
    v = derived.load_value(path, "strings", _STRINGS_KEY)
    ok = isinstance(v, dict) and all(isinstance(e, list) and len(e) == 3 and isinstance(e[0], int)
                                     and isinstance(e[1], int) and isinstance(e[2], list) for e in v.values())
    return v if ok else None


class ModelError(Exception):
    """A model that cannot be found or run; the message says what to do."""


def resolve(model: str, progress: catalog.Progress | None = None) -> Path:
    """A path to a .gguf, or a catalog name (fetched on first use)."""
    if model in catalog.CATALOG:
        try:
            return catalog.fetch(model, progress)
        except catalog.FetchError as e:
            raise ModelError(str(e)) from None
    p = Path(model).expanduser()
    if p.exists() or model.endswith(".gguf") or os.sep in model:
        if p.exists() and not p.is_file():
            raise ModelError(f"model path {p} is not a regular file: give a path to a .gguf file")
        if not p.is_file():
            raise ModelError(f"model file {p} does not exist: give a path to a .gguf file or one of: "
                             f"{', '.join(catalog.CATALOG)}")
        return p
    raise ModelError(catalog.unknown_name_message(model))


@dataclass
class Model:
    name: str
    path: Path
    file: GGUFFile
    cfg: ModelConfig
    tokenizer: Tokenizer
    template: ChatTemplate
    backend: object

    def encode_prompt(self, text: str | None = None, messages: list[dict] | None = None,
                      system: str | None = None, raw: bool = False) -> list[int]:
        """A request's token ids, the one place prompt, batch (and a server) make them: raw text
        is continued as it is (after the system text, if any); otherwise the chat template
        renders the messages (or one user message of text), with the system prompt first when
        the messages have none."""
        if raw:
            return self.tokenizer.encode((system + "\n" if system else "") + text)
        msgs = list(messages) if messages is not None else [{"role": "user", "content": text}]
        if system and not any(m["role"] == "system" for m in msgs):
            msgs = [{"role": "system", "content": system}] + msgs
        return self.template.encode(self.tokenizer, msgs)

    def make_cache(self, n_ctx: int | None = None, n_keep: int = 0):
        return self.backend.make_cache(self.context_length(n_ctx), n_keep)

    def context_length(self, n_ctx: int | None) -> int:
        """-c/--ctx, or 4096 (llama.cpp's default), never past what the model was trained for."""
        return min(n_ctx or DEFAULT_CTX, self.cfg.n_ctx_train)


def load(model: str, progress: catalog.Progress | None = None, threads: int | None = None,
         flash: bool = True, cache_types: tuple[str, str] = ("f16", "f16"), backend: str = "numba",
         draft: bool = False, first=None) -> Model:
    """flash: llama.cpp's flash-attention arithmetic (its CPU default, -fa auto/on), else -fa off's.
    backend: numba | mlx | auto (runner.backends.make). draft: a speculative draft's weights.
    first: a runner.backends.first_run(), told the model's needs once the file is validated."""
    path = resolve(model, progress)
    try:
        f = open_gguf(path, _kept_strings(path))
        cfg = config_from_gguf(f)
        validate(f, cfg)    # the file is untrusted: its shapes are proven before any kernel runs
    except GGUFError as e:
        raise ModelError(str(e)) from None
    if first is not None:
        first.tell(f, cfg, draft)
    if f.string_arrays:     # decoded and validated now: kept for the next load
        derived.keep_value(path, "strings", _STRINGS_KEY, f.string_arrays)
    kept = derived.load_value(path, "merges", _MERGES_KEY)
    kept = np.frombuffer(kept, np.int32).reshape(-1, 3) if isinstance(kept, bytes) and len(kept) % 12 == 0 else None
    try:        # a table made (now or at a first long text) is kept for the next load
        tok = Tokenizer.from_metadata(f.metadata, kept, lambda m: derived.keep_value(path, "merges", _MERGES_KEY, m.tobytes()))
    except ValueError as e:
        raise ModelError(f"{path}: {e}") from None
    template = ChatTemplate.from_metadata(f.metadata)
    if threads:
        import numba
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    from runner import backends
    try:
        be = backends.make(backend, f, cfg, flash, cache_types, progress, draft)
    except backends.BackendError as e:
        raise ModelError(str(e)) from None
    except (quant.UnsupportedType, GGUFError) as e:
        raise ModelError(f"{path}: {e}") from None
    return Model(model, path, f, cfg, tok, template, be)
