"""gguf_io.validate: a file whose metadata disagrees with its tensors is refused at load, with
one line naming the file, the key or tensor, what was expected and what was found, before
any kernel can index past an array. The reproducers of issue 14 are named tests here."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

from gguf_io.config import config_from_gguf
from gguf_io.reader import GGUFError, open_gguf
from gguf_io.testing import set_dims, set_metadata, write_tiny_model
from gguf_io.validate import validate
from models import catalog

ROOT = Path(__file__).resolve().parent.parent


def check(path):
    f = open_gguf(path)
    validate(f, config_from_gguf(f))


def refused(path, *needles):
    with pytest.raises(GGUFError) as e:
        check(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(path)), msg
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("kw", [{}, {"tied_output": True, "head_dim": 32}, {"weight_type": T.Q8_0, "n_head_kv": 4}])
def test_valid_tiny_models_pass(tmp_path, arch, kw):
    check(write_tiny_model(tmp_path / "m.gguf", arch, **kw))


@pytest.mark.real
@pytest.mark.parametrize("name", list(catalog.CATALOG))
def test_catalog_models_pass(name):
    check(catalog.fetch(name))


# ---- the reproducers: metadata larger than the tensors ----

def test_head_count_larger_than_the_q_matrix(tmp_path):
    p = write_tiny_model(tmp_path / "m.gguf", "llama", head_dim=32)   # q: 4 heads x 32
    set_metadata(p, "llama.attention.head_count", 16)
    refused(p, "tensor blk.0.attn_q.weight", "dims [64, 128]", "expected [64, 512]")


def test_head_count_kv_larger_than_k(tmp_path):
    p = write_tiny_model(tmp_path / "m.gguf", "qwen2")
    set_metadata(p, "qwen2.attention.head_count_kv", 4)
    refused(p, "blk.0.attn_k.weight", "expected [64, 64]")


def test_head_count_kv_not_dividing_head_count(tmp_path):
    p = write_tiny_model(tmp_path / "m.gguf", "llama")
    set_metadata(p, "llama.attention.head_count_kv", 3)
    refused(p, "head_count 4 is not a multiple of head_count_kv 3")


def test_huge_rope_dimension_count(tmp_path):
    p = write_tiny_model(tmp_path / "m.gguf", "qwen3", extra=lambda w: w.add_rope_dimension_count(16))
    set_metadata(p, "qwen3.rope.dimension_count", 1 << 30)
    refused(p, "qwen3.rope.dimension_count is 1073741824, expected 2 to 16")


def test_odd_rope_dimension_count(tmp_path):
    p = write_tiny_model(tmp_path / "m.gguf", "llama", extra=lambda w: w.add_rope_dimension_count(16))
    set_metadata(p, "llama.rope.dimension_count", 15)
    refused(p, "rope.dimension_count is 15, expected an even number")


def test_huge_block_count(tmp_path):
    p = write_tiny_model(tmp_path / "m.gguf", "llama")
    set_metadata(p, "llama.block_count", 2**32 - 1)
    refused(p, "llama.block_count is 4294967295, expected 1 to 1024")


def test_block_count_past_the_layers_in_the_file(tmp_path):
    p = write_tiny_model(tmp_path / "m.gguf", "gemma3", n_layer=2)
    set_metadata(p, "gemma3.block_count", 3)
    refused(p, "tensor blk.2.attn_norm.weight is missing")


def test_huge_key_length(tmp_path):
    p = write_tiny_model(tmp_path / "m.gguf", "llama", head_dim=32)
    set_metadata(p, "llama.attention.key_length", 1 << 20)
    refused(p, "head dim", "is 1048576, expected 1 to 1024")


def test_huge_context_length(tmp_path):
    p = write_tiny_model(tmp_path / "m.gguf", "llama")
    set_metadata(p, "llama.context_length", 2**32 - 1)
    refused(p, "llama.context_length is 4294967295")


def test_feed_forward_length_not_the_ffn_matrices(tmp_path):
    p = write_tiny_model(tmp_path / "m.gguf", "qwen2", n_ff=128)
    set_metadata(p, "qwen2.feed_forward_length", 256)
    refused(p, "blk.0.ffn_gate.weight has dims [64, 128], expected [64, 256]")


def test_embedding_length_not_the_norms(tmp_path):
    p = write_tiny_model(tmp_path / "m.gguf", "llama", head_dim=16)
    set_metadata(p, "llama.embedding_length", 128)
    refused(p, "token_embd.weight has dims [64, 384], expected [128, 384]")


def test_short_norm(tmp_path):
    p = write_tiny_model(tmp_path / "m.gguf", "gemma3")
    set_dims(p, "blk.1.post_ffw_norm.weight", (32,))
    refused(p, "tensor blk.1.post_ffw_norm.weight has dims [32], expected [64]")


def test_short_qk_norm(tmp_path):
    p = write_tiny_model(tmp_path / "m.gguf", "qwen3")
    set_dims(p, "blk.1.attn_k_norm.weight", (8,))
    refused(p, "blk.1.attn_k_norm.weight has dims [8], expected [16]")


def test_embedding_rows_fewer_than_tokens(tmp_path):
    p = write_tiny_model(tmp_path / "m2.gguf", "llama", tied_output=True)
    set_dims(p, "token_embd.weight", (64, 200))    # fewer rows than tokens
    refused(p, "tokenizer.ggml.tokens has 384 tokens, expected 200")


def test_wrong_metadata_type_is_named(tmp_path):
    p = write_tiny_model(tmp_path / "m.gguf", "llama", extra=lambda w: w.add_string("llama.rope.dimension_count", "16"))
    with pytest.raises(GGUFError, match=r"llama\.rope\.dimension_count is '16', expected a non-negative integer"):
        check(p)
    p = write_tiny_model(tmp_path / "m2.gguf", "llama", extra=lambda w: w.add_uint32("llama.rope.scaling.type", 1))
    with pytest.raises(GGUFError, match=r"llama\.rope\.scaling\.type is 1, expected a string"):
        check(p)


def test_special_token_id_must_be_an_integer(tmp_path):
    p = write_tiny_model(tmp_path / "m.gguf", "llama", extra=lambda w: w.add_string("tokenizer.ggml.eot_token_id", "x"))
    refused(p, "tokenizer.ggml.eot_token_id is 'x', expected an integer token id")


def test_scores_shorter_than_the_vocabulary(tmp_path):
    p = write_tiny_model(tmp_path / "m.gguf", "llama")
    f = open_gguf(p)
    f.metadata["tokenizer.ggml.scores"] = f.metadata["tokenizer.ggml.scores"][:10]
    with pytest.raises(GGUFError, match="tokenizer.ggml.scores is an array of 10, expected 384 numbers"):
        validate(f, config_from_gguf(f))


def test_tokens_too_long_are_refused(tmp_path, monkeypatch):
    """A SentencePiece merge table tries every split of every token: a hostile vocabulary of
    long tokens would make the first load run for minutes, so its lengths are bounded."""
    import gguf_io.validate as V
    p = write_tiny_model(tmp_path / "m.gguf", "llama")

    def with_token(token):
        f = open_gguf(p)            # validation is remembered per open file
        f.metadata["tokenizer.ggml.tokens"][7] = token
        return f, config_from_gguf(f)

    validate(*with_token("a" * V.MAX_TOKEN_CHARS))
    with pytest.raises(GGUFError, match=f"tokens entry 7 is {V.MAX_TOKEN_CHARS + 1} characters long, expected at most"):
        validate(*with_token("a" * (V.MAX_TOKEN_CHARS + 1)))
    f, cfg = with_token("a" * V.MAX_TOKEN_CHARS)    # each at the bound, the sum past its own
    total = sum(map(len, f.metadata["tokenizer.ggml.tokens"]))
    monkeypatch.setattr(V, "MAX_VOCAB_CHARS", total - 1)
    with pytest.raises(GGUFError, match=f"holds {total} characters in all, expected at most {total - 1}"):
        validate(f, cfg)


def test_bpe_merge_outside_the_vocabulary(tmp_path):
    # the tokenizers library panics (a foreign exception) on such a merge: refused first
    p = write_tiny_model(tmp_path / "m.gguf", "llama")
    f = open_gguf(p)
    f.metadata["tokenizer.ggml.model"] = "gpt2"
    f.metadata["tokenizer.ggml.merges"] = ["e t", "x ?"]
    with pytest.raises(GGUFError, match=r"merges entry 1 \('x \?'\) is not two tokens"):
        validate(f, config_from_gguf(f))


def test_backend_validates_too(tmp_path):
    """Code that builds the backend without runner.load (tests, tools) is protected as well."""
    from runner.backends.numba_cpu import NumbaCPU
    p = write_tiny_model(tmp_path / "m.gguf", "llama", head_dim=32)
    f = open_gguf(p)
    cfg = config_from_gguf(f)
    set_metadata(p, "llama.attention.head_count", 16)
    bad = open_gguf(p)
    with pytest.raises(GGUFError, match="attn_q.weight"):
        NumbaCPU(bad, config_from_gguf(bad))
    assert cfg.n_head == 4


# ---- through the CLI: one line, exit 1, no traceback ----

@pytest.mark.parametrize("key, value, needle", [
    ("llama.attention.head_count", 16, "blk.0.attn_q.weight has dims [64, 128], expected [64, 512]"),
    ("llama.rope.dimension_count", 1 << 30, "llama.rope.dimension_count is 1073741824, expected 2 to 32"),
    ("llama.block_count", 2**32 - 1, "llama.block_count is 4294967295, expected 1 to 1024"),
])
def test_cli_prompt_on_a_hostile_file_is_one_line(tmp_path, key, value, needle):
    p = write_tiny_model(tmp_path / "m.gguf", "llama", head_dim=32, extra=lambda w: w.add_rope_dimension_count(32))
    set_metadata(p, key, value)
    env = {**os.environ, "NUMBAT_HOME": str(tmp_path / "home")}
    r = subprocess.run([sys.executable, "-m", "cli", "prompt", str(p), "a", "--raw", "-n", "1"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ") and needle in lines[0] and str(p) in lines[0], lines[0]


# ---- the fuzz corpus (tests/fuzz.py): mutated tiny models through load and a forward ----

FUZZ_FILES = 3000


def test_fuzz_corpus_has_no_crash_hang_or_foreign_exception(capsys):
    """Every mutated file either runs or is refused with numbat's own error; a worker
    subprocess takes file after file (timeouts, restarted when it dies). Counts are printed
    to the terminal; `python -m tests.fuzz N` is the longer run."""
    from tests import fuzz
    lines = []
    counts, failures = fuzz.run(FUZZ_FILES, seed=0, report=lines.append)
    with capsys.disabled():
        print(f"\nfuzz: {FUZZ_FILES} files, seed 0: {counts['ok']} ran, {counts['refused']} refused, "
              f"{counts['foreign']} foreign, {counts['crash']} crashes, {counts['hang']} hangs, {counts['seconds']} s")
    assert failures == [], "\n".join(lines)
    assert counts["ok"] + counts["refused"] == FUZZ_FILES
    # the corpus reaches the kernels: some mutations keep a file valid and it runs
    assert counts["ok"] >= FUZZ_FILES // 20 and counts["refused"] >= FUZZ_FILES // 2


# ---- other untrusted input through the CLI: prompt bytes, flags ----

def _cli(tmp_path, *args, input=None):
    env = {**os.environ, "NUMBAT_HOME": str(tmp_path / "home")}
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=ROOT, env=env, input=input,
                          capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("cli") / "tiny.gguf", "llama")


def test_invalid_utf8_on_stdin_and_argv_is_replaced(tmp_path, tiny_file):
    """A byte that is not UTF-8 is read as U+FFFD: the same ids as the text with U+FFFD."""
    want = _cli(tmp_path, "tokenize", str(tiny_file), "-", "--ids", input="a\ufffdb".encode())
    assert want.returncode == 0 and want.stdout.decode().startswith("[1, "), want.stderr.decode()
    for args, stdin in (([os.fsencode(str(tiny_file)), b"a\xffb"], None), ([str(tiny_file), "-"], b"a\xffb")):
        r = _cli(tmp_path, "tokenize", *args, "--ids", input=stdin)
        assert r.returncode == 0, r.stderr.decode()
        assert r.stdout == want.stdout


def test_invalid_utf8_typed_into_chat_is_replaced(tmp_path, tiny_file):
    r = _cli(tmp_path, "chat", str(tiny_file), "-n", "2", "--temp", "0", input=b"a\xffb\n/exit\n")
    assert r.returncode == 0 and b"Traceback" not in r.stderr and b"Error" not in r.stderr, r.stderr.decode()


@pytest.mark.parametrize("flags, needle", [(["-t", "-1"], "-t/--threads must be at least 1, got -1"),
                                           (["--seed", "-1"], "--seed must be in 0..2^64-1, got -1")])
def test_out_of_range_flags_name_the_flag(tmp_path, tiny_file, flags, needle):
    r = _cli(tmp_path, "prompt", str(tiny_file), "a", "--raw", "-n", "1", *flags)
    err = r.stderr.decode().strip().splitlines()
    assert r.returncode == 1 and len(err) == 1 and needle in err[0], err


# ---- what validation cannot see: values, not shapes ----

def test_overflowing_activations_do_not_raise(tmp_path):
    """Norm weights of 3e38 (valid shapes, legal floats) overflow the activations to inf;
    llama.cpp then gives inf/NaN logits, and so should numbat, not a ZeroDivisionError
    (quant/act.py's 1 / (-127 / amax) with amax inf; found by tests/fuzz.py, seed 2, file 8264)."""
    import numpy as np

    from gguf_io.testing import _patch
    from runner.model import load
    from tests import fuzz
    p = fuzz.write_bases(tmp_path)[5]       # qwen2, Q6_K matrices (the K-quant activation path)
    t = open_gguf(p).tensors["blk.0.attn_norm.weight"]
    _patch(p, t.offset, np.full(t.nbytes // 4, 3e38, np.float32).tobytes())
    m = load(str(p))
    cache = m.make_cache(32)
    m.backend.forward([1, 300], cache)
    out = m.backend.forward([5], cache)
    assert out.shape == (1, m.cfg.n_vocab) and not np.isfinite(out).all()   # inf/NaN, as llama.cpp
