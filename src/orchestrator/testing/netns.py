"""Separate hosts on one machine, for tests that need real network interfaces: Linux network namespaces.

``async with Network.open(("orch", "trainer", "intruder")) as net:`` makes one namespace per host, a bridge
in a namespace of its own, and a veth pair per host joining it to the bridge, each host with an address in
a private /24 (``net.address_of("orch")``) and ``lo`` up. ``await net.run("orch", *argv)`` starts a process
inside a host (``ip netns exec``, an asyncio subprocess); on exit every process is stopped by its pid
(SIGTERM, then SIGKILL) and every namespace deleted, however the block ends, which takes the interfaces
and the bridge with them. Nothing is added to the machine's own namespace, so its routes and addresses are
untouched, and a fixed port inside a host never collides with anything else.

Names carry the pid (``on<pid>-<host>``) so concurrent runs never meet; ``namespaces()`` lists what
exists, for tests that check nothing was left behind. ``unavailable()`` says why namespaces cannot be made
here (not root, no ``ip``, the kernel or container refuses), for ``pytest.skip``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import re
import shutil
import subprocess
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import IO, Any

from orchestrator.procs import terminate

Process = asyncio.subprocess.Process

STOP_S = 5.0  # a process still running this long after SIGTERM at exit is killed


def prefix() -> str:
    """The start of every namespace name this process makes."""
    return f"on{os.getpid()}-"


def namespaces() -> list[str]:
    """Names of the network namespaces that exist now (``ip netns list``)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True, timeout=30).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def unavailable() -> str | None:
    """None if namespaces, veth pairs and a bridge can be made here; else why not (for ``pytest.skip``)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) on this machine"
    probe = f"{prefix()}probe"
    steps = [["ip", "netns", "add", probe], ["ip", "-n", probe, "link", "add", "br0", "type", "bridge"],
             ["ip", "-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "b0"]]
    try:
        for argv in steps:
            done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
            if done.returncode:
                return f"`{' '.join(argv)}` failed here: {done.stderr.strip() or f'exit {done.returncode}'}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False, timeout=30)
    return None


class NetnsError(RuntimeError):
    """A namespace, interface or address could not be set up; names the ``ip`` command and its error."""


class Network:
    """Hosts on a private subnet; see the module docstring."""

    def __init__(self, hosts: Sequence[str], subnet: ipaddress.IPv4Network) -> None:
        if len(set(hosts)) != len(hosts) or not hosts:
            raise ValueError(f"hosts must be distinct names, got {list(hosts)}")
        self.hosts = tuple(hosts)
        self.subnet = subnet
        self.bridge_ns = f"{prefix()}bridge"
        self._addresses = {h: str(subnet.network_address + i + 1) for i, h in enumerate(self.hosts)}
        self._made: list[str] = []  # namespaces that exist, in creation order
        self._procs: list[Process] = []

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, hosts: Sequence[str]) -> AsyncIterator[Network]:
        """Make the hosts and the bridge; stop every process and delete every namespace on exit."""
        net = cls(hosts, await _free_subnet())
        try:
            await net._build()
            yield net
        finally:
            await net._teardown()

    def namespace(self, host: str) -> str:
        """The namespace name of ``host``."""
        if host not in self._addresses:
            raise KeyError(f"no host {host!r} in this network (hosts: {', '.join(self.hosts)})")
        return f"{prefix()}{host}"

    def address_of(self, host: str) -> str:
        """``host``'s IPv4 address (on its ``eth0``)."""
        self.namespace(host)  # KeyError for an unknown host
        return self._addresses[host]

    async def run(self, host: str, *argv: str, stdin: int | IO[Any] | None = None,
                  stdout: int | IO[Any] | None = None, stderr: int | IO[Any] | None = None, cwd: Path | None = None,
                  hostname: str | None = None,
                  own_sysfs: bool = True, env: dict[str, str] | None = None) -> Process:
        """Start ``argv`` inside ``host`` (environment and files as ours); stopped by its pid on exit if still
        running. ``stdin``/``stdout``/``stderr`` as for ``asyncio.create_subprocess_exec``. With ``hostname``
        it also gets a UTS namespace of its own with that host name, so it reports itself as another machine
        (``socket.gethostname()``: e.g. an env worker's pool ``host``). ``own_sysfs=False`` enters the network
        namespace only (``nsenter``), keeping this machine's /sys and its cgroup mounts, which slurmd needs: ``ip
        netns exec`` mounts a /sys of the namespace's own, without them."""
        if hostname is not None:  # unshare and sh exec in turn: the pid stays the command's own
            argv = ("unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', hostname, *argv)
        enter = (("ip", "netns", "exec", self.namespace(host)) if own_sysfs
                 else ("nsenter", f"--net=/run/netns/{self.namespace(host)}", "--"))
        proc = await asyncio.create_subprocess_exec(*enter, *argv, stdin=stdin, stdout=stdout, stderr=stderr,
                                                    cwd=cwd, env=env)
        self._procs.append(proc)  # `ip netns exec` and nsenter exec argv: this pid is the command's own
        return proc

    def pids(self, host: str) -> list[int]:
        """Every process inside ``host``'s network namespace now (``ip netns pids``), ours or their children."""
        out = subprocess.run(["ip", "netns", "pids", self.namespace(host)], capture_output=True, text=True,
                             check=False, timeout=30).stdout
        return [int(p) for p in out.split()]

    async def _build(self) -> None:
        await self._add_namespace(self.bridge_ns)
        await self._ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        await self._ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            ns = self.namespace(host)
            await self._add_namespace(ns)
            await self._ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"port{i}", "netns",
                           self.bridge_ns)
            await self._ip("-n", self.bridge_ns, "link", "set", f"port{i}", "master", "br0", "up")
            await self._ip("-n", ns, "addr", "add", f"{self._addresses[host]}/{self.subnet.prefixlen}", "dev", "eth0")
            await self._ip("-n", ns, "link", "set", "eth0", "up")

    async def _add_namespace(self, name: str) -> None:
        await self._ip("netns", "add", name)
        self._made.append(name)
        await self._ip("-n", name, "link", "set", "lo", "up")

    async def _teardown(self) -> None:
        for proc in self._procs:
            await terminate(proc, STOP_S)
        errors = []
        for name in reversed(self._made):
            proc = await asyncio.create_subprocess_exec("ip", "netns", "del", name, stderr=subprocess.PIPE)
            _, err = await proc.communicate()
            if proc.returncode:
                errors.append(f"ip netns del {name}: {err.decode().strip()}")
        self._made.clear()
        if errors:
            raise NetnsError("; ".join(errors))

    async def _ip(self, *args: str) -> None:
        proc = await asyncio.create_subprocess_exec("ip", *args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, err = await proc.communicate()
        if proc.returncode:
            raise NetnsError(f"`ip {' '.join(args)}` failed: {err.decode().strip() or f'exit {proc.returncode}'}")


async def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 picked from our pid that overlaps no address of this machine (the hosts' traffic never
    leaves their namespaces, but a familiar-looking clash would confuse whoever reads a failure)."""
    proc = await asyncio.create_subprocess_exec("ip", "-4", "-o", "addr", "show", stdout=subprocess.PIPE)
    out, _ = await proc.communicate()
    used = [ipaddress.ip_interface(a).network for a in re.findall(r"\binet (\S+)", out.decode())]
    pid = os.getpid()
    for n in range(256):
        subnet = ipaddress.IPv4Network(f"10.{100 + (pid + n) % 150}.{(pid // 150 + n) % 256}.0/24")
        if not any(subnet.overlaps(u) for u in used):
            return subnet
    raise NetnsError("no free 10.x.y.0/24 subnet for the test network")
