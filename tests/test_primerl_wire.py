"""prime-rl's packing and MicroBatch bytes, checked against prime-rl's own output and its decoder's strictness.

GOLDEN is what prime-rl's ``prepare_batch`` (``src/prime_rl/trainer/batch.py`` at 559b447, token-count bin cost)
followed by ``msgspec.msgpack.Encoder().encode`` produced for the batch ``golden_batch()`` builds, run once in a
scratch environment with prime-rl's own source: our packer and encoder must give the same bytes.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest

from orchestrator.errors import WireError
from orchestrator.testing.primerl import DECODER, MicroBatch, check_step
from orchestrator.transport import MICRO_BATCH_FIELDS, Batch, balanced_partition, encode_step, pack_ranks

GOLDEN = [
    "91dc00109801ccc8ce00011170030506010198c2c3c3c3c2c3c2c298cb0000000000000000cb3fe0000000000000cb3fe00000000000"
    "00cb3fe0000000000000cb0000000000000000cbbff0000000000000cb0000000000000000cb000000000000000098cb000000000000"
    "0000cbbfe0000000000000cbbff4000000000000cbbfc0000000000000cb0000000000000000cbc000000000000000cb000000000000"
    "0000cb000000000000000098000102030001000192040498cb3fe6666666666666cb3fe6666666666666cb3fe6666666666666cb3fe6"
    "666666666666cb3ff0000000000000cb3ff0000000000000cb3ff0000000000000cb3ff000000000000098a567736d386ba567736d38"
    "6ba567736d386ba567736d386ba46d617468a46d617468a0a0920404c093c41000010203040506070a0b0c0d0000000093080201a575"
    "696e7438c0c0c0c0c0",
    "91dc0010980708090a0b0c0d0e98c2c2c3c3c3c3c3c398cb0000000000000000cb0000000000000000cb3fd0000000000000cb3fd000"
    "0000000000cb3fd0000000000000cb3fd0000000000000cb3fd0000000000000cb3fd000000000000098cb0000000000000000cb0000"
    "000000000000cbbfd0000000000000cbbfd0000000000000cbbfd0000000000000cbbfd0000000000000cbbfd0000000000000cbbfd0"
    "000000000000980001020304050607910898cb3fe6666666666666cb3fe6666666666666cb3fe6666666666666cb3fe6666666666666"
    "cb3fe6666666666666cb3fe6666666666666cb3fe6666666666666cb3fe666666666666698a567736d386ba567736d386ba567736d38"
    "6ba567736d386ba567736d386ba567736d386ba567736d386ba567736d386b9108c093c4101415161718191a1b1c1d1e1f2021222393"
    "080201a575696e7438c0c0c0c0c0",
]
# On-policy distillation: the same batch with a teacher's column, sample 0 of algorithm opd (weight 1), sample 1 of
# reward (no teacher: zeros, weight 0), sample 2 of reward+opd (weight 0.5); prime-rl's prepare_batch (559b447) of
# the TrainingSamples its orchestrator would make of them: stamp_loss_routing(ref_kl) for sample 0 (rl_weights 0,
# ref_kl_weights 1 on the mask, no advantages), ref_logprobs and ref_kl_weights 0.5 on the mask for sample 2.
GOLDEN_OPD = [
    "91dc00109801ccc8ce00011170030506010198c2c3c3c3c2c3c2c298cb0000000000000000cb0000000000000000cb0000000000000000"
    "cb0000000000000000cb0000000000000000cbbff0000000000000cb0000000000000000cb000000000000000098cb0000000000000000"
    "cbbfe0000000000000cbbff4000000000000cbbfc0000000000000cb0000000000000000cbc000000000000000cb0000000000000000cb"
    "000000000000000098000102030001000192040498cb3fe6666666666666cb3fe6666666666666cb3fe6666666666666cb3fe666666666"
    "6666cb3ff0000000000000cb3ff0000000000000cb3ff0000000000000cb3ff000000000000098a567736d386ba567736d386ba567736d"
    "386ba567736d386ba46d617468a46d617468a0a092040498cb0000000000000000cbbff8000000000000cbbfe8000000000000cbc00800"
    "0000000000cb0000000000000000cb0000000000000000cb0000000000000000cb000000000000000093c41000010203040506070a0b0c"
    "0d0000000093080201a575696e7438c0c098cb0000000000000000cb0000000000000000cb0000000000000000cb0000000000000000cb"
    "3ff0000000000000cb3ff0000000000000cb0000000000000000cb0000000000000000c098cb0000000000000000cb3ff0000000000000"
    "cb3ff0000000000000cb3ff0000000000000cb0000000000000000cb0000000000000000cb0000000000000000cb0000000000000000",
    "91dc0010980708090a0b0c0d0e98c2c2c3c3c3c3c3c398cb0000000000000000cb0000000000000000cb3fd0000000000000cb3fd00000"
    "00000000cb3fd0000000000000cb3fd0000000000000cb3fd0000000000000cb3fd000000000000098cb0000000000000000cb00000000"
    "00000000cbbfd0000000000000cbbfd0000000000000cbbfd0000000000000cbbfd0000000000000cbbfd0000000000000cbbfd0000000"
    "000000980001020304050607910898cb3fe6666666666666cb3fe6666666666666cb3fe6666666666666cb3fe6666666666666cb3fe666"
    "6666666666cb3fe6666666666666cb3fe6666666666666cb3fe666666666666698a567736d386ba567736d386ba567736d386ba567736d"
    "386ba567736d386ba567736d386ba567736d386ba567736d386b910898cb0000000000000000cbbfe0000000000000cbbff00000000000"
    "00cbc000000000000000cbbfd0000000000000cbc010000000000000cbbff2000000000000cbbfb000000000000093c410141516171819"
    "1a1b1c1d1e1f2021222393080201a575696e7438c0c0c0c098cb0000000000000000cb0000000000000000cb3fe0000000000000cb3fe0"
    "000000000000cb3fe0000000000000cb3fe0000000000000cb3fe0000000000000cb3fe0000000000000",
]
TEMPERATURES = {"gsm8k": 0.7, "math": 1.0}
REFS = [[0.0, -1.5, -0.75, -3.0], [0.0, 0.0], [0.0, -0.5, -1.0, -2.0, -0.25, -4.0, -1.125, -0.0625, -2.5, -0.375]]


def golden_batch() -> Batch:
    ids = [[1, 200, 70000, 3], [5, 6], list(range(7, 17))]
    masks = [[0, 1, 1, 1], [0, 1], [0, 0] + [1] * 8]
    logprobs = [[0.0, -0.5, -1.25, -0.125], [0.0, -2.0], [0.0, 0.0] + [-0.25] * 8]
    chunks: dict[str, list[np.ndarray]] = {
        "token_ids": [np.array(x, np.int32) for x in ids],
        "loss_mask": [np.array(x, np.uint8) for x in masks],
        "logprobs": [np.array(x, np.float32) for x in logprobs],
        "routed_experts": [(np.arange(len(x) * 2, dtype=np.uint8) + 10 * i).reshape(len(x), 2, 1)
                           for i, x in enumerate(ids)],
    }
    scalars: dict[str, list[Any]] = {"advantage": [0.5, -1.0, 0.25], "env": ["gsm8k", "math", "gsm8k"],
                                     "reward": [1.0, 0.0, 1.0]}
    return Batch.from_columns("run", 0, chunks, [len(x) for x in ids], scalars)


def opd_batch() -> Batch:
    """``golden_batch`` with the teacher's column and the distillation scalars (see GOLDEN_OPD)."""
    b = golden_batch()
    columns = {**b.columns, "ref_logprobs": np.concatenate([np.array(r, np.float32) for r in REFS])}
    scalars = {**b.scalars, "advantage": [0.0, -1.0, 0.25], "opd_weight": [1.0, 0.0, 0.5],
               "reward_weight": [0.0, 1.0, 1.0]}
    return Batch(b.run, b.step, columns, b.offsets, scalars)


