"""Bad input, upstream faults, client hang-ups, retries and auth: clear errors, never a 500, every call recorded."""

from __future__ import annotations

import json
import socket

import httpx
import openai
import pytest

from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_harness import RunningGateway, running_gateway
from tests.support.openai_calls import assert_openai_error, client_body
from tests.support.pgcluster import free_port
from tests.support.stored import count_calls, stored_calls
from tests.support.waiting import SocketReader, wait_until


@pytest.mark.parametrize(
    ("body", "headers", "status", "code"),
    [
        (b"{not json", {}, 400, "invalid_json"),
        (b"[1, 2]", {}, 400, "invalid_json"),
        (b'{"messages": []}', {}, 400, "invalid_model"),
        (b'{"model": 7, "messages": []}', {}, 400, "invalid_model"),
        (b'{"model": "..", "messages": []}', {}, 400, "invalid_model"),
        (b'{"model": "r", "messages": []}', {"X-Run": "org/../r"}, 400, "invalid_model"),
        (b'{"model": "r", "messages": []}', {"X-Trajectory-Id": "bad id!"}, 400, "invalid_id"),
        (b'{"model": "r", "messages": []}', {"X-Trajectory-Id": "t", "X-Group-Size": "-1"}, 400, "invalid_id"),
        (b'{"model": "r", "messages": []}', {"X-Mode": "nope"}, 400, "invalid_mode"),
    ],
)
def test_bad_requests_get_openai_errors(
    gateway: RunningGateway, db_url: str, body: bytes, headers: dict[str, str], status: int, code: str
) -> None:
    response = httpx.post(gateway.base_url + "/chat/completions", content=body, headers=headers)
    assert assert_openai_error(response, status)["code"] == code
    gateway.flush()
    assert count_calls(db_url) == 0  # nothing reached vLLM, nothing to record


def test_oversized_body_is_413(gateway_settings: dict[str, object]) -> None:
    with running_gateway(**{**gateway_settings, "max_body_bytes": 2048}) as gw:
        big = json.dumps({"model": "r", "messages": [{"role": "user", "content": "x" * 5000}]})
        assert_openai_error(httpx.post(gw.base_url + "/chat/completions", content=big), 413)

        def chunks():  # no content-length: the limit must hold for chunked bodies too
            yield b'{"model": "r", "messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"y" * 500
            yield b'"}]}'

        assert_openai_error(httpx.post(gw.base_url + "/chat/completions", content=chunks()), 413)


def test_unknown_route_and_method(gateway: RunningGateway) -> None:
    assert_openai_error(httpx.get(gateway.url + "/v1/nope"), 404)
    assert_openai_error(httpx.get(gateway.base_url + "/chat/completions"), 405)


def test_upstream_http_errors_pass_through_and_are_recorded(
    gateway: RunningGateway, upstream: FakeUpstream, db_url: str
) -> None:
    fixture = upstream.fixture("error_n2_temperature0")
    # Eval mode sends the client's temperature 0 as is (train mode would sample at 1, which vLLM accepts with n=2).
    headers = {"X-Trajectory-Id": "t-400", "X-Mode": "eval"}
    response = httpx.post(gateway.base_url + "/chat/completions", json=client_body(fixture), headers=headers)
    assert response.status_code == fixture["status"] == 400
    assert response.json() == fixture["response"]
    upstream.mode = "error500"
    with pytest.raises(openai.InternalServerError):
        openai.OpenAI(base_url=gateway.base_url, api_key="k", max_retries=0).chat.completions.create(
            **client_body(upstream.fixture("chat")), extra_headers={"X-Trajectory-Id": "t-500"}
        )
    gateway.flush()
    for trajectory, status in (("t-400", 400), ("t-500", 500)):
        (call,) = stored_calls(db_url, trajectory)
        assert call["status_code"] == status and not call["trainable"]
        assert call["error"] and call["untrainable_reason"] == f"upstream status {status}"


