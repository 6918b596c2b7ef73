"""One model call in flight, and what a mode of the hot path may do with it once it has an outcome.

`Exchange` is the one object the hot path (gateway/proxy/hot_path.py) and its token_in mode
(gateway/proxy/token_in.py) hand around: the client's side of the call (its ASGI channels and the headers its answer
carries), what attribution and admission decided, and what the upstream answered. Everything a stage learns goes on
it, so a stage's signature names the call and only what is particular to that stage (a payload, an upstream
response), and the record is written from it alone.

`Outcome` is what token_in needs of the proxy: answer and record a call. It lives here, below both, so that the
proxy can hand token_in itself (it implements `Outcome`) without token_in importing the proxy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.types import Receive, Send

from gateway.http.errors import GatewayError
from gateway.proxy.attribution import Attribution
from gateway.proxy.capture import ChoiceCapture, ClientAsks
from gateway.proxy.routing import Route
from gateway.upstream.replicas import Lease


@dataclass(slots=True)
class Exchange:
    """Everything known about one call while it is in flight; becomes one record per choice.

    Which stage of `Proxy.handle` sets what (receive -> attribute -> admit -> forward -> relay -> record):

    - receive: `request_id`, `endpoint`, `capture`, `received`, `created_at`, `request`, and the client's ASGI
      `receive` and `send`;
    - attribute: `attribution`, `seq`, `retry_count`, `idempotency_key`, `stream`;
    - admit: `route` (the policy version that answers; forward may route a call again, when vLLM has retired its
      adapter), `off_policy` (the sampling plan), `asks` (which injected fields the client asked for itself),
      `headers` (the request id, attribution and policy version every answer carries);
    - forward: `lease`, `upstream_started`; in token_in mode also `segment_reason` and `predecessor`;
    - relay: `status`, `first_chunk`, `error`, `finished`; in token_in mode also `captured` and `history_keys`;
    - record: reads it all (`Proxy.submit`); nothing is set after.
    """

    request_id: str
    endpoint: str  # the label records and metrics carry: the API the client called
    capture: str  # CHAT or COMPLETIONS: the shape of vLLM's answer, which decides how it is read
    received: float
    created_at: float
    request: dict[str, Any]
    receive: Receive
    send: Send
    attribution: Attribution
    seq: int
    retry_count: int
    idempotency_key: str | None
    stream: bool
    route: Route
    off_policy: str | None  # why the call was sampled from another distribution than the one trained, if it was
    asks: ClientAsks
    headers: list[tuple[bytes, bytes]]  # sent with the answer, whatever it is
    lease: Lease | None = None  # the vLLM replica answering the call (gateway/upstream/replicas.py)
    upstream_started: float = 0.0
    # token_in runs (gateway/proxy/token_in.py): why the call started a new token segment, and the (seq, choice) its
    # prompt continues; then the ids per choice when they don't come from the response itself, and each choice's
    # history key.
    segment_reason: str | None = None
    predecessor: tuple[int, int] | None = None
    status: int | None = None
    first_chunk: float | None = None
    error: str | None = None
    finished: float = 0.0
    captured: list[ChoiceCapture] | None = None
    history_keys: dict[int, str] = field(default_factory=dict)

    @property
    def replica_label(self) -> str:
        return self.lease.replica.url if self.lease is not None else ""


class Outcome(Protocol):
    """Answer and record a call: what a mode of the hot path hands back to the proxy (`Proxy` implements it)."""

    async def fail(self, call: Exchange, error: GatewayError) -> None:
        """Record the call as failed with `error` and answer it with that error."""

    async def send_answer(self, call: Exchange, status: int, body: bytes, content_type: bytes) -> None:
        """Send a whole (non-stream) answer, already recorded, and count it."""

    def submit(self, call: Exchange, response: dict[str, Any] | None) -> None:
        """Record the call: one record per choice, one error record if it has none."""
