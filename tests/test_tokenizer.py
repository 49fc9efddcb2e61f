"""Tokenizer: llama.cpp's ids on real vocabularies (fixtures from tests/oracle), plus small
synthetic vocabularies for the rules that need no model."""
import json
from pathlib import Path

import numpy as np
import pytest

from runner import tokenizer as tk
from runner.tokenizer import Tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
REAL = {"qwen2.5-coder:0.5b": "tokenizer_qwen2.5-coder-0.5b.json", "gemma3:270m": "tokenizer_gemma3-270m.json"}
UNICODE_16 = "".join(map(chr, [0x1CC00, 0x1CC15, 0x1CCF0, 0x10D50, 0x10D6E, 0x105C0, 0x11380, 0x16D40, 0x1E5D0,
                               0x1FADC, 0x1FAE9, 0x1F8B2]))
EXTRA_TEXTS = ["", " ", "\n", "  leading", "trailing  ", "tab\tsep\r\nwin", "mixé naïve café",
               "x" * 300, "零一二三四五六七八九", "a\u00a0b\u2009c\u3000d", "<tool_call>{}</tool_call>",
               "[multimodal] <table> </s>", UNICODE_16, "1" + UNICODE_16 + " z" + UNICODE_16[::-1]]


@pytest.fixture(scope="module", params=list(REAL))
def real(request):
    from gguf_io import open_gguf
    from models.catalog import fetch

    meta = open_gguf(fetch(request.param)).metadata
    fixture = json.loads((FIXTURES / REAL[request.param]).read_text(encoding="utf-8"))
    return Tokenizer.from_metadata(meta), dict(fixture, meta=meta)


@pytest.mark.real
def test_ids_match_llama_cpp(real):
    tok, fx = real
    assert tok.add_bos == fx["add_bos"]
    for case in fx["texts"]:
        assert tok.encode(case["text"]) == case["ids"], case["name"]


@pytest.mark.real
def test_eog_and_control_tokens_match_llama_cpp(real):
    tok, fx = real
    assert sorted(tok.eog_ids) == fx["eog_ids"]
    assert len(tok.control) == fx["n_control"]
    assert tok.eos_id in tok.eog_ids and all(tok.is_control(i) for i in tok.eog_ids)


@pytest.mark.real
def test_partial_and_whole_models_agree(real, monkeypatch):
    """Texts short enough take a model of their own substrings (runner.tokenizer._Encoder):
    the same ids as the whole vocabulary's model, the fixtures' llama.cpp ids above."""
    monkeypatch.setattr(tk, "WHOLE_AFTER", float("inf"))    # partial models throughout, however slow the machine
    tok, fx = real
    texts = [c["text"] for c in fx["texts"]] + EXTRA_TEXTS + ["x" * 700, "def f(x):\n    return x ** 2\n" * 40]
    whole = _whole(Tokenizer.from_metadata(fx["meta"]))
    # partial models from a kept table, and (SentencePiece) with no table: their tokens' rows made
    for fresh in (Tokenizer.from_metadata(fx["meta"], whole.merges), Tokenizer.from_metadata(fx["meta"])):
        assert [fresh.encode(t, special=True) for t in texts] == [whole.encode(t, special=True) for t in texts]
        # and on random mixtures of the fixtures' characters, code, digits, spaces and specials
        rng = np.random.default_rng(0)
        chars = sorted(set("".join(texts[:-2]))) + list(" \n\t0123456789") + ["<|im_start|>", "<end_of_turn>", "  ", "\u00e9t\u00e9"]
        for _ in range(150):
            text = "".join(rng.choice(chars, size=int(rng.integers(1, 80))))
            assert fresh.encode(text, special=True) == whole.encode(text, special=True), repr(text)
        assert fresh._encoder.whole is None
    assert (fresh._encoder._merges is None) == (tok.kind == "spm")


