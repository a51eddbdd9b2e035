"""CURVE authentication and encryption for the ZMQ sockets the orchestrator binds on tcp://.

Keys are the files ``orchestrator keys DIR --name NAME`` makes (pyzmq's ``zmq.auth.create_certificates``):
``NAME.key`` holds the public key and is handed to peers; ``NAME.key_secret`` holds the secret key as well
and never leaves its host. The side that binds is the CURVE *server*; each side that connects is a *client*
with its own key pair and the server's public key.

Server: ``with curve_server(ctx, keys) as server:`` runs a ZAP authenticator for the ZMQ context ``ctx`` (in
a thread, so it works for ``zmq.Context`` and ``zmq.asyncio.Context`` sockets alike and never on the event
loop) that accepts only the client public keys in ``keys.authorized``; ``server.secure(sock)`` makes a socket
of that context, before it binds, a CURVE server with our key pair. A context has one authenticator for its
whole life: open one ``curve_server`` per context and secure all its sockets with it (libzmq releases a
stopped authenticator's endpoint asynchronously, so a second one on the same context may not start). Leaving
the block stops the authenticator; close the sockets first, and terminate the context after. Secured sockets
fail closed (``ZAP_ENFORCE_DOMAIN``): without an authenticator no client gets in.

Client: ``secure_client(sock, ClientKeys(...))`` before ``connect``.

What a peer that cannot authenticate sees (no keys, a key not in the authorized directory, or the wrong
server key): the handshake fails and ZMQ closes the connection. It never receives a message, and nothing it
sends reaches the server's sockets: to the server it is as if it had never connected. A refused client key is
logged once on the server; ``RefusalWatch`` logs the cause once on the client. libzmq does not retry a
connection refused for its key or for having none (only one that failed for a wrong server key): the client's
sockets are left without a connection (a PUSH would wait for ever; the trainer library raises TrainerRefused),
so such a client must be restarted once its key is authorized. All traffic
of an accepted connection is encrypted.

ipc:// sockets are not covered: a Unix socket is reachable only by processes on the same host that may
open its file, so its directory's permissions decide who connects (``run.output_dir`` by default).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.utils.monitor import parse_monitor_message
from zmq.utils.z85 import Z85CHARS

from orchestrator.configbase import Source, opt
from orchestrator.errors import KeyFileError

log = logging.getLogger(__name__)

ZAP_DOMAIN = "orchestrator"
LOGGED_REFUSALS = 256  # refused client keys logged (each once); a flood of fresh keys is not logged for ever
MAKE_KEYS = "make keys with `orchestrator keys DIR --name NAME`"
# A local env worker's keys, set by the hub that starts it (a key pair made for the run, never on disk).
LOCAL_KEYS_ENV = ("ORCHESTRATOR_SERVER_PUBLIC_KEY", "ORCHESTRATOR_CLIENT_PUBLIC_KEY", "ORCHESTRATOR_CLIENT_SECRET_KEY")


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair as Z85 text (40 characters each), read from a ``NAME.key_secret`` file."""

    public: bytes
    secret: bytes = field(repr=False)


@dataclass(frozen=True)
class ServerKeys:
    """What a socket that binds needs: our key pair and the public keys of the clients it accepts (read once,
    from ``authorized_dir``: a key added there later counts after a restart)."""

    keys: KeyPair
    authorized: frozenset[bytes]
    authorized_dir: Path


@dataclass(frozen=True)
class ClientKeys:
    """What a socket that connects needs: the server's public key and our own key pair."""

    server_public: bytes
    keys: KeyPair


# ---------------------------------------------------------------------------------------------- key files


def _read(path: Path) -> tuple[bytes, bytes | None]:
    """(public key, secret key or None) of a key file; KeyFileError saying what is wrong with it."""
    if path.is_dir():
        raise KeyFileError(path, "is a directory, expected a key file")
    if not path.exists():
        raise KeyFileError(path, f"no such file; {MAKE_KEYS}")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError as e:
        raise KeyFileError(path, f"cannot read it: {e.strerror or e}") from None
    except ValueError:
        raise KeyFileError(path, f"not a CURVE key file (no public-key line); {MAKE_KEYS}") from None
    for name, key in (("public-key", public), ("secret-key", secret)):
        if key is not None and (len(key) != 40 or not set(key) <= set(Z85CHARS)):
            raise KeyFileError(path, f"its {name} is not 40 Z85 characters; the file is damaged ({MAKE_KEYS})")
    return public, secret


def load_key_pair(path: str | Path) -> KeyPair:
    """Our key pair from a ``NAME.key_secret`` file."""
    path = Path(path)
    public, secret = _read(path)
    if secret is None:
        raise KeyFileError(path, "holds only a public key; expected the secret key file NAME.key_secret "
                                 "made next to it")
    return KeyPair(public, secret)


