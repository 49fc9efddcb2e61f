"""Tokenizers that give the same token ids as llama.cpp for a GGUF vocabulary.

The merge loops run in the `tokenizers` library; what llama.cpp adds around them is done here
in plain Python so that it follows llama.cpp step by step (src/llama-vocab.cpp):

1. Special-token partition: CONTROL/UNKNOWN tokens (only when ``special=True``) and
   USER_DEFINED tokens (always) are cut out of the text, longest token first, each at every
   occurrence. UNUSED tokens are never cut out.
2. Each remaining text fragment is tokenized on its own:
   - BPE ("gpt2"): a byte-level BPE model over the GGUF vocab and merges, behind the regex
     splits llama.cpp uses for ``tokenizer.ggml.pre``; no Unicode normalizer.
   - SPM ("llama"): an optional space prefix, ' ' -> '▁', then BPE with byte fallback whose
     merges are every split of a token into two vocab tokens, ordered by the token's score.
3. BOS/EOS are added around the result.

Known difference: the regex engine in `tokenizers` knows the letters and digits added in
Unicode 16 (Garay, Kirat Rai, Egyptian hieroglyphs extension A, ... about 4,400 codepoints);
llama.cpp's tables do not, so text holding them can split into different BPE words there.
Such text still round-trips.
"""
from __future__ import annotations

import codecs
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np
from tokenizers import Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

# tokenizer.ggml.token_type values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"


@dataclass(frozen=True)
class _Pre:
    regexes: tuple[str, ...]   # applied in turn; matches and the gaps between them become words
    ignore_merges: bool = False   # a word that is already a token is taken whole (llama3)


