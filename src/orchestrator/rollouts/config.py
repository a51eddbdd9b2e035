"""The rollout stage's config sections: ``[scheduler]``, ``[[env]]`` (with its ``sampling``), ``[eval]``.

Each section checks what it can alone (``problems``, called by the loader); ``rollout_problems`` checks how the
three fit together (a group within the in-flight bound, distinct environment names).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.configbase import Source, address_problems, opt
from orchestrator.rollouts.curriculum import CurriculumConfig


@dataclass(frozen=True)
class ConcurrencyConfig:
    adaptive: bool = opt(False, doc="follow each inference server's KV cache (its /metrics) with a cap per server; "
                         "false: scheduler.max_inflight alone, as before")
    poll_s: float = opt(2.0, gt=0, le=600, doc="how often each server's /metrics is read")
    start_per_server: int | None = opt(None, ge=1, doc="each server's first cap (unset: its KV capacity, from "
                                       "its /metrics, over rollout_tokens; a server that does not say its "
                                       "capacity starts at max_inflight split evenly over the servers)")
    rollout_tokens: int | None = opt(None, ge=1, doc="the KV tokens one rollout holds at its longest (prompt and "
                                     "every turn), for the first cap (unset: the longest rollout of the first "
                                     "groups to finish on the server; one group runs there until then)")
    min_per_server: int = opt(1, ge=1, doc="no cut goes below this many rollouts per server")
    grow_below: float = opt(0.6, gt=0, le=1, doc="KV usage under which a binding cap grows at the full "
                            "grow_factor (above it, less and less, to none at trim_above); also the usage a "
                            "capacity queue needs to count")
    grow_factor: float = opt(1.25, gt=1, le=4, doc="growth per turnover (as many completions as in flight), "
                             "a share of it per completion, at most a group a poll")
    trim_above: float = opt(0.8, gt=0, le=1, doc="KV usage over which the cap does not grow (it is not lowered: "
                            "such a reading is often one wave of rollouts at its peak)")
    trim_to: float = opt(0.7, gt=0, le=1, doc="the usage a hard trim aims at: cap = in flight x trim_to / usage")
    cancel_above: float = opt(0.9, gt=0, le=1, doc="KV usage over which the rollouts above the trimmed cap are "
                              "cancelled (whole groups not yet half done, youngest first)")
    cancel_only_preempting: bool = opt(True, doc="cancel past cancel_above only while the server preempts (its "
                                        "counter rose since the last poll); a full cache that does not preempt "
                                        "only stops growth, nothing thrown away. false: cancel past cancel_above "
                                        "always, preempting or not (prime-rl's rule)")
    cancel_polls: int = opt(4, ge=1, doc="polls in a row past cancel_above that preempt before rollouts are "
                            "cancelled (one group's peak preempts once; a cache that thrashes goes on)")
    preemption_budget: float = opt(0.0075, ge=0, le=1, doc="preemptions per finished request the cap may cost: "
                                   "a preemption within it only stops growth at the in-flight count it happened "
                                   "under; past it, the cap is cut and stays a step below that count until "
                                   "the budget is repaid (0: every preemption cuts). Counted with the server's "
                                   "vllm:request_success counter; a server without it: every preemption cuts")
    budget_window: int = opt(600, ge=1, doc="the budget's reserve, in finished requests: preemption_budget x this "
                             "preemptions may come at once without a cut, and at most as many are owed")
    cut_factor: float = opt(0.9, gt=0, le=0.95, doc="on preemptions or a persistent queue: cap = in flight x this")
    probe_after: int = opt(3, ge=0, doc="turnovers without a preemption, within the budget, after which growth "
                           "may go a group past the in-flight count preemptions were last seen under (a probe; "
                           "one that preempts doubles the wait, up to 8x). 0: at once")
    queue_polls: int = opt(2, ge=1, doc="polls in a row with a capacity queue (see queue_ratio) that make a "
                           "persistent queue")
    queue_ratio: float = opt(0.5, ge=0, doc="a poll has a capacity queue when its KV usage is at least grow_below "
                             "and more requests wait for capacity than this x those running (0: any waiting "
                             "request; one that arrived between two engine iterations waits too, at any load)")

    def problems(self, key: str, source: Source) -> Iterable[str]:
        """What is wrong across fields (each field's own bounds are checked by the loader)."""
        if not self.grow_below < self.trim_above:
            yield (f"{source(f'{key}.grow_below')}: {key}.grow_below: must be below {key}.trim_above "
                   f"({self.grow_below} >= {self.trim_above})")
        if not self.trim_to < self.trim_above <= self.cancel_above:
            yield (f"{source(f'{key}.trim_to')}: {key}.trim_to: must be below {key}.trim_above, and that at most "
                   f"{key}.cancel_above (got {self.trim_to}, {self.trim_above}, {self.cancel_above})")


@dataclass(frozen=True)
class SchedulerConfig:
    batch_size: int | None = opt(None, ge=1, doc="rollouts per step (set this or token_budget)")
    token_budget: int | None = opt(None, ge=1, doc="tokens per step (set this or batch_size)")
    max_inflight: int = opt(64, ge=1, doc="rollouts running at once")
    max_async_level: int = opt(1, ge=0, doc="a batch for step s takes rollouts sampled at step >= s - this")
    max_off_policy_steps: int = opt(4, ge=0, doc="in-flight rollouts this many steps old are cancelled")
    group_timeout_s: float = opt(600.0, gt=0, doc="a group still running after this long is failed")
    worker_address: str | None = opt(None, doc="ZMQ address env workers connect to; unset: ipc:// in output_dir")
    remote_workers: int = opt(0, ge=0, doc="env workers on other hosts (orchestrator env-worker --connect "
                              "worker_address) that must be ready before the first group")
    max_buffered_rollouts: int = opt(1024, ge=1, doc="finished rollouts not in a step yet; full: no new work")
    worker_nice: int = opt(5, ge=0, le=19, doc="niceness added to local env workers, so the loop gets a busy CPU first")
    worker_silence_s: float = opt(10.0, ge=2, doc="an env worker that sends nothing (not even its heartbeat, every "
                                  "second) this long is lost: its rollouts fail; a local one is killed and restarted, "
                                  "a remote one re-admitted when it speaks again. A local one whose process is at "
                                  "work (running, reading the disk) is given 6 times this")
    # 50 (groups of 4, steps of 8): with a quarter of groups passing the gates a step stops by chance with
    # probability ~1e-11; with 2% passing, 40% of steps stop, after 50 steps' worth of inference
    max_rejected_batches: int = opt(50, ge=0, doc="a step that has seen this many batches' worth of rollouts "
                                    "rejected by gates without filling stops the run (0: never)")
    concurrency: ConcurrencyConfig = opt(ConcurrencyConfig(), doc="[scheduler.concurrency]: a cap per inference "
                                         "server that follows its KV cache (off by default)")

    def problems(self, key: str, source: Source) -> Iterable[str]:
        if (self.batch_size is None) == (self.token_budget is None):
            yield (f"{source(f'{key}.batch_size')}: {key}.batch_size / {key}.token_budget: "
                   "set exactly one of them (a step is batch_size rollouts or token_budget tokens)")
        if self.max_off_policy_steps < self.max_async_level:
            yield (f"{source(f'{key}.max_off_policy_steps')}: {key}.max_off_policy_steps: must be >= "
                   f"{key}.max_async_level ({self.max_off_policy_steps} < {self.max_async_level}), or rollouts "
                   "still usable would be cancelled")
        c, ckey = self.concurrency, f"{key}.concurrency"
        for name, value in (("min_per_server", c.min_per_server), ("start_per_server", c.start_per_server)):
            if value is not None and value > self.max_inflight:
                yield (f"{source(f'{ckey}.{name}')}: {ckey}.{name}: must be <= {key}.max_inflight ({value} > "
                       f"{self.max_inflight}): no server's cap goes above it")
        if self.batch_size is not None and self.max_buffered_rollouts < self.batch_size:
            yield (f"{source(f'{key}.max_buffered_rollouts')}: {key}.max_buffered_rollouts: must be >= "
                   f"{key}.batch_size ({self.max_buffered_rollouts} < {self.batch_size}), or no step can fill")
        yield from address_problems(f"{key}.worker_address", self.worker_address, source)


# set by the orchestrator (cache_salt: the policy version) or by verifiers' client, never by the user
OWNED_SAMPLING_KEYS = {"cache_salt", "logprobs", "stop_token_ids", "routed_experts_prompt_start"}


@dataclass(frozen=True)
class SamplingConfig:
    """Sent to the server as written; an unset key is not sent, so the server's default applies."""

    max_tokens: int = opt(256, ge=1, doc="tokens sampled per turn")
    temperature: float = opt(1.0, ge=0, doc="sampling temperature (also sent to the trainer with each sample)")
    top_p: float | None = opt(None, gt=0, le=1, doc="nucleus sampling")
    top_k: int | None = opt(None, ge=-1, doc="sample from the k most likely tokens (-1: all)")
    min_p: float | None = opt(None, ge=0, le=1, doc="minimum probability relative to the most likely token")
    repetition_penalty: float | None = opt(None, gt=0, doc="vLLM's repetition penalty (1: none)")
    presence_penalty: float | None = opt(None, ge=-2, le=2, doc="OpenAI-style presence penalty")
    frequency_penalty: float | None = opt(None, ge=-2, le=2, doc="OpenAI-style frequency penalty")
    stop: tuple[str, ...] | None = opt(None, doc="strings that end a turn")
    seed: int | None = opt(None, doc="per-request seed (with group_size > 1 every rollout of a group would be "
                           "the same: only for group_size = 1)")
    extra_body: dict[str, Any] = opt({}, doc="more sampling parameters for the server, passed through as they are")

    def params(self) -> dict[str, Any]:
        """What is sent: every key that is set, and ``extra_body``'s keys."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if v is not None and k != "extra_body"}
        if self.stop is not None:
            out["stop"] = list(self.stop)
        return {**out, **self.extra_body}


@dataclass(frozen=True, kw_only=True)
class EnvConfig:
    name: str | None = opt(None, doc="name in logs and metrics; unset means the taskset id")
    taskset: str = opt(doc="verifiers taskset id: an installed package exporting a Taskset (orchestrator-arithmetic "
                       "is module orchestrator_arithmetic) or one of verifiers' own (textarena)")
    args: dict[str, Any] = opt({}, doc="arguments of the taskset")
    group_size: int = opt(8, ge=1, doc="rollouts per task (one group)")
    weight: float = opt(1.0, gt=0, doc="mixing weight among environments")
    workers: int = opt(1, ge=0, doc="env worker processes; 0 runs in-process (debugging only)")
    max_concurrent: int | None = opt(None, ge=1, doc="rollouts of this env running at once")
    group_scoring: bool = opt(False, doc="the env scores whole groups: any failure drops the group")
    max_token_lag: int | None = opt(None, ge=0, doc="trained tokens sampled by weights more than this many steps "
                                    "behind the step they train in are masked out of the loss (the versions column; "
                                    "a token whose version is only bounded counts at its lower bound); a sample "
                                    "left with nothing to train is dropped; unset: no limit")
    sampling: SamplingConfig = opt(SamplingConfig(), doc="sampling parameters")
    curriculum: CurriculumConfig | None = opt(None, doc="[env.curriculum]: draw tasks from pools by their recent "
                                              "pass rate; unset: every task in turn, in a seeded order")
    verifiers: dict[str, Any] = opt({}, doc="verifiers' [env] table without taskset, passed through: each seat "
                                    "(agent, player...) with harness, runtime (unset: subprocess), max_turns, token "
                                    "limits, timeout, retries; the env's timeout, retries... (checked by verifiers "
                                    "in `orchestrator check` and the env workers)")
    select: dict[str, Any] = opt({}, doc="which tasks, as verifiers' SelectConfig: limit, skip, include, exclude... "
                                 "(an endless taskset needs limit)")

    @property
    def label(self) -> str:
        return self.name or self.taskset


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Online evaluation: every ``interval`` steps, the first ``num_examples`` tasks of each ``[[eval.env]]``,
    ``group_size`` rollouts each, under one policy version, beside training."""

    interval: int = opt(10, ge=1, doc="evaluate at steps 0 (see at_start), interval, 2*interval...")
    num_examples: int = opt(32, ge=1, doc="tasks per environment: the first ones of its taskset, every time")
    group_size: int = opt(4, ge=1, doc="rollouts per task (k): pass@k and pass^k for k = 1, 2, 4... up to it")
    at_start: bool = opt(True, doc="evaluate the starting policy at step 0 too")
    pass_threshold: float = opt(0.5, doc="a rollout passes when its reward is above this")
    max_inflight: int | None = opt(None, ge=1, doc="evaluation rollouts at once, within scheduler.max_inflight "
                                   "(default: half of it), so evaluation never starves training")
    hold_weights: bool = opt(True, doc="a round keeps the policy it started with: a weight sync waits for it "
                             "(training goes on meanwhile); false: record the versions that sampled it")
    env: tuple[EnvConfig, ...] = opt(doc="[[eval.env]] tables, as [[env]] (group_size, weight, curriculum unused)")

    def problems(self, key: str, source: Source) -> Iterable[str]:
        if not self.env:
            yield f"{source(f'{key}.env')}: {key}.env: [eval] needs at least one [[eval.env]] table"
        labels = [e.label for e in self.env]
        for i, label in enumerate(labels):
            if label in labels[:i]:
                yield (f"{source(f'{key}.env[{i}].name')}: {key}.env[{i}].name: {label!r} is already used by "
                       "another [[eval.env]]; give each a distinct name")


def rollout_problems(scheduler: SchedulerConfig, envs: Sequence[EnvConfig], ev: EvalConfig | None,
                     source: Source) -> Iterable[str]:
    """What the training environments and evaluation ask of the scheduler, and what each environment's
    sampling may not say (eval environments are not checked here: their group_size is unused)."""
    if not envs:
        yield f"{source('env')}: env: at least one [[env]] table is required"
    labels: dict[str, int] = {}
    for i, env in enumerate(envs):
        if env.group_size > scheduler.max_inflight:
            yield (f"{source(f'env[{i}].group_size')}: env[{i}].group_size: {env.group_size} is larger than "
                   f"scheduler.max_inflight ({scheduler.max_inflight}); a group must fit in flight at once")
        if env.max_concurrent is not None and env.group_size > env.max_concurrent:
            yield (f"{source(f'env[{i}].max_concurrent')}: env[{i}].max_concurrent: must be >= "
                   f"group_size ({env.max_concurrent} < {env.group_size})")
        if env.label in labels:
            yield (f"{source(f'env[{i}].name')}: env[{i}].name: {env.label!r} is already used by "
                   f"env[{labels[env.label]}]; give each environment a distinct name")
        labels.setdefault(env.label, i)
        if env.max_token_lag is not None and env.max_token_lag >= scheduler.max_async_level:
            yield (f"{source(f'env[{i}].max_token_lag')}: env[{i}].max_token_lag: {env.max_token_lag} can never "
                   f"mask a token: a rollout is at most scheduler.max_async_level ({scheduler.max_async_level}) "
                   "steps behind its step, and its tokens are no older than it; set it below that, or leave it unset")
    for i, env in enumerate(envs):
        yield from _sampling_problems(env, f"env[{i}]", source)
    if ev is not None:
        yield from _eval_fit_problems(ev, scheduler, source)


def _sampling_problems(env: EnvConfig, key: str, source: Source) -> Iterable[str]:
    sp = env.sampling
    if sp.seed is not None and env.group_size > 1:
        yield (f"{source(f'{key}.sampling.seed')}: {key}.sampling.seed: with group_size = "
               f"{env.group_size} every rollout of a group would sample the same tokens (no advantage to "
               "learn from); leave it unset")
    for name in sorted(set(sp.extra_body) & OWNED_SAMPLING_KEYS):
        yield (f"{source(f'{key}.sampling.extra_body.{name}')}: {key}.sampling.extra_body.{name}: set by "
               "the orchestrator (cache_salt: the policy version) or by verifiers' client; remove it")
    for name in sorted(set(sp.extra_body) & {f.name for f in dataclasses.fields(SamplingConfig)}):
        yield (f"{source(f'{key}.sampling.extra_body.{name}')}: {key}.sampling.extra_body.{name}: "
               f"use {key}.sampling.{name}")


def _eval_fit_problems(ev: EvalConfig, scheduler: SchedulerConfig, source: Source) -> Iterable[str]:
    """Evaluation shares the scheduler's in-flight slots and must leave training some."""
    cap = ev.max_inflight or max(scheduler.max_inflight // 2, 1)  # as evaluation.py takes it
    if ev.group_size > cap:
        yield (f"{source('eval.group_size')}: eval.group_size: {ev.group_size} rollouts of a task must fit in "
               f"eval.max_inflight ({cap}{'' if ev.max_inflight else ': half of scheduler.max_inflight'})")
    if ev.max_inflight is not None and ev.max_inflight >= scheduler.max_inflight:
        yield (f"{source('eval.max_inflight')}: eval.max_inflight: must be below scheduler.max_inflight "
               f"({ev.max_inflight} >= {scheduler.max_inflight}), or evaluation could take every slot from training")


def smallest_group(envs: Sequence[EnvConfig], evaluation: EvalConfig | None) -> int:
    """The smallest group any of these environments opens: what "room for another group" is measured in."""
    return min([e.group_size for e in envs] + ([evaluation.group_size] if evaluation is not None else []), default=1)
