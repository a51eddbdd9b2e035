"""Key files for tests of authenticated links: a server, its authorized clients, and peers that must not
get in, laid out as a user would (``orchestrator keys`` per host; the clients' public halves copied into
the server's authorized directory)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from orchestrator.security import ClientKeys, ServerKeys, create_key_pair, load_client_keys, load_server_keys


@dataclass(frozen=True)
class KeySet:
    """Under ``directory``: ``server/orchestrator.key{,_secret}``, ``clients/NAME.key{,_secret}`` for each
    authorized client and for ``intruder`` and ``old-server`` (never authorized), and ``authorized/`` with
    the authorized clients' public keys."""

    directory: Path

    @property
    def server_secret(self) -> Path:
        return self.directory / "server" / "orchestrator.key_secret"

    @property
    def server_public(self) -> Path:
        return self.directory / "server" / "orchestrator.key"

    @property
    def authorized_dir(self) -> Path:
        return self.directory / "authorized"

    def client_secret(self, name: str) -> Path:
        return self.directory / "clients" / f"{name}.key_secret"

    def server(self) -> ServerKeys:
        return load_server_keys(self.server_secret, self.authorized_dir)

    def client(self, name: str) -> ClientKeys:
        """The keys of client ``name`` (authorized or not) for this server."""
        return load_client_keys(self.server_public, self.client_secret(name))

    def wrong_server(self, name: str) -> ClientKeys:
        """Client ``name``'s own keys, but another server's public key (e.g. one from before a key change)."""
        return load_client_keys(self.directory / "clients" / "old-server.key", self.client_secret(name))


def make_key_set(directory: Path, clients: tuple[str, ...] = ("trainer",)) -> KeySet:
    """Create the keys of a ``KeySet`` in ``directory``: ``clients`` are authorized."""
    keys = KeySet(directory)
    create_key_pair(directory / "server", "orchestrator")
    keys.authorized_dir.mkdir(mode=0o700)
    for name in (*clients, "intruder", "old-server"):
        public, _ = create_key_pair(directory / "clients", name)
        if name in clients:
            shutil.copy(public, keys.authorized_dir / public.name)
    return keys
