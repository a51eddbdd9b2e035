"""Messages between the orchestrator (ZMQ ROUTER) and env workers (ZMQ DEALER).

Every message is a multipart ZMQ message whose first frame is a small msgpack map with a ``type``:

worker -> orchestrator
  ``hello``      {worker}                         on connect; answered with ``setup``
  ``ready``      {worker, envs: {name: tasks}}    environments loaded; assignments may start
  ``records``    {group, records: [ROLLOUT header, ...]} + their column frames, in order: finished
                 rollouts of one group, sent together when the group ends (or FLUSH_S after the last
                 one finished while others still run), so the orchestrator handles one message per group
  ``heartbeat``  {worker, inflight}               every HEARTBEAT_S
  ``fatal``      {worker, error}                  the worker cannot go on (an env failed to load)

orchestrator -> worker
  ``setup``      {envs: [{name, taskset, args}], model, tokenizer}
  ``assign``     {group, env, task, rids, server, sampling, policy_step}   run len(rids) rollouts of one task
  ``cancel``     {group}                          drop a group (stale or timed out)
  ``stop``       {}                               exit cleanly

ROLLOUT: each header holds the scalars (reward, metrics, error, stop condition, timing, token counts, and
per sample ``[tokens, layers, top_k]``); it is followed by exactly four frames when the rollout has
samples: token ids (int32), loss mask (uint8), logprobs (float32), routed experts (uint8, possibly
empty), each the concatenation of all its samples. Frames are sent and received without copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from orchestrator.errors import WireError
from orchestrator.samples import Sample

HEARTBEAT_S = 1.0
FLUSH_S = 1.0
COLUMNS = ("token_ids", "loss_mask", "logprobs", "routed_experts")
DTYPES = {"token_ids": np.int32, "loss_mask": np.uint8, "logprobs": np.float32, "routed_experts": np.uint8}


def pack(msg: dict[str, Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(frame: bytes | memoryview) -> dict[str, Any]:
    try:
        msg = msgpack.unpackb(frame, raw=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise WireError(f"undecodable message header: {e}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise WireError(f"message header is not a map with a 'type': {str(msg)[:100]}")
    return msg


def sample_frames(samples: list[Sample]) -> tuple[list[list[int]], list[bytes | np.ndarray]]:
    """Per-sample shapes ``[tokens, layers, top_k]`` and the four column frames (one concatenation each)."""
    shapes = [[s.num_tokens, *(s.routed_experts.shape[1:] if s.routed_experts is not None else (0, 0))]
              for s in samples]
    if not samples:
        return shapes, []
    frames: list[bytes | np.ndarray] = [np.concatenate([getattr(s, c) for s in samples]) for c in COLUMNS[:3]]
    routed = [s.routed_experts for s in samples if s.routed_experts is not None]
    frames.append(np.concatenate([r.reshape(-1) for r in routed]) if routed else b"")
    return shapes, frames


def records_message(group: str, records: list[tuple[dict[str, Any], list[Any]]]) -> list[Any]:
    """One ``records`` message: the headers (each saying how many frames follow it) then all frames."""
    headers = [{**h, "frames": len(f)} for h, f in records]
    return [pack({"type": "records", "group": group, "records": headers}), *(x for _, f in records for x in f)]


def split_records(msg: dict[str, Any], frames: list[memoryview]) -> list[RolloutRecord]:
    """The rollout records of a ``records`` message; WireError when the frames do not add up."""
    headers = msg.get("records")
    if not isinstance(headers, list) or not all(isinstance(h, dict) for h in headers):
        raise WireError("records message without a list of record headers")
    counts = [h.get("frames") for h in headers]
    if not all(isinstance(c, int) and c in (0, len(COLUMNS)) for c in counts) or sum(counts) != len(frames):
        raise WireError(f"records message: frame counts {counts} do not match its {len(frames)} frames")
    out, i = [], 0
    for h, n in zip(headers, counts, strict=True):
        out.append(RolloutRecord(h, frames[i:i + n]))
        i += n
    return out


@dataclass
class RolloutRecord:
    """A finished rollout as the orchestrator holds it: scalars plus column frames it never copies."""

    header: dict[str, Any]
    frames: list[memoryview]  # token_ids, loss_mask, logprobs, routed_experts (empty when no samples)

    @property
    def env(self) -> str:
        return str(self.header["env"])

    @property
    def reward(self) -> float:
        return float(self.header.get("reward") or 0.0)  # None: a failed rollout with no usable reward

    @property
    def ok(self) -> bool:
        return bool(self.header.get("ok"))

    def column(self, name: str) -> np.ndarray:
        """A column of all this rollout's samples, concatenated (a view of the received frame)."""
        if not self.frames:
            return np.zeros(0, DTYPES[name])
        return np.frombuffer(self.frames[COLUMNS.index(name)], dtype=DTYPES[name])

    def sampled(self) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, logprobs) of the sampled tokens, for filters."""
        mask = self.column("loss_mask").astype(bool)
        return self.column("token_ids")[mask], self.column("logprobs")[mask]

    def check(self) -> None:
        """Raise WireError when the frames do not match the header's shapes."""
        shapes = self.header.get("samples", [])
        if not shapes:
            return
        if len(self.frames) != len(COLUMNS):
            raise WireError(f"rollout {self.header.get('rid')}: {len(self.frames)} column frames, expected 4")
        tokens = sum(int(s[0]) for s in shapes)
        routed = sum(int(s[0]) * int(s[1]) * int(s[2]) for s in shapes)
        for name, expect in zip(COLUMNS, (tokens, tokens, tokens, routed), strict=True):
            got = len(self.frames[COLUMNS.index(name)]) // np.dtype(DTYPES[name]).itemsize
            if got != expect:
                raise WireError(f"rollout {self.header.get('rid')}: column {name} has {got} values, "
                                f"header says {expect}")
