"""CURVE on real loopback sockets: key files, the authenticator, who gets in, and what the wire carries.

Every "gets nothing" below is checked after the refused peer's handshake has failed (a monitor event on the
server's socket), so no test depends on how long anything takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import zmq
import zmq.asyncio

from orchestrator.errors import KeyFileError
from orchestrator.security import (
    ClientKeys,
    CurveServer,
    ServerKeys,
    create_key_pair,
    curve_server,
    is_loopback,
    load_authorized_keys,
    load_key_pair,
    load_public_key,
    secure_client,
)
from orchestrator.testing.handshakes import failed_handshakes
from orchestrator.testing.keys import make_key_set

TIMEOUT_S = 60.0  # a hang guard: every wait ends on an event (a message, a failed handshake)
S = TypeVar("S", bound=zmq.Socket[Any])


@dataclass(frozen=True)
class Keys:
    """A server, one authorized client, and peers that must not get in."""

    server: ServerKeys
    client: ClientKeys
    unlisted: ClientKeys  # a key pair the server has never heard of
    wrong_server: ClientKeys  # an authorized client that holds another server's public key


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    made = make_key_set(tmp_path / "keys")
    return Keys(made.server(), made.client("trainer"), made.client("intruder"), made.wrong_server("trainer"))


# ---------------------------------------------------------------------------------------------- key files


def test_key_pair_files_and_modes(tmp_path: Path) -> None:
    public, secret = create_key_pair(tmp_path / "keys", "orchestrator")
    assert (public.name, secret.name) == ("orchestrator.key", "orchestrator.key_secret")
    assert stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    assert load_key_pair(secret).public == load_public_key(public)
    assert sorted(p.name for p in (tmp_path / "keys").iterdir()) == [public.name, secret.name]  # no scratch left


def test_existing_keys_are_never_overwritten(tmp_path: Path) -> None:
    public, secret = create_key_pair(tmp_path, "orchestrator")
    before = (public.read_bytes(), secret.read_bytes())
    secret.unlink()  # even half a pair: its public half may be in peers' hands
    with pytest.raises(FileExistsError, match=r"orchestrator\.key already exists"):
        create_key_pair(tmp_path, "orchestrator")
    assert public.read_bytes() == before[0]
    assert not secret.exists()


def write_public_only(path: Path) -> Path:
    public, _ = create_key_pair(path.parent / "made", "x")
    path.write_bytes(public.read_bytes())
    return path


def write_secret(path: Path) -> Path:
    _, secret = create_key_pair(path.parent / "made", "x")
    path.write_bytes(secret.read_bytes())
    return path


def write_damaged(path: Path) -> Path:
    public, _ = create_key_pair(path.parent / "made", "x")
    text = public.read_text()
    start = text.index('public-key = "') + len('public-key = "')
    path.write_text(text[:start] + text[start + 5:])  # five characters short
    return path


KEY_PAIR_CASES = [
    pytest.param(lambda p: p, "no such file; make keys with `orchestrator keys", id="missing"),
    pytest.param(lambda p: (p.mkdir(), p)[1], "is a directory, expected a key file", id="directory"),
    pytest.param(lambda p: (p.write_text("hello\n"), p)[1], "not a CURVE key file (no public-key line)",
                 id="not-a-key-file"),
    pytest.param(write_public_only, "holds only a public key; expected the secret key file", id="public-half"),
    pytest.param(write_damaged, "its public-key is not 40 Z85 characters", id="damaged"),
]


@pytest.mark.parametrize(("make", "message"), KEY_PAIR_CASES)
def test_unusable_secret_key_files_are_named(make: Any, message: str, tmp_path: Path) -> None:
    path = make(tmp_path / "orchestrator.key_secret")
    with pytest.raises(KeyFileError) as e:
        load_key_pair(path)
    assert str(e.value).startswith(f"{path}: "), e.value
    assert message in str(e.value)


def test_a_public_key_file_holding_a_secret_is_refused(tmp_path: Path) -> None:
    path = write_secret(tmp_path / "orchestrator.key")
    with pytest.raises(KeyFileError, match="holds a secret key; expected a public key file"):
        load_public_key(path)


def test_authorized_keys_directory_problems(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="no such directory"):
        load_authorized_keys(tmp_path / "missing")
    (tmp_path / "file").write_text("")
    with pytest.raises(KeyFileError, match="is not a directory"):
        load_authorized_keys(tmp_path / "file")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(KeyFileError, match=r"holds no \*\.key files, so no client could connect"):
        load_authorized_keys(empty)
    leaked = tmp_path / "leaked"
    leaked.mkdir()
    write_secret(leaked / "worker.key")
    with pytest.raises(KeyFileError) as e:
        load_authorized_keys(leaked)
    assert str(e.value).startswith(f"{leaked}/worker.key: holds a secret key")


def test_authorized_keys_are_the_public_key_files_only(tmp_path: Path) -> None:
    a, a_secret = create_key_pair(tmp_path, "a")
    b, _ = create_key_pair(tmp_path, "b")
    assert load_authorized_keys(tmp_path) == {load_public_key(a), load_public_key(b)}  # .key_secret skipped
    assert load_key_pair(a_secret).public not in {load_public_key(b)}


@pytest.mark.parametrize(("address", "loopback"), [
    ("tcp://127.0.0.1:5555", True), ("tcp://127.3.2.1:5555", True), ("tcp://localhost:5555", True),
    ("tcp://[::1]:5555", True), ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False),
    ("tcp://10.0.0.1:5555", False), ("tcp://eth0:5555", False), ("tcp://[::]:5555", False),
    ("tcp://myhost:5555", False), ("ipc:///tmp/x.sock", False),
])
def test_loopback_addresses(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback


# ---------------------------------------------------------------------------------------------- sockets


@contextlib.contextmanager
def push_server(ctx: zmq.Context[S], keys: ServerKeys) -> Iterator[tuple[S, str]]:
    """A CURVE PUSH bound to a free loopback port; its address."""
    with curve_server(ctx, keys) as server:
        push = ctx.socket(zmq.PUSH)
        try:
            server.secure(push)
            push.bind("tcp://127.0.0.1:*")
            yield push, push.getsockopt_string(zmq.LAST_ENDPOINT)
        finally:
            push.close(linger=0)


def client(ctx: zmq.Context[S], kind: int, address: str, keys: ClientKeys | None) -> S:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        secure_client(sock, keys)
    sock.connect(address)
    return sock


@contextlib.asynccontextmanager
async def asyncio_context() -> AsyncIterator[zmq.asyncio.Context]:
    """A context whose sockets are all closed on exit, however the test ends (term() would wait for them)."""
    ctx = zmq.asyncio.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


REFUSED = ["no-keys", "unlisted-key", "wrong-server-key"]


def refused_keys(keys: Keys, which: str) -> ClientKeys | None:
    return {"no-keys": None, "unlisted-key": keys.unlisted, "wrong-server-key": keys.wrong_server}[which]


@pytest.mark.parametrize("refused", REFUSED)
async def test_only_authorized_clients_receive(keys: Keys, refused: str) -> None:
    async with asyncio_context() as ctx:
        with push_server(ctx, keys.server) as (push, address), failed_handshakes(push) as failures:
            intruder = client(ctx, zmq.PULL, address, refused_keys(keys, refused))
            await failures.next(TIMEOUT_S)  # its handshake failed: it is not a peer of the PUSH
            trainer = client(ctx, zmq.PULL, address, keys.client)
            for i in range(4):  # a PUSH deals messages round-robin among its peers: all go to the trainer
                await asyncio.wait_for(push.send(b"step %d" % i), TIMEOUT_S)
            got = [await asyncio.wait_for(trainer.recv(), TIMEOUT_S) for _ in range(4)]
            assert got == [b"step 0", b"step 1", b"step 2", b"step 3"]
            assert not await intruder.poll(0)


@pytest.mark.parametrize("refused", REFUSED)
async def test_nothing_a_refused_client_sends_arrives(keys: Keys, refused: str) -> None:
    async with asyncio_context() as ctx:
        with curve_server(ctx, keys.server) as server:
            pull = ctx.socket(zmq.PULL)
            server.secure(pull)
            pull.bind("tcp://127.0.0.1:*")
            address = pull.getsockopt_string(zmq.LAST_ENDPOINT)
            with failed_handshakes(pull) as failures:
                intruder = client(ctx, zmq.PUSH, address, refused_keys(keys, refused))
                intruder.send(b"forged", flags=zmq.NOBLOCK)  # queued, waiting for a connection
                await failures.next(TIMEOUT_S)
            trainer = client(ctx, zmq.PUSH, address, keys.client)
            await trainer.send(b"first")
            await trainer.send(b"second")
            got = [await asyncio.wait_for(pull.recv(), TIMEOUT_S) for _ in range(2)]
            assert got == [b"first", b"second"]
            assert not await pull.poll(0)
            pull.close(linger=0)  # before the authenticator stops


def test_plain_context_sockets_work_too(keys: Keys) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with push_server(ctx, keys.server) as (push, address):
            trainer = client(ctx, zmq.PULL, address, keys.client)
            assert push.poll(int(TIMEOUT_S * 1000), zmq.POLLOUT)  # the trainer is a peer
            push.send(b"hello")
            assert trainer.poll(int(TIMEOUT_S * 1000))
            assert trainer.recv() == b"hello"
    finally:
        ctx.destroy(linger=0)


async def test_without_an_authenticator_nobody_gets_in(keys: Keys) -> None:
    """Secured sockets fail closed: with no authenticator in the context even an authorized key is refused
    (libzmq's default would accept any client that knows the server's public key)."""
    async with asyncio_context() as ctx:
        push = ctx.socket(zmq.PUSH)
        CurveServer(ctx, keys.server.keys).secure(push)  # what curve_server hands out, without its thread
        push.bind("tcp://127.0.0.1:*")
        with failed_handshakes(push) as failures:
            trainer = client(ctx, zmq.PULL, push.getsockopt_string(zmq.LAST_ENDPOINT), keys.client)
            assert await failures.next(TIMEOUT_S) == "HANDSHAKE_FAILED_NO_DETAIL"
            with pytest.raises(zmq.Again):
                await push.send(b"x", flags=zmq.NOBLOCK)  # no peer
        trainer.close()
        push.close()


async def test_one_authenticator_per_context(keys: Keys) -> None:
    async with asyncio_context() as ctx:
        with (curve_server(ctx, keys.server), pytest.raises(RuntimeError, match="already runs a ZAP authenticator"),
              curve_server(ctx, keys.server)):
            pass


async def test_curve_server_secures_only_its_own_sockets_while_it_runs(keys: Keys) -> None:
    async with asyncio_context() as ctx:
        with curve_server(ctx, keys.server) as server:
            async with asyncio_context() as other:
                foreign = other.socket(zmq.PUSH)
                with pytest.raises(ValueError, match="another ZMQ context"):
                    server.secure(foreign)
                foreign.close()
        late = ctx.socket(zmq.PUSH)
        with pytest.raises(RuntimeError, match="has ended"):
            server.secure(late)
        late.close()


# ---------------------------------------------------------------------------------------------- the wire


class Tap:
    """A TCP relay on loopback that keeps every byte the server sends to the client."""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.removeprefix("tcp://").rpartition(":")
        self.upstream = (host, int(port))
        self.seen = bytearray()
        self.server: asyncio.Server | None = None
        self.pumps: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def open(self) -> AsyncIterator[str]:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        try:
            async with self.server:
                yield f"tcp://127.0.0.1:{port}"
        finally:
            for task in self.pumps:
                task.cancel()
            await asyncio.gather(*self.pumps, return_exceptions=True)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        for task in (self._pump(reader, up_writer, keep=False), self._pump(up_reader, writer, keep=True)):
            self.pumps.add(asyncio.ensure_future(task))

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, keep: bool) -> None:
        try:
            while data := await reader.read(65536):
                if keep:
                    self.seen += data
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()


SECRET = b"the-plaintext-batch-" * 8


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
async def test_what_the_wire_carries(keys: Keys, curve: bool) -> None:
    """With CURVE the bytes on the wire do not contain the message; without it they do (the control)."""
    async with asyncio_context() as ctx:
        with contextlib.ExitStack() as stack:
            if curve:
                push, address = stack.enter_context(push_server(ctx, keys.server))
            else:
                push = ctx.socket(zmq.PUSH)
                stack.callback(push.close, linger=0)
                push.bind("tcp://127.0.0.1:*")
                address = push.getsockopt_string(zmq.LAST_ENDPOINT)
            tap = Tap(address)
            async with tap.open() as tapped:
                trainer = client(ctx, zmq.PULL, tapped, keys.client if curve else None)
                await asyncio.wait_for(push.send(SECRET), TIMEOUT_S)
                assert await asyncio.wait_for(trainer.recv(), TIMEOUT_S) == SECRET
                trainer.close()
            assert len(tap.seen) > len(SECRET)  # the message went through the tap
            assert (SECRET[:20] in tap.seen) is not curve


# ---------------------------------------------------------------------------------------------- the command


def run_keys(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator", "keys", *args], capture_output=True, text=True,
                          timeout=180, check=False)


def test_keys_command_makes_a_usable_pair_and_says_where_it_goes(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    done = run_keys(str(directory), "--name", "trainer")
    assert done.returncode == 0, done.stderr
    public, secret = directory / "trainer.key", directory / "trainer.key_secret"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert load_key_pair(secret).public == load_public_key(public)
    for needle in (f"wrote {public}", f"wrote {secret}", f'server_key = "{secret}"', "authorized_keys",
                   f"copy {public} into the orchestrator's authorized_keys directory", f"--client-key {secret}"):
        assert needle in done.stdout, needle


def test_keys_command_never_overwrites(tmp_path: Path) -> None:
    assert run_keys(str(tmp_path)).returncode == 0  # --name defaults to orchestrator
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(before) == ["orchestrator.key", "orchestrator.key_secret"]
    again = run_keys(str(tmp_path))
    assert again.returncode == 1
    assert "already exist; not overwriting keys" in again.stderr, again.stderr
    assert "Traceback" not in again.stderr
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_keys_command_refuses_a_name_that_is_a_path(tmp_path: Path) -> None:
    done = run_keys(str(tmp_path), "--name", "../elsewhere")
    assert done.returncode == 1
    assert "--name '../elsewhere': use letters, digits" in done.stderr
    assert list(tmp_path.iterdir()) == []
