"""On-policy distillation on the real stack: a real teacher scores every sample, and a real student learns from it.

The teacher is the real stack's ``teacher`` model (the tiny dense Qwen3 at another seed, sharper: realstack/models.py),
served for the test's duration by the second dense server (reloaded with its weights, and with the dense model's
again after: no extra server start); the student is the dense model on the first. Two claims:

- the ``ref_logprobs`` the trainer gets are the teacher's: a transformers recomputation under the teacher's weights
  (float32) matches every token of every sample to 1e-4, multi-turn samples included, although the teacher's
  server reports processed logprobs and the job samples at temperature 0.7 (prompt logprobs are raw, always);
- distillation works: 12 steps of OPD (the teacher's reverse KL alone, no reward) lower the student's exact KL to the
  teacher (over the whole vocabulary, at the answer of arithmetic prompts the run never saw) by a margin, and the
  same run with the teacher's logprobs shuffled across the batch does not (the control: a pipeline that scored the
  wrong tokens, or mixed up samples, trains like that). Measured by this test on vLLM 0.32.0 (2026-11-28, load
  10-14 from other work), the exact KL at steps 0 / 4 / 8 / 12: 2.467 / 2.393 / 2.286 / 2.184 with the teacher,
  2.467 / 2.464 / 2.486 / 2.534 shuffled; MARGIN (0.12) is under half the drop (0.28).

Wall time at that load: 92 s for the first test, 358 s for the second (two 12-step jobs of 128 samples), after the
session's server start.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer

from orchestrator.contracts.wire import Batch
from orchestrator.envs.arithmetic import problems
from orchestrator.testing.real_job import RealJob, Servers, reload_base, run_real_job
from orchestrator.trainer.reference import ReferenceTrainer
from orchestrator.trainer.torch_learner import TorchLearnConfig, TorchLearner

pytestmark = [pytest.mark.timeout(2400), pytest.mark.usefixtures("verifiers_home")]
PARITY = 1e-4
STEPS = 12
MARGIN = 0.12  # nats of exact KL; see the module docstring for what was measured


@pytest.fixture
async def teacher(servers: Servers) -> AsyncIterator[str]:
    """The second dense server, serving the teacher's weights until the test ends."""
    url = servers.dense[1].url
    await reload_base(url, servers.model("teacher"))
    try:
        yield url
    finally:
        await reload_base(url, servers.model("dense"))


def distilling_job(out: Path, servers: Servers, teacher: str, **kw: Any) -> RealJob:
    return RealJob(out, servers.model("dense"), (servers.dense[0].url,),
                   extra={"teacher": {"servers": [teacher], "model": "tiny", "request_timeout_s": 120.0}}, **kw)


def load(model: Path) -> Any:
    m: Any = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    return m.eval()


async def test_the_trainer_gets_the_teachers_logprob_of_every_token(servers: Servers, teacher: str,
                                                                     tmp_path: Path) -> None:
    await reload_base(servers.dense[0].url, servers.model("dense"))
    seen: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def capture(batch: Batch) -> None:
        for i in range(batch.num_samples):
            s = batch.sample(i)
            seen.append((np.array(s["token_ids"]), np.array(s["loss_mask"]), np.array(s["ref_logprobs"])))

    job = distilling_job(tmp_path, servers, teacher, steps=2, temperature=0.7, max_tokens=3,
                         env_keys={"arith": {"algorithm": "opd"}, "guess": {"algorithm": "reward+opd"}})
    await run_real_job(job, TorchLearner(servers.model("dense"), TorchLearnConfig(lr=1e-3)),
                       trainer=functools.partial(ReferenceTrainer, on_batch=capture))
    model = load(servers.model("teacher"))
    worst, multi_turn = 0.0, 0
    for ids, mask, ref in seen:
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.from_numpy(ids.astype(np.int64))[None]).logits[0], -1)
        expected = np.r_[0.0, lp[:-1].gather(1, torch.from_numpy(ids[1:].astype(np.int64))[:, None])[:, 0].numpy()]
        assert ref[0] == 0.0
        worst = max(worst, float(np.abs(ref - expected).max()))
        multi_turn += int(np.count_nonzero(np.diff(mask.astype(np.int8), prepend=0) == 1)) > 1
    assert len(seen) >= 2 * job.batch_size - 8, len(seen)
    assert worst <= PARITY, worst
    assert multi_turn > 0  # guess-number's turns were scored too


class ShuffledTeacher(TorchLearner):
    """The control: the teacher's logprobs of the sampled tokens permuted across the batch (seeded)."""

    rng = np.random.default_rng(0)

    def teacher(self, batch: Batch) -> np.ndarray:
        ref = super().teacher(batch).copy()
        sampled = batch.columns["loss_mask"] != 0
        ref[sampled] = self.rng.permutation(ref[sampled])
        return ref


def exact_kl(student: Path, teacher: Path) -> float:
    """The mean KL(student || teacher) of the answer's first token, over the whole vocabulary, on 64 arithmetic
    prompts the run did not sample (the taskset's last ones), in the chat template."""
    tok = Tokenizer.from_file(str(teacher / "tokenizer.json"))
    prompts = [tok.encode(f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).ids
               for p, _ in list(problems())[-64:]]
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.int64)
    attention = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, :len(p)], attention[row, :len(p)] = torch.tensor(p), 1
    last = attention.sum(1) - 1
    with torch.no_grad():
        ls, lt = (torch.log_softmax(load(m)(input_ids=ids, attention_mask=attention).logits[torch.arange(len(prompts)),
                                                                                                   last], -1)
                  for m in (student, teacher))
    return float((ls.exp() * (ls - lt)).sum(-1).mean())


async def kl_to_the_teacher(servers: Servers, teacher: str, out: Path, learner_class: type[TorchLearner]
                            ) -> tuple[float, float, list[float]]:
    """The exact KL before and after ``STEPS`` steps of OPD, and what the trainer reported each step."""
    model = servers.model("dense")
    await reload_base(servers.dense[0].url, model)
    job = distilling_job(out, servers, teacher, steps=STEPS, envs=("arith",), batch_size=128, group_size=16,
                         max_tokens=1, env_keys={"arith": {"algorithm": "opd"}})
    result = await run_real_job(job, learner_class(model, TorchLearnConfig(lr=3e-3)), timeout_s=1100)
    reported = [row["learned"]["teacher_kl"] for row in result.journal]
    return (exact_kl(model, servers.model("teacher")), exact_kl(result.checkpoints / f"step_{STEPS}",
                                                               servers.model("teacher")), reported)


async def test_distillation_lowers_the_students_kl_to_the_teacher_and_not_with_its_logprobs_shuffled(
        servers: Servers, teacher: str, tmp_path: Path) -> None:
    before, after, reported = await kl_to_the_teacher(servers, teacher, tmp_path / "opd", TorchLearner)
    assert after < before - MARGIN, (before, after, reported)
    assert all(k is not None for k in reported)
    before, control, shuffled = await kl_to_the_teacher(servers, teacher, tmp_path / "shuffled", ShuffledTeacher)
    assert control > before - MARGIN, (before, control, shuffled)
