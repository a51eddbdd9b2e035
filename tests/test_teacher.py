"""The env worker's teacher client against real simulated servers: exact scores, retries, bounds, failures; and the
preflight of the teacher's servers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import orjson
import pytest

from orchestrator.assets import tokenizer_dir
from orchestrator.config import JobConfig
from orchestrator.contracts.protocol import TeacherSpec
from orchestrator.errors import Failure
from orchestrator.inference.config import TeacherConfig
from orchestrator.inference.preflight import PreflightError, encode_probe, preflight_teacher
from orchestrator.policy import Policy
from orchestrator.sim.server import Faults
from orchestrator.testing.distill import TEACHER_SEED, exact_logprobs
from orchestrator.testing.jobs import ARITHMETIC, job_config
from orchestrator.testing.procs import wait_until
from orchestrator.testing.sim import sim_cluster
from orchestrator.workers.teacher import Teacher, TeacherError, parse_prompt_logprobs

SEQ = np.array([2, 140, 17, 300, 42, 9, 77, 3, 2, 500, 3], np.int32)


def spec(urls: list[str], **kw: object) -> TeacherSpec:
    return TeacherSpec(servers=urls, model="teacher", **{"retry_backoff_s": 0.0, **kw})  # type: ignore[arg-type]


async def test_a_score_is_the_teachers_exact_logprob_of_every_token_and_0_for_the_first() -> None:
    async with sim_cluster(1, model="teacher", policy_seed=TEACHER_SEED) as sims, Teacher.open(spec(sims.urls)) as t:
        got = await t.score(SEQ)
    assert got.dtype == np.float32
    assert got.shape == SEQ.shape
    assert got[0] == 0.0
    np.testing.assert_allclose(got, exact_logprobs(Policy.seeded(TEACHER_SEED), SEQ).astype(np.float32), rtol=0,
                               atol=0)
    assert (got[1:] < 0).all()


async def test_another_policy_scores_otherwise() -> None:
    """The scores come from the teacher's weights: a server on the initial policy answers other numbers."""
    async with sim_cluster(1, model="teacher") as sims, Teacher.open(spec(sims.urls)) as t:
        got = await t.score(SEQ)
    assert np.abs(got - exact_logprobs(Policy.seeded(TEACHER_SEED), SEQ)).max() > 0.1
    np.testing.assert_allclose(got, exact_logprobs(Policy.initial(), SEQ).astype(np.float32), rtol=0, atol=0)


async def test_a_down_teacher_is_tried_again_then_the_rollout_fails_as_teacher_error() -> None:
    async with sim_cluster(1, model="teacher", faults=Faults(down=True)) as sims, \
            Teacher.open(spec(sims.urls, retries=2)) as t:
        with pytest.raises(TeacherError) as e:
            await t.score(SEQ)
        assert sims[0].counters.down == 3  # the first attempt and two retries
    assert e.value.kind == Failure.TEACHER_ERROR
    assert "HTTP 503" in str(e.value)
    assert "after 3 attempts" in str(e.value)


async def test_a_teacher_that_is_down_is_passed_over_for_one_that_answers() -> None:
    async with sim_cluster(2, model="teacher", policy_seed=TEACHER_SEED) as sims, \
            Teacher.open(spec(sims.urls, retries=1)) as t:
        sims.set_faults(0, down=True)
        for _ in range(4):  # whichever it tries first, each score ends on the live one
            np.testing.assert_allclose(await t.score(SEQ), exact_logprobs(Policy.seeded(TEACHER_SEED), SEQ),
                                       rtol=0, atol=1e-5)
        assert sims[1].counters.requests == 4


async def test_a_killed_teacher_is_a_connection_error() -> None:
    async with sim_cluster(1, model="teacher") as sims:
        await sims.kill(0)
        async with Teacher.open(spec(sims.urls, retries=1)) as t:
            with pytest.raises(TeacherError) as e:
                await t.score(SEQ)
    assert e.value.kind == Failure.TEACHER_ERROR
    assert "ClientConnectorError" in str(e.value)


async def test_a_teacher_slower_than_the_timeout_fails_as_teacher_timeout() -> None:
    async with sim_cluster(1, model="teacher", faults=Faults(hold=True)) as sims, \
            Teacher.open(spec(sims.urls, retries=1, timeout_s=0.2)) as t:
        with pytest.raises(TeacherError) as e:
            await t.score(SEQ)
    assert e.value.kind == Failure.TEACHER_TIMEOUT
    assert "within 0.2 s" in str(e.value)


@pytest.mark.parametrize("kind", ["truncated_json", "bad_prompt_token", "short_prompt_logprobs"])
async def test_garbage_from_the_teacher_fails_as_teacher_malformed(kind: str) -> None:
    async with sim_cluster(1, model="teacher", faults=Faults(malformed_rate=1.0)) as sims, \
            Teacher.open(spec(sims.urls, retries=0)) as t:
        # the fault picks a kind at random among those that break the reply: score until this one was drawn
        while f"malformed:{kind}" not in {g.fault for g in sims[0].log.generate}:
            assert len(sims[0].log.generate) < 200
            with pytest.raises(TeacherError) as e:
                await t.score(SEQ)
            assert e.value.kind == Failure.TEACHER_MALFORMED


