"""One model call in flight, and what a mode of the hot path may do with it once it has an outcome.

`Exchange` is the one object the hot path (gateway/proxy/hot_path.py) and its token_in mode
(gateway/proxy/token_in.py) hand around: the client's side of the call (its ASGI channels and the headers its answer
carries), what attribution and admission decided, and what the upstream answered. Everything a stage learns goes on
it, so a stage's signature names the call and only what is particular to that stage (a payload, an upstream
response), and the record is written from it alone.

`Caller` is who called, as the entry that read the request derived it (the chat endpoints' ASGI handler, or an edge
translator that turned its own API's request into a chat request): what attribution and the run check read.

`Answer` is where a call's answer goes, as the chat path produces it: a chat completion or each stream chunk as a
dict, or an error. The chat client's own (`ChatAnswer`, gateway/proxy/asgi_io.py) serialises them; the edge translators
(gateway/edge/) turn the same dicts into their API's answer, so nothing is serialised only to be parsed again.

`Outcome` is what token_in needs of the proxy: answer and record a call. It lives here, below both, so that the
proxy can hand token_in itself (it implements `Outcome`) without token_in importing the proxy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.types import Receive

from gateway.http.errors import GatewayError
from gateway.proxy.attribution import Attribution, PathPrefix
from gateway.proxy.capture import ChoiceCapture, ClientAsks
from gateway.proxy.routing import Route
from gateway.upstream.replicas import Lease

Headers = list[tuple[bytes, bytes]]


@dataclass(frozen=True, slots=True)
class Caller:
    """A call as its entry received it, before the proxy attributes it (`Proxy.serve`)."""

    request_id: str
    endpoint: str  # the label records and metrics carry: the API the client called
    capture: str  # CHAT or COMPLETIONS: the endpoint vLLM is asked
    received: float
    created_at: float
    headers: dict[str, str]  # the client's own request headers, names lower-cased
    prefix: PathPrefix | None  # the attribution path prefix, if the client used one
    key_group: str | None  # the attribution carried by the API key's suffix
    key_trajectory: str | None
    runs: frozenset[str] | None  # the runs the key is bound to (None: any)
    # The request's size as the chat path would read it: the body, or the chat request an edge built from its own
    # (what is recorded), both within TRAJGATE_MAX_BODY_BYTES.
    body_bytes: int


class Answer(Protocol):
    """Where a call's answer goes, as dicts: a whole answer in one call, a stream as `start`, then chunks buffered
    per upstream read and sent by `flush`, then `end`. Every method after the first answer is the stream's; the
    headers are those every answer carries (request id, attribution, policy version)."""

    async def error(self, error: GatewayError, headers: Headers) -> None:
        """Answer with an error of the gateway's own (the call was refused, or vLLM could not be reached)."""

    async def answer(self, response: dict[str, Any], content_type: bytes, headers: Headers) -> None:
        """Answer with a chat (or completions) response, already recorded and stripped of what the client did not
        ask for."""

    async def passthrough(self, status: int, body: bytes, content_type: bytes, headers: Headers) -> None:
        """Answer with vLLM's own body where it is no response to read (an error status, or not JSON)."""

    async def start(self, headers: Headers) -> None:
        """Start an event stream (status 200)."""

    def chunk(self, chunk: dict[str, Any]) -> None:
        """One chunk, as the client gets it: held until `flush`."""

    def error_chunk(self, chunk: dict[str, Any], payload: bytes) -> None:
        """vLLM's error event mid-stream (`payload` as vLLM sent it): held until `flush`."""

    def done(self) -> None:
        """The stream is complete (OpenAI's `[DONE]`): held until `flush`."""

    async def flush(self) -> None:
        """Send what the chunks held since the last flush give the client, if anything."""

    async def broke(self, message: str) -> None:
        """The stream failed: tell the client in-band, now. What was held and not flushed is dropped: the read it
        came from failed."""

    async def end(self) -> None:
        """End the stream's body."""


@dataclass(slots=True)
class Exchange:
    """Everything known about one call while it is in flight; becomes one record per choice.

    Which stage of `Proxy.serve` sets what (receive -> attribute -> admit -> forward -> relay -> record):

    - receive: `request_id`, `endpoint`, `capture`, `received`, `created_at`, `request`, the client's ASGI
      `receive` (watched for a hang-up) and where its answer goes (`answer`);
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
    answer: Answer
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

    async def send_answer(self, call: Exchange, response: dict[str, Any]) -> None:
        """Send a whole (non-stream) chat answer, already recorded and stripped for the client, and count it."""

    def submit(self, call: Exchange, response: dict[str, Any] | None) -> None:
        """Record the call: one record per choice, one error record if it has none."""
