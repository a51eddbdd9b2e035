from __future__ import annotations

import numpy as np
import pytest

from orchestrator.columns.samples import PlainNode as Node
from orchestrator.columns.samples import SampleError, build_sample
from orchestrator.columns.versions import CallKey, CallSpans


def routed(n: int, layers: int = 2, k: int = 3, fill: int = 0) -> np.ndarray:
    return np.full((n, layers, k), fill, dtype=np.uint8)


def test_multi_turn_sample_columns_line_up() -> None:
    nodes = [
        Node([1, 2, 3], routed_experts=routed(3, fill=1)),  # prompt
        Node([4, 5], [False, True], [-0.5], routed(2, fill=2)),  # scaffold + one sampled token
        Node([6], routed_experts=routed(1, fill=3)),  # feedback
        Node([7, 8, 9], [False, True, True], [-1.0, -2.0], routed(3, fill=4)),
    ]
    s = build_sample(nodes)
    assert s.token_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert s.token_ids.dtype == np.int32
    assert s.loss_mask.tolist() == [0, 0, 0, 0, 1, 0, 0, 1, 1]
    assert s.loss_mask.dtype == np.uint8
    np.testing.assert_array_equal(s.logprobs, np.array([0, 0, 0, 0, -0.5, 0, 0, -1, -2], dtype=np.float32))
    assert s.routed_experts is not None
    assert s.routed_experts.shape == (9, 2, 3)
    assert s.routed_experts.dtype == np.uint8
    assert s.routed_experts[:, 0, 0].tolist() == [1, 1, 1, 2, 2, 3, 4, 4, 4]
    assert (s.num_tokens, s.num_sampled) == (9, 3)


def test_without_routed_experts() -> None:
    s = build_sample([Node([1, 2]), Node([3], [True], [-0.1])])
    assert s.routed_experts is None
    assert s.loss_mask.tolist() == [0, 0, 1]


@pytest.mark.parametrize(
    ("nodes", "message"),
    [
        ([Node([1, 2], routed_experts=routed(3))], "routed experts shape"),
        ([Node([1, 2], routed_experts=routed(2)), Node([3])], "routed experts on 1 of 2 nodes"),
        ([Node([1, 2], [True], [-1.0])], "mask has 1 entries for 2 tokens"),
        ([Node([1, 2], [True, True], [-1.0])], "1 logprobs for 2 sampled tokens"),
        ([Node([1], [True], [float("nan")])], "non-finite logprob"),
        ([Node([1], routed_experts=routed(1, 2, 3)), Node([2], routed_experts=routed(1, 4, 3))], "shapes differ"),
        ([Node([1]), Node([2**40])], "node 1: .*"),  # not an int32 token id
        ([Node([1], [True], ["x"])], "node 0: .*"),  # type: ignore[list-item]  # the point: not a number
        ([Node([1, 2]), Node([3], [True], [-1.0, -2.0])], "node 1: 2 logprobs for 1 sampled tokens"),
        ([Node([1, 2], [True, True], [-1.0, 0.0]), Node([3], [True], [float("inf")])], "node 1: non-finite"),
    ],
)
def test_inconsistent_data_is_a_sample_error(nodes: list[Node], message: str) -> None:
    with pytest.raises(SampleError, match=message):
        build_sample(nodes)


def test_any_sequence_type_gives_the_same_sample() -> None:
    # the point: element and sequence types other than Node's annotations (numpy bools, tuples, arrays)
    as_lists = build_sample([Node([1, 2], [False, True], [-0.5]),
                             Node([3], [np.True_], [-1.5])])  # type: ignore[list-item]
    as_other = build_sample([Node((1, 2), (False, True), (-0.5,)),  # type: ignore[arg-type]
                             Node(np.array([3]), np.array([7]), np.array([-1.5]))])  # type: ignore[arg-type]
    for a, b in [(as_lists.token_ids, as_other.token_ids), (as_lists.loss_mask, as_other.loss_mask),
                 (as_lists.logprobs, as_other.logprobs)]:
        assert a.dtype == b.dtype
        assert a.tolist() == b.tolist()
    assert as_lists.loss_mask.tolist() == [0, 1, 1]


# ---------------------------------------------------------------------------------------------- versions


def test_versions_are_bounded_by_the_floor_without_calls_and_exact_from_them() -> None:
    from orchestrator.columns.versions import NOT_SAMPLED, TokenVersions, bounded, call_key, exact, lower_bound

    nodes = [Node([1, 2, 3]), Node([4, 5], [False, True], [-0.5]), Node([6]),
             Node([7, 8, 9], [False, True, True], [-1.0, -2.0])]
    plain = build_sample(nodes, TokenVersions(floor=7))
    assert plain.versions is not None
    assert plain.versions.tolist() == [NOT_SAMPLED] * 4 + [bounded(7), NOT_SAMPLED, NOT_SAMPLED, bounded(7),
                                                            bounded(7)]
    assert plain.optional == ("versions",)
    assert build_sample(nodes).optional == ()  # no TokenVersions: no column

    # the first call's completion (token 5) starts at position 4; the second's (8, 9) at 7, half of it unknown
    calls: dict[CallKey, list[CallSpans]] = {call_key(4, [5]): [((8, 0, 1),)], call_key(7, [8, 9]): [((8, 0, 1),)]}
    versions = TokenVersions(floor=7, calls=calls)
    s = build_sample(nodes, versions)
    assert s.versions is not None
    assert s.versions.tolist() == [-1, -1, -1, -1, 8, -1, -1, 8, bounded(7)]
    assert lower_bound(s.versions).tolist() == [-1, -1, -1, -1, 8, -1, -1, 8, 7]
    assert exact(s.versions).tolist() == [False] * 4 + [True, False, False, True, False]
    assert (versions.exact, versions.bounded) == (2, 1)


def test_a_completion_two_calls_reported_differently_is_bounded_by_the_older() -> None:
    from orchestrator.columns.versions import TokenVersions, bounded, call_key

    nodes = [Node([1, 2]), Node([3, 4], [True, True], [-1.0, -1.0])]
    calls: dict[CallKey, list[CallSpans]] = {call_key(2, [3, 4]): [((5, 0, 1), (6, 1, 2)), ((6, 0, 2),)]}
    s = build_sample(nodes, TokenVersions(floor=4, calls=calls))
    assert s.versions is not None
    assert s.versions.tolist() == [-1, -1, bounded(5), bounded(6)]
    other_place: dict[CallKey, list[CallSpans]] = {call_key(1, [3, 4]): [((5, 0, 2),)]}  # after another prompt
    s = build_sample(nodes, TokenVersions(floor=4, calls=other_place))
    assert s.versions is not None
    assert s.versions.tolist() == [-1, -1, bounded(4), bounded(4)]


def test_call_spans_read_only_step_numbers() -> None:
    from orchestrator.columns.versions import call_spans, expand

    def per_token(raw: object, n: int) -> list[int]:
        out: list[int] = expand(call_spans(raw, n), n).tolist()
        return out

    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert call_spans(spans, 5) == ((3, 0, 2), (4, 2, 5))
    assert per_token(spans, 5) == [3, 3, 4, 4, 4]
    assert per_token([{"version": "default", "start": 0, "end": 3}], 3) == [-1, -1, -1]
    assert per_token(None, 2) == [-1, -1]  # vLLM: no label reported for these tokens
    assert per_token([{"version": "3", "start": 1, "end": 9}], 3) == [-1, -1, -1]  # past the end
    assert per_token([{"version": "-3", "start": 0, "end": 1}, "junk"], 1) == [-1]
