"""Build the small word-level tokenizer shipped in src/orchestrator/assets/tokenizer.

The simulated inference server samples from its vocabulary and verifiers' TrainClient renders prompts
with it (through transformers' AutoTokenizer and the chat template saved here), so the demo, the tests
and the benchmarks run offline. Run this after changing the vocabulary; the output is committed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
ROLES = ["system", "user", "assistant", "tool"]
WORDS = (  # noqa: SIM905 - a sentence is easier to edit than a list
    "the a an is are was what which how many much answer question number guess my your i you it this that "
    "too high low higher lower correct wrong yes no try again please think step by plus minus times divided "
    "equals sum of and or not so then final result between from to game over left turns solve compute "
    "add subtract multiply value find out is in at on for with"
).split()
PUNCT = list(".,:;?!+-*/=()[]{}<>'\"#")
NUMBERS = [str(i) for i in range(1001)]


def vocabulary() -> list[str]:
    seen: dict[str, None] = {}
    for tok in [*SPECIALS, *ROLES, *WORDS, *PUNCT, *NUMBERS]:
        seen.setdefault(tok, None)
    return list(seen)


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build(out: Path) -> None:
    vocab = {tok: i for i, tok in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(False), pre_tokenizers.Punctuation()]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins word tokens with spaces
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<pad>", "unk_token": "<unk>"}, indent=2) + "\n"
    )
    print(f"wrote {len(vocab)}-token tokenizer to {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parents[1] / "src/orchestrator/assets/tokenizer"
    )
    build(p.parse_args().out)


if __name__ == "__main__":
    main()
