"""ModelConfig from GGUF metadata: the per-architecture flags on tiny models, errors on
unsupported or incomplete files, and the values of the real catalog models."""
import math

import pytest

from gguf_io.config import config_from_gguf
from gguf_io.reader import GGUFError, open_gguf
from gguf_io.testing import write_tiny_model

# arch -> flags that differ between architectures
FLAGS = {
    "llama": dict(rope_neox=False, qkv_bias=False, qk_norm=False, post_norms=False, act="silu", embed_scale=1.0),
    "qwen2": dict(rope_neox=True, qkv_bias=True, qk_norm=False, post_norms=False, act="silu", embed_scale=1.0),
    "qwen3": dict(rope_neox=True, qkv_bias=False, qk_norm=True, post_norms=False, act="silu", embed_scale=1.0),
    "gemma3": dict(rope_neox=True, qkv_bias=False, qk_norm=True, post_norms=True, act="gelu_tanh",
                   embed_scale=math.sqrt(64)),
}


def tiny_config(tmp_path, arch, **kw):
    return config_from_gguf(open_gguf(write_tiny_model(tmp_path / f"{arch}.gguf", arch, **kw)))


@pytest.mark.parametrize("arch", FLAGS)
def test_tiny_model_fields(tmp_path, arch):
    c = tiny_config(tmp_path, arch, n_embd=64, n_layer=3, n_head=4, n_head_kv=2, n_ff=96, n_vocab=300,
                    n_ctx_train=512, rope_base=5e5, norm_eps=1e-5)
    assert c.arch == arch
    assert (c.n_embd, c.n_layer, c.n_head, c.n_head_kv, c.head_dim, c.n_ff) == (64, 3, 4, 2, 16, 96)
    assert (c.n_vocab, c.n_ctx_train, c.rope_dim) == (300, 512, 16)
    assert c.rope_base == 5e5 and c.norm_eps == pytest.approx(1e-5)
    assert (c.rope_scaling, c.rope_scale) == ("none", 1.0)
    assert not c.tied_output
    for k, v in FLAGS[arch].items():
        assert getattr(c, k) == v, k
    if arch != "gemma3":
        assert c.sliding_window == 0
        assert not any(c.is_sliding(i) for i in range(3))
        assert all(c.rope_base_for(i) == 5e5 for i in range(3))


@pytest.mark.parametrize("arch", FLAGS)
def test_explicit_head_dim_and_tied_output(tmp_path, arch):
    c = tiny_config(tmp_path, arch, head_dim=32, tied_output=True)
    assert (c.n_embd, c.n_head, c.head_dim, c.rope_dim) == (64, 4, 32, 32)
    assert c.tied_output


def test_gemma3_sliding_pattern(tmp_path):
    c = tiny_config(tmp_path, "gemma3", n_layer=13, head_dim=32, sliding_window=8, rope_base=1e6)
    assert c.sliding_window == 8
    # llama.cpp's gemma3: every 6th layer (5, 11) attends globally with the file's rope base,
    # the others use the sliding window and a 10k base
    globals_ = [i for i in range(13) if not c.is_sliding(i)]
    assert globals_ == [5, 11]
    assert [c.rope_base_for(i) for i in (0, 4, 5, 6, 11, 12)] == [1e4, 1e4, 1e6, 1e4, 1e6, 1e4]


def test_unknown_architecture(tmp_path):
    f = open_gguf(write_tiny_model(tmp_path / "m.gguf", "llama"))
    f.metadata["general.architecture"] = "mamba"
    with pytest.raises(GGUFError, match="'mamba'") as e:
        config_from_gguf(f)
    assert str(f.path) in str(e.value)


@pytest.mark.parametrize("arch,key", [
    ("llama", "embedding_length"), ("llama", "attention.head_count"), ("qwen2", "block_count"),
    ("gemma3", "feed_forward_length"),
])
def test_missing_required_key(tmp_path, arch, key):
    f = open_gguf(write_tiny_model(tmp_path / "m.gguf", arch))
    del f.metadata[f"{arch}.{key}"]
    with pytest.raises(GGUFError, match=f"{arch}.{key}") as e:
        config_from_gguf(f)
    assert str(f.path) in str(e.value)


def test_missing_token_embeddings(tmp_path):
    f = open_gguf(write_tiny_model(tmp_path / "m.gguf", "qwen3"))
    del f.tensors["token_embd.weight"]
    with pytest.raises(GGUFError, match="token_embd.weight"):
        config_from_gguf(f)


@pytest.mark.parametrize("key", ["attention.head_count", "embedding_length"])
def test_zero_sizes_are_gguf_errors(tmp_path, key):
    """A hostile header must fail as a GGUFError naming the key, not a ZeroDivisionError or a
    config with zero-sized heads."""
    f = open_gguf(write_tiny_model(tmp_path / "m.gguf", "llama"))
    f.metadata[f"llama.{key}"] = 0
    with pytest.raises(GGUFError, match=f"llama.{key}"):
        config_from_gguf(f)


@pytest.mark.real
def test_real_qwen25_coder_05b():
    from models.catalog import fetch
    c = config_from_gguf(open_gguf(fetch("qwen2.5-coder:0.5b")))
    assert (c.arch, c.n_layer, c.n_head, c.n_head_kv, c.head_dim, c.n_embd) == ("qwen2", 24, 14, 2, 64, 896)
    assert c.qkv_bias and c.rope_neox and not c.qk_norm and c.sliding_window == 0
    assert c.n_vocab == 151936 and c.rope_base == 1e6


@pytest.mark.real
def test_real_gemma3_270m():
    from models.catalog import fetch
    c = config_from_gguf(open_gguf(fetch("gemma3:270m")))
    assert (c.arch, c.n_layer, c.head_dim, c.sliding_window, c.n_embd) == ("gemma3", 18, 256, 512, 640)
    assert (c.n_head, c.n_head_kv, c.n_vocab) == (4, 1, 262144)
    assert c.qk_norm and c.post_norms and c.tied_output and c.rope_neox
    assert [i for i in range(18) if not c.is_sliding(i)] == [5, 11, 17]
