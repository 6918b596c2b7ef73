"""Which model vLLM should serve a run's calls with: the base model at version 0, adapter `run@step` later.

The table lives in memory so the hot path never asks the database; it is refreshed from published policy
versions in the background.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Route:
    run: str
    version: int
    served_name: str


class PolicyRouter:
    def __init__(self, base_model: str | None) -> None:
        self.base_model = base_model
        self._routes: dict[str, Route] = {}

    def resolve(self, run: str, base_model: str) -> Route:
        route = self._routes.get(run)
        return route if route is not None else Route(run, 0, base_model)

    def update(self, routes: list[Route]) -> None:
        self._routes = {route.run: route for route in routes}

    def runs(self) -> list[str]:
        return sorted(self._routes)
