"""The simulated model: what a sim server samples from, and what loading weights changes.

``SimPolicy.sample(prompt_ids, sampling_params)`` is the one place tokens come from: token by token from the
tiny policy (``orchestrator.policy``), conditioned on the prompt and on what it sampled so far, from the
distribution the request's sampling parameters make: ``temperature`` (0: greedy), then ``top_k`` (-1 or 0:
off), then ``top_p``. ``min_p`` and the penalties are accepted and ignored. The logprobs a reply reports, as
vLLM's ``--logprobs-mode`` says (``v031:v1/sample/sampler.py``; observed on vLLM 0.31.0 to 5e-7 against a
float32 recomputation, OBSERVED.md), are exact:

- ``raw_logprobs`` (vLLM's default): the log-softmax of the unscaled logits, whatever the temperature, top-k
  or top-p: not those of the distribution sampled from, unless temperature is 1 and nothing is cut;
- ``processed_logprobs``: those of the distribution sampled from (temperature, top-k, top-p applied; tokens
  these exclude have logprob -inf, reported as vLLM's floor, -9999.0), except for a greedy request (temperature
  0), whose logprobs are the raw ones (vLLM's greedy path skips the processing).

The ranks and top logprobs of a reply are of the same distribution as its logprobs.

``prompt_logprobs(ids, k)`` scores a sequence (a teacher's prefill): each token's raw logprob given the tokens before
it, whatever the mode or the request's temperature (observed on vLLM 0.31.0: equal to a float32 recomputation's raw
log-softmax to 5e-7 with ``--logprobs-mode processed_logprobs`` at temperature 0.7; VLLM-032.md section 5), with its
rank and the top ``k``.

``read(path)`` (blocking: a worker thread) reads the parameters the trainer saved in the weights directory
(``orchestrator.policy.FILE``) and ``install`` puts them in place. The simulator's weights are that file, so a
path that is not a directory, a directory without it, or a file it cannot read fail the load as a real
server's do (``LoadFailed`` with the worker's error: ``orchestrator.sim.engine``). Reading the very file loaded
last (the same inode, size and mtime: the reference trainer hard-links one unchanged policy into each
checkpoint) reuses the parameters in hand. Before any load the server samples from ``Policy.initial()``.

The sampling state after a prompt is kept for the last ``PROMPT_CACHE`` prompts (every rollout of a group
sends the same one) until new parameters load. ``route(rows)`` draws the MoE routing of a sequence. Sampling
and routing draw from generators seeded at construction, so a server's replies are deterministic under its
seed for a given order of requests and weight loads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import numpy as np

from orchestrator.errors import CheckpointError
from orchestrator.policy import FILE, Cursor, Policy, Sequences
from orchestrator.sim.engine import LoadFailed
from orchestrator.sim.requests import SamplingParams
from orchestrator.sim.vocab import SimVocab

LOGPROB_FLOOR = -9999.0  # vLLM floors logprobs at -9999.0
TINY = 1e-200  # a sum of weights too small to draw from (relative to the largest weight, 1)
PROMPT_CACHE = 256  # prompts whose cursor is kept (a group's rollouts send the same prompt)
FileId = tuple[int, int, int, int]  # device, inode, size, mtime (ns)
LogprobsModeName = Literal["raw_logprobs", "processed_logprobs"]  # vLLM's --logprobs-mode values simulated
LOGPROBS_MODES: tuple[LogprobsModeName, ...] = get_args(LogprobsModeName)


def logprobs_mode_named(name: str) -> LogprobsModeName:
    """The mode called ``name``; ValueError naming the valid ones otherwise."""
    for mode in LOGPROBS_MODES:
        if name == mode:
            return mode
    raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, not {name!r}")


@dataclass(frozen=True)
class Sample:
    """One sampled completion, with what vLLM reports about it."""

    token_ids: np.ndarray  # int64 [n]
    logprobs: np.ndarray  # float64 [n]: each sampled token's logprob
    ranks: np.ndarray  # int64 [n]: each sampled token's rank in the distribution (1: the most likely)
    finish_reason: str  # "stop" or "length"
    stop_reason: int | None  # the stop token that ended it, None for the end-of-turn token or a length stop
    top_ids: np.ndarray  # int64 [n, k]: per token, the k most likely ids (k = sampling_params.logprobs; -1: all)
    top_logprobs: np.ndarray  # float64 [n, k]


@dataclass(frozen=True)
class PromptLogprobs:
    """What vLLM reports for each prompt token after the first (``prompt_logprobs``): rows are tokens 1..T-1."""

    logprobs: np.ndarray  # float64 [T-1]: each token's raw logprob given the tokens before it
    ranks: np.ndarray  # int64 [T-1]
    top_ids: np.ndarray  # int64 [T-1, k]: the k most likely ids at each position
    top_logprobs: np.ndarray  # float64 [T-1, k]


@dataclass(frozen=True)
class Experts:
    """The MoE shape routed experts are drawn for."""

    layers: int
    top_k: int
    num_experts: int


class SimPolicy:
    def __init__(self, vocab: SimVocab, seed: int, experts: Experts | None = None,
                 logprobs_mode: LogprobsModeName = "raw_logprobs", start: Policy | None = None) -> None:
        tokens_seed, routing_seed = np.random.SeedSequence(seed).spawn(2)
        self.vocab = vocab
        self.experts = experts
        self.logprobs_mode = logprobs_mode  # what replies report (vLLM's --logprobs-mode; raw is its default)
        self._prompts: OrderedDict[bytes, Cursor] = OrderedDict()  # least recently used first
        self._model = start or Policy.initial()  # the weights it starts from (a teacher: Policy.seeded)
        self.weights_path: str | None = None  # the last directory loaded; None: the weights it started with
        self.loads = 0
        self._file_id: FileId | None = None  # the weights file loaded last
        self._rng = np.random.default_rng(tokens_seed)
        self._routing_rng = np.random.default_rng(routing_seed)

    @property
    def model(self) -> Policy:
        """The parameters sampled from now; setting them forgets every prompt's sampling state."""
        return self._model

    @model.setter
    def model(self, policy: Policy) -> None:
        self._model = policy
        self._prompts.clear()

    def read(self, path: object) -> tuple[Policy | None, FileId]:
        """Blocking: the parameters saved in directory ``path`` and which file held them (None: the file loaded
        last, whose parameters are in hand). LoadFailed with the worker's error as vLLM words it."""
        if not isinstance(path, str):  # prime-rl's update_weights with no weight_dir: os.path.isdir(None)
            raise LoadFailed(f"stat: path should be string, bytes, os.PathLike or integer, not {type(path).__name__}")
        directory = Path(path)
        if not directory.is_dir():  # vLLM takes it for a hub repo id (observed: it tries the hub, then this)
            raise LoadFailed(f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': '{path}'. Use "
                             "`repo_type` argument if needed.")
        try:
            st = (directory / FILE).stat()
        except FileNotFoundError:
            raise LoadFailed(f"Cannot find any model weights with `{path}`") from None
        file_id = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if file_id == self._file_id:
            return None, file_id
        try:
            model = Policy.load(directory)
        except CheckpointError as e:
            raise LoadFailed(str(e)) from None
        if model is None:  # removed since the stat above
            raise LoadFailed(f"Cannot find any model weights with `{path}`")
        return model, file_id

    def install(self, path: str | None, model: Policy | None = None, file_id: FileId | None = None) -> None:
        """Count a load of ``path`` and sample from ``model`` from now on (None: the parameters in hand, as
        vLLM's reload_weights without a path reloads the last ones)."""
        if model is not None:
            self.model = model
            self._file_id = file_id
        if path is not None:
            self.weights_path = path
        self.loads += 1

    def _cursor(self, prompt_ids: Sequence[int]) -> Cursor:
        ids = np.asarray(prompt_ids, dtype=np.int64)
        key = ids.tobytes()
        cursor = self._prompts.get(key)
        if cursor is None:
            cursor = self._prompts[key] = Cursor(self.model, ids)
            if len(self._prompts) > PROMPT_CACHE:
                self._prompts.popitem(last=False)
        else:
            self._prompts.move_to_end(key)
        return cursor.copy()

    def sample(self, prompt_ids: Sequence[int], sp: SamplingParams) -> Sample:
        """Sample up to ``sp.max_tokens`` ids, one at a time, stopping after the first stop token."""
        cursor = self._cursor(prompt_ids)
        stops = set(sp.stop_token_ids) if sp.ignore_eos else {*sp.stop_token_ids, self.vocab.eos_id}
        k = 0 if sp.logprobs is None else self.vocab.size if sp.logprobs < 0 else max(sp.logprobs, 1)
        ids: list[int] = []
        logprobs, ranks, top_ids, top_lps = [], [], [], []
        finish, stop_reason = "length", None
        # masked until sp.min_tokens are sampled: the stop ids and EOS, even with ignore_eos (vLLM 0.31:
        # SamplingParams.update_from_generation_config adds EOS to the ids its min-tokens processor masks)
        banned = np.array(sorted({*sp.stop_token_ids, self.vocab.eos_id}), np.int64)
        banned = banned[banned < cursor.size]
        # temperature 1, nothing cut, raw logprobs reported (RL's sampling): the distribution sampled from is the
        # reported one but for min_tokens' mask, so one exponential serves both
        plain = (self.logprobs_mode == "raw_logprobs" and sp.temperature == 1.0 and sp.top_p >= 1.0
                 and not 0 < sp.top_k < cursor.size)
        for _ in range(max(sp.max_tokens, 1)):
            logits = cursor.logits()
            masking = len(ids) < sp.min_tokens and banned.size > 0  # raw logprobs are reported before any mask
            cdf = None
            if plain:
                shifted = logits - logits[int(logits.argmax())]
                weights = np.exp(shifted)
                lp = shifted - float(np.log(weights.sum()))
                if masking:  # after the sum: the reported logprobs are the unmasked ones
                    weights[banned] = 0.0  # the rest keep their ratios: the same distribution as the masked one
                cdf = np.cumsum(weights)
                if cdf[-1] < TINY:  # the ids left weigh under e^-460 of a masked one together: shift to their best
                    cdf = None
            if cdf is None:
                masked = logits
                if masking:
                    masked = logits.copy()
                    masked[banned] = -np.inf
                z = processed_logits(masked, sp)  # its maximum is 0
                cdf = np.cumsum(np.exp(z))
                lp = self._reported(logits, z, float(np.log(cdf[-1])), sp)
            token = int(min(np.searchsorted(cdf, self._rng.random() * cdf[-1], side="right"), cdf.size - 1))
            ids.append(token)
            logprobs.append(float(lp[token]))
            ranks.append(1 + int(np.count_nonzero(lp > lp[token])))
            top = np.argsort(-lp, kind="stable")[:k] if k > 1 else np.full(k, lp.argmax())
            top_ids.append(top)
            top_lps.append(lp[top])
            if token in stops:
                finish, stop_reason = "stop", None if token == self.vocab.eos_id else token
                break
            cursor.push(token)
        floor = np.float64(LOGPROB_FLOOR)
        return Sample(np.array(ids, np.int64), np.maximum(logprobs, floor), np.array(ranks, np.int64), finish,
                      stop_reason, np.array(top_ids, np.int64).reshape(len(ids), k),
                      np.maximum(np.array(top_lps).reshape(len(ids), k), floor))

    def prompt_logprobs(self, prompt_ids: Sequence[int], k: int) -> PromptLogprobs:
        """The raw logprob, rank and top ``k`` of every prompt token after the first (floored at vLLM's -9999.0)."""
        ids = np.asarray(prompt_ids, dtype=np.int64)
        seqs = Sequences(ids, np.array([0, ids.size], np.int64), np.arange(1, ids.size, dtype=np.int64))
        z = self.model.logits_at(seqs)
        z -= z.max(axis=1, keepdims=True)
        lp = np.maximum(z - np.log(np.exp(z).sum(axis=1, keepdims=True)), LOGPROB_FLOOR)
        rows = np.arange(seqs.positions.size)
        chosen = lp[rows, ids[1:]]
        top = np.argsort(-lp, axis=1, kind="stable")[:, :k]
        return PromptLogprobs(chosen, 1 + np.count_nonzero(lp > chosen[:, None], axis=1), top,
                              np.take_along_axis(lp, top, axis=1))

    def _reported(self, logits: np.ndarray, z: np.ndarray, log_total: float, sp: SamplingParams) -> np.ndarray:
        """The logprobs a reply reports for every id: those of the sampling distribution (processed, but not for
        greedy requests: vLLM's greedy path returns the log-softmax of the unscaled logits,
        ``v031:v1/sample/sampler.py`` ``Sampler.sample``), or the log-softmax of the unscaled logits (raw)."""
        if self.logprobs_mode == "processed_logprobs" and sp.temperature > 0:
            return z - log_total
        shifted = logits - logits[int(np.argmax(logits))]
        out: np.ndarray = shifted - float(np.log(np.sum(np.exp(shifted))))
        return out

    def route(self, rows: int) -> np.ndarray:
        """Expert ids ``[rows, layers, top_k]`` (distinct within a token's layer), as int64."""
        assert self.experts is not None
        e = self.experts
        first = self._routing_rng.integers(0, e.num_experts, (rows, e.layers, 1))
        stride = max(e.num_experts // e.top_k, 1)
        return (first + np.arange(e.top_k) * stride) % e.num_experts


def processed_logits(logits: np.ndarray, sp: SamplingParams) -> np.ndarray:
    """The logits of the distribution ``sp`` samples from (vLLM's order: temperature, top-k, top-p), shifted
    so their maximum is 0; excluded ids get -inf. Temperature 0 (greedy) is the point mass on the most likely
    id. ``z - log(sum(exp(z)))`` are the logprobs vLLM reports as processed (for a temperature above 0)."""
    if sp.temperature <= 0:
        out = np.full(logits.size, -np.inf)
        out[int(np.argmax(logits))] = 0.0
        return out
    z: np.ndarray = logits - logits[int(np.argmax(logits))]
    if sp.temperature != 1.0:
        z = z / sp.temperature
    if 0 < sp.top_k < z.size:
        z = np.where(z >= np.partition(z, -sp.top_k)[-sp.top_k], z, -np.inf)
    if sp.top_p < 1.0:
        order = np.argsort(-z, kind="stable")
        p = np.exp(z[order])
        cum = np.cumsum(p) / p.sum()
        cut = order[int(np.searchsorted(cum, sp.top_p)) + 1:]  # keep the smallest prefix reaching top_p
        z = z.copy()
        z[cut] = -np.inf
    return z

