"""Tiny synthetic GGUF models for tests, written with gguf-py's GGUFWriter.

The files carry llama.cpp's tensor names and metadata keys and a small but valid SPM
tokenizer, so llama.cpp (the oracle) loads and runs them like a real model.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf import quants as gq

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
DEFAULT_ROPE_BASE = {"llama": 10000.0, "qwen2": 1e6, "qwen3": 1e6, "gemma3": 1e6}
N_SPECIAL = 3 + 256   # <unk> <s> </s> and the byte tokens


def tiny_vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """An SPM vocabulary: <unk>, <s>, </s>, <0x00>..<0xFF>, then ordinary pieces with
    decreasing scores (SentencePiece scores are log-probabilities)."""
    if n_vocab <= N_SPECIAL:
        raise ValueError(f"n_vocab must exceed {N_SPECIAL}")
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    pieces = ["▁", *letters, *(f"▁{a}" for a in letters)]
    pieces += [a + b for a in letters for b in letters]
    pieces += [f"▁{a}{b}" for a in letters for b in letters]
    pieces = pieces[:n_vocab - N_SPECIAL]
    if len(pieces) < n_vocab - N_SPECIAL:
        raise ValueError(f"n_vocab must be at most {N_SPECIAL + len(pieces)}")
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    scores = [0.0] * N_SPECIAL + [-float(i) for i in range(len(pieces))]
    types = ([TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
             + [TokenType.NORMAL] * len(pieces))
    return tokens, scores, [int(t) for t in types]


def write_tiny_model(path: str | Path, arch: str = "llama", *, n_embd: int = 64, n_layer: int = 2,
                     n_head: int = 4, n_head_kv: int = 2, head_dim: int | None = None, n_ff: int = 128,
                     n_vocab: int = 384, n_ctx_train: int = 256, seed: int = 0,
                     weight_type: GGMLQuantizationType = GGMLQuantizationType.F32,
                     tied_output: bool = False, sliding_window: int = 8, rope_base: float | None = None,
                     norm_eps: float = 1e-6, extra: Callable[[GGUFWriter], None] | None = None,
                     tensor_types: dict[str, GGMLQuantizationType] | None = None) -> Path:
    """Write a random model of `arch` to `path`. Matrices are stored as `weight_type`
    (quantized with gguf-py's reference quantizers), or as `tensor_types` names for a tensor by its
    name without the layer's prefix ("attn_v.weight"), norms and biases as F32.
    `sliding_window` only applies to gemma3. `extra(writer)` runs before the file is
    written, to add metadata (for example ``w.add_custom_alignment(64)``)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; one of {ARCHS}")
    path = Path(path)
    hd = head_dim or n_embd // n_head
    rng = np.random.default_rng(seed)
    w = GGUFWriter(path, arch)

    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    if hd != n_embd // n_head:
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_rope_freq_base(rope_base if rope_base is not None else DEFAULT_ROPE_BASE[arch])
    w.add_layer_norm_rms_eps(norm_eps)
    if arch == "gemma3":
        w.add_sliding_window(sliding_window)

    tokens, scores, types = tiny_vocab(n_vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def matrix(name, rows, cols, gain=1.0):
        # std gain/sqrt(fan_in) keeps activations O(1) through the layers
        x = rng.normal(0.0, gain / np.sqrt(cols), (rows, cols)).astype(np.float32)
        wt = (tensor_types or {}).get(name.split(".", 2)[-1] if name.startswith("blk.") else name, weight_type)
        if wt in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w.add_tensor(name, gq.quantize(x, wt))
        else:
            w.add_tensor(name, gq.quantize(x, wt), raw_dtype=wt)

    def vector(name, n, mean, std):
        w.add_tensor(name, rng.normal(mean, std, n).astype(np.float32))

    # gain 3 on the vocabulary matrices: logits with std ~3, so the softmax is neither flat
    # nor one-hot and the top tokens are separated by more than quantization noise
    matrix("token_embd.weight", n_vocab, n_embd, 3.0)
    for i in range(n_layer):
        b = f"blk.{i}"
        vector(f"{b}.attn_norm.weight", n_embd, 1.0, 0.1)
        matrix(f"{b}.attn_q.weight", n_head * hd, n_embd)
        matrix(f"{b}.attn_k.weight", n_head_kv * hd, n_embd)
        matrix(f"{b}.attn_v.weight", n_head_kv * hd, n_embd)
        if arch == "qwen2":
            vector(f"{b}.attn_q.bias", n_head * hd, 0.0, 0.1)
            vector(f"{b}.attn_k.bias", n_head_kv * hd, 0.0, 0.1)
            vector(f"{b}.attn_v.bias", n_head_kv * hd, 0.0, 0.1)
        if arch in ("qwen3", "gemma3"):
            vector(f"{b}.attn_q_norm.weight", hd, 1.0, 0.1)
            vector(f"{b}.attn_k_norm.weight", hd, 1.0, 0.1)
        matrix(f"{b}.attn_output.weight", n_embd, n_head * hd)
        if arch == "gemma3":
            vector(f"{b}.post_attention_norm.weight", n_embd, 1.0, 0.1)
        vector(f"{b}.ffn_norm.weight", n_embd, 1.0, 0.1)
        matrix(f"{b}.ffn_gate.weight", n_ff, n_embd)
        matrix(f"{b}.ffn_up.weight", n_ff, n_embd)
        matrix(f"{b}.ffn_down.weight", n_embd, n_ff)
        if arch == "gemma3":
            vector(f"{b}.post_ffw_norm.weight", n_embd, 1.0, 0.1)
    vector("output_norm.weight", n_embd, 1.0, 0.1)
    if not tied_output:
        matrix("output.weight", n_vocab, n_embd, 3.0)

    if extra is not None:
        extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- editing a written file in place (regression tests and the fuzzer) ----

@dataclass(frozen=True)
class Field:
    """Where a metadata value or a tensor-info field sits in a file's header."""
    vtype: int     # GGUF metadata value type (scalar types only are patchable)
    start: int
    end: int


def header_fields(path: str | Path) -> tuple[dict[str, Field], dict[str, Field], dict[str, Field]]:
    """(metadata values, tensor dims, tensor types) of a valid file, by key / tensor name:
    byte ranges that a test can overwrite with a value of the same size."""
    from gguf_io.reader import _Cursor

    data = Path(path).read_bytes()
    c = _Cursor(memoryview(data), Path(path))
    c.pos = 8
    n_tensors, n_kv = c.scalar("Q", "tensor count"), c.scalar("Q", "metadata count")
    kv, dims, types = {}, {}, {}
    for _ in range(n_kv):
        key = c.string("key")
        vtype = c.scalar("I", "type")
        start = c.pos
        c.value(vtype, key)
        kv[key] = Field(vtype, start, c.pos)
    for _ in range(n_tensors):
        name = c.string("name")
        n_dims = c.scalar("I", "dims")
        dims[name] = Field(10, c.pos, c.pos + 8 * n_dims)
        c.pos += 8 * n_dims
        types[name] = Field(4, c.pos, c.pos + 4)
        c.pos += 4 + 8
    return kv, dims, types


_CODES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def set_metadata(path: str | Path, key: str, value) -> None:
    """Overwrite the scalar metadata value `key` in place, keeping its type (so the header
    keeps its length): e.g. a head count the tensors do not match."""
    fld = header_fields(path)[0][key]
    _patch(path, fld.start, struct.pack("<" + _CODES[fld.vtype], value))


def set_dims(path: str | Path, name: str, dims: tuple[int, ...]) -> None:
    """Overwrite tensor `name`'s dims in place (same number of dims)."""
    fld = header_fields(path)[1][name]
    assert (fld.end - fld.start) // 8 == len(dims)
    _patch(path, fld.start, struct.pack(f"<{len(dims)}Q", *dims))


def _patch(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
