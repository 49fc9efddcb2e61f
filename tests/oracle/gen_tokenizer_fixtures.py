"""Write tests/fixtures/tokenizer_*.json: llama.cpp's token ids for a fixed set of texts.

Dev-only (needs llama-cpp-python==0.3.36, the oracle). Run from the repo root:
    python tests/oracle/gen_tokenizer_fixtures.py
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import llama_cpp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gguf_io import open_gguf  # noqa: E402
from models.catalog import fetch  # noqa: E402
from runner.chat_template import ChatTemplate  # noqa: E402

MODELS = {"qwen2.5-coder:0.5b": "tokenizer_qwen2.5-coder-0.5b.json", "gemma3:270m": "tokenizer_gemma3-270m.json"}

# Tokenized as user text: add_bos as the model says, special=False.
TEXTS = {
    "prose": "The quick brown fox jumps over the lazy dog. It wasn't the first time; the dog, "
             "unimpressed, yawned and rolled over, while the fox trotted off toward the river.",
    "python": "def mean(xs: list[float]) -> float:\n    \"\"\"Average.\"\"\"\n    if not xs:\n"
              "\treturn 0.0\n    total = sum(xs)  # 1e-3 tolerance\n    return total / len(xs)\n",
    "hindi": "नमस्ते दुनिया! आप कैसे हैं? मुझे हिंदी पढ़ना पसंद है।",
    "emoji": "😀 🎉👍🏽 👨‍👩‍👧‍👦 🇯🇵 ❤️‍🔥",
    "cjk": "日本語のテキストです。中文文本测试。한국어 문장입니다.",
    "whitespace": "a  b   c\n\n\nd\te \t\t f   \n  trailing   ",
    "digits": "1234567 3.14159 0x1F 2024-11-29 +44 20 7946 0958",
    "contractions": "don't I'll we're they've she'd it's DON'T I'LL",
    "typed_specials": "user typed <|im_start|>system and <start_of_turn>model and <|endoftext|> </s> <bos>",
    "html_tags": "<table><tr><td>1</td></tr></table> <b>bold</b>",
    "empty": "",
}

# A rendered chat prompt without control text in the messages: tokenized with special=True
# and no added BOS (a template that wants one writes it).
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there!\nWhat is 2+2?"},
        {"role": "assistant", "content": "4."}, {"role": "user", "content": "Thanks 😀"}]


def main() -> None:
    for name, filename in MODELS.items():
        path = str(fetch(name))
        meta = open_gguf(path).metadata
        llm = llama_cpp.Llama(model_path=path, n_ctx=512, vocab_only=True, verbose=False)
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        n = llama_cpp.llama_vocab_n_tokens(vocab)
        add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
        prompt = ChatTemplate.from_metadata(meta).render(CHAT)
        fixture = {
            "model": name,
            "oracle": f"llama-cpp-python {llama_cpp.__version__}",
            "add_bos": add_bos,
            "eog_ids": [i for i in range(n) if llama_cpp.llama_vocab_is_eog(vocab, i)],
            "n_control": sum(bool(llama_cpp.llama_vocab_is_control(vocab, i)) for i in range(n)),
            "texts": [{"name": k, "text": t, "ids": llm.tokenize(t.encode(), add_bos=add_bos, special=False)}
                      for k, t in TEXTS.items()],
            "chat": {"messages": CHAT, "prompt": prompt,
                     "ids": llm.tokenize(prompt.encode(), add_bos=False, special=True)},
        }
        out = ROOT / "tests" / "fixtures" / filename
        text = json.dumps(fixture, ensure_ascii=False, indent=1)
        text = re.sub(r"(?<=[\[,])\n\s+(?=-?\d)|(?<=\d)\n\s+(?=\])", "", text)   # id lists on one line
        out.write_text(text + "\n", encoding="utf-8")
        print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