def load_public_key(path: str | Path) -> bytes:
    """A peer's public key from a ``NAME.key`` file; a file holding a secret key is refused (secret keys
    never leave their host: hand out the ``.key`` half only)."""
    path = Path(path)
    public, secret = _read(path)
    if secret is not None:
        raise KeyFileError(path, "holds a secret key; expected a public key file NAME.key (give peers only the "
                                 "public .key and keep NAME.key_secret on its own host)")
    return public


def load_authorized_keys(directory: str | Path) -> frozenset[bytes]:
    """The public keys in a directory's ``*.key`` files (at least one)."""
    directory = Path(directory)
    if not directory.exists():
        raise KeyFileError(directory, "no such directory; create it and copy the public NAME.key file of "
                                      "every client allowed to connect into it")
    if not directory.is_dir():
        raise KeyFileError(directory, "is not a directory; expected the directory of the public NAME.key "
                                      "files of the clients allowed to connect")
    try:
        files = sorted(p for p in directory.glob("*.key") if p.is_file())
    except OSError as e:
        raise KeyFileError(directory, f"cannot list it: {e.strerror or e}") from None
    if not files:
        raise KeyFileError(directory, "holds no *.key files, so no client could connect; copy the public "
                                      "NAME.key file of every client allowed to connect into it")
    return frozenset(load_public_key(p) for p in files)


def load_server_keys(server_key: str | Path, authorized_keys: str | Path) -> ServerKeys:
    """A server's keys: our ``.key_secret`` file and the directory of the authorized clients' ``.key`` files."""
    return ServerKeys(load_key_pair(server_key), load_authorized_keys(authorized_keys), Path(authorized_keys))


def load_client_keys(server_key: str | Path, client_key: str | Path) -> ClientKeys:
    """A client's keys: the server's public ``.key`` file and our ``.key_secret`` file."""
    return ClientKeys(load_public_key(server_key), load_key_pair(client_key))


def create_key_pair(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public, mode 0644) and ``NAME.key_secret`` (mode 0600) into ``directory`` (made
    with mode 0700 if missing); returns their paths. FileExistsError if either exists: keys are never
    overwritten. The secret is never readable by others, not even briefly: the files are made in a private
    scratch directory and hard-linked into place (which also refuses to replace a file that appeared since)."""
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    existing = [str(p) for p in (public, secret) if p.exists() or p.is_symlink()]
    if existing:
        raise FileExistsError(f"{' and '.join(existing)} already exist{'s' if len(existing) == 1 else ''}")
    scratch = Path(tempfile.mkdtemp(prefix=".keys-", dir=directory))  # mode 0700
    try:
        made_public, made_secret = (Path(p) for p in zmq.auth.create_certificates(scratch, name))
        made_secret.chmod(0o600)
        made_public.chmod(0o644)
        secret.hardlink_to(made_secret)
        try:
            public.hardlink_to(made_public)
        except BaseException:
            secret.unlink()
            raise
    finally:
        shutil.rmtree(scratch)
    return public, secret


# ---------------------------------------------------------------------------------------------- sockets


class CurveServer:
    """Handed out by ``curve_server``: makes sockets of its context CURVE servers while its authenticator
    runs."""

    def __init__(self, ctx: zmq.Context[Any], keys: KeyPair) -> None:
        self._context = ctx.underlying
        self._keys = keys
        self.running = True

    def secure(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CURVE server with our key pair. Call before ``bind``: options set later do not
        apply to the bound endpoint."""
        if not self.running:
            raise RuntimeError("curve_server has ended: its authenticator no longer runs")
        if sock.context.underlying != self._context:
            raise ValueError("the socket belongs to another ZMQ context than this curve_server's authenticator")
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self._keys.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self._keys.public)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no authenticator (stopped, crashed): nobody gets in


class _AuthorizedKeys:
    """The authenticator's credentials provider: accepts the authorized client keys and logs each refused
    key once (it is asked again on every reconnect). Runs on the authenticator's thread."""

    def __init__(self, keys: ServerKeys) -> None:
        self.keys = keys
        self.refused: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys.authorized:
            return True
        if key not in self.refused and len(self.refused) < LOGGED_REFUSALS:
            self.refused.add(key)
            log.warning("refused a CURVE client: its public key %s is not in %s", key.decode(),
                        self.keys.authorized_dir)
        return False


@contextlib.contextmanager
def curve_server(ctx: zmq.Context[Any], keys: ServerKeys) -> Iterator[CurveServer]:
    """Run a ZAP authenticator for ``ctx`` that accepts only ``keys.authorized``; yields what secures its
    sockets. The authenticator (a thread) is stopped on exit, however the block ends."""
    from zmq.auth.thread import ThreadAuthenticator  # brings asyncio along: only where a server needs it

    # A shadow shares the libzmq context, so its inproc ZAP endpoint serves asyncio sockets too.
    auth = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying))
    try:
        auth.start()
    except zmq.ZMQError as e:
        auth.stop()  # closes what start() opened, or terminating the context would wait for it for ever
        if e.errno == zmq.EADDRINUSE:
            raise RuntimeError("this ZMQ context already runs a ZAP authenticator; open one curve_server per "
                               "context and secure all its sockets with it") from None
        raise
    server = CurveServer(ctx, keys.keys)
    try:
        auth.configure_curve_callback(ZAP_DOMAIN, _AuthorizedKeys(keys))
        yield server
    finally:
        server.running = False
        auth.stop()


