"""The simulated server's view of the built-in tokenizer: which ids exist, how likely each is, and how text
tokenizes (``POST /tokenize``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache

import numpy as np
import tokenizers

from orchestrator.assets import tokenizer_dir

EOS = "<|im_end|>"
STOP_PROBABILITY = 0.12  # chance a sampled token is the end of turn: replies average about 8 tokens


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

    def distribution(self, version: int, temperature: float) -> np.ndarray:
        """Sampling probabilities over all ids for a weight version (the caller caches). Numbers up to 100 are
        the most likely words, so environments that expect a number sometimes get the right one; the
        end-of-turn token has STOP_PROBABILITY. Temperature flattens (> 1) or sharpens (< 1) the distribution."""
        rng = np.random.default_rng(1_000_003 + version)  # each policy version is a different "model"
        logits = rng.normal(0.0, 1.0, self.sampleable.size)
        small_numbers = np.array([t.isdigit() and int(t) <= 100 for t in np.array(self.tokens)[self.sampleable]])
        logits[small_numbers] += 2.0
        t = max(temperature, 1e-3)
        p = np.exp((logits - logits.max()) / t)
        p *= (1 - STOP_PROBABILITY) / p.sum()
        dist = np.zeros(self.size)
        dist[self.sampleable] = p
        dist[self.eos_id] = STOP_PROBABILITY
        dist /= dist.sum()
        return dist

    def decode(self, ids: np.ndarray) -> str:
        return " ".join(self.tokens[i] for i in ids.tolist() if i != self.eos_id)