async def test_a_sample_longer_than_the_teachers_context_is_not_tried_again() -> None:
    async with sim_cluster(1, model="teacher", max_model_len=8) as sims, Teacher.open(spec(sims.urls, retries=3)) as t:
        with pytest.raises(TeacherError) as e:
            await t.score(SEQ)
        assert sims[0].counters.requests == 0
        assert len(sims[0].log.generate) == 1
    assert e.value.kind == Failure.TEACHER_ERROR
    assert "HTTP 400" in str(e.value)


async def test_at_most_max_inflight_requests_reach_the_teacher_at_once() -> None:
    async with sim_cluster(1, model="teacher", policy_seed=TEACHER_SEED, faults=Faults(hold=True)) as sims, \
            Teacher.open(spec(sims.urls, max_inflight=2)) as t:
        tasks = [asyncio.create_task(t.score(SEQ[: 4 + i])) for i in range(5)]
        await sims[0].gate.wait_until(lambda st: st.inside == 2)
        await wait_until(lambda: t.waiting == 3, 30, "three scores waiting for a slot")
        assert (t.inflight, sims[0].gate.state().inside) == (2, 2)  # the others wait here, not at the server
        sims[0].faults = Faults()  # the held ones answer; the waiting ones go, two at a time
        results = await asyncio.gather(*tasks)
    for i, got in enumerate(results):
        np.testing.assert_allclose(got, exact_logprobs(Policy.seeded(TEACHER_SEED), SEQ[: 4 + i]), rtol=0, atol=1e-5)


async def test_one_token_needs_no_request() -> None:
    async with Teacher.open(spec(["http://127.0.0.1:9/v1"])) as t:  # nothing listens there
        assert (await t.score(SEQ[:1])).tolist() == [0.0]


def test_the_reply_is_read_strictly() -> None:
    ids = np.array([5, 6, 7])
    good = {"prompt_logprobs": [None, {"6": {"logprob": -1.5, "rank": 3}}, {"7": {"logprob": -0.25}, "9": {}}]}
    assert parse_prompt_logprobs(orjson.dumps(good), ids).tolist() == [0.0, -1.5, -0.25]
    for bad, why in [({}, "no prompt_logprobs"), ({"prompt_logprobs": None}, "entries"),
                     ({"prompt_logprobs": [None, {"6": {"logprob": -1.5}}]}, "2 entries for 3"),
                     ({"prompt_logprobs": [None, {"6": {"logprob": -1.5}}, {"8": {"logprob": -1.0}}]}, "token 7"),
                     ({"prompt_logprobs": [None, {"6": {"logprob": "x"}}, {"7": {"logprob": -1.0}}]}, "token 6"),
                     ({"prompt_logprobs": [None, {"6": {"logprob": True}}, {"7": {"logprob": -1.0}}]}, "token 6")]:
        with pytest.raises(TeacherError, match=why) as e:
            parse_prompt_logprobs(orjson.dumps(bad), ids)
        assert e.value.kind == Failure.TEACHER_MALFORMED
    with pytest.raises(TeacherError, match="no prompt_logprobs"):
        parse_prompt_logprobs(b"{not json", ids)


def teacher_config(urls: list[str], model: str = "teacher") -> TeacherConfig:
    return TeacherConfig(servers=tuple(urls), model=model)


async def test_preflight_passes_a_teacher_that_can_serve_the_job() -> None:
    async with sim_cluster(2, model="teacher", policy_seed=TEACHER_SEED, max_model_len=4097) as sims:
        reports = await preflight_teacher(teacher_config(sims.urls), encoded=encode_probe(tokenizer_dir()),
                                          policy_max_len=4096)
    assert [r.max_model_len for r in reports] == [4097, 4097]


async def test_preflight_names_every_problem_of_the_teachers_servers() -> None:
    async with sim_cluster(1, model="other") as wrong, sim_cluster(1, model="teacher", max_model_len=512) as short, \
            sim_cluster(1, model="teacher", scale_out=False) as no_route, sim_cluster(1, model="teacher") as gone:
        await gone.kill(0)
        urls = [*wrong.urls, *short.urls, *no_route.urls, *gone.urls]
        with pytest.raises(PreflightError) as e:
            await preflight_teacher(teacher_config(urls), encoded=[1, 2, 3], policy_max_len=4096)
    problems = e.value.problems
    assert len(problems) == 6, problems
    assert f"teacher {wrong.urls[0]}: serves ['other'], not teacher.model = 'teacher'" in problems[0]
    assert "max_model_len 512 is below the policy servers' 4096" in problems[1]
    assert "--max-model-len 4097" in problems[1]
    assert "must use the policy's tokenizer" in problems[2]  # the probe [1, 2, 3] is not the built-in encoding
    assert all("tokenizer" in p or "--enable-scale-out" in p for p in problems[3:5])
    assert f"teacher {gone.urls[0]}: not reachable" in problems[5]


async def test_check_servers_checks_the_teacher_of_a_job_that_distils(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from orchestrator.commands.check import check_servers

    async with sim_cluster(1) as policy, sim_cluster(1, model="teacher", max_model_len=4097) as teacher:
        def cfg(model: str) -> JobConfig:
            return job_config(tmp_path, inference={"servers": policy.urls}, scheduler={"batch_size": 4},
                              teacher={"servers": teacher.urls, "model": model},
                              env=[{**ARITHMETIC, "algorithm": "reward+opd"}])

        await check_servers(cfg("teacher"))
        assert f"# teacher {teacher.urls[0]}: OK ('teacher', max_model_len 4097)" in capsys.readouterr().out
        with pytest.raises(PreflightError, match=r"not teacher\.model = 'nope': set teacher\.model"):
            await check_servers(cfg("nope"))
