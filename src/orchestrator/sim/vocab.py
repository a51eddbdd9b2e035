"""The simulated server's view of the built-in tokenizer: which ids exist, how text tokenizes (``POST
/tokenize``) and how ids read back. How likely each id is, is the policy's business (``orchestrator.policy``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache

import numpy as np
import tokenizers

from orchestrator.assets import tokenizer_dir

EOS = "<|im_end|>"


@dataclass
class SimVocab:
    tokens: list[str]  # id -> token text
    eos_id: int
    sampleable: np.ndarray  # ids the server may sample (no special tokens but the end of turn)
    tokenizer: tokenizers.Tokenizer

    @classmethod
    @cache
    def load(cls) -> SimVocab:
        """Read the built-in tokenizer once per process; every server shares it (it is never changed)."""
        path = tokenizer_dir() / "tokenizer.json"
        data = json.loads(path.read_text())
        vocab: dict[str, int] = data["model"]["vocab"]
        tokens = [""] * (max(vocab.values()) + 1)
        for tok, i in vocab.items():
            tokens[i] = tok
        specials = {t["content"] for t in data.get("added_tokens", [])}
        sampleable = np.array([i for i, t in enumerate(tokens) if t and t not in specials], dtype=np.int64)
        return cls(tokens, vocab[EOS], sampleable, tokenizers.Tokenizer.from_file(str(path)))

    @property
    def size(self) -> int:
        return len(self.tokens)

    def decode(self, ids: np.ndarray) -> str:
        return " ".join(self.tokens[i] for i in ids.tolist() if i != self.eos_id)
