"""Check a model file against its own config before any kernel runs.

The numba kernels are compiled without bounds checks: they trust that every array has the
shape the config implies. A GGUF file is untrusted input, so this module proves that trust
once, at load: every tensor the forward reads is present with the rank, dims and type the
config implies, every count is within sane bounds (so no loop or allocation is sized by a
number the tensors do not back), and the tokenizer's arrays agree with the embedding rows.
Anything else is a GGUFError naming the file, the tensor or key, what was expected and what
was found.
"""
from __future__ import annotations

import dataclasses

import math
from typing import Any

import numpy as np
from gguf_io.types import GGMLQuantizationType as T

from gguf_io.config import ModelConfig, _show
from gguf_io.reader import GGUFError, GGUFFile

# Far above any released model (llama 3.1 405B: 126 layers, 128 heads, 16384 wide, 53248 ffn,
# 128k context; gemma3: 262144 tokens), far below what could exhaust memory or time before
# the tensor checks run.
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_EMBD = 1 << 17
MAX_FF = 1 << 20
MAX_VOCAB = 1 << 22
MAX_CTX = 1 << 24
# the tokenizer's work at a first load grows with its tokens' lengths (the SentencePiece merge
# table tries every split of every token): qwen2.5's longest token is 128 characters, all of
# gemma3's 262k tokens 1.5M characters
MAX_TOKEN_CHARS = 1024
MAX_VOCAB_CHARS = 1 << 24

# norms, biases and rope factors are read as float vectors; llama.cpp never quantizes them
_FLOAT_TYPES = (T.F32, T.F16, T.BF16)


def validate(f: GGUFFile, cfg: ModelConfig) -> None:
    """Raise GGUFError unless `f` holds every tensor `cfg` makes the forward read, shaped as
    `cfg` says, and a tokenizer consistent with its embedding rows. Once per file and config:
    the loader and each backend ask (a backend may be built from a file directly), and the
    tokenizer's check costs ~0.2 s of every start."""
    if getattr(f, "_validated_for", None) == cfg:
        return
    _validate(f, cfg)
    f._validated_for = dataclasses.replace(cfg)     # a copy: a config changed later is checked again