def lengths_batch(lengths: list[int], routed_dtype: str | None = None) -> Batch:
    rng = np.random.default_rng(len(lengths))
    chunks: dict[str, list[np.ndarray]] = {
        "token_ids": [rng.integers(2, 150_000, n, dtype=np.int32) for n in lengths],
        "loss_mask": [np.ones(n, np.uint8) for n in lengths],
        "logprobs": [rng.normal(size=n).astype(np.float32) for n in lengths],
    }
    if routed_dtype is not None:
        high = 512 if routed_dtype == "uint16" else 64
        chunks["routed_experts"] = [rng.integers(0, high, (n, 3, 2)).astype(routed_dtype) for n in lengths]
    scalars: dict[str, list[Any]] = {"advantage": [float(i) + 0.5 for i in range(len(lengths))],
                                     "env": ["e"] * len(lengths)}
    return Batch.from_columns("run", 0, chunks, lengths, scalars)


def test_bytes_equal_what_prime_rl_packs_and_msgspec_encodes() -> None:
    step = encode_step(golden_batch(), seq_len=8, ranks=2, pad_to_multiple_of=4, temperature=TEMPERATURES)
    assert [bytes(m).hex() for m in step.messages] == GOLDEN
    assert (step.micro_batches, step.pad_tokens, step.dummies, step.truncated) == (1, 2, 0, 1)