@pytest.mark.real
def test_spm_rows_of_some_tokens_are_the_whole_tables(real):
    """The merge rows made for a partial model's tokens are those the whole table has for them,
    in its order (on the real vocabulary: its scores' ties, its splits)."""
    tok, fx = real
    if tok.kind != "spm":
        pytest.skip("a BPE vocabulary's table is its metadata's merges")
    enc, rng = tok._encoder, np.random.default_rng(1)
    table = enc.merges
    for n in (1, 50, 5000):
        ids = np.sort(rng.choice(len(tok.tokens), n, replace=False))
        member = np.zeros(len(tok.tokens), np.bool_)
        member[ids] = True
        assert np.array_equal(enc.make(ids.tolist()), table[member[table[:, 2]]])


@pytest.mark.real
def test_round_trip(real):
    tok, fx = real
    for text in [c["text"] for c in fx["texts"]] + EXTRA_TEXTS:
        assert tok.decode(tok.encode(text)) == text, repr(text)
        ids = tok.encode(text, add_bos=False)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


@pytest.mark.real
def test_unicode_16_round_trips(real):
    tok, _ = real
    for ch in UNICODE_16:
        for text in (ch, f"a{ch}b", f" {ch}{ch} ", f"{ch}1"):
            assert tok.decode(tok.encode(text)) == text, hex(ord(ch))


@pytest.mark.real
def test_stream_decoder_never_splits_a_character(real):
    tok, fx = real
    texts = {c["name"]: c["text"] for c in fx["texts"]}
    rare = "𠜎𠜱𠝹𠱓 " + UNICODE_16   # characters no vocabulary holds whole: byte tokens
    broken = 0
    for text in (texts["hindi"], texts["emoji"], texts["cjk"], rare):
        ids = tok.encode(text)
        broken += sum(1 for i in ids if not _is_utf8(tok.token_bytes(i)))
        stream = tok.stream()
        chunks = [stream.add(i) for i in ids] + [stream.flush()]
        assert "".join(chunks) == text
        assert all("\ufffd" not in c for c in chunks)
    assert broken > 10, "the texts should have tokens that hold part of a character"


@pytest.mark.real
def test_typed_special_text_stays_plain(real):
    tok, _ = real
    for text in ("<|im_start|>", "<start_of_turn>", "<|endoftext|>", "<end_of_turn>", "</s>"):
        if text not in tok.tokens:
            continue
        plain = tok.encode(text, add_bos=False)
        assert not any(tok.is_control(i) for i in plain) and tok.decode(plain) == text
        assert tok.encode(text, add_bos=False, special=True) == [tok.tokens.index(text)]


@pytest.mark.real
def test_control_tokens_print_only_when_asked(real):
    tok, _ = real
    eot = min(tok.eog_ids)
    assert tok.decode([eot]) == "" and tok.decode([eot], special=True) == tok.tokens[eot]
    stream = tok.stream()
    assert stream.add(eot) == "" and stream.flush() == ""
    assert tok.stream(special=True).add(eot) == tok.tokens[eot]


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


# -- synthetic vocabularies ----------------------------------------------------------------

