"""The simulated server's view of the built-in tokenizer: which ids exist and how likely each is."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache

import numpy as np

from orchestrator.assets import tokenizer_dir

EOS = "<|im_end|>"
STOP_PROBABILITY = 0.12  # chance a sampled token is the end of turn: replies average about 8 tokens


@dataclass
class SimVocab:
    tokens: list[str]  # id -> token text
    eos_id: int
    sampleable: np.ndarray  # ids the server may sample (no special tokens but the end of turn)
    _dists: dict[tuple[int, float], np.ndarray] = field(default_factory=dict)

    @classmethod
    @cache
    def load(cls) -> SimVocab:
        data = json.loads((tokenizer_dir() / "tokenizer.json").read_text())
        vocab: dict[str, int] = data["model"]["vocab"]
        tokens = [""] * (max(vocab.values()) + 1)
        for tok, i in vocab.items():
            tokens[i] = tok
        specials = {t["content"] for t in data.get("added_tokens", [])}
        sampleable = np.array([i for i, t in enumerate(tokens) if t and t not in specials], dtype=np.int64)
        return cls(tokens, vocab[EOS], sampleable)

    @property
    def size(self) -> int:
        return len(self.tokens)

    def distribution(self, version: int, temperature: float) -> np.ndarray:
        """Sampling probabilities over all ids for a weight version (cached). Numbers up to 100 are the most
        likely words, so environments that expect a number sometimes get the right one; the end-of-turn
        token has STOP_PROBABILITY. Temperature flattens (> 1) or sharpens (< 1) the distribution."""
        key = (version, round(temperature, 6))
        dist = self._dists.get(key)
        if dist is not None:
            return dist
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
        self._dists[key] = dist
        return dist

    def decode(self, ids: np.ndarray) -> str:
        return " ".join(self.tokens[i] for i in ids.tolist() if i != self.eos_id)
