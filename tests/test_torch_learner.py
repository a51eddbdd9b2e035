"""The PyTorch learner on a micro Qwen3 built here: its mismatch report, its modes, its update and its checkpoints.

Batches are sampled from the model itself with torch, so their logprobs are exactly what the learner must
recompute (a real server's are checked in tests/real). Needs the [torch] extra, which scripts/test.sh installs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from orchestrator.contracts.wire import Batch, LogprobsMode
from orchestrator.trainer.torch_learner import TorchLearnConfig, TorchLearner

VOCAB = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=128, tie_word_embeddings=False)
    directory = tmp_path_factory.mktemp("model")
    transformers.Qwen3ForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


def sampled_batch(model_dir: Path, *, temperature: float, mode: LogprobsMode, n: int = 6, prompt: int = 5, new: int = 4,
                  advantages: list[float] | None = None, seed: int = 0) -> Batch:
    """``n`` samples: a random prompt, then ``new`` tokens sampled at ``temperature``, each with its logprob in
    ``mode`` (raw: of the unscaled logits; processed: of the tempered ones), as a server would ship them."""
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # untyped
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    ids, masks, lps = [], [], []
    for _ in range(n):
        seq = torch.randint(0, VOCAB, (prompt,), generator=gen)
        shipped = []
        for _ in range(new):
            with torch.no_grad():
                z = model(input_ids=seq[None]).logits[0, -1]
            token = torch.multinomial(torch.softmax(z / temperature, -1), 1, generator=gen)
            shipped.append(float(torch.log_softmax(z / temperature if mode == "processed" else z, -1)[token]))
            seq = torch.cat([seq, token])
        ids.append(seq.numpy().astype(np.int32))
        masks.append(np.r_[np.zeros(prompt), np.ones(new)].astype(np.uint8))
        lps.append(np.r_[np.zeros(prompt), shipped].astype(np.float32))
    adv = advantages if advantages is not None else [1.0 if i % 2 else -1.0 for i in range(n)]
    batch = Batch.from_columns("t", 0, {"token_ids": ids, "loss_mask": masks, "logprobs": lps}, [len(x) for x in ids],
                               {"advantage": adv, "temperature": [temperature] * n})
    batch.logprobs_mode = mode  # what the orchestrator stamps on every batch
    return batch


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_the_first_pass_recomputes_what_was_shipped_in_the_batchs_mode(model_dir: Path, mode: LogprobsMode) -> None:
    batch = sampled_batch(model_dir, temperature=0.7, mode=mode)
    stats = TorchLearner(model_dir, TorchLearnConfig(lr=1e-3)).update(batch)
    assert (stats.mode, stats.samples, stats.tokens) == (mode, 6, 24)
    assert stats.mismatch_max < 1e-5, stats
    assert abs(stats.ratio_mean - 1) < 1e-5, stats


def test_the_wrong_mode_or_a_shifted_mask_shows_in_the_report(model_dir: Path) -> None:
    processed = sampled_batch(model_dir, temperature=0.7, mode="processed")
    processed.logprobs_mode = "raw"  # a trainer told the wrong mode
    assert TorchLearner(model_dir).update(processed).mismatch_mean > 1e-2
    shifted = sampled_batch(model_dir, temperature=1.0, mode="raw")
    for name in ("loss_mask", "logprobs"):  # each shipped logprob read against the token after its own
        col = shifted.columns[name]
        col[1:] = col[:-1].copy()
    assert TorchLearner(model_dir).update(shifted).mismatch_mean > 1e-2  # 1e-7 when aligned


def test_samples_of_older_policies_are_counted_and_left_out_of_the_mismatch(
        model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An async job's batch of step s holds rollouts of policy s - 1 too: they differ from the learner's weights
    by what the last update changed, which is no fault (the demo warned of a 0.24 mismatch every step for it)."""
    batch = sampled_batch(model_dir, temperature=1.0, mode="raw")
    batch.step = 3
    lps, offsets = batch.columns["logprobs"], batch.offsets
    batch.scalars["policy"] = [3, 2, 3, 2, 3, 2]
    for i in (1, 3, 5):  # as sampled by other weights
        lps[offsets[i]:offsets[i + 1]] -= 0.5 * batch.columns["loss_mask"][offsets[i]:offsets[i + 1]]
    stats = TorchLearner(model_dir).update(batch)
    assert stats.stale == 3, stats
    assert stats.mismatch_max < 1e-5, stats
    assert stats.ratio_max > 1.5  # the ratio still covers every sample: exp(0.5) for the older ones
    batch.scalars["policy"] = [2] * 6
    with caplog.at_level("WARNING"):
        stats = TorchLearner(model_dir).update(batch)
    assert stats.stale == 6, stats
    assert np.isnan(stats.mismatch_max), stats
    assert "mismatch n/a" in str(stats)
    assert "differ from the trainer's recomputation" not in caplog.text
    batch.scalars["policy"] = [3] * 6  # on-policy but shipped wrong: the report and the warning
    with caplog.at_level("WARNING"):
        stats = TorchLearner(model_dir).update(batch)
    assert stats.stale == 0, stats
    assert stats.mismatch_mean > 0.1, stats
    assert "differ from the trainer's recomputation" in caplog.text


