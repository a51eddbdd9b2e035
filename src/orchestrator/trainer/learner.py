"""The reference trainer's learning mode: a clipped, importance-weighted policy-gradient update per batch.

This is also the example of how a trainer consumes our batches. It reads only what the orchestrator ships, with
the public trainer library (``orchestrator.transport``):

- ``batch.offsets[i]:batch.offsets[i+1]`` are sample ``i``'s tokens in every column;
- ``token_ids`` (int32): the whole sequence, prompt and every turn;
- ``loss_mask`` (uint8): 1 where the policy sampled the token, so only those are trained;
- ``logprobs`` (float32): each sampled token's logprob under the weights that sampled it (the behaviour
  policy ``μ``, possibly a step or two old: ``max_async_level``); 0 elsewhere;
- ``batch.scalars["advantage"][i]``: the sample's advantage (its reward minus its group's mean);
- ``batch.logprobs_mode``: which logprobs ``logprobs`` holds, ``"raw"`` or ``"processed"`` (below), and
  ``batch.scalars["temperature"][i]``: the temperature sample ``i`` was sampled at;
- ``batch.scalars["policy"][i]``: the policy step of the weights that sampled it (``step_N`` checkpoints are
  policy ``N``; a batch of step ``s`` from a trainer that trains every step is on-policy where it equals ``s``);
- with a ``[teacher]`` (on-policy distillation, trainer/distill.py): ``ref_logprobs``, the teacher's logprob of each
  token, and ``batch.scalars["opd_weight"][i]``, the weight of its term.

The model it trains is the tiny policy the simulated servers sample from (``orchestrator.policy``); a real
trainer would run its model's forward and backward instead of ``Policy.logits_at``/``gradient``, and the
rest is the same. For each sampled token ``y`` at position ``t`` of sample ``i`` (advantage ``A_i``, ``T_i``
sampled tokens), with ``r = π_θ(y | tokens before t) / μ(y)``, the objective is PPO's clipped surrogate, each
sample weighing the same whatever its length (GRPO's):

    J(θ) = 1/N Σ_i 1/T_i Σ_t min(r·A_i, clip(r, 1 - ε, 1 + ε)·A_i)

With a teacher, ``A_i`` becomes per token: ``A_i + opd_weight_i · (r_t - log π_θ(y) + b)``, ``r_t`` the teacher's
logprob of the token, ``log π_θ(y)`` taken as a constant, ``b`` the batch's baseline (trainer/distill.py): the policy
gradient of the reverse KL to the teacher. The mean of ``log π_θ(y) - r_t`` before the update is reported
(``teacher_kl``).

Each batch gets ``passes`` steps of plain gradient ascent ``θ += lr · ∇J``, ``r`` recomputed before each:
the first from where the behaviour policy left off (``r`` = 1 on-policy), the later ones where the clip keeps
the policy near the data. Plain gradient steps, not Adam: a step is as large as the evidence, so data that
is wrong in scale (behaviour logprobs of the wrong tokens: ratios far from 1) moves the policy little
instead of being normalised into a full-size step.

``π_θ`` is computed in the batch's logprobs mode, so that the first pass's ratio is 1 on-policy: for ``"raw"``
(vLLM's default ``--logprobs-mode raw_logprobs``, and the simulated servers'), the log-softmax of the unscaled
logits, whatever the sampling temperature; for ``"processed"`` (``processed_logprobs``), that of the logits over
the temperature the tokens were sampled at (the per-sample ``temperature`` scalar, else
``LearnConfig.temperature``). A batch that does not say (``None``: an older sender) is taken as processed, as this
learner always did. (Raw logprobs at a temperature other than 1 are refused by the orchestrator's preflight
unless the job states ``inference.logprobs_mode = "raw"``: then this trains on them as they are.)

The learner's state is the policy alone: a trainer restarted from a checkpoint (``receive --journal``) goes on
from the policy saved in it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from orchestrator.contracts.wire import Batch
from orchestrator.policy import Policy, Sequences
from orchestrator.trainer import distill

log = logging.getLogger(__name__)

MAX_LOG_RATIO = 50.0  # r is computed from a log-ratio capped here: a wild behaviour logprob cannot overflow it


@dataclass(frozen=True)
class LearnConfig:
    """How the reference trainer learns; the defaults are what the demo and the learning test use."""

    lr: float = 1.0  # step size of each gradient-ascent step
    passes: int = 2  # gradient steps per batch
    clip: float = 0.2  # ε of the clipped ratio
    temperature: float = 1.0  # the sampling temperature, when the batch does not carry one per sample

    def __post_init__(self) -> None:
        if not (self.lr > 0 and self.passes >= 1 and 0 < self.clip < 1 and self.temperature > 0):
            raise ValueError(f"LearnConfig: need lr > 0, passes >= 1, 0 < clip < 1, temperature > 0; got {self}")


@dataclass(frozen=True)
class LearnStats:
    """What one update saw and did (logged by the trainer, one line per step)."""

    samples: int
    tokens: int  # trained tokens
    objective: float  # J(θ) before the first pass
    ratio_mean: float  # mean r over trained tokens before the first pass: how far off-policy the batch was
    clipped: float  # share of trained tokens whose gradient the clip removed in the last pass
    grad_norm: float  # of the first pass
    teacher_kl: float | None = None  # mean log π_θ(y) - r_t over the distilled tokens, before the update

    def __str__(self) -> str:
        kl = "" if self.teacher_kl is None else f", KL to the teacher {self.teacher_kl:.4f}"
        return (f"learned from {self.tokens} tokens: ratio {self.ratio_mean:.3f}, clipped {self.clipped:.1%}, "
                f"objective {self.objective:+.4f}, grad norm {self.grad_norm:.3f}{kl}")


@dataclass
class PolicyLearner:
    """Trains a ``Policy`` (default: ``Policy.initial()``, the one simulated servers start from) on batches."""

    config: LearnConfig = field(default_factory=LearnConfig)
    policy: Policy = field(default_factory=Policy.initial)

    def update(self, batch: Batch) -> LearnStats:
        """``config.passes`` gradient steps on ``batch``; ``self.policy`` is then the new policy."""
        seqs, advantage, behaviour, temperature = self.inputs(batch)
        if seqs.positions.size == 0:
            return LearnStats(batch.num_samples, 0, 0.0, 1.0, 0.0, 0.0)
        teacher = self.teacher_inputs(batch, seqs)
        # each token's weight in J: 1 / (N · T_i)
        sample = np.searchsorted(seqs.offsets, seqs.positions, side="right") - 1
        weight = 1.0 / (batch.num_samples * np.bincount(sample, minlength=batch.num_samples)[sample])
        first = None
        kl: float | None = None
        for _ in range(self.config.passes):
            objective, ratio, clipped, grad, logp = self._gradient(seqs, advantage, behaviour, temperature, weight,
                                                                   teacher)
            norm = float(np.sqrt(sum(float(np.sum(g * g)) for g in grad.values())))
            if first is None:  # the KL to the teacher as the batch has it (teacher_inputs may change what trains)
                first = (objective, float(ratio.mean()), norm)
                kl = distill.mean_kl(logp - distill.teacher_logprobs(batch)[seqs.positions], teacher[1])
            if norm == 0.0:  # every token clipped (or no advantage): nothing moves
                break
            self.policy = self.policy.moved({k: self.config.lr * g for k, g in grad.items()}, step=self.policy.step)
        assert first is not None
        if self.policy.step is not None:
            self.policy.step += 1
        return LearnStats(batch.num_samples, int(seqs.positions.size), first[0], first[1], clipped, first[2], kl)

    def _gradient(self, seqs: Sequences, advantage: np.ndarray, behaviour: np.ndarray, temperature: np.ndarray,
                  weight: np.ndarray, teacher: tuple[np.ndarray, np.ndarray]
                  ) -> tuple[float, np.ndarray, float, dict[str, np.ndarray], np.ndarray]:
        """J(θ) now, each token's ratio r, the share of tokens the clip removes, ∇J, and each token's logprob
        (``teacher``: per scored token, the teacher's logprob and the weight of its term)."""
        targets = seqs.token_ids[seqs.positions]
        rows = np.arange(targets.size)
        z = self.policy.logits_at(seqs) / temperature[:, None]
        z -= z.max(axis=1, keepdims=True)
        probs = np.exp(z)
        probs /= probs.sum(axis=1, keepdims=True)
        logp = np.log(np.maximum(probs[rows, targets], 1e-300))
        reference, opd = teacher
        if opd.any():  # + opd · (r - ℓ + b), ℓ a constant (trainer/distill.py)
            advantage = advantage - opd * (logp - reference - distill.baseline(behaviour, reference, opd))
        ratio = np.exp(np.minimum(logp - behaviour, MAX_LOG_RATIO))
        eps = self.config.clip
        active = np.where(advantage >= 0, ratio <= 1 + eps, ratio >= 1 - eps)  # where min() takes the unclipped term
        objective = float(np.sum(weight * np.minimum(ratio * advantage, np.clip(ratio, 1 - eps, 1 + eps) * advantage)))
        coef = np.where(active, weight * ratio * advantage, 0.0) / temperature  # dJ/dlogits: through r and 1/T
        dlogits = -probs * coef[:, None]  # d log π(y) / d logits = onehot(y) - p
        dlogits[rows, targets] += coef
        return objective, ratio, float(1.0 - active.mean()), self.policy.gradient(seqs, dlogits), logp

    def inputs(self, batch: Batch) -> tuple[Sequences, np.ndarray, np.ndarray, np.ndarray]:
        """What the update reads from a batch: the sequences with their sampled positions, and per sampled
        token its sample's advantage, its behaviour logprob and the temperature its logprob is computed at
        (1 for raw logprobs; its sampling temperature otherwise)."""
        mask = batch.columns["loss_mask"].astype(bool)
        offsets = batch.offsets.astype(np.int64)
        mask[offsets[:-1][offsets[:-1] < mask.size]] = False  # a sample's first token has no context
        positions = np.flatnonzero(mask)
        sample = np.searchsorted(offsets, positions, side="right") - 1
        temps = batch.scalars.get("temperature") or [self.config.temperature] * batch.num_samples
        if batch.logprobs_mode == "raw":  # the shipped logprobs are of the unscaled logits: so are π_θ's
            temps = [1.0] * batch.num_samples
        return (Sequences(batch.columns["token_ids"].astype(np.int64), offsets, positions),
                np.asarray(batch.scalars["advantage"], np.float64)[sample],
                batch.columns["logprobs"][positions].astype(np.float64),
                np.asarray(temps, np.float64)[sample])

    def teacher_inputs(self, batch: Batch, seqs: Sequences) -> tuple[np.ndarray, np.ndarray]:
        """Per scored token: the teacher's logprob of it and the weight of its term (0 without a teacher). A
        subclass may change what is trained on (the learning tests shuffle the teacher's logprobs)."""
        sample = np.searchsorted(seqs.offsets, seqs.positions, side="right") - 1
        return (distill.teacher_logprobs(batch)[seqs.positions].astype(np.float64),
                distill.opd_weights(batch)[sample])

    def save(self, directory: Path) -> Path:
        """Save the current policy into ``directory`` (the checkpoint a weight update names)."""
        return self.policy.save(directory)

    def weights(self) -> dict[str, np.ndarray]:
        """The current policy's parameters by name (what a broadcast sends: a simulated server installs them)."""
        return self.policy.weights

    def resume(self, directory: Path) -> bool:
        """Go on from the policy saved in ``directory`` (False: none there)."""
        policy = Policy.load(directory)
        if policy is None:
            return False
        self.policy = policy
        return True
