"""A DNS a test controls, for ``inference.discover`` (``orchestrator.inference.discovery.Resolver``):
``StaticResolver({"rl-servers": ["127.0.0.2"]})`` answers what it holds; ``set(name, addresses)`` changes the answer
(a pod that becomes ready, or goes), ``fail(name, error)`` makes the lookup itself fail (a DNS server that does not
answer). ``asked`` counts the lookups of each name."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping


class StaticResolver:
    def __init__(self, answers: Mapping[str, Iterable[str]] = ()) -> None:  # type: ignore[assignment]
        self.answers = {name: list(addrs) for name, addrs in dict(answers).items()}
        self.errors: dict[str, OSError] = {}
        self.asked: Counter[str] = Counter()

    def set(self, name: str, addresses: Iterable[str]) -> None:
        self.answers[name] = list(addresses)
        self.errors.pop(name, None)

    def fail(self, name: str, error: OSError) -> None:
        self.errors[name] = error

    async def resolve(self, host: str) -> list[str]:
        self.asked[host] += 1
        if host in self.errors:
            raise self.errors[host]
        return sorted(self.answers.get(host, []))
