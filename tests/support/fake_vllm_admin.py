"""A stand-in for one vLLM replica's VllmAdmin (trainer.worker.publish): what the publisher loads adapters into, which
can be unreachable or refuse. The HTTP side is exercised against real vLLM in tests/e2e; the replica and gateway tests
use this to drive publication and failover without one."""

from __future__ import annotations

from pathlib import Path

from trainer.worker.publish import PublishError, Unreachable


class FakeAdmin:
    """Stands in for one replica's VllmAdmin: `up` False is an unreachable vLLM, `refuse` one that answers 4xx/5xx."""

    def __init__(self, name: str) -> None:
        self.base_url = f"http://{name}:8000/v1"
        self.up = True
        self.refuse = False
        self.served: set[str] = set()
        self.loads = 0

    def _reach(self) -> None:
        if not self.up:
            raise Unreachable(f"vLLM unreachable at {self.base_url}: connection refused")

    def load(self, name: str, path: Path | str) -> None:
        self._reach()
        self.loads += 1
        if self.refuse:
            raise PublishError(f"vLLM refused to load {name} (500)")
        self.served.add(name)

    def unload(self, name: str) -> None:
        self._reach()
        self.served.discard(name)

    def models(self) -> set[str]:
        self._reach()
        return set(self.served)

    def check_answers(self, name: str) -> float:
        self._reach()
        if name not in self.served:
            raise PublishError(f"{name} is loaded but does not answer (404)")
        return 0.01

    def replicas(self) -> list[FakeAdmin]:
        return [self]