_LLAMA3 = _Pre((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+",), ignore_merges=True)
_QWEN2 = _Pre((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+",))
# tokenizer.ggml.pre names as llama.cpp spells them -> its pre-tokenizer for that name
PRE_TOKENIZERS: dict[str, _Pre] = {
    "default": _Pre((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
    "gpt-2": _Pre((_GPT2,)),
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
}
MODELS = ("gpt2", "llama")

# Token texts llama.cpp treats as end of generation (and so as CONTROL), whatever their type.
_EOG_TEXTS = frozenset([
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
])
# Fill-in-the-middle tokens llama.cpp also forces to CONTROL; pad, repo and file_sep end generation.
_FIM_TEXTS = frozenset([
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
    "<|code_prefix|>", "<|prefix|>", "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>",
    "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>", "<|suffix|>", "<|fim_middle|>",
    "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>",
    "<|middle|>",
])
_FIM_EOG_TEXTS = (("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
                  ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
                  ("<|file_sep|>",))


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable stand-in character -> the byte it encodes."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


@dataclass(eq=False)
class Tokenizer:
    tokens: list[str]
    kind: str                          # "bpe" or "spm"
    control: frozenset[int]            # CONTROL tokens, as llama.cpp marks them
    eog_ids: frozenset[int]
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    _encoder: _Encoder = field(repr=False)
    _hidden: frozenset[int] = field(repr=False)              # CONTROL/UNKNOWN: print only when asked
    _pieces: _Pieces = field(repr=False)                     # bytes each token stands for
    _special: list[tuple[str, int, bool]] = field(repr=False)  # (text, id, hidden), longest first

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def is_control(self, token_id: int) -> bool:
        return token_id in self.control

    def token_bytes(self, token_id: int) -> bytes:
        return self._pieces[token_id]

    @classmethod
    def from_metadata(cls, meta: Mapping, merges: np.ndarray | None = None, keep=None) -> Tokenizer:
        """merges: this vocabulary's merge table (Tokenizer.merges) kept from an earlier load;
        keep(table): called with the table when it is made instead (to keep it for the next
        load). A SentencePiece table is made only when a whole model needs it (1.0-1.3 s for
        gemma3's 262k tokens): short texts take the merges of their own tokens."""
        model = meta.get("tokenizer.ggml.model")
        if model not in MODELS:
            raise ValueError(f"unsupported tokenizer.ggml.model {model!r}: numbat supports "
                             f"{', '.join(MODELS)} (BPE and SentencePiece vocabularies)")
        tokens = list(meta["tokenizer.ggml.tokens"])
        n = len(tokens)
        types = np.asarray(meta.get("tokenizer.ggml.token_type", np.full(n, NORMAL)), dtype=np.int32)
        index = {t: i for i, t in enumerate(tokens)}
        if merges is not None and not (merges.ndim == 2 and merges.shape[1] == 3 and merges.dtype == np.int32
                                       and (merges >= 0).all() and (merges < n).all()):
            merges = None       # not this vocabulary's: made again
        if model == "gpt2":
            pre_name = meta.get("tokenizer.ggml.pre", "default")
            pre = PRE_TOKENIZERS.get(pre_name)
            if pre is None:
                raise ValueError(f"unsupported tokenizer.ggml.pre {pre_name!r} for a BPE vocabulary: "
                                 f"numbat supports {', '.join(PRE_TOKENIZERS)}")
            if merges is None:
                merges = _bpe_merges(index, meta["tokenizer.ggml.merges"])
                if keep is not None:
                    keep(merges)
            encoder = _Encoder(tokens, index, merges, pre)
            kind, defaults = "bpe", dict(bos=11, eos=11, add_bos=pre is _LLAMA3, prefix=False)
        else:
            scores = np.asarray(meta.get("tokenizer.ggml.scores", np.zeros(n)), np.float32)
            encoder = _Encoder(tokens, index, merges, None,
                               lambda ids=None: _spm_merges(tokens, index, scores, ids), keep)
            kind, defaults = "spm", dict(bos=1, eos=2, add_bos=True, prefix=True)

        def special_id(key: str, default: int | None) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}", default)
            return value if value is not None and 0 <= value < n else default

        bos_id, eos_id = special_id("bos_token_id", defaults["bos"]), special_id("eos_token_id", defaults["eos"])
        forced = [index[t] for t in _EOG_TEXTS | _FIM_TEXTS if t in index]
        fim_eog = [next((index[t] for t in names if t in index), None) for names in _FIM_EOG_TEXTS]
        forced += [i for i in fim_eog if i is not None]
        control = frozenset(np.flatnonzero(types == CONTROL).tolist()) | frozenset(forced)
        hidden = control | frozenset(np.flatnonzero(types == UNKNOWN).tolist())
        eog = {index[t] for t in _EOG_TEXTS if t in index} | {i for i in fim_eog if i is not None}
        eog |= {i for i in (eos_id, special_id("eot_token_id", None), special_id("eom_token_id", None)) if i is not None}

        user_defined = set(np.flatnonzero(types == USER_DEFINED).tolist())
        # llama.cpp sorts its special-token cache by length only; ties keep id order here.
        special = sorted(((tokens[i], i, i in hidden) for i in sorted(hidden | user_defined)),
                         key=lambda s: -len(s[0].encode()))
        return cls(
            tokens=tokens, kind=kind, control=control, eog_ids=frozenset(eog),
            bos_id=bos_id, eos_id=eos_id,
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", defaults["add_bos"])),
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", defaults["prefix"])),
            _encoder=encoder, _hidden=hidden, _pieces=_Pieces(tokens, types, hidden | user_defined, kind),
            _special=special,
        )

    # -- encoding --------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None, special: bool = False,
               add_eos: bool | None = None) -> list[int]:
        """Token ids for ``text``; add_bos/add_eos None follow the model's metadata.

        With ``special=False`` text that spells a control token (``<|im_start|>``) stays
        plain text, as llama.cpp does for user input.
        """
        return self.encode_fragments(self.partition(text, special), add_bos, add_eos)

    def partition(self, text: str, special: bool = False) -> list[str | int]:
        """Cut special tokens out of ``text`` as llama.cpp does: raw text pieces and token ids."""
        frags: list[str | int] = [text] if text else []
        for piece, token_id, hidden in self._special:
            if (hidden and not special) or piece not in text:
                continue
            out: list[str | int] = []
            for frag in frags:
                if isinstance(frag, int) or piece not in frag:
                    out.append(frag)
                    continue
                for k, part in enumerate(frag.split(piece)):
                    if k:
                        out.append(token_id)
                    if part:
                        out.append(part)
            frags = out
        return frags

    def encode_fragments(self, frags: Iterable[str | int], add_bos: bool | None = None,
                         add_eos: bool | None = None) -> list[int]:
        """Tokenize partitioned text: ids pass through, each text piece is tokenized alone."""
        parts, prev_special = [], True   # SPM prefixes a space to text at the start and after a token
        for frag in frags:
            if not isinstance(frag, int) and self.kind == "spm":
                frag = ((" " if self.add_space_prefix and prev_special else "") + frag).replace(" ", "▁")
            parts.append(frag)
            prev_special = isinstance(frag, int)
        texts = [p for p in parts if not isinstance(p, int)]
        model = self._encoder.model(texts) if texts else None
        ids = [self.bos_id] if (self.add_bos if add_bos is None else add_bos) else []
        for part in parts:
            ids.extend([part] if isinstance(part, int) else model.encode(part, add_special_tokens=False).ids)
        if self.add_eos if add_eos is None else add_eos:
            ids.append(self.eos_id)
        return ids

    @property
    def merges(self) -> np.ndarray:
        """The merge table, (n, 3) int32 rows (left, right, merged id) by rank: for a later load
        of the same vocabulary (making it took 0.1 s for the qwen2.5 files, seconds for gemma3's)."""
        return self._encoder.merges

    # -- decoding --------------------------------------------------------------------------

    def piece(self, token_id: int, special: bool = False) -> bytes:
        """What a token prints as: control tokens print nothing unless ``special``."""
        if not special and token_id in self._hidden:
            return b""
        return self._pieces[token_id]

    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        return b"".join(self.piece(i, special) for i in ids).decode("utf-8", errors="replace")

    def stream(self, special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, special)


class StreamDecoder:
    """Turns ids arriving one at a time into text, holding back an unfinished UTF-8 character.

    ``add(id)`` returns only whole characters (bytes that can never form one come out as
    U+FFFD); ``flush()`` returns whatever is still held at the end.
    """

    def __init__(self, tokenizer: Tokenizer, special: bool = False):
        self._tokenizer = tokenizer
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.piece(token_id, self._special))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


# -- building ------------------------------------------------------------------------------

class _Pieces:
    """The bytes each token stands for, the way llama.cpp's token_to_piece renders them.
    Made on first use of each token: making all 152k of them cost 0.2 s of every start."""

    def __init__(self, tokens: Sequence[str], types: np.ndarray, raw: frozenset[int], kind: str):
        self.tokens, self.types, self.raw, self.kind = tokens, types, raw, kind
        self.byte_of = _byte_decoder()
        self.made: dict[int, bytes] = {}

    def __getitem__(self, i: int) -> bytes:
        p = self.made.get(i)
        if p is None:
            p = self.made[i] = self._make(i)
        return p

    def _make(self, i: int) -> bytes:
        text, t = self.tokens[i], self.types[i]
        if i in self.raw:   # control, unknown and user-defined tokens are stored as plain text
            return text.encode()
        if t == BYTE:   # <0xAB>
            return bytes([int(text[3:5], 16)])
        if t != NORMAL:   # UNUSED and unknown types print nothing
            return b""
        if self.kind == "spm":
            return text.replace("▁", " ").encode()
        byte_of = self.byte_of
        return bytes(byte_of[c] for c in text) if all(c in byte_of for c in text) else text.encode()


PARTIAL_MAX = 100_000    # substrings a text may have for the partial model (~20 ms of lookups)
WHOLE_AFTER = 0.3        # seconds of partial models after which the whole one is built (~its cost)


class _Encoder:
    """The `tokenizers` BPE model a text is encoded with. Building it over a whole vocabulary
    takes 0.15-0.3 s for 152k tokens (1.4 s for gemma3's 262k from a kept JSON), a fifth of
    a one-shot prompt's process, so a text of PARTIAL_MAX substrings or fewer gets a model of
    only the tokens that are substrings of its words and the merges that make them, built in
    milliseconds. The ids are the same: every merge that can apply inside a word makes a
    substring of it, the partial model keeps those merges in the same order of rank, and a
    substring is a token there if and only if it is one in the vocabulary. A longer text,
    or partial models that have taken as long as a whole one (a batch file's many prompts),
    build the whole model once, kept for every later text."""

    def __init__(self, tokens: list[str], index: dict[str, int], merges: np.ndarray | None, pre: _Pre | None,
                 make=None, keep=None):
        """merges None: make(ids) makes the table's rows that make the tokens ids (all: None),
        and keep is given the whole table once it is made."""
        self.tokens, self.index, self._merges, self.pre, self.make, self.keep = tokens, index, merges, pre, make, keep
        self.whole: HFTokenizer | None = None
        self.spent = 0.0        # seconds spent on partial models
        self.longest = max(map(len, tokens), default=1)
        # SPM's byte fallback may emit any byte token; BPE's words are made of vocab tokens
        self.always = [index[t] for t in (f"<0x{b:02X}>" for b in range(256)) if t in index] if pre is None else []
        self.splitter = pre and pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])

    @property
    def merges(self) -> np.ndarray:
        if self._merges is None:
            self._merges = self.make()
            if self.keep is not None:
                self.keep(self._merges)
        return self._merges

    def model(self, texts: list[str]) -> HFTokenizer:
        if self.whole is not None:
            return self.whole
        words = {w for t in texts for w, _ in self.splitter.pre_tokenize_str(t)} if self.splitter else set(texts)
        longest = self.longest
        if sum(len(w) * min(len(w), longest) for w in words) > PARTIAL_MAX or self.spent > WHOLE_AFTER:
            self.whole = self._build(self.index, self.merges)
            return self.whole
        start, index = time.perf_counter(), self.index
        ids = {index[s] for w in words for i in range(len(w)) for j in range(i + 1, min(len(w), i + longest) + 1)
               if (s := w[i:j]) in index}
        ids.update(self.always)
        if self._merges is None:        # the rows of these tokens only, as the whole table orders them
            merges = self.make(sorted(ids))
        else:
            member = np.zeros(len(self.tokens), np.bool_)
            member[list(ids)] = True
            merges = self._merges[member[self._merges[:, 2]]]
        hf = self._build({self.tokens[i]: i for i in ids}, merges)
        self.spent += time.perf_counter() - start
        return hf

    def _build(self, vocab: dict[str, int], merges: np.ndarray) -> HFTokenizer:
        t = self.tokens
        pairs = [(t[a], t[b]) for a, b, _ in merges.tolist()]
        if self.pre is None:        # SentencePiece
            return HFTokenizer(models.BPE(vocab, pairs, byte_fallback=True))
        hf = HFTokenizer(models.BPE(vocab, pairs, ignore_merges=self.pre.ignore_merges))
        hf.pre_tokenizer = self.splitter
        return hf


def _bpe_merges(index: dict[str, int], merges: Sequence[str]) -> np.ndarray:
    """The merge table of tokenizer.ggml.merges ("left right" strings, by rank)."""
    rows = []
    for m in merges:
        k = m.find(" ", 1)   # the first space after the first character separates the pair
        a, b = m[:k], m[k + 1:]
        if k < 0 or a not in index or b not in index or a + b not in index:
            raise ValueError(f"tokenizer.ggml.merges entry {len(rows)} ({m[:40]!r}) is not two tokens "
                             f"that merge into a third")
        rows.append((index[a], index[b], index[a + b]))
    return np.array(rows, np.int32).reshape(-1, 3)


def _spm_merges(tokens: Sequence[str], index: dict[str, int], scores: np.ndarray, ids=None) -> np.ndarray:
    """SentencePiece's merges as a BPE table: every split of a token into two tokens, the
    highest-scoring token first (ties in vocab order; its splits by their halves' scores,
    ties in split order), so that BPE merges like SentencePiece. index: token -> id, as
    from_metadata made it. One pass over every split (gguf_io.validate bounds the
    vocabulary's characters), the order by one sort: 1.0-1.3 s for gemma3's 262k tokens.
    ids (ascending): only the rows that make these tokens, in the whole table's order (each
    row's sort keys are its own)."""
    get = index.get
    a_, b_, i_ = [], [], []
    for i in range(len(tokens)) if ids is None else ids:
        t = tokens[i]
        for k in range(1, len(t)):
            a = get(t[:k])
            if a is not None:
                b = get(t[k:])
                if b is not None:
                    a_.append(a)
                    b_.append(b)
                    i_.append(i)
    a, b, i = (np.array(v, np.int64) for v in (a_, b_, i_))
    s = np.asarray(scores, np.float32)
    order = np.lexsort((-s[b], -s[a], i, -s[i]))    # the last key first; stable: split order
    return np.stack([a[order], b[order], i[order]], axis=1).astype(np.int32).reshape(-1, 3)
