"""A tiny policy over the built-in vocabulary: the simulated server samples from it, the learning trainer trains it.

Numpy only (no verifiers, no torch), so both sides import it: ``orchestrator.sim.policy`` samples every token
of a simulated reply from it and loads its parameters when a weight update names a directory;
``orchestrator.trainer.learner`` (``orchestrator receive --learn``) trains it from the batches we ship and
saves it into the checkpoint directory it announces.

The model is log-linear: the logit of the next token ``y`` is a sum over features of the context of
``feature · W_block · ψ(y)``. ``ψ(y)``, a token's features, are its id (one-hot), its kind (``KINDS``) and, for
a number, its value as overlapping bumps along the number line (``BUMP_CENTERS``: what it learns about 20
carries over to 18 and 23). The context features, one weight array each (``WEIGHTS``):

- ``context``: a constant, and which distinct ids the context holds (a bag of tokens);
- ``numbers``: for each id ``t``, the value bumps of the most recent number written right after ``t`` (``7``
  in ``+ 7``, ``40`` in ``between 40``: a number read with the word before it; only the dense part of ``ψ``);
- ``mean``: the value bumps of the mean of the distinct numbers in the context;
- ``previous``: the previous token's kind and value bumps.

So it conditions on the prompt (which words it holds, which numbers follow which words, how large they are),
knows whether it has just started a reply or just said a number, and relates the number it says to the
numbers it read. That is what the built-in environments reward: arithmetic wants one number near a function
of the prompt's two numbers and its operator; guess-number wants a number near the middle, moved by the
feedback and the last guess. About 2.3 M float32 parameters for the built-in vocabulary.

For speed the parameters are expanded once per parameter set into logit tables (``Tables``): a context's logits
are then a few vector additions per token, the same on both sides. Non-sampleable ids (padding, unknown, start
of message) always get ``MASKED``.

On disk (``save``/``load``): ``DIR/tiny_policy.npz`` holding the ``WEIGHTS`` arrays (float32) and ``meta``
(JSON: format, vocabulary size, feature layout, step), written to a temp file and renamed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator.assets import tokenizer_dir
from orchestrator.errors import CheckpointError

FILE = "tiny_policy.npz"
FORMAT = 2
KINDS = ("special", "eos", "role", "word", "punct", "number")
ROLES = frozenset({"system", "user", "assistant", "tool"})
EOS = "<|im_end|>"
BUMP_CENTERS = (*range(0, 101, 5), 150, 200, 300, 500, 750, 1000)
MASKED = -1e4  # the logit of ids that are never sampled: exp() is 0, logprobs stay finite
INITIAL_STOP_PROBABILITY = 0.12  # initial chance a token is the end of turn: replies average about 8 tokens
NK, NB = len(KINDS), len(BUMP_CENTERS)
DT = NK + NB  # dense token features: kind, value bumps
WEIGHTS = ("context", "numbers", "mean", "previous")


@dataclass(frozen=True)
class Vocab:
    """Per-id features of the built-in vocabulary."""

    tokens: tuple[str, ...]
    eos_id: int
    kind: np.ndarray  # int64 [V]: index into KINDS
    is_number: np.ndarray  # bool [V]
    value: np.ndarray  # float64 [V]: a number's value, 0 for other tokens
    bumps: np.ndarray  # float32 [V, NB]: a number's value bumps, zeros for other tokens
    features: np.ndarray  # float32 [V, DT]: the dense part of ψ (kind, value bumps)
    sampleable: np.ndarray  # bool [V]

    @property
    def size(self) -> int:
        return len(self.tokens)

    @classmethod
    @cache
    def builtin(cls) -> Vocab:
        """The vocabulary of the built-in tokenizer (read once per process)."""
        data = json.loads((tokenizer_dir() / "tokenizer.json").read_text())
        specials = {t["content"] for t in data.get("added_tokens", [])}
        return cls.from_tokens(_id_order(data["model"]["vocab"]), specials)

    @classmethod
    def from_tokens(cls, tokens: list[str], specials: set[str]) -> Vocab:
        kind = np.array([KINDS.index(_kind(t, specials)) for t in tokens])
        is_number = kind == KINDS.index("number")
        values = np.array([float(t) if n else np.nan for t, n in zip(tokens, is_number, strict=True)])
        bumps = np.nan_to_num(value_bumps(values))
        features = np.concatenate([np.eye(NK)[kind], bumps], axis=1).astype(np.float32)
        sampleable = np.array([bool(t) and (t not in specials or t == EOS) for t in tokens])
        return cls(tuple(tokens), tokens.index(EOS), kind, is_number, np.nan_to_num(values),
                   bumps.astype(np.float32), features, sampleable)


_CENTERS = np.asarray(BUMP_CENTERS, dtype=np.float64)
_WIDTHS = np.gradient(_CENTERS)  # neighbouring bumps overlap: learning about 20 moves 18 and 23 too


def value_bumps(values: np.ndarray) -> np.ndarray:
    """``[n, NB]``: each value as overlapping bumps along the number line."""
    z = (np.asarray(values, np.float64)[:, None] - _CENTERS) / _WIDTHS
    out: np.ndarray = np.exp(-0.5 * z * z)
    return out


def _id_order(vocab: dict[str, int]) -> list[str]:
    tokens = [""] * (max(vocab.values()) + 1)
    for tok, i in vocab.items():
        tokens[i] = tok
    return tokens


def _kind(token: str, specials: set[str]) -> str:
    if token == EOS:
        return "eos"
    if token in specials or not token:
        return "special"
    if token in ROLES:
        return "role"
    if token.isdigit():
        return "number"
    return "word" if token[0].isalpha() else "punct"


def shapes(v: int) -> dict[str, tuple[int, ...]]:
    """The shape of each ``WEIGHTS`` array for a vocabulary of ``v`` ids: rows are context features, the last
    axis token features (``v`` one-hot ids, then the ``DT`` dense ones; ``numbers`` has only the dense ones)."""
    return {"context": (1 + v, v + DT), "numbers": (v, NB, DT), "mean": (NB, v + DT), "previous": (DT, v + DT)}


class Tables:
    """The weights expanded into logits: per context feature, its contribution to the logits of every id."""

    def __init__(self, vocab: Vocab, w: dict[str, np.ndarray]) -> None:
        # expanded in float32 (float64 BLAS on a busy 2-core machine is several times slower), kept in float64:
        # sampling adds a row per token to a float64 vector, and mixed-precision additions cost twice as much
        context = self.expand(vocab, w["context"]).astype(np.float64)
        self.bias = context[0] + np.where(vocab.sampleable, 0.0, MASKED)
        self.bag = context[1:]  # [V, V]: token t in the context
        self.numbers = w["numbers"]  # [V, NB, DT]: the value bumps of the number after t -> dense token features
        self.mean = self.expand(vocab, w["mean"]).astype(np.float64)  # [NB, V]: bumps of the context's mean number
        self.previous = (vocab.features @ self.expand(vocab, w["previous"])).astype(np.float64)  # [V, V]: previous
        self.features_t = np.ascontiguousarray(vocab.features.T, dtype=np.float64)  # [DT, V]

    def number_logits(self, after: np.ndarray, bumps: np.ndarray) -> np.ndarray:
        """Logits ``[n, V]`` that numbers with value bumps ``bumps`` ``[n, NB]`` add right after tokens ``after``."""
        dense = np.matmul(bumps[:, None, :], self.numbers[after])[:, 0]
        out: np.ndarray = dense @ self.features_t
        return out

    def number_rows_sum(self, after: np.ndarray, bumps: np.ndarray) -> np.ndarray:
        """``number_logits(after, bumps).sum(axis=0)`` ``[V]``, summed before the projection onto the ids."""
        dense = np.matmul(bumps[:, None, :], self.numbers[after])[:, 0].sum(axis=0, dtype=np.float64)
        out: np.ndarray = dense @ self.features_t
        return out

    def number_row(self, after: int, bumps: np.ndarray) -> np.ndarray:
        """``number_logits`` of one number ``[V]``: bumps ``[NB]`` right after token ``after``."""
        out: np.ndarray = (bumps @ self.numbers[after]) @ self.features_t
        return out

    @staticmethod
    def expand(vocab: Vocab, rows: np.ndarray) -> np.ndarray:
        """Rows over token features ``[n, V + DT]`` -> rows over token ids ``[n, V]``: ``rows @ ψᵀ``."""
        v = vocab.size
        out: np.ndarray = rows[:, :v] + rows[:, v:] @ vocab.features.T
        return out


class Policy:
    """The parameters (float32 arrays named in ``WEIGHTS``, shaped as ``shapes``) and the tables sampling reads."""

    def __init__(self, weights: dict[str, np.ndarray], vocab: Vocab | None = None, step: int | None = None) -> None:
        self.vocab = vocab or Vocab.builtin()
        want = shapes(self.vocab.size)
        got = {k: tuple(weights[k].shape) if k in weights else None for k in WEIGHTS}
        if got != want:
            raise CheckpointError(f"tiny policy weights have shapes {got}, expected {want} for a vocabulary of "
                                  f"{self.vocab.size}")
        self.weights = {k: np.ascontiguousarray(weights[k], dtype=np.float32) for k in WEIGHTS}
        self.step = step
        self.tables = Tables(self.vocab, self.weights)

    @classmethod
    def initial(cls, vocab: Vocab | None = None) -> Policy:
        """The deterministic starting point: context-free logits that favour numbers up to 100 and end a turn
        with probability ``INITIAL_STOP_PROBABILITY`` (seeded, the same in every process)."""
        vocab = vocab or Vocab.builtin()
        weights = {k: np.zeros(s, np.float32) for k, s in shapes(vocab.size).items()}
        logits = np.random.default_rng(1_000_003).normal(0.0, 1.0, vocab.size)
        logits[vocab.is_number & (vocab.value <= 100)] += 2.0
        others = vocab.sampleable.copy()
        others[vocab.eos_id] = False
        mass = np.exp(logits[others]).sum()
        logits[vocab.eos_id] = np.log(mass * INITIAL_STOP_PROBABILITY / (1 - INITIAL_STOP_PROBABILITY))
        weights["context"][0, :vocab.size] = np.where(vocab.sampleable, logits, 0.0)
        return cls(weights, vocab, step=0)

    @classmethod
    def seeded(cls, seed: int, vocab: Vocab | None = None, scale: float = 0.3, sharpness: float = 2.0) -> Policy:
        """Another policy, drawn from ``seed``: ``initial``'s kind of bias (its own draw) times ``sharpness``, plus
        random weights of size ``scale`` on the bag of tokens and on the previous token, so its logits depend on
        the context. The simulated servers' teacher for on-policy distillation (``orchestrator sim-inference
        --policy-seed``). Sharper than ``initial`` (entropy ~3.2 nats against ~5 at an answer): a student cannot
        come closer to it by spreading out, so a distillation that learns nothing does not look like one that
        learns (tests/test_learner.py's control)."""
        vocab = vocab or Vocab.builtin()
        rng = np.random.default_rng(seed)
        weights = {k: np.zeros(s, np.float32) for k, s in shapes(vocab.size).items()}
        logits = rng.normal(0.0, 1.0, vocab.size)
        logits[vocab.is_number & (vocab.value <= 100)] += 2.0
        weights["context"][0, :vocab.size] = np.where(vocab.sampleable, logits * sharpness, 0.0)
        weights["context"][1:, :vocab.size] = rng.normal(0.0, scale, (vocab.size, vocab.size))
        weights["previous"][:, :vocab.size] = rng.normal(0.0, scale, (DT, vocab.size))
        return cls(weights, vocab, step=0)

    def moved(self, delta: dict[str, np.ndarray], step: int | None = None) -> Policy:
        """A new policy with parameters ``W + delta`` (the learner's update)."""
        return Policy({k: self.weights[k] + delta[k] for k in WEIGHTS}, self.vocab, step=step)

    # ------------------------------------------------------------------------------------------- files

    def save(self, directory: Path) -> Path:
        """Write ``directory/FILE`` atomically (temp file, then rename); returns its path."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / FILE
        tmp = directory / f".{FILE}.{os.getpid()}.tmp"
        arrays: dict[str, Any] = {**self.weights, "meta": np.array(json.dumps({**_meta(self.vocab),
                                                                                      "step": self.step}))}
        with open(tmp, "wb") as f:  # compressed: rows of tokens no context has held yet stay zero
            np.savez_compressed(f, **arrays)
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, directory: Path, vocab: Vocab | None = None) -> Policy | None:
        """The policy saved in ``directory``; None if it holds none. CheckpointError if the file is unusable."""
        path = directory / FILE
        if not path.exists():
            return None
        vocab = vocab or Vocab.builtin()
        try:
            with np.load(path, allow_pickle=False) as f:
                meta = json.loads(str(f["meta"]))
                weights = {k: f[k] for k in WEIGHTS if k in f.files}
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{path}: not a tiny policy file ({e})") from e
        want = _meta(vocab)
        got = {k: meta.get(k) for k in want}
        if got != want:
            raise CheckpointError(f"{path}: saved for {got}, this build reads {want}")
        return cls(weights, vocab, step=meta.get("step"))

    # ------------------------------------------------------------------------------------ batches of samples

    def logits_at(self, seqs: Sequences) -> np.ndarray:
        """Logits ``[P, V]`` of each scored token given the tokens before it in its sample."""
        t, ctx = self.tables, _Contexts(self.vocab, seqs)
        out = np.empty((seqs.positions.size, self.vocab.size))
        for (a, b), rows in ctx.samples():
            last = seqs.positions[rows] - 1 - a  # each context's last token, within the sample
            events = np.zeros((b - a, self.vocab.size))  # what each token adds to the logits of the tokens after it
            first = ctx.first[a:b]
            events[first] = t.bag[ctx.ids[a:b][first]]
            j = a + np.flatnonzero(ctx.number_at[a:b])
            if j.size:
                events[j - a] += t.number_logits(ctx.ids[j - 1], ctx.number_delta[j])
            out[rows] = np.cumsum(events, axis=0)[last]
        out += t.bias
        out += ctx.mean_bumps @ t.mean
        out += t.previous[seqs.token_ids[seqs.positions - 1]]
        return out

    def gradient(self, seqs: Sequences, dlogits: np.ndarray) -> dict[str, np.ndarray]:
        """The gradient with respect to each ``WEIGHTS`` array (float64) of ``Σ_i dlogits[i] ·
        logits_at(seqs)[i]``: backpropagation through ``logits_at``."""
        vocab, ctx, v = self.vocab, _Contexts(self.vocab, seqs), self.vocab.size
        out = {k: np.zeros(s) for k, s in shapes(v).items()}
        g = np.concatenate([dlogits, dlogits @ vocab.features], axis=1)  # [P, V + DT]: dlogits · ψ
        out["context"][0] = g.sum(axis=0)
        out["mean"] += ctx.mean_bumps.T @ g
        out["previous"] += vocab.features[seqs.token_ids[seqs.positions - 1]].T @ g
        for (a, b), rows in ctx.samples():
            # a token at index j is in the context of every later position: suffix sums over positions
            per_position = np.zeros((b - a, g.shape[1]))
            per_position[seqs.positions[rows] - 1 - a] = g[rows]  # positions are distinct, so are contexts
            suffix = np.cumsum(per_position[::-1], axis=0)[::-1]
            first = np.flatnonzero(ctx.first[a:b])  # distinct ids within a sample: no repeated rows
            out["context"][1 + ctx.ids[a + first]] += suffix[first]
            j = np.flatnonzero(ctx.number_at[a:b])
            np.add.at(out["numbers"], ctx.ids[a + j - 1], ctx.number_delta[a + j, :, None] * suffix[j, None, v:])
        return out


def _meta(vocab: Vocab) -> dict[str, object]:
    return {"format": FORMAT, "vocab_size": vocab.size, "kinds": list(KINDS), "bumps": list(BUMP_CENTERS),
            "numbers": "bumps"}


@dataclass(frozen=True)
class Sequences:
    """Samples as the policy reads them: tokens concatenated, ``offsets[i]:offsets[i+1]`` sample ``i``'s, and
    the ``positions`` (indices into ``token_ids``, ascending, none the first of its sample) to score."""

    token_ids: np.ndarray  # int64 [T]
    offsets: np.ndarray  # int64 [n + 1]
    positions: np.ndarray  # int64 [P]


class _Contexts:
    """What each token adds to the context of the tokens after it in its sample."""

    def __init__(self, vocab: Vocab, seqs: Sequences) -> None:
        ids, offsets = seqs.token_ids, seqs.offsets
        self.ids, self.offsets = ids, offsets
        sample = np.repeat(np.arange(offsets.size - 1), np.diff(offsets))
        _, first = np.unique(sample * vocab.size + ids, return_index=True)
        self.first = np.zeros(ids.size, bool)  # the first occurrence of each distinct id in its sample
        self.first[first] = True
        # a number right after token t (in its sample) replaces "the number after t": the change of its bumps
        self.number_at = vocab.is_number[ids].copy()
        self.number_at[offsets[:-1][offsets[:-1] < ids.size]] = False  # a sample's first token follows nothing
        self.number_delta = np.zeros((ids.size, NB))
        at = np.flatnonzero(self.number_at)
        if at.size:
            key = sample[at] * vocab.size + ids[at - 1]  # (sample, the token before), in order
            bumps = vocab.bumps[ids[at]].astype(np.float64)
            order = np.lexsort((at, key))  # by key, then position: the previous number after the same token
            before = np.zeros_like(bumps)
            same = key[order][1:] == key[order][:-1]
            before[order[1:]] = np.where(same[:, None], bumps[order[:-1]], 0.0)
            self.number_delta[at] = bumps - before
        self.pos_sample = sample[seqs.positions]
        # the mean value of the distinct numbers before each scored position (no numbers: no bumps)
        first_number = self.first & vocab.is_number[ids]
        count = np.concatenate([[0], np.cumsum(first_number)])
        total = np.concatenate([[0.0], np.cumsum(np.where(first_number, vocab.value[ids], 0.0))])
        end, start = seqs.positions, offsets[self.pos_sample]
        n = count[end] - count[start]
        self.mean_bumps = np.where(n[:, None] > 0, value_bumps((total[end] - total[start]) / np.maximum(n, 1)), 0.0)
        self.bounds = np.searchsorted(self.pos_sample, np.arange(offsets.size))

    def samples(self) -> Iterator[tuple[tuple[int, int], slice]]:
        """Each sample with scored positions: its token range and the slice of its scored positions."""
        for s in np.unique(self.pos_sample).tolist():
            yield (int(self.offsets[s]), int(self.offsets[s + 1])), slice(self.bounds[s], self.bounds[s + 1])


class Cursor:
    """A context being extended token by token (sampling): its logits after each token, in a few additions.

    ``copy()`` is cheap (the logit vectors are replaced, never changed in place), so a server can keep the
    cursor of a prompt it sees again (every rollout of a group sends the same one)."""

    def __init__(self, policy: Policy, prompt_ids: np.ndarray) -> None:
        self._t, self._vocab = policy.tables, policy.vocab
        ids = np.asarray(prompt_ids, dtype=np.int64)
        distinct = np.unique(ids)
        self._seen = set(distinct.tolist())
        self._z = self._t.bias + self._t.bag[distinct].sum(axis=0, dtype=np.float64)
        self._after: dict[int, int] = {}  # token -> the most recent number right after it
        numbers = self._vocab.is_number
        for before, token in zip(ids[:-1].tolist(), ids[1:].tolist(), strict=True):
            if numbers[token]:
                self._after[before] = token
        if self._after:
            after, number = np.array(list(self._after)), np.array(list(self._after.values()))
            self._z = self._z + self._t.number_rows_sum(after, self._vocab.bumps[number])
        values = self._vocab.value[distinct[numbers[distinct]]]
        self._sum, self._count = float(values.sum()), int(values.size)  # of the distinct numbers seen
        self._mean = self._mean_logits()
        self._prev: int | None = int(ids[-1]) if ids.size else None

    @property
    def size(self) -> int:
        """The vocabulary's size: the length of ``logits()``."""
        return self._vocab.size

    def copy(self) -> Cursor:
        out = object.__new__(Cursor)
        out.__dict__.update(self.__dict__)
        out._seen, out._after = set(self._seen), dict(self._after)
        return out

    def logits(self) -> np.ndarray:
        """The next token's logits (float64 ``[V]``)."""
        z: np.ndarray = self._z + self._mean
        if self._prev is not None:
            z += self._t.previous[self._prev]
        return z

    def push(self, token: int) -> None:
        if token not in self._seen:
            self._seen.add(token)
            self._z = self._z + self._t.bag[token]
            if self._vocab.is_number[token]:
                self._sum += float(self._vocab.value[token])
                self._count += 1
                self._mean = self._mean_logits()
        if self._prev is not None and self._vocab.is_number[token]:
            old = self._after.get(self._prev)
            self._after[self._prev] = token
            if old != token:
                bumps = self._vocab.bumps[token] - (0.0 if old is None else self._vocab.bumps[old])
                self._z = self._z + self._t.number_row(self._prev, bumps)
        self._prev = token

    def _mean_logits(self) -> np.ndarray:
        if not self._count:
            return np.zeros(self._z.size)
        out: np.ndarray = value_bumps(np.array([self._sum / self._count]))[0] @ self._t.mean
        return out
