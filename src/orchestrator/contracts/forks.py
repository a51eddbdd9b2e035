"""What the hub and its warm env worker say to each other (hub/forks.py, workers/zygote.py): one JSON message a
line on a socket pair. The hub asks for a worker (``Fork``); the warm process answers that it was born (``Born``)
and, later, that it ended (``Ended``)."""

from __future__ import annotations

import msgspec


class Fork(msgspec.Struct, tag="fork"):
    argv: list[str]  # the worker's ``env-worker`` arguments (``--connect``, ``--id``...)


class Born(msgspec.Struct, tag="born"):
    pid: int


class Ended(msgspec.Struct, tag="ended"):
    pid: int
    status: int  # as asyncio reports a child's: its exit code, or minus the signal that ended it


Reply = Born | Ended
encode = msgspec.json.Encoder().encode
requests = msgspec.json.Decoder(Fork)
replies = msgspec.json.Decoder(Reply)