def _validate(f: GGUFFile, cfg: ModelConfig) -> None:
    def fail(what: str):
        raise GGUFError(f"{f.path}: {what}")

    def count(what: str, value, lo: int, hi: int):
        if not lo <= value <= hi:
            fail(f"{what} is {value}, expected {lo} to {hi}")

    count(f"{cfg.arch}.block_count", cfg.n_layer, 1, MAX_LAYERS)
    count(f"{cfg.arch}.attention.head_count", cfg.n_head, 1, MAX_HEADS)
    count(f"{cfg.arch}.attention.head_count_kv", cfg.n_head_kv, 1, cfg.n_head)
    if cfg.n_head % cfg.n_head_kv:
        fail(f"{cfg.arch}.attention.head_count {cfg.n_head} is not a multiple of head_count_kv {cfg.n_head_kv}")
    count(f"{cfg.arch}.embedding_length", cfg.n_embd, 1, MAX_EMBD)
    count(f"head dim ({cfg.arch}.attention.key_length or embedding_length / head_count)", cfg.head_dim, 1, MAX_HEAD_DIM)
    count(f"{cfg.arch}.feed_forward_length", cfg.n_ff, 1, MAX_FF)
    count("vocabulary size (rows of token_embd.weight)", cfg.n_vocab, 1, MAX_VOCAB)
    count(f"{cfg.arch}.context_length", cfg.n_ctx_train, 1, MAX_CTX)
    count(f"{cfg.arch}.attention.sliding_window", cfg.sliding_window, 0, MAX_CTX)
    count(f"{cfg.arch}.rope.dimension_count", cfg.rope_dim, 2, cfg.head_dim)
    if cfg.rope_dim % 2:
        fail(f"{cfg.arch}.rope.dimension_count is {cfg.rope_dim}, expected an even number")
    v = f.metadata.get(f"{cfg.arch}.attention.value_length")
    if v is not None and v != cfg.head_dim:
        fail(f"{cfg.arch}.attention.value_length is {_show(v)}, expected the key length {cfg.head_dim}")
    for what, x, lo in (("rope.freq_base", cfg.rope_base, 0.0), ("rope.scaling.factor", cfg.rope_scale, 0.0)):
        if not (math.isfinite(x) and x > lo):
            fail(f"{cfg.arch}.{what} is {x}, expected a positive number")
    if not (math.isfinite(cfg.norm_eps) and cfg.norm_eps >= 0):
        fail(f"{cfg.arch}.attention.layer_norm_rms_epsilon is {cfg.norm_eps}, expected a non-negative number")

    def tensor(name: str, dims: tuple[int, ...], required: bool = True) -> None:
        """`name` has GGUF dims `dims` (dims[0] the input axis of a matrix)."""
        t = f.tensors.get(name)
        if t is None:
            if required:
                fail(f"tensor {name} is missing (the {cfg.arch} architecture needs it)")
            return
        if t.dims != dims:
            fail(f"tensor {name} has dims {list(t.dims)}, expected {list(dims)} from the metadata")
        if len(dims) == 1 and t.type_id not in _FLOAT_TYPES:
            fail(f"tensor {name} is {t.type_name}, expected one of {', '.join(x.name for x in _FLOAT_TYPES)}")

    e, q, kv, ff = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim, cfg.n_ff
    tensor("token_embd.weight", (e, cfg.n_vocab))
    tensor("output_norm.weight", (e,))
    tensor("output.weight", (e, cfg.n_vocab), required=not cfg.tied_output)
    tensor("rope_freqs.weight", (cfg.rope_dim // 2,), required=False)
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        for name, dims in (("attn_norm.weight", (e,)), ("attn_q.weight", (e, q)), ("attn_k.weight", (e, kv)),
                           ("attn_v.weight", (e, kv)), ("attn_output.weight", (q, e)), ("ffn_norm.weight", (e,)),
                           ("ffn_gate.weight", (e, ff)), ("ffn_up.weight", (e, ff)), ("ffn_down.weight", (ff, e))):
            tensor(b + name, dims)
        # the forward uses these when present: each must then be whole (q and k norms together)
        for name, n in (("attn_q.bias", q), ("attn_k.bias", kv), ("attn_v.bias", kv)):
            tensor(b + name, (n,), required=cfg.qkv_bias)
        has_q, has_k = b + "attn_q_norm.weight" in f.tensors, b + "attn_k_norm.weight" in f.tensors
        for name in ("attn_q_norm.weight", "attn_k_norm.weight"):
            tensor(b + name, (cfg.head_dim,), required=cfg.qk_norm or has_q or has_k)
        for name in ("post_attention_norm.weight", "post_ffw_norm.weight"):
            tensor(b + name, (e,), required=cfg.post_norms)

    _tokenizer(f, cfg, fail)


def _tokenizer(f: GGUFFile, cfg: ModelConfig, fail) -> None:
    """The arrays the tokenizer and the chat template index: one entry per embedding row."""
    m = f.metadata

    def kind(key: str, ok, want: str, required: bool = False) -> Any:
        v = m.get(key)
        if v is None:
            if required:
                fail(f"metadata key {key} is missing, expected {want}")
            return None
        if not ok(v):
            fail(f"metadata key {key} is {_show(v)}, expected {want}")
        return v

    is_str = lambda v: isinstance(v, str)
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)
    strings = lambda v: isinstance(v, list) and all(isinstance(t, str) for t in v)
    model = kind("tokenizer.ggml.model", is_str, "a string", required=True)
    tokens = kind("tokenizer.ggml.tokens", strings, "an array of strings", required=True)
    if len(tokens) != cfg.n_vocab:
        fail(f"metadata key tokenizer.ggml.tokens has {len(tokens)} tokens, "
             f"expected {cfg.n_vocab} (the rows of token_embd.weight)")
    if "tokenizer.ggml.tokens" not in f.kept:      # kept arrays passed this when written
        longest = max(map(len, tokens), default=0)
        if longest > MAX_TOKEN_CHARS:
            j = next(j for j, t in enumerate(tokens) if len(t) == longest)
            fail(f"metadata key tokenizer.ggml.tokens entry {j} is {longest} characters long, "
                 f"expected at most {MAX_TOKEN_CHARS}")
        total = sum(map(len, tokens))
        if total > MAX_VOCAB_CHARS:
            fail(f"metadata key tokenizer.ggml.tokens holds {total} characters in all, expected at most {MAX_VOCAB_CHARS}")

    def per_token(v, dtype_kind: str) -> bool:
        return isinstance(v, np.ndarray) and v.ndim == 1 and v.dtype.kind in dtype_kind and len(v) == len(tokens)
    kind("tokenizer.ggml.token_type", lambda v: per_token(v, "iu"), f"{len(tokens)} integers, one per token")
    kind("tokenizer.ggml.scores", lambda v: per_token(v, "iuf"), f"{len(tokens)} numbers, one per token")
    kind("tokenizer.ggml.pre", is_str, "a string")
    kind("tokenizer.chat_template", is_str, "a string")
    for key, v in m.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            kind(key, is_int, "an integer token id")
        elif key.startswith("tokenizer.ggml.add_"):
            kind(key, lambda v: isinstance(v, (bool, int)), "a boolean")
    if model == "gpt2":
        merges = kind("tokenizer.ggml.merges", strings, "an array of strings", required=True)
        # arrays kept from an earlier open of this same file (models.derived, written only after
        # its validation passed) have been checked
        if not {"tokenizer.ggml.tokens", "tokenizer.ggml.merges"} <= f.kept:
            _merges(tokens, merges, fail)


def _merges(tokens: list, merges: list, fail) -> None:
    """Each merge two tokens whose join is a token, split as runner.tokenizer splits it: the
    tokenizers library panics on any other (0.1-0.2 s for 150k merges)."""
    vocab = set(tokens)
    for j, merge in enumerate(merges):
        k = merge.find(" ", 1)
        a, b = merge[:k], merge[k + 1:]
        if k < 0 or a not in vocab or b not in vocab or a + b not in vocab:
            fail(f"metadata key tokenizer.ggml.merges entry {j} ({_show(merge)}) is not two tokens "
                 f"of the vocabulary that merge into a third")