def secure_client(sock: zmq.Socket[Any], keys: ClientKeys) -> None:
    """Make ``sock`` a CURVE client of the server whose public key ``keys`` holds. Call before ``connect``."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.keys.secret)


HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class RefusalWatch:
    """Logs, once per kind, why a client socket's handshakes fail, so a client the server refuses does not wait
    in silence; the warning says whether it must be restarted (see the module docstring), and ``final`` keeps
    that reason when libzmq will not connect again. ``check()`` does not block: call it when idle. ``close()``
    before the socket's context is terminated."""

    def __init__(self, sock: zmq.Socket[Any], address: str, keys: ClientKeys | None, who: str) -> None:
        self.address, self.keys, self.who = address, keys, who
        # why, once the server refused for good: libzmq 4.3.5 does not reconnect after a refused key or a missing
        # one (a protocol error ends the session), so the socket has no pipe left and a send would block for ever
        self.final: str | None = None
        # unique: not id(sock), which a socket made after this one closed may get while libzmq still unbinds this
        # monitor's endpoint (its IO thread does that later): EADDRINUSE, seen on a loaded machine
        endpoint = f"inproc://refusals.{uuid.uuid4().hex}"
        sock.monitor(endpoint, HANDSHAKE_FAILED)
        self._sock = sock
        self._events: zmq.Socket[bytes] = zmq.Context.shadow(sock.context.underlying).socket(zmq.PAIR)
        self._events.connect(endpoint)
        self._told: set[str] = set()

    def check(self) -> None:
        while True:
            try:
                frames = self._events.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = int(parse_monitor_message(frames)["event"])
            why = self._why(event)
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH or (
                    self.keys is None and event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):  # not NO_DETAIL: retried
                self.final = why
            if why not in self._told:
                self._told.add(why)
                log.warning("%s", why)

    def _why(self, event: int) -> str:
        where = f"the handshake with {self.address} failed"
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (f"{where}: the server refused this {self.who}'s key. Its public NAME.key must be in the server's "
                    f"security.authorized_keys directory (read when the server starts); then restart this {self.who}")
        if self.keys is None:
            return (f"{where}: the server requires CURVE keys (its public key and this {self.who}'s key pair); "
                    f"restart this {self.who} with them")
        return (f"{where}: the server's public key given to this {self.who} is not that server's, or the server "
                "does not use CURVE (retrying)")

    def close(self) -> None:
        self._sock.disable_monitor()
        self._events.close(linger=0)


def is_loopback(address: str) -> bool:
    """Whether a ``tcp://HOST:PORT`` address names this host only: 127.0.0.0/8, ::1 or localhost. Anything
    else (another IP, ``*``, an interface or host name) may be reachable from other hosts; other schemes
    are not tcp and give False."""
    if not address.startswith("tcp://"):
        return False
    host = address.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False



@dataclass(frozen=True)
class SecurityConfig:
    """CURVE keys for the tcp:// sockets the orchestrator binds (docs/security.md). Paths, like every path
    in this file except ``include``, are relative to the working directory unless absolute."""

    server_key: str | None = opt(None, doc="the orchestrator's secret key file NAME.key_secret (made by "
                                           "`orchestrator keys`); unset: no CURVE, tcp:// only on loopback")
    authorized_keys: str | None = opt(None, doc="directory of the public NAME.key files of the env workers and "
                                                "trainers allowed to connect (read at start)")
    allow_unauthenticated_trainer: bool = opt(False, doc="kind = 'prime-rl' only: allow a non-loopback trainer "
                                                         "address, though prime-rl's link has no authentication")

    def server_keys(self, address: str) -> ServerKeys | None:
        """The CURVE keys for a socket bound at ``address``: None for ipc:// (file permissions guard it) or
        when no keys are set. KeyFileError if a key file changed for the worse since the config loaded."""
        if self.server_key is None or self.authorized_keys is None or not address.startswith("tcp://"):
            return None
        return load_server_keys(self.server_key, self.authorized_keys)

    def problems(self, key: str, source: Source) -> Iterable[str]:
        """Keys set in pairs, and readable now (not at the first connection, minutes into the run)."""
        for name, value, other in (("server_key", self.server_key, "authorized_keys"),
                                   ("authorized_keys", self.authorized_keys, "server_key")):
            if value is None and getattr(self, other) is not None:
                yield (f"{source(f'{key}.{name}')}: {key}.{name}: required when {key}.{other} is set "
                       "(CURVE needs the orchestrator's secret key and the directory of its clients' public keys)")
        for name, value, load in (("server_key", self.server_key, load_key_pair),
                                  ("authorized_keys", self.authorized_keys, load_authorized_keys)):
            if value is not None:
                try:
                    load(value)
                except KeyFileError as e:
                    yield f"{source(f'{key}.{name}')}: {key}.{name}: {e}"
