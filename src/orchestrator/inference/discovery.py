"""The server list as a DNS name: every address the name resolves to is an inference server (``inference.discover``).

A Kubernetes headless service resolves to one address per ready pod (its readiness probe decides), so following
it follows the servers as they come and go. ``ServerDiscovery.run()`` resolves the name every
``discover_interval_s`` and tells the pool: an address that appears is ``InferencePool.add``ed (out of rotation:
the pool's probe admits it after preflight, a weight sync to the current policy and a generate canary), one
that vanishes is ``InferencePool.remove``d (out of rotation at once; its rollouts in flight end as they end).
A failed lookup (a DNS server that does not answer) changes nothing and is logged once per cause; a name with
no address (no pod ready yet) empties the list.

``Resolver`` is the interface to DNS (a Protocol with one method): ``SystemResolver`` asks the system's resolver
(getaddrinfo); tests give one they control (``orchestrator.testing.resolver.StaticResolver``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Iterable
from typing import Protocol
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger(__name__)

NOT_FOUND = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}
FIRST_WARN_S = 30.0


class ServerList(Protocol):
    """What discovery changes: the pool's servers (``InferencePool``)."""

    def urls(self) -> Iterable[str]: ...

    def add(self, url: str) -> object: ...

    def remove(self, url: str, why: str) -> None: ...


class Resolver(Protocol):
    """DNS, as discovery uses it."""

    async def resolve(self, host: str) -> list[str]:
        """The addresses ``host`` names now ([] when it names none); OSError when the lookup itself failed."""
        ...


class SystemResolver:
    """The system's resolver (``getaddrinfo``, off the event loop through asyncio)."""

    async def resolve(self, host: str) -> list[str]:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            if e.errno in NOT_FOUND:
                return []
            raise
        return sorted({str(info[4][0]) for info in infos})


def server_url(template: str, address: str) -> str:
    """``template`` (``http://NAME:PORT/v1``) with its host replaced by ``address``."""
    parts = urlsplit(template)
    host = f"[{address}]" if isinstance(ipaddress.ip_address(address), ipaddress.IPv6Address) else address
    return urlunsplit(parts._replace(netloc=f"{host}:{parts.port}"))


class ServerDiscovery:
    """Follows ``url``'s host name as ``pool``'s server list (see the module docstring)."""

    def __init__(self, url: str, resolver: Resolver, interval_s: float) -> None:
        self.url, self.resolver, self.interval_s = url, resolver, interval_s
        host = urlsplit(url).hostname
        assert host is not None  # InferenceConfig.problems
        self.host = host
        self._failing = ""  # the last lookup's error, logged once

    async def urls(self) -> list[str] | None:
        """The servers' URLs the name gives now; None when the lookup failed (logged once per cause)."""
        try:
            addresses = await self.resolver.resolve(self.host)
        except OSError as e:
            if str(e) != self._failing:
                self._failing = str(e)
                log.warning("inference.discover: cannot resolve %s (%s); the server list stays as it is", self.host, e)
            return None
        if self._failing:
            self._failing = ""
            log.info("inference.discover: %s resolves again", self.host)
        return [server_url(self.url, a) for a in addresses]

    async def first(self, warn_s: float = FIRST_WARN_S) -> list[str]:
        """The first non-empty list (before the pool opens: preflight needs a server); says what it waits for
        every ``warn_s``."""
        loop = asyncio.get_running_loop()
        t0 = warned = loop.time()
        while True:
            urls = await self.urls()
            if urls:
                log.info("inference.discover: %s gives %d server(s): %s", self.host, len(urls), ", ".join(urls))
                return urls
            if loop.time() - warned >= warn_s:
                warned = loop.time()
                log.warning("inference.discover: %s has given no server for %.0f s (no pod ready yet?); waiting",
                            self.host, warned - t0)
            await asyncio.sleep(self.interval_s)

    async def run(self, pool: ServerList) -> None:
        """Every ``interval_s``: resolve, then add new servers to ``pool`` and remove vanished ones. Consumes the
        name's answers, produces ``pool.add`` / ``pool.remove`` calls; wakes on its timer only; runs until
        cancelled (owned by the pool's ``run``)."""
        while True:
            await asyncio.sleep(self.interval_s)
            urls = await self.urls()
            if urls is None:
                continue
            have = set(pool.urls())
            for url in urls:
                if url not in have:
                    pool.add(url)
            for url in have - set(urls):
                pool.remove(url, f"{self.host} no longer resolves to it")
