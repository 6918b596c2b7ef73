"""The hot path: receive -> attribute -> admit -> forward -> relay -> record (enqueue the record for the writer).

Written as a raw ASGI handler (no framework routing or validation on the way) because it sits in front of
every model call; everything it records goes to the writer's queue, and it awaits the database only in the bounded cases
docs/design.md lists: a group this process has not seen admitted, a token_in turn whose predecessor is not in this
process's memory, a Responses `previous_response_id` not in memory. `serve` is the
one path every model call takes once its request is parsed, the APIs translated at the edge included; it answers
through the call's `Answer` (gateway/proxy/exchange.py), in dicts, so only the chat client's answer is serialised.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

import aiohttp
import orjson
from sqlalchemy import Engine
from starlette.types import Receive, Scope, Send

from gateway.http import sse
from gateway.http.auth import Auth, presented_key
from gateway.http.errors import GatewayError
from gateway.http.metrics import GatewayMetrics
from gateway.http.sse import DONE_PAYLOAD
from gateway.proxy import capture, sampling
from gateway.proxy.admit import Admission
from gateway.proxy.asgi_io import ChatAnswer, relay_until_done, send_bytes
from gateway.proxy.attribution import PathPrefix, attribute, check_bound, check_run, split_api_key
from gateway.proxy.exchange import Answer, Caller, Exchange
from gateway.proxy.routing import PolicyRouter
from gateway.proxy.token_in import TokenIn
from gateway.proxy.turns import SeqClock
from gateway.recorder.writer import RecordWriter
from gateway.store.call_record import CallRecord
from gateway.store.models import CHAT, COMPLETIONS
from gateway.upstream.client import UpstreamError, UpstreamPool, UpstreamResponse
from gateway.upstream.failures import exchange_error
from gateway.upstream.replicas import Replica, Replicas, fetch_models

ENDPOINTS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS}
PATHS = {endpoint: path for path, endpoint in ENDPOINTS.items()}


class Proxy:
    def __init__(
        self,
        upstream_urls: list[str],
        upstream_api_key: str | None,
        upstream_timeout_s: float,
        max_body_bytes: int,
        auth: Auth,
        router: PolicyRouter,
        writer: RecordWriter,
        metrics: GatewayMetrics,
        engine: Engine | None = None,
        token_state_wait_s: float = 0.0,
        admission_poll_s: float = 0.5,
        token_in_templates: str | None = None,
    ) -> None:
        self.replicas = Replicas(upstream_urls)
        self.max_body_bytes = max_body_bytes
        self.auth = auth
        self.router = router
        self.writer = writer
        self.metrics = metrics
        self.seq_clock = SeqClock()
        self._id_base = os.urandom(8).hex()
        self._ids = itertools.count()
        self.upstream_headers = {"content-type": "application/json"}
        if upstream_api_key:
            self.upstream_headers["authorization"] = f"Bearer {upstream_api_key}"
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=upstream_timeout_s)
        self.session: aiohttp.ClientSession | None = None  # the control plane: /models, token text
        self.upstream = UpstreamPool(self.upstream_headers, connect_timeout_s=10, read_timeout_s=upstream_timeout_s)
        self.token_in = TokenIn(
            self.upstream, self.replicas, self, metrics, engine, token_state_wait_s, token_in_templates
        )
        self.admission = Admission(engine, router, metrics, admission_poll_s)

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
        self.session = aiohttp.ClientSession(connector=connector, timeout=self._timeout, auto_decompress=True)

    async def close(self) -> None:
        self.upstream.close()
        if self.session is not None:
            await self.session.close()

    async def base_model(self) -> str:
        """TRAJGATE_BASE_MODEL, or else the first model vLLM lists (asked once)."""
        if self.router.base_model is None:
            models = await self.upstream_models()
            if not models:
                raise GatewayError(502, "TRAJGATE_BASE_MODEL is unset and vLLM lists no model", "upstream_error")
            name = models[0].get("id")
            if not isinstance(name, str) or not 0 < len(name) <= MAX_BASE_MODEL or "\x00" in name:
                # (it is every record's base model: one the store cannot hold would lose every call, answered)
                message = f"vLLM's first model is not a name the store can hold: set TRAJGATE_BASE_MODEL ({name!r:.80})"
                raise GatewayError(502, message, "upstream_error")
            self.router.base_model = name
        return self.router.base_model

    async def upstream_models(self, replica: Replica | None = None) -> list[dict[str, Any]]:
        """`/models` of one replica (by default the least-loaded healthy one)."""
        assert self.session is not None
        replica = replica or self.replicas.pick(None, None)
        try:
            models = await fetch_models(self.session, self.upstream_headers, replica)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            raise GatewayError(502, f"vLLM unreachable: {type(exc).__name__}", "upstream_error") from None
        if models is None:
            raise GatewayError(502, "vLLM /models did not answer 200", "upstream_error")
        return models

    def new_request_id(self) -> str:
        """A new request id: 64 random bits per process and a counter, as unique as a uuid4 and without a system
        call."""
        return f"req-{self._id_base}{next(self._ids):016x}"

    async def handle(self, scope: Scope, receive: Receive, send: Send, prefix: PathPrefix | None) -> None:
        """The chat and completions endpoints: read and authenticate the request, then serve it (`serve`) with the
        chat client's own answer (`ChatAnswer`)."""
        received = time.perf_counter()
        created_at = time.time()
        request_id = self.new_request_id()
        endpoint = ENDPOINTS[prefix.rest if prefix else scope["path"]]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        answer = ChatAnswer(send)
        try:
            key, key_group, key_trajectory = split_api_key(presented_key(headers))
            runs = self.auth.check_agent(key)  # before the body: an unauthenticated caller learns nothing about it
            body = await self.read_body(receive, headers)
            request = parse_json(body)
        except GatewayError as exc:
            await self._refuse(endpoint, request_id, exc, answer)
            return
        caller = Caller(
            request_id, endpoint, endpoint, received, created_at, headers, prefix, key_group, key_trajectory, runs,
            len(body),
        )  # fmt: skip
        await self.serve(request, caller, receive, answer)

    async def serve(self, request: dict[str, Any], caller: Caller, receive: Receive, answer: Answer) -> None:
        """One model call, from a parsed request on: attribute -> admit -> forward -> relay -> record, answered
        through `answer`. The chat endpoints come here from `handle`; the APIs translated at the edge
        (gateway/edge/) with the chat request they built, their caller as they read it, and their own `Answer`."""
        headers = caller.headers
        try:
            if caller.body_bytes > self.max_body_bytes:  # an edge's chat request, grown past the client's body
                raise _too_large(self.max_body_bytes)
            attribution = attribute(headers, caller.prefix, caller.key_group, caller.key_trajectory)
            retry_count, idempotency_key = _retry_headers(headers)
            run = check_bound(named_run(headers, request), caller.runs)
            route = self.router.resolve(run, await self.base_model())
            if self.admission.applies(route, attribution):  # a group's version, admitted first if new here
                route = await self.admission.route(route, attribution, receive)
            plan = sampling.plan(request, attribution.mode, route.sampling, route.on_policy_sampling)
            upstream_body, asks = capture.prepare_upstream(
                request, caller.capture, route.served_name, overrides=plan.upstream
            )
            upstream_payload = _serialise(upstream_body)
        except GatewayError as exc:
            await self._refuse(caller.endpoint, caller.request_id, exc, answer)
            return

        request_id = caller.request_id
        call = Exchange(
            request_id=request_id,
            endpoint=caller.endpoint,
            capture=caller.capture,
            received=caller.received,
            created_at=caller.created_at,
            request=request,
            receive=receive,
            answer=answer,
            attribution=attribution,
            seq=self.seq_clock.next(),
            retry_count=retry_count,
            idempotency_key=idempotency_key,
            stream=capture.vllm_bool(request.get("stream")),
            route=route,
            off_policy=plan.off_policy,
            asks=asks,
            headers=[
                (b"x-request-id", request_id.encode()),
                (b"x-trajectory-id", attribution.trajectory_id.encode()),
                (b"x-group-id", attribution.group_id.encode()),
                (b"x-policy-version", str(route.version).encode()),
            ],
        )
        call.lease = self.replicas.lease(attribution.trajectory_id, route.served_name)
        try:
            if caller.capture == CHAT and route.token_mode == "token_in":
                await self.token_in.handle(call, upstream_body)
            else:
                await self._forward(call, PATHS[caller.capture], upstream_payload)
        finally:
            call.lease.release()

    async def _refuse(self, endpoint: str, request_id: str, error: GatewayError, answer: Answer) -> None:
        """Answer a call refused before it was forwarded (nothing is recorded: nothing was generated)."""
        self.metrics.count_request(endpoint, error.status)
        headers = [(b"x-request-id", request_id.encode())]
        headers += [(name.encode(), value.encode()) for name, value in error.headers().items()]
        await answer.error(error, headers)

    async def _forward(self, call: Exchange, path: str, payload: bytes) -> None:
        """Chat and completions calls: vLLM's own endpoint, answered as it arrives."""
        assert call.lease is not None
        call.upstream_started = time.perf_counter()
        upstream = await self._post(call, path, payload)
        if upstream is None:
            return
        body: bytes | None = None  # a 404's body, read to see whether it names a retired adapter
        if upstream.status == 404 and call.route.version > 0:
            try:
                body = await upstream.read()
            except (UpstreamError, TimeoutError) as exc:
                upstream.release()
                await self.fail(call, exchange_error(exc))
                return
            again = await self._reroute_retired(call, payload, body)
            if again is not None:
                upstream.release()
                upstream = await self._post(call, path, again)
                if upstream is None:
                    return
                body = None

        call.lease.answered(upstream.status)
        try:
            is_sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
            if call.stream and upstream.status == 200 and is_sse:
                await self._relay_stream(upstream, call)
            else:
                await self._relay_whole(upstream, call, body)
        finally:
            upstream.release()

    async def _post(self, call: Exchange, path: str, payload: bytes) -> UpstreamResponse | None:
        """POST the call to its replica; None once a failure to reach vLLM has been answered and recorded."""
        assert call.lease is not None
        try:
            return await call.lease.post(self.upstream, path.removeprefix("/v1"), payload)
        except (TimeoutError, UpstreamError) as exc:
            await self.fail(call, exchange_error(exc))
        return None

    async def _reroute_retired(self, call: Exchange, payload: bytes, body: bytes) -> bytes | None:
        """vLLM answered 404 naming the adapter the call was routed to: the trainer retired (unloaded) it after this
        gateway's route table was read. Nothing was generated, so the call is routed again, to the run's version
        after a reload of the table, and recorded with (and answered under) that version: the new payload. None
        (vLLM's 404 is the answer) for any other 404, or when the reload names the same adapter."""
        if call.route.served_name.encode() not in body:
            return None
        now = await self.admission.reloaded(call.route)
        if now.served_name == call.route.served_name:
            return None
        request = orjson.loads(payload)
        request["model"] = now.served_name
        call.route = now
        version = str(now.version).encode()
        call.headers = [(name, version if name == b"x-policy-version" else value) for name, value in call.headers]
        self.metrics.retired_adapter_retries.inc()
        return orjson.dumps(request)

    async def _relay_whole(self, upstream: UpstreamResponse, call: Exchange, body: bytes | None = None) -> None:
        """Non-stream responses, and any upstream error: read the body (unless `body` was read already), record,
        answer."""
        try:
            raw = body if body is not None else await upstream.read()
        except (UpstreamError, TimeoutError) as exc:
            await self.fail(call, exchange_error(exc))
            return
        call.finished = time.perf_counter()
        call.status = upstream.status
        content_type = upstream.headers.get("content-type", "application/json").encode()
        if upstream.status == 200:
            try:
                response = orjson.loads(raw)
            except orjson.JSONDecodeError:
                call.error = "upstream sent a body that is not JSON"
            else:
                self.submit(call, response)
                capture.strip_for_client(response, call.asks)
                await self.send_answer(call, response, content_type)
                return
        else:
            # Postgres text cannot hold a NUL; an upstream error body is for people to read, so U+FFFD will do.
            call.error = raw[:4000].decode("utf-8", "replace").replace("\x00", "\ufffd")
        self.submit(call, None)
        await call.answer.passthrough(upstream.status, raw, content_type, call.headers)
        self._answered(call, upstream.status)

    async def send_answer(
        self, call: Exchange, response: dict[str, Any], content_type: bytes = b"application/json"
    ) -> None:
        """Send a whole (non-stream) answer, already recorded and stripped for the client, and count it."""
        await call.answer.answer(response, content_type, call.headers)
        self._answered(call, 200)

    def _answered(self, call: Exchange, status: int) -> None:
        """Count a whole answer just sent, with the latency the gateway added around vLLM's time."""
        done = time.perf_counter()
        self.metrics.count_request(call.endpoint, status)
        self.metrics.observe_upstream(call.endpoint, call.replica_label, call.finished - call.upstream_started)
        self.metrics.observe_added(call.endpoint, (call.upstream_started - call.received) + (done - call.finished))

    async def _relay_stream(self, upstream: UpstreamResponse, call: Exchange) -> None:
        """Forward each SSE event as it arrives (no buffering); assemble the record on the side.

        The events one upstream read delivers go to the client in one write: an ASGI `send` costs more than the
        event's own work (uvicorn's flow control, a transport write), and they arrived together anyway, so
        nothing is held back. The record is written whatever happens to the writes to the client: the OpenAI SDK hangs up as soon as it
        reads `data: [DONE]`, and a client that leaves early still leaves a partial call worth recording.
        """
        call.status = 200
        answer = call.answer
        emit = answer.chunk  # bound once: it runs for every event
        assembler = capture.StreamAssembler(call.capture, strip=call.asks)  # also strips each chunk for the client
        state = {"done": False, "recorded": False}

        def record() -> None:
            if state["recorded"]:
                return
            state["recorded"] = True
            call.finished = time.perf_counter()
            if not state["done"] and call.error is None:
                call.error = "stream ended without [DONE]"
            self.submit(call, assembler.response() if assembler.chunks else None)

        def fail(error: str) -> None:
            call.error = error
            record()

        await answer.start(call.headers)

        def relay_event(payload: bytes) -> None:
            """Feed one event's data to the record and hand what the client gets for it to the answer."""
            if payload == DONE_PAYLOAD:
                state["done"] = True
                record()  # before the client sees [DONE]: it may hang up, and a flush must find the record
                answer.done()
                return
            if call.first_chunk is None:
                call.first_chunk = time.perf_counter()
            try:
                chunk = orjson.loads(payload)
            except orjson.JSONDecodeError:
                call.error = "upstream sent an SSE event that is not JSON"
                return
            if "choices" not in chunk and "error" in chunk:  # (a chunk has choices: one lookup for it)
                call.error = orjson.dumps(chunk["error"]).decode()
                answer.error_chunk(chunk, payload)
            else:
                assembler.feed(chunk)
                emit(chunk)

        async def pump() -> None:
            lines = sse.DataLines()
            flush = answer.flush
            async for data in upstream.iter_chunks():
                for payload in lines.feed(data):
                    relay_event(payload)
                await flush()
            last = lines.end()
            if last is not None:
                relay_event(last)
                await flush()
            state["done"] = True

        try:
            error = await relay_until_done(pump(), call.receive, answer.broke, lambda: state["done"], fail)
            if error is not None:
                call.error = error
        finally:
            if not state["done"]:
                upstream.close()  # drop the connection so vLLM sees the hang-up and stops generating
            record()
            self.metrics.count_request(call.endpoint, 200)
            if call.first_chunk is not None:
                self.metrics.observe_upstream(
                    call.endpoint, call.replica_label, call.first_chunk - call.upstream_started
                )
        await answer.end()

    async def fail(self, call: Exchange, error: GatewayError) -> None:
        """Record the call as failed and answer the client with the error."""
        call.finished = time.perf_counter()
        call.status = error.status
        call.error = error.message
        self.submit(call, None)
        self.metrics.count_request(call.endpoint, error.status)
        await call.answer.error(error, call.headers)

    def submit(self, call: Exchange, response: dict[str, Any] | None) -> None:
        """One record per choice (n > 1 gives several rows of the same turn); one error record if none."""
        latency_ms = (call.finished - call.received) * 1000
        ttft_ms = (call.first_chunk - call.received) * 1000 if call.first_chunk is not None else None
        if call.captured is not None:
            choices = call.captured
        else:
            choices = capture.choices_from_response(response, call.capture) if response else []
        stored_response = capture.slim_response(response) if response else None
        if not choices:
            choices = [capture.ChoiceCapture(0, None, None, None, None)]
        reason: str | None
        for choice in choices:
            if call.error is not None:
                trainable, reason = False, call.error if call.status == 200 else f"upstream status {call.status}"
            else:
                trainable, reason = capture.check_trainable(
                    choice.prompt_token_ids, choice.completion_token_ids, choice.logprobs
                )
                if trainable and call.off_policy is not None:
                    trainable, reason = False, call.off_policy
            self.writer.submit(
                CallRecord(
                    id=call.request_id if choice.index == 0 else f"{call.request_id}-{choice.index}",
                    run=call.route.run,
                    base_model=self.router.base_model or call.route.served_name,
                    trajectory_id=call.attribution.trajectory_id,
                    group_id=call.attribution.group_id,
                    group_size=call.attribution.group_size,
                    mode=call.attribution.mode,
                    seq=call.seq,
                    choice_index=choice.index,
                    policy_version=call.route.version,
                    endpoint=call.endpoint,
                    stream=call.stream,
                    request=call.request,
                    response=stored_response,
                    prompt_token_ids=choice.prompt_token_ids,
                    completion_token_ids=choice.completion_token_ids,
                    completion_logprobs=choice.logprobs,
                    finish_reason=_storable(choice.finish_reason),
                    usage=response.get("usage") if response else None,
                    status_code=call.status,
                    error=_storable(call.error),
                    trainable=trainable,
                    untrainable_reason=_storable(reason),
                    latency_ms=latency_ms,
                    ttft_ms=ttft_ms,
                    retry_count=call.retry_count,
                    idempotency_key=call.idempotency_key,
                    created_at=call.created_at,
                    history_key=call.history_keys.get(choice.index),
                    segment_reason=call.segment_reason,
                    predecessor_seq=call.predecessor[0] if call.predecessor else None,
                    predecessor_choice=call.predecessor[1] if call.predecessor else None,
                    generated_trajectory=call.attribution.generated,
                )
            )

    async def read_body(self, receive: Receive, headers: dict[str, str]) -> bytes:
        """The whole request body within TRAJGATE_MAX_BODY_BYTES (413 above it): every API surface reads it here."""
        declared = _int_header(headers.get("content-length"))
        if declared > self.max_body_bytes:
            raise _too_large(self.max_body_bytes)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise GatewayError(400, "client disconnected before sending the body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _too_large(self.max_body_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"request body larger than {limit} bytes", code="request_too_large")


def named_run(headers: dict[str, str], request: dict[str, Any]) -> str:
    """The run a call names: `X-Run`, else `model` (the APIs translated at the edge ask the same)."""
    return check_run(headers.get("x-run") or request.get("model"))


def parse_json(body: bytes) -> dict[str, Any]:
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise GatewayError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(request, dict):
        raise GatewayError(400, "request body must be a JSON object", code="invalid_json")
    return request


# What the calls table holds (retry_count is an int4, idempotency_key a varchar(256)). Refused up front with a
# 400: a header the store cannot hold would otherwise be answered 200 and then rejected by the database.
MAX_RETRY_COUNT = 2**31 - 1
MAX_IDEMPOTENCY_KEY = 256
MAX_BASE_MODEL = 512  # runs.base_model
# orjson serialises at most this many nested arrays/objects; a deeper body could be parsed but neither forwarded
# nor stored, so it is a 400 before anything is sent upstream.
MAX_JSON_DEPTH = 254


def _retry_headers(headers: dict[str, str]) -> tuple[int, str | None]:
    """`x-stainless-retry-count` and `Idempotency-Key`, checked against what the store can hold."""
    raw = (headers.get("x-stainless-retry-count") or "").strip()
    retry_count = 0
    if raw:
        if not (raw.isascii() and raw.isdigit()) or len(raw) > 10 or int(raw) > MAX_RETRY_COUNT:
            message = f"x-stainless-retry-count must be an integer from 0 to {MAX_RETRY_COUNT}"
            raise GatewayError(400, message, code="invalid_header")
        retry_count = int(raw)
    key = headers.get("idempotency-key")
    if key is not None and len(key) > MAX_IDEMPOTENCY_KEY:
        raise GatewayError(400, f"Idempotency-Key longer than {MAX_IDEMPOTENCY_KEY} characters", code="invalid_header")
    if key is not None and "\x00" in key:  # (HTTP/1.1 parsers refuse one; checked here for any other server)
        raise GatewayError(400, "Idempotency-Key holds a NUL character", code="invalid_header")
    return retry_count, key


def _storable(value: Any) -> str | None:
    """Text from upstream as a text column can hold it: a string (vLLM's finish_reason always is; another upstream's
    might not be) with no NUL, which Postgres text refuses. A record the store refused would be a call answered and
    then missing from the database; U+FFFD marks the replaced character (the response column keeps what was sent)."""
    if value is None:
        return None
    text = value if isinstance(value, str) else orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()
    return text.replace("\x00", "\ufffd") if "\x00" in text else text


def _serialise(body: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError:  # the only thing a parsed body can fail on is nesting depth
        message = f"request body is nested more than {MAX_JSON_DEPTH} levels deep"
        raise GatewayError(400, message, code="invalid_json") from None


def _int_header(value: str | None) -> int:
    try:
        return max(int(value), 0) if value else 0
    except ValueError:
        return 0


async def send_json(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send_bytes(send, status, body, [(b"content-type", b"application/json"), *headers])