def test_the_teachers_column_goes_where_prime_rls_trainer_reads_it() -> None:
    step = encode_step(opd_batch(), seq_len=8, ranks=2, pad_to_multiple_of=4, temperature=TEMPERATURES)
    assert [bytes(m).hex() for m in step.messages] == GOLDEN_OPD
    grid = [DECODER.decode(m) for m in step.messages]
    by_first = {s.input_ids[0]: s for s in check_step(grid, seq_len=8, pad_to_multiple_of=4, routed_dtype="uint8")}
    opd, reward, both = by_first[1], by_first[5], by_first[7]
    assert (opd.ref_logprobs, opd.ref_kl_weights, opd.rl_weights) == (REFS[0], [0.0, 1.0, 1.0, 1.0], [0.0] * 4)
    assert opd.advantage == 0.0
    assert reward.ref_logprobs == [0.0, 0.0]  # in the same micro-batch as a distilled sample: prime-rl's fill
    assert (reward.ref_kl_weights, reward.rl_weights) == ([0.0, 0.0], [1.0, 1.0])
    assert both.ref_logprobs == REFS[2][:8]  # cut to seq_len with its sample
    assert both.ref_kl_weights == [0.0, 0.0] + [0.5] * 6
    assert both.rl_weights is None  # reward+opd keeps the rl component (weight 1)


def test_a_batch_without_a_distilled_sample_sends_no_teacher_fields() -> None:
    b = opd_batch()
    b.scalars["opd_weight"] = [0.0, 0.0, 0.0]  # a job with a teacher whose step holds only reward envs' samples
    step = encode_step(b, seq_len=8, ranks=2, pad_to_multiple_of=4, temperature=TEMPERATURES)
    for mb in (mb for m in step.messages for mb in DECODER.decode(m)):
        assert (mb.ref_logprobs, mb.ref_kl_weights, mb.rl_weights) == (None, None, None)


def test_the_trainers_decoder_reads_it_and_msgspec_writes_the_same_bytes() -> None:
    step = encode_step(lengths_batch([300, 5, 70, 1, 16], "uint8"), seq_len=128, ranks=3, pad_to_multiple_of=2)
    for message in step.messages:
        mbs = DECODER.decode(message)
        assert msgspec.msgpack.encode(mbs) == bytes(message)
        for mb in mbs:
            assert len(msgspec.msgpack.decode(msgspec.msgpack.encode(mb))) == len(MICRO_BATCH_FIELDS)
    assert list(MicroBatch.__struct_fields__) == list(MICRO_BATCH_FIELDS)


def test_the_worked_example_of_prime_rl_packing() -> None:
    """Lengths 3, 5, 2, 10, 4 with seq_len 8, 2 ranks, pad to 4 (prime-rl's own result, token-count cost)."""
    plan = pack_ranks(lengths_batch([3, 5, 2, 10, 4]), 8, 2, pad_to_multiple_of=4)
    assert [[(mb.lengths.tolist(), mb.pad) for mb in rank] for rank in plan] == [
        [([8], 0), ([5], 3)],
        [([4, 2], 2), ([3], 1)],
    ]
    padded_five = plan[0][1]
    assert padded_five.position_ids().tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert padded_five.sequence_lengths == [8]
    assert plan[0][0].samples.tolist() == [3]  # the 10-token sample, cut to 8