def test_upstream_unreachable_is_502(gateway_settings: dict[str, object], db_url: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with running_gateway(**{**gateway_settings, "upstream_url": dead}) as gw:
        response = httpx.post(
            gw.base_url + "/chat/completions",
            json={"model": "r", "messages": [{"role": "user", "content": "hi"}]},
            headers={"X-Trajectory-Id": "t-502"},
        )
        assert_openai_error(response, 502)
        gw.flush()
    (call,) = stored_calls(db_url, "t-502")
    assert call["status_code"] == 502 and "unreachable" in call["error"]


def test_upstream_timeout_is_504(gateway_settings: dict[str, object], upstream: FakeUpstream, db_url: str) -> None:
    upstream.mode = "hang"
    with running_gateway(**{**gateway_settings, "upstream_timeout_s": 0.5}) as gw:
        response = httpx.post(
            gw.base_url + "/chat/completions",
            json=client_body(upstream.fixture("chat")),
            headers={"X-Trajectory-Id": "t-504"},
            timeout=10,
        )
        assert_openai_error(response, 504)
        gw.flush()
    upstream.mode = "replay"
    (call,) = stored_calls(db_url, "t-504")
    assert call["status_code"] == 504


def test_upstream_cut_mid_stream_records_partial(gateway: RunningGateway, upstream: FakeUpstream, db_url: str) -> None:
    upstream.mode = "cut_stream"
    body = client_body(upstream.fixture("chat_stream"))
    with httpx.stream(
        "POST", gateway.base_url + "/chat/completions", json=body, headers={"X-Trajectory-Id": "t-cut"}
    ) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert "error" in json.loads(lines[-1][6:])  # the client is told the stream broke
    gateway.flush()
    (call,) = stored_calls(db_url, "t-cut")
    assert not call["trainable"] and "stream" in call["untrainable_reason"]
    assert 0 < len(call["completion_token_ids"]) < len(upstream.fixture("chat")["response"]["choices"][0]["token_ids"])


def test_client_disconnect_cancels_upstream_and_records_partial(
    gateway: RunningGateway, upstream: FakeUpstream, db_url: str
) -> None:
    upstream.mode = "slow_stream"
    cancelled_before = upstream.cancelled_streams
    body = json.dumps(client_body(upstream.fixture("chat_stream"))).encode()
    with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"X-Trajectory-Id: t-gone\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        # Two whole events reached the client (each ends with a blank line), then it goes away mid-stream.
        SocketReader(sock).until(lambda got: len(got) if got.count(b"\n\n") >= 2 else None, 10, "two events")
    wait_until(lambda: upstream.cancelled_streams > cancelled_before, 10, "the upstream request to be cancelled")
    gateway.flush()
    (call,) = stored_calls(db_url, "t-gone")
    assert call["error"] == "client disconnected mid-stream" and not call["trainable"]
    assert len(call["completion_token_ids"]) >= 1


def test_sdk_retries_replace_the_earlier_attempt(gateway: RunningGateway, upstream: FakeUpstream, db_url: str) -> None:
    body = client_body(upstream.fixture("chat"))
    url = gateway.base_url + "/chat/completions"
    httpx.post(url, json=body, headers={"X-Trajectory-Id": "t-retry"})
    httpx.post(url, json=body, headers={"X-Trajectory-Id": "t-retry", "x-stainless-retry-count": "1"})
    httpx.post(url, json=body, headers={"X-Trajectory-Id": "t-retry", "Idempotency-Key": "k-1"})
    httpx.post(url, json=body, headers={"X-Trajectory-Id": "t-retry", "Idempotency-Key": "k-1"})
    httpx.post(url, json=body, headers={"X-Trajectory-Id": "t-retry"})
    gateway.flush()
    assert len(stored_calls(db_url, "t-retry")) == 3


def test_real_sdk_retry_after_upstream_error_leaves_one_turn(
    gateway: RunningGateway, upstream: FakeUpstream, db_url: str
) -> None:
    upstream.mode = "error500"
    client = openai.OpenAI(base_url=gateway.base_url, api_key="k", max_retries=2)
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(
            **client_body(upstream.fixture("chat")), extra_headers={"X-Trajectory-Id": "t-sdk-retry"}
        )
    assert len(upstream.received) >= 3
    gateway.flush()
    assert len(stored_calls(db_url, "t-sdk-retry")) == 1


def test_agent_and_admin_keys(gateway_settings: dict[str, object], upstream: FakeUpstream, db_url: str) -> None:
    with running_gateway(**{**gateway_settings, "agent_keys": "agent-1,agent-2", "admin_key": "admin-x"}) as gw:
        body = client_body(upstream.fixture("chat"))
        url = gw.base_url + "/chat/completions"
        assert_openai_error(httpx.post(url, json=body), 401)
        assert_openai_error(httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}), 401)
        assert httpx.post(url, json=body, headers={"Authorization": "Bearer agent-2"}).status_code == 200
        assert httpx.post(url, json=body, headers={"x-api-key": "agent-1"}).status_code == 200
        client = openai.OpenAI(base_url=gw.base_url, api_key="agent-1#gk/tk", max_retries=0)
        assert client.chat.completions.create(**body).choices[0].message.content
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=gw.base_url, api_key="bad#gk/tk", max_retries=0).chat.completions.create(**body)
        gw.flush()
    (call,) = stored_calls(db_url, "tk")
    assert "agent-1" not in json.dumps(call, default=str)


def test_health_ready_metrics_models(gateway: RunningGateway, upstream: FakeUpstream) -> None:
    assert httpx.get(gateway.url + "/health").json() == {"status": "ok"}
    assert httpx.get(gateway.url + "/ready").json() == {"database": "ok", "upstream": "ok"}
    httpx.post(gateway.base_url + "/chat/completions", json=client_body(upstream.fixture("chat")))
    gateway.flush()
    metrics = httpx.get(gateway.url + "/metrics").text
    assert 'trajgate_requests_total{endpoint="chat",status="200"} 1.0' in metrics
    assert "trajgate_added_latency_seconds_bucket" in metrics
    assert "trajgate_records_written_total 1.0" in metrics
    assert "trajgate_records_logged_total 1.0" in metrics  # in the write-ahead log before the answer completed
    assert "trajgate_writer_queue_depth 0.0" in metrics and "trajgate_writer_queue_bytes 0.0" in metrics
    counters = ("records_spooled", "records_replayed", "records_rejected", "records_lost", "records_unlogged",
                "spool_errors", "spool_sync_errors")  # fmt: skip
    for counter in counters:
        assert f"trajgate_{counter}_total 0.0" in metrics  # what an operator alerts on when a call was not stored
    assert "trajgate_spool_unreadable_lines_total 0.0" in metrics and "trajgate_records_held 0.0" in metrics
    models = httpx.get(gateway.base_url + "/models").json()
    assert models["data"][0]["id"] == "smollm2"


def test_ready_reports_unreachable_upstream(gateway_settings: dict[str, object]) -> None:
    with running_gateway(**{**gateway_settings, "upstream_url": f"http://127.0.0.1:{free_port()}/v1"}) as gw:
        response = httpx.get(gw.url + "/ready")
    assert response.status_code == 503 and response.json()["upstream"] == "unreachable"
