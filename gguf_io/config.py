"""ModelConfig: one frozen record that covers every supported architecture through flags
(rope style, qkv bias, qk-norm, embedding scale, sliding-window pattern), built from metadata."""
from __future__ import annotations

import math
from dataclasses import dataclass

from gguf_io.reader import GGUFError, GGUFFile

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    norm_eps: float
    rope_base: float
    rope_dim: int
    rope_neox: bool                 # half-split pairs (qwen2/3, gemma3) vs adjacent pairs (llama)
    rope_scaling: str = "none"      # none | linear | yarn (only linear is applied)
    rope_scale: float = 1.0         # positions are divided by this for linear scaling
    rope_base_local: float = 0.0    # gemma3: sliding-window layers use their own base
    sliding_window: int = 0         # 0: every layer attends to the whole context
    swa_period: int = 0             # gemma3: layers i with (i+1) % period != 0 are sliding
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False        # gemma3: norms after attention and after the FFN
    embed_scale: float = 1.0
    scale_q: bool = False           # gemma3: 1/sqrt(head_dim) multiplies q (before f16), not the scores
    act: str = "silu"               # silu | gelu_tanh
    tied_output: bool = False

    def is_sliding(self, layer: int) -> bool:
        return self.sliding_window > 0 and self.swa_period > 0 and (layer + 1) % self.swa_period != 0

    def window(self, layer: int) -> int:
        """The layer's sliding window, 0 for a global layer."""
        return self.sliding_window if self.is_sliding(layer) else 0

    def rope_base_for(self, layer: int) -> float:
        return self.rope_base_local if self.is_sliding(layer) and self.rope_base_local else self.rope_base


def config_from_gguf(f: GGUFFile) -> ModelConfig:
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{f.path}: architecture '{arch}' is not supported (numbat runs {', '.join(ARCHITECTURES)})")

    # Metadata is untrusted: every value is type-checked here, so a string or an array where a
    # number belongs is a GGUFError naming the key, not a TypeError later. Ranges and agreement
    # with the tensors are checked by gguf_io.validate.
    def get(key, default=None, required=False, kind=int):
        full = f"{arch}.{key}"
        v = f.metadata.get(full)
        if v is None:
            if required:
                raise GGUFError(f"{f.path}: metadata key {full} is missing or not a positive integer")
            return default
        if kind is int:
            ok = isinstance(v, int) and not isinstance(v, bool) and (v > 0 if required else v >= 0)
            want = "a positive integer" if required else "a non-negative integer"
        elif kind is float:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            want = "a finite number"
        else:
            ok, want = isinstance(v, str), "a string"
        if not ok:
            raise GGUFError(f"{f.path}: metadata key {full} is {_show(v)}, expected {want}")
        return v

    n_embd, n_head = get("embedding_length", required=True), get("attention.head_count", required=True)
    head_dim = get("attention.key_length") or n_embd // n_head
    tokens = f.metadata.get("tokenizer.ggml.tokens")
    emb = f.tensors.get("token_embd.weight")
    if emb is None:
        raise GGUFError(f"{f.path}: tensor token_embd.weight is missing")
    n_vocab = emb.dims[1] if len(emb.dims) > 1 else len(tokens or ())
    scaling = get("rope.scaling.type", "none", kind=str)
    common = dict(
        arch=arch, n_embd=n_embd, n_layer=get("block_count", required=True), n_head=n_head,
        n_head_kv=get("attention.head_count_kv") or n_head, head_dim=head_dim,
        n_ff=get("feed_forward_length", required=True), n_vocab=n_vocab,
        n_ctx_train=get("context_length", 2048), norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5, kind=float)),
        rope_base=float(get("rope.freq_base", 10000.0, kind=float)), rope_dim=get("rope.dimension_count") or head_dim,
        rope_scaling=scaling,
        rope_scale=float(get("rope.scaling.factor", 1.0, kind=float) or 1.0) if scaling == "linear" else 1.0,
        tied_output="output.weight" not in f.tensors,
        qkv_bias="blk.0.attn_q.bias" in f.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in f.tensors,
    )
    if arch == "llama":
        return ModelConfig(**common, rope_neox=False)
    if arch in ("qwen2", "qwen3"):
        return ModelConfig(**common, rope_neox=True)
    # gemma3: llama.cpp's converter stores RMSNorm weights already as (1 + w), so no +1 here;
    # the oracle tests check it. Every 6th layer is global; the others use a 10k-base rope.
    return ModelConfig(**common, rope_neox=True, rope_base_local=10000.0,
                       sliding_window=get("attention.sliding_window", 0), swa_period=6,
                       post_norms=True, embed_scale=math.sqrt(n_embd), act="gelu_tanh", scale_q=True)


def _show(v) -> str:
    """A metadata value for an error message, cut short (arrays can hold 200k strings)."""
    if isinstance(v, (list, tuple)) or hasattr(v, "shape"):
        return f"an array of {len(v)}"
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."
