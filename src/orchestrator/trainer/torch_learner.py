"""A PyTorch learner for real models: recompute what was shipped, report the mismatch, take a clipped PG step.

Built only on the public trainer library (``orchestrator.transport``: ``Batch``) and Hugging Face transformers, so a
researcher can copy this file into their own trainer. ``orchestrator receive ADDRESS --torch-model DIR`` runs it
behind the reference trainer's loop (receive, learn, save ``step_N``, journal, acknowledge, announce).

For each batch:

1. **Recompute.** Every sample's tokens go through the model (float32 by default); the logprob of each token the
   policy sampled (``loss_mask`` = 1; a sample's first token has no context) is read from the logits one position
   earlier, in the mode the server shipped (``batch.logprobs_mode``): ``raw`` is log-softmax of the unscaled
   logits (vLLM's default), ``processed`` of the logits divided by the sample's temperature (vLLM's
   ``--logprobs-mode processed_logprobs``: the distribution it sampled from).
2. **Report.** Before the update on the batch of step ``s`` the trainer's weights are those it saved as
   ``step_s``, policy ``s``. Token by token (trainer/versions.py): a token these weights sampled, in a sample
   begun under them (so its whole context was computed by them too), must have the shipped logprob the learner
   recomputes. Over those tokens, ``max``/``mean`` of ``|shipped - recomputed|`` is the train/inference mismatch:
   a float32 dense model served in float32 matches to < 1e-6; bf16 serving to ~5e-3. Anything larger is a bug
   somewhere: a misaligned loss mask, a server and trainer that disagree on the logprobs mode, a versions column
   that names the wrong weights, or a server that did not load the weights it answered 200 for (vLLM's CPU MoE
   reload: REAL-VLLM.md). Above ``warn_mismatch`` a WARNING says so. Tokens of older weights differ by what the
   updates since changed, which is not a fault: their samples are counted (``stale``: no token of these
   weights) and they are left out of the mismatch. Tokens these weights sampled in a reply begun under older
   ones (a sync's keep pause caught its request in flight: it went on over KV cache of the older weights) are
   reported apart (``mixed_*``): vLLM does not recompute that cache, so they differ (observed: 0.12 on average).
   A later turn of a sample begun under older weights is in neither (its prefix may come from their cache).
   With ``min_tokens`` in the sampling args, processed logprobs of a reply's first ``min_tokens`` tokens are of a
   distribution without the stop tokens (vLLM masks them before sampling): they differ by ``-log(1 - p_stop)``.
   The importance ratio ``exp(recomputed - shipped)`` of the first pass (mean, min, max) is over every token. A
   batch without ``versions`` (an older sender) counts a sample's tokens as its ``policy``'s; one without
   ``policy`` scalars is taken as on-policy throughout.
3. **Learn.** PPO's clipped surrogate with per-sample weights (GRPO's: each sample weighs the same whatever its
   length), on the shipped advantages; AdamW; ``passes`` optimizer steps per batch, gradients clipped to
   ``max_grad_norm``. With a teacher (on-policy distillation, trainer/distill.py) the advantage of each trained
   token gains ``opd_weight · (r_t - ℓ_t + b)``: ``r_t`` the teacher's logprob of the token (``ref_logprobs``),
   ``ℓ_t`` the recomputed one (no gradient through it), ``b`` the batch's baseline; and the step's report says the
   mean KL to the teacher, ``ℓ_t - r_t`` over the distilled tokens before the update (``teacher_kl``).

``save(dir)`` writes the weights as safetensors (``save_pretrained``), which vLLM's ``reload_weights`` reads;
``resume(dir)`` loads them back (a trainer restarted from its journal). The optimizer's state is not saved.
``weights()`` are the parameters by their checkpoint names, what a broadcast to the servers sends
(trainer/gloo_broadcast.py): the same tensors ``save`` writes, which vLLM's ``load_weights`` reads.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from orchestrator.contracts.wire import Batch
from orchestrator.trainer import distill
from orchestrator.trainer.versions import clean_context, cut_by_sync, sampled_by

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TorchLearnConfig:
    """How the PyTorch learner trains; the defaults suit a real model (the tests' tiny one uses lr 1e-2)."""

    lr: float = 1e-6
    passes: int = 1  # optimizer steps per batch
    clip: float = 0.2  # ε of the clipped ratio
    max_grad_norm: float = 1.0
    device: str = "cpu"  # "cuda" for GPUs (not tested here: no GPU on these machines)
    dtype: str = "float32"  # of the trainer's copy of the model; float32 for exact parity
    micro_batch_tokens: int = 16384  # padded tokens per forward pass
    warn_mismatch: float = 1e-2  # a step whose mean |shipped - recomputed| exceeds this gets a WARNING
    temperature: float = 1.0  # processed mode: the temperature of samples whose batch carries none

    def __post_init__(self) -> None:
        if not (self.lr > 0 and self.passes >= 1 and 0 < self.clip < 1 and self.max_grad_norm > 0
                and self.micro_batch_tokens >= 1 and self.temperature > 0):
            raise ValueError(f"TorchLearnConfig: need lr > 0, passes >= 1, 0 < clip < 1, max_grad_norm > 0, "
                             f"micro_batch_tokens >= 1, temperature > 0; got {self}")


@dataclass(frozen=True)
class TorchLearnStats:
    """One step's report: the train/inference mismatch (before the update) and what the update did."""

    samples: int
    tokens: int  # trained tokens
    mode: str  # the logprobs mode recomputed: raw or processed
    mismatch_max: float  # max |shipped - recomputed| over the on-policy samples' trained tokens (nan: none)
    mismatch_mean: float
    ratio_mean: float  # importance ratio exp(recomputed - shipped), first pass
    ratio_min: float
    ratio_max: float
    objective: float  # the clipped surrogate before the update
    clipped: float  # share of trained tokens whose gradient the clip removed (last pass)
    grad_norm: float  # before clipping, first pass
    stale: int = 0  # samples without a token of the learner's weights, left out of the mismatch
    own_tokens: int = 0  # trained tokens the mismatch is over: of its weights, in samples begun under them
    mixed_tokens: int = 0  # trained tokens of its weights in replies a sync cut (KV context of older weights)
    mixed_max: float = math.nan  # max / mean |shipped - recomputed| over those (nan: none)
    mixed_mean: float = math.nan
    teacher_kl: float | None = None  # mean ℓ_t - r_t over the distilled tokens before the update (None: none)

    def __str__(self) -> str:
        mismatch = (f"mismatch max {self.mismatch_max:.2e} mean {self.mismatch_mean:.2e}"
                    if math.isfinite(self.mismatch_max) else "mismatch n/a (no on-policy sample)")
        stale = f" ({self.stale} of {self.samples} samples of older policies)" if self.stale else ""
        if self.mixed_tokens:
            stale += (f"; {self.mixed_tokens} tokens of its weights in replies a sync cut: mismatch max "
                      f"{self.mixed_max:.2e} mean {self.mixed_mean:.2e}")
        kl = "" if self.teacher_kl is None else f", KL to the teacher {self.teacher_kl:.4f}"
        return (f"trained {self.tokens} tokens ({self.mode} logprobs): {mismatch}{stale}, "
                f"ratio {self.ratio_mean:.4f} [{self.ratio_min:.3f}, {self.ratio_max:.3f}], "
                f"clipped {self.clipped:.1%}, objective {self.objective:+.4f}, grad norm {self.grad_norm:.3f}{kl}")


@dataclass
class Sample:
    """What the learner reads of one sample: its tokens, which of them are trained, and their shipped data."""

    token_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [P]: trained positions (each >= 1)
    shipped: torch.Tensor  # float32 [P]: their shipped logprobs
    advantage: float
    temperature: float
    on_policy: bool  # some of its trained tokens the weights the learner holds before this batch's update sampled
    own: torch.Tensor | None = None  # bool [P]: trained tokens those weights sampled over a context of theirs
    mixed: torch.Tensor | None = None  # bool [P]: trained tokens those weights sampled in a reply a sync cut
    opd_weight: float = 0.0  # the weight of the teacher's term (0: not distilled)
    reference: torch.Tensor | None = None  # float32 [P]: the teacher's logprobs it trains towards
    teacher: torch.Tensor | None = None  # float32 [P]: the teacher's logprobs as shipped (the KL report's)


class TorchLearner:
    """Trains a Hugging Face causal LM (``model_dir``) on batches: ``update(batch)``, ``save(dir)``, ``resume(dir)``."""

    def __init__(self, model_dir: Path, config: TorchLearnConfig = TorchLearnConfig()) -> None:
        self.config = config
        self.device = torch.device(config.device)
        dtype = getattr(torch, config.dtype)
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        self.model = model.to(self.device)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=0.0)

    # ------------------------------------------------------------------------------------------ inputs

    def samples(self, batch: Batch) -> list[Sample]:
        """The batch's samples as the learner reads them (a subclass may change what is trained: the tests shift
        the loss mask to show the mismatch report catches it)."""
        mask = batch.columns["loss_mask"]
        ids, shipped = batch.columns["token_ids"], batch.columns["logprobs"]
        temps = batch.scalars.get("temperature") or [self.config.temperature] * batch.num_samples
        own, clean, cut = sampled_by(batch), clean_context(batch), cut_by_sync(batch)
        opd, teacher, trained_towards = distill.opd_weights(batch), distill.teacher_logprobs(batch), self.teacher(batch)
        out = []
        for i in range(batch.num_samples):
            a, b = int(batch.offsets[i]), int(batch.offsets[i + 1])
            positions = np.flatnonzero(mask[a:b])
            positions = positions[positions >= 1]  # a sample's first token has no context
            mine = own[a:b][positions]
            out.append(Sample(torch.from_numpy(ids[a:b].astype(np.int64)), torch.from_numpy(positions),
                              _tensor(shipped[a:b][positions]), float(batch.scalars["advantage"][i]),
                              float(temps[i]), bool(mine.any()), torch.from_numpy(mine & clean[a:b][positions]),
                              torch.from_numpy(mine & cut[a:b][positions]), float(opd[i]),
                              _tensor(trained_towards[a:b][positions]) if opd[i] else None,
                              _tensor(teacher[a:b][positions]) if opd[i] else None))
        return out

    def teacher(self, batch: Batch) -> np.ndarray:
        """The teacher's logprobs the learner trains towards, per token of the batch: its ``ref_logprobs`` (a
        subclass may change them: the learning tests shuffle them; the KL report keeps reading the batch's)."""
        return distill.teacher_logprobs(batch)

    def mode(self, batch: Batch) -> str:
        """The logprobs mode to recompute in: what the batch says the server shipped; processed when it does not
        say (senders before the field existed)."""
        return batch.logprobs_mode or "processed"

    # ----------------------------------------------------------------------------------------- learning

    def update(self, batch: Batch) -> TorchLearnStats:
        """Report the mismatch, then ``passes`` optimizer steps on the clipped surrogate."""
        samples, mode = self.samples(batch), self.mode(batch)
        tokens = sum(int(s.positions.numel()) for s in samples)
        stale = sum(not s.on_policy for s in samples)
        if tokens == 0:
            return TorchLearnStats(len(samples), 0, mode, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, stale)
        first: dict[str, float] = {}
        clipped = 0.0
        base = self._baseline(samples)
        for p in range(self.config.passes):
            self.optimizer.zero_grad(set_to_none=True)
            seen = self._backward(samples, mode, len(samples), base, report=not first)
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm))
            if p == 0:
                first = {**seen, "grad_norm": norm}
            clipped = seen["clipped"]
            if math.isfinite(norm) and norm > 0:
                self.optimizer.step()
        stats = TorchLearnStats(len(samples), tokens, mode, first["mismatch_max"], first["mismatch_mean"],
                                first["ratio_mean"], first["ratio_min"], first["ratio_max"], first["objective"],
                                clipped, first["grad_norm"], stale, int(first["own_tokens"]),
                                int(first["mixed_tokens"]), first["mixed_max"], first["mixed_mean"],
                                first["teacher_kl"] if math.isfinite(first["teacher_kl"]) else None)
        if stats.mismatch_mean > self.config.warn_mismatch:  # False for nan: no on-policy sample
            log.warning("step %d: the shipped logprobs differ from the trainer's recomputation by %.3g on average "
                        "(max %.3g): a misaligned loss mask, a logprobs mode the server and trainer disagree on, or "
                        "a server not serving the weights it loaded", batch.step, stats.mismatch_mean,
                        stats.mismatch_max)
        return stats

    def _backward(self, samples: list[Sample], mode: str, n: int, base: float = 0.0, *, report: bool
                  ) -> dict[str, float]:
        """Accumulate the gradient of -J over micro-batches; what this pass saw (the mismatch and the KL to the
        teacher when ``report``). ``base``: the teacher term's baseline (``_baseline``)."""
        diffs, mixed, ratios, kls, objective, active, total = [], [], [], [], 0.0, 0, 0
        for group in self._micro_batches(samples):
            logps = self._logprobs(group, mode)
            loss = torch.zeros((), device=self.device)
            for s, logp in zip(group, logps, strict=True):
                shipped = s.shipped.to(self.device)
                ratio = torch.exp(logp - shipped)
                advantage = self._advantage(s, logp.detach(), base)
                clipped = torch.clamp(ratio, 1 - self.config.clip, 1 + self.config.clip)
                surrogate = torch.minimum(ratio * advantage, clipped * advantage)
                loss = loss - surrogate.mean() / n
                with torch.no_grad():
                    unclipped = torch.where(advantage >= 0, ratio <= 1 + self.config.clip,
                                            ratio >= 1 - self.config.clip)
                    active += int(unclipped.sum())
                    total += int(ratio.numel())
                    if report:
                        ratios.append(ratio.detach().cpu())
                        diff = (logp.detach() - shipped).abs().cpu()
                        own = s.own if s.own is not None else torch.full_like(diff, s.on_policy, dtype=torch.bool)
                        diffs.append(diff[own])
                        if s.mixed is not None:
                            mixed.append(diff[s.mixed])
                        if s.teacher is not None:
                            kls.append((logp.detach() - s.teacher.to(self.device)).cpu())
            loss.backward()  # type: ignore[no-untyped-call]
            objective -= float(loss.detach())
        out = {"objective": objective, "clipped": 1.0 - active / max(total, 1)}
        if report:
            d, r = _nonempty(diffs), torch.cat(ratios)
            m = _nonempty(mixed)
            kl = float(torch.cat(kls).mean()) if kls else math.nan
            out |= {"mismatch_max": float(d.max()), "mismatch_mean": float(d.mean()), "ratio_mean": float(r.mean()),
                    "ratio_min": float(r.min()), "ratio_max": float(r.max()), "mixed_max": float(m.max()),
                    "mixed_mean": float(m.mean()), "own_tokens": sum(int(x.numel()) for x in diffs),
                    "mixed_tokens": sum(int(x.numel()) for x in mixed), "teacher_kl": kl}
        return out

    def _advantage(self, s: Sample, logp: torch.Tensor, base: float) -> torch.Tensor:
        """Per trained token: the sample's advantage, plus the teacher's term when it is distilled."""
        advantage = torch.full_like(logp, s.advantage)
        if s.reference is not None and s.opd_weight:
            advantage = advantage + s.opd_weight * (s.reference.to(self.device) - logp + base)
        return advantage

    @staticmethod
    def _baseline(samples: list[Sample]) -> float:
        """The teacher term's baseline: the mean of shipped - teacher logprob over the distilled tokens."""
        parts = [(s.shipped, s.reference) for s in samples if s.reference is not None and s.opd_weight]
        if not parts:
            return 0.0
        return distill.baseline(torch.cat([p[0] for p in parts]).numpy(), torch.cat([p[1] for p in parts]).numpy(),
                                np.ones(sum(p[0].numel() for p in parts)))

    def _micro_batches(self, samples: list[Sample]) -> list[list[Sample]]:
        """Samples with trained tokens, in groups of at most ``micro_batch_tokens`` padded tokens."""
        groups: list[list[Sample]] = [[]]
        longest = 0
        for s in sorted((s for s in samples if s.positions.numel()), key=lambda s: s.token_ids.numel()):
            longest = max(longest, int(s.token_ids.numel()))
            if groups[-1] and longest * (len(groups[-1]) + 1) > self.config.micro_batch_tokens:
                groups.append([])
                longest = int(s.token_ids.numel())
            groups[-1].append(s)
        return [g for g in groups if g]

    def _logprobs(self, group: list[Sample], mode: str) -> list[torch.Tensor]:
        """Each sample's recomputed logprobs of its trained tokens, in ``mode`` (right-padded forward pass)."""
        width = max(int(s.token_ids.numel()) for s in group)
        ids = torch.zeros((len(group), width), dtype=torch.int64)
        attention = torch.zeros((len(group), width), dtype=torch.int64)
        for row, s in enumerate(group):
            ids[row, :s.token_ids.numel()] = s.token_ids
            attention[row, :s.token_ids.numel()] = 1
        logits = self.model(input_ids=ids.to(self.device), attention_mask=attention.to(self.device)).logits
        out = []
        for row, s in enumerate(group):
            pos = s.positions.to(self.device)
            z = logits[row, pos - 1].float()  # the logits that predicted each trained token
            if mode == "processed":
                z = z / s.temperature
            out.append(torch.log_softmax(z, dim=-1).gather(1, s.token_ids.to(self.device)[pos][:, None])[:, 0])
        return out

    # --------------------------------------------------------------------------------------- checkpoints

    def save(self, directory: Path) -> None:
        """The weights (safetensors) and config into ``directory``: what ``reload_weights`` reads."""
        self.model.save_pretrained(directory, safe_serialization=True)

    def weights(self) -> dict[str, torch.Tensor]:
        """The parameters by name (tied ones once, as ``save_pretrained`` writes them)."""
        return dict(self.model.named_parameters())

    def resume(self, directory: Path) -> bool:
        """Load the weights saved in ``directory`` (False: none there)."""
        from safetensors.torch import load_file

        files = sorted(directory.glob("*.safetensors"))
        if not files:
            return False
        state: dict[str, Any] = {}
        for f in files:
            state.update(load_file(f, device=str(self.device)))
        self.model.load_state_dict(state)
        return True


def _nonempty(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` concatenated; a single nan when they hold nothing (max and mean are then nan)."""
    joined = torch.cat(parts) if parts else torch.zeros(0)
    return joined if joined.numel() else torch.full((1,), math.nan)


def _tensor(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(values.astype(np.float32))
