"""Which model vLLM should serve a run's calls with: the base model at version 0, adapter `run@step` later.

The table lives in memory so the hot path never asks the database; the gateway refreshes it from the runs and
their loaded policy versions in the background (and at once after `POST /v1/runs`). It also carries each run's
sampling settings (overrides and `on_policy_sampling`), which the gateway applies to every call of the run, its
token mode, and how new training groups are admitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import Engine

from gateway.store.runs import route_table


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    mode: str  # "wait" or "reject"
    timeout_s: float
    # A group admitted on version V is served only by versions V..V + max_staleness (0: exactly V).
    max_staleness: int = 0


@dataclass(frozen=True, slots=True)
class Route:
    run: str
    version: int
    served_name: str
    # Sampling parameters that replace the client's in the upstream request (the run's config.sampling).
    sampling: dict[str, Any] = field(default_factory=dict)
    # Train-mode calls are sampled neutral unless the run turned this off (gateway/proxy/sampling.py).
    on_policy_sampling: bool = True
    # "chat" or "token_in" (gateway/runs/config.py): how chat calls reach vLLM.
    token_mode: str = "chat"
    # How a call starting a new training group is admitted (gateway/proxy/admit.py); None: no bound to keep (the run
    # says off, or no trainer has taken it yet, so there is nothing to pace the agents against).
    admission: AdmissionPolicy | None = None
    # Every version vLLM serves the run by, oldest first, as (version, served name); version 0 is the base model.
    loaded: tuple[tuple[int, str], ...] = ()

    def for_group(self, admitted: int) -> Route:
        """The route for a call of a group admitted on version `admitted`: the newest loaded version its bound
        allows (admitted .. admitted + max_staleness), so a group never mixes versions beyond its bound, and at
        max_staleness 0 every call of it is served by exactly the version it was admitted on. When none of those is
        loaded any more the group is stale already (the trainer drops it): the newest version serves it."""
        top = admitted + (self.admission.max_staleness if self.admission is not None else 0)
        if admitted <= self.version <= top:
            return self
        for version, name in reversed(self.loaded):
            if admitted <= version <= top:
                return replace(self, version=version, served_name=name)
        return self


class PolicyRouter:
    def __init__(self, base_model: str | None) -> None:
        self.base_model = base_model
        self._routes: dict[str, Route] = {}
        # The database's clock before the table was last read (None: never): published in this gateway's heartbeat,
        # so the trainer unloads a retired adapter only once no gateway can still route to it.
        self.read_at: float | None = None

    def resolve(self, run: str, base_model: str) -> Route:
        route = self._routes.get(run)
        return route if route is not None else Route(run, 0, base_model)

    def update(self, routes: list[Route]) -> None:
        self._routes = {route.run: route for route in routes}

    def runs(self) -> list[str]:
        return sorted(self._routes)

    def refresh(self, engine: Engine) -> None:
        """Reload the table from the database (blocking: call it off the event loop); raises SQLAlchemyError.
        A run with no loaded adapter is served by its base model at version 0."""
        rows, read_at = route_table(engine)
        self.update(
            [
                Route(
                    row.run,
                    row.version or 0,
                    row.served_name or row.base_model,
                    row.sampling,
                    row.on_policy_sampling,
                    row.token_mode,
                    AdmissionPolicy(row.admission, row.admission_timeout_s, row.max_staleness)
                    if row.admission != "off" and row.trained
                    else None,
                    row.loaded,
                )
                for row in rows
            ]
        )
        self.read_at = read_at