def test_a_rank_that_cannot_get_a_split_bin_gets_a_dummy_without_loss() -> None:
    batch = lengths_batch([3, 2])
    plan = pack_ranks(batch, 8, 3)
    assert [len(rank) for rank in plan] == [1, 1, 1]
    dummies = [mb for rank in plan for mb in rank if mb.dummy]
    assert len(dummies) == 1
    assert dummies[0].samples.tolist() == [0]  # a copy of the first micro-batch
    assert not dummies[0].loss_mask().any()
    assert not dummies[0].advantages().any()
    grid = [DECODER.decode(m) for m in encode_step(batch, seq_len=8, ranks=3).messages]
    assert len(check_step(grid, seq_len=8)) == 2  # the dummy is checked and carries no sample


@pytest.mark.parametrize("dtype", ["uint8", "uint16"])
def test_routed_experts_keep_their_dtype_and_pads_get_zero_rows(dtype: str) -> None:
    batch = lengths_batch([7, 4, 9], dtype)
    grid = [DECODER.decode(m) for m in encode_step(batch, seq_len=16, ranks=2, pad_to_multiple_of=4).messages]
    samples = check_step(grid, seq_len=16, pad_to_multiple_of=4, routed_dtype=dtype)
    by_first = {s.input_ids[0]: s for s in samples}
    for i in range(batch.num_samples):
        got = by_first[int(batch.sample(i)["token_ids"][0])]
        np.testing.assert_array_equal(got.routed, batch.sample(i)["routed_experts"])
        assert got.advantage == batch.scalars["advantage"][i]


def test_per_token_advantages_temperatures_and_env_names() -> None:
    batch = golden_batch()
    grid = [DECODER.decode(m) for m in encode_step(batch, seq_len=64, ranks=1, temperature=TEMPERATURES).messages]
    samples = check_step(grid, seq_len=64, routed_dtype="uint8")
    assert sorted((s.env, s.temperature, s.advantage, len(s.input_ids)) for s in samples) == [
        ("gsm8k", 0.7, 0.25, 10), ("gsm8k", 0.7, 0.5, 4), ("math", 1.0, -1.0, 2)]
    for s in samples:  # advantage on the loss-mask tokens only
        i = batch.scalars["advantage"].index(s.advantage)
        assert s.loss_mask == [bool(m) for m in batch.sample(i)["loss_mask"]]


def test_a_step_without_samples_is_one_micro_batch_of_pads_per_rank() -> None:
    empty = Batch.from_columns("run", 0, {"token_ids": [], "loss_mask": [], "logprobs": []}, [],
                               {"advantage": [], "env": []})
    step = encode_step(empty, seq_len=8, ranks=2, pad_to_multiple_of=4)
    for message in step.messages:
        [mb] = DECODER.decode(message)
        assert (mb.input_ids, mb.loss_mask, mb.sequence_lengths, mb.env_names) == ([1] * 4, [False] * 4, [4],
                                                                                   [""] * 4)


def test_missing_temperature_or_columns_are_named() -> None:
    with pytest.raises(WireError, match=r"no temperature for envs \['math'\]"):
        encode_step(golden_batch(), seq_len=8, ranks=1, temperature={"gsm8k": 0.7})
    batch = golden_batch()
    del batch.scalars["advantage"]
    with pytest.raises(WireError, match="per-sample scalar 'advantage'"):
        encode_step(batch, seq_len=8, ranks=1)


def test_balanced_partition_gives_equal_counts_and_close_loads() -> None:
    weights = [10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 1, 1]
    parts = balanced_partition(weights, 3)
    assert sorted(i for p in parts for i in p) == list(range(len(weights)))
    assert {len(p) for p in parts} == {4}
    loads = [sum(weights[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= 2  # a heuristic: 19 each exists, Karmarkar-Karp finds 20/19/18
    with pytest.raises(ValueError, match="do not split into 3 sets"):
        balanced_partition([1, 2], 3)