def _spm_meta(**extra):
    """A SentencePiece vocab: specials, 256 byte tokens, a few pieces scored like SPM."""
    tokens = ["<unk>", "<s>", "</s>", "<ctl>", "<ud>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [tk.UNKNOWN, tk.CONTROL, tk.CONTROL, tk.CONTROL, tk.USER_DEFINED] + [tk.BYTE] * 256
    pieces = ["▁", "a", "b", "c", "▁a", "ab", "▁ab", "bc", "▁abc", "é"]
    tokens += pieces
    types += [tk.NORMAL] * len(pieces)
    scores = [0.0] * 261 + [-float(i) for i in range(len(pieces))]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": np.array(types, np.int32),
            "tokenizer.ggml.scores": np.array(scores, np.float32),
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    meta.update(extra)
    return meta


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBAT_HOME", str(tmp_path))
    return tmp_path


def test_spm_merges_by_score_with_byte_fallback(home):
    tok = Tokenizer.from_metadata(_spm_meta())
    ids = tok.encode("abc abz", add_bos=False)
    assert [tok.tokens[i] for i in ids] == ["▁abc", "▁ab", "<0x7A>"]
    assert tok.decode(ids) == " abc abz"
    assert tok.encode("ab", add_eos=True) == [1, tok.tokens.index("▁ab"), 2]


def test_spm_space_prefix_follows_metadata(home):
    no_prefix = Tokenizer.from_metadata(_spm_meta(**{"tokenizer.ggml.add_space_prefix": False}))
    assert [no_prefix.tokens[i] for i in no_prefix.encode("ab", add_bos=False)] == ["ab"]
    # after a special token the prefix is added again, as llama.cpp does
    tok = Tokenizer.from_metadata(_spm_meta())
    ids = tok.encode("a<ud>a", add_bos=False)
    assert [tok.tokens[i] for i in ids] == ["▁a", "<ud>", "▁a"]


def test_token_types_decide_splitting(home):
    tok = Tokenizer.from_metadata(_spm_meta(**{"tokenizer.ggml.add_space_prefix": False}))
    ctl, ud = tok.tokens.index("<ctl>"), tok.tokens.index("<ud>")
    assert ud in tok.encode("a<ud>b", add_bos=False)              # user-defined: always
    assert ctl not in tok.encode("a<ctl>b", add_bos=False)        # control: only when asked
    assert ctl in tok.encode("a<ctl>b", add_bos=False, special=True)
    assert tok.decode(tok.encode("a<ctl>b", add_bos=False)) == "a<ctl>b"
    assert tok.is_control(ctl) and not tok.is_control(ud)


def test_a_kept_merge_table_is_taken_and_a_wrong_one_made_again(home, monkeypatch):
    meta = _spm_meta()
    first = Tokenizer.from_metadata(meta)
    assert first.merges.dtype == np.int32 and first.merges.shape[1] == 3 and len(first.merges)
    made = []
    real = tk._spm_merges
    monkeypatch.setattr(tk, "_spm_merges", lambda *a: made.append(1) or real(*a))
    assert Tokenizer.from_metadata(meta, first.merges).encode("abc ab") == first.encode("abc ab") and not made
    for bad in (first.merges[:, :2].copy(), first.merges.astype(np.int64), first.merges + len(meta["tokenizer.ggml.tokens"])):
        again = Tokenizer.from_metadata(meta, bad)
        assert np.array_equal(again.merges, first.merges) and again.encode("abc ab") == first.encode("abc ab")
    assert len(made) == 3


def test_spm_table_is_made_for_a_whole_model_only_and_kept(home, monkeypatch):
    monkeypatch.setattr(tk, "WHOLE_AFTER", float("inf"))
    kept = []
    tok = Tokenizer.from_metadata(_spm_meta(), keep=kept.append)
    assert [tok.tokens[i] for i in tok.encode("abc abz", add_bos=False)] == ["▁abc", "▁ab", "<0x7A>"]
    assert tok._encoder._merges is None and not kept
    _whole(tok)
    assert len(kept) == 1 and kept[0] is tok.merges and len(tok.merges)
    bpe = []
    Tokenizer.from_metadata(_bpe_meta(), keep=bpe.append)      # BPE's is made from the metadata at once
    assert len(bpe) == 1 and bpe[0].shape == (5, 3)


def test_bad_merges_are_a_clear_error():
    with pytest.raises(ValueError, match=r"merges entry 1 \('x y'\) is not two tokens"):
        Tokenizer.from_metadata(_bpe_meta(**{"tokenizer.ggml.merges": ["Ġ t", "x y"]}))


def _whole(tok: Tokenizer) -> Tokenizer:
    """tok with the model of its whole vocabulary built (as a text past PARTIAL_MAX builds it)."""
    tok._encoder.model(["x" * (tk.PARTIAL_MAX + 1)])
    assert tok._encoder.whole is not None
    return tok


def test_partial_models_give_the_whole_models_ids(home, monkeypatch):
    """A short text is encoded with the tokens and merges of its own substrings only."""
    monkeypatch.setattr(tk, "WHOLE_AFTER", float("inf"))
    for meta, texts in ((_spm_meta(), ["abc abz", "ab", "bcé a", "zzz"]),
                        (_bpe_meta(), [" the 12 é", "1234 the", "they"]), (_bpe_meta("llama-bpe"), ["123 the the"])):
        part, whole = Tokenizer.from_metadata(meta), _whole(Tokenizer.from_metadata(meta))
        assert [part.encode(t) for t in texts] == [whole.encode(t) for t in texts]
        assert part._encoder.whole is None       # every text above went through a partial model
        long = "ab" * tk.PARTIAL_MAX     # one word of more than PARTIAL_MAX substrings
        assert part.encode(long) == whole.encode(long)
        assert part._encoder.whole is not None   # it builds the whole model, kept for the next


def _bpe_meta(pre="qwen2", **extra):
    """Byte-level BPE: the 256 byte characters, a few merges, ChatML control tokens."""
    alphabet = list(tk._byte_decoder())
    merges = ["Ġ t", "h e", "Ġt he", "1 2", "12 3"]
    tokens = alphabet + ["Ġt", "he", "Ġthe", "12", "123", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    types = [tk.NORMAL] * (len(tokens) - 3) + [tk.CONTROL] * 3
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": np.array(types, np.int32), "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.eos_token_id": len(tokens) - 2, "tokenizer.ggml.add_bos_token": False}
    meta.update(extra)
    return meta


def test_bpe_pre_tokenizers_differ_as_in_llama_cpp():
    qwen = Tokenizer.from_metadata(_bpe_meta("qwen2"))
    llama3 = Tokenizer.from_metadata(_bpe_meta("llama-bpe", **{"tokenizer.ggml.add_bos_token": False}))
    # qwen2 splits digits one by one, llama3 in groups of up to three
    assert len(qwen.encode("1234")) == 4 and len(llama3.encode("1234")) == 2
    for tok in (qwen, llama3):
        ids = tok.encode(" the 12 é")
        assert tok.tokens[ids[0]] == "Ġthe" and tok.decode(ids) == " the 12 é"
        assert tok.eog_ids == {tok.tokens.index("<|im_end|>"), tok.tokens.index("<|endoftext|>")}


def test_unknown_model_or_pre_is_a_clear_error():
    with pytest.raises(ValueError, match=r"tokenizer.ggml.model 't5'.*gpt2, llama"):
        Tokenizer.from_metadata(_bpe_meta(**{"tokenizer.ggml.model": "t5"}))
    with pytest.raises(ValueError, match=r"tokenizer.ggml.pre 'starcoder'.*qwen2"):
        Tokenizer.from_metadata(_bpe_meta("starcoder"))


def test_stream_decoder_holds_partial_characters():
    tok = Tokenizer.from_metadata(_bpe_meta())
    ids = tok.encode("é😀")   # no merges: one token per byte
    assert len(ids) == 6
    stream = tok.stream()
    assert [stream.add(i) for i in ids] == ["", "é", "", "", "", "😀"]
    assert stream.flush() == ""
    stream = tok.stream()
    assert stream.add(ids[2]) == "" and stream.flush() == "\ufffd"   # a cut-off character at the end


def test_partial_models_give_way_to_the_whole_one_after_their_time(home, monkeypatch):
    """Many texts (a batch file's prompts): once the partial models have cost WHOLE_AFTER
    seconds in all, the whole model is built and kept."""
    monkeypatch.setattr(tk, "WHOLE_AFTER", 0.0)
    tok = Tokenizer.from_metadata(_bpe_meta())
    first = tok.encode(" the 12")
    assert tok._encoder.whole is None and tok._encoder.spent > 0
    assert tok.encode(" the 12") == first and tok._encoder.whole is not None