def test_an_update_moves_the_policy_toward_positive_advantages(model_dir: Path) -> None:
    batch = sampled_batch(model_dir, temperature=1.0, mode="raw", n=8, advantages=[1.0] * 4 + [-1.0] * 4)
    learner = TorchLearner(model_dir, TorchLearnConfig(lr=1e-2, passes=3))
    first = learner.update(batch)
    again = learner.update(batch)  # the same data: the shipped logprobs are now one update old
    assert first.grad_norm > 0
    assert again.objective > first.objective
    assert again.ratio_mean != pytest.approx(1.0, abs=1e-4)


def test_save_and_resume_round_trip_the_weights(model_dir: Path, tmp_path: Path) -> None:
    learner = TorchLearner(model_dir, TorchLearnConfig(lr=1e-2))
    learner.update(sampled_batch(model_dir, temperature=1.0, mode="raw"))
    learner.save(tmp_path / "step_1")
    assert list((tmp_path / "step_1").glob("*.safetensors"))
    fresh = TorchLearner(model_dir)
    assert not fresh.resume(tmp_path / "nothing")
    assert fresh.resume(tmp_path / "step_1")
    for a, b in zip(learner.model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert TorchLearnConfig().lr == 1e-6  # a real model's default, not the tests' tiny one's
    with pytest.raises(ValueError, match="lr > 0"):
        TorchLearnConfig(lr=0)


def with_teacher(batch: Batch, shift: list[float]) -> Batch:
    """``batch`` distilled from a teacher whose logprob of each sampled token of sample i is the shipped one plus
    ``shift[i]`` (it likes the token more than the policy does where ``shift`` > 0); no reward advantage."""
    mask = batch.columns["loss_mask"] != 0
    per_token = np.repeat(np.asarray(shift, np.float32), np.diff(batch.offsets))
    batch.columns["ref_logprobs"] = np.where(mask, batch.columns["logprobs"] + per_token, -3.0).astype(np.float32)
    batch.scalars.update(opd_weight=[1.0] * batch.num_samples, reward_weight=[0.0] * batch.num_samples,
                         advantage=[0.0] * batch.num_samples)
    return batch


def sampled_logprob(model: Any, batch: Batch, i: int) -> float:
    """Sample ``i``'s last token's logprob under ``model`` given the tokens before it."""
    ids = torch.from_numpy(batch.sample(i)["token_ids"].astype(np.int64))
    with torch.no_grad():
        return float(torch.log_softmax(model(input_ids=ids[None]).logits[0, -2], -1)[ids[-1]])


def test_the_kl_to_the_teacher_is_reported_and_the_teachers_term_moves_the_policy_its_way(model_dir: Path) -> None:
    batch = with_teacher(sampled_batch(model_dir, temperature=1.0, mode="raw", n=2, new=1), [2.0, -2.0])
    learner = TorchLearner(model_dir, TorchLearnConfig(lr=1e-2))
    before = [sampled_logprob(learner.model, batch, i) for i in range(2)]
    stats = learner.update(batch)
    assert stats.teacher_kl == pytest.approx(0.0, abs=1e-5)  # mean of -2 and +2: on-policy, shipped = recomputed
    assert "KL to the teacher" in str(stats)
    assert sampled_logprob(learner.model, batch, 0) > before[0]  # the teacher likes it more: up
    assert sampled_logprob(learner.model, batch, 1) < before[1]
    batch.scalars["opd_weight"] = [0.0, 0.0]  # not distilled: no advantage, no teacher's term, no report
    stats = TorchLearner(model_dir, TorchLearnConfig(lr=1e-2)).update(batch)
    assert (stats.teacher_kl, stats.grad_norm) == (None, 0.0)


def test_a_batch_without_the_teachers_column_reports_no_kl(model_dir: Path) -> None:
    stats = TorchLearner(model_dir).update(sampled_batch(model_dir, temperature=1.0, mode="raw"))
    assert stats.teacher_kl is None
    assert "teacher" not in str(stats)
