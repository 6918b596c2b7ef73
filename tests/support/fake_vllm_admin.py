"""Stand-ins for vLLM's adapter side: FakeAdmin replaces one replica's VllmAdmin (trainer.worker.publish), which can be
unreachable or refuse, for the replica and gateway tests to drive publication and failover; FakeVllm serves vLLM's
adapter endpoints over HTTP with its slot cap, for the real VllmAdmin. Real vLLM is exercised in tests/e2e."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from trainer.worker.publish import PublishError, Unreachable


class FakeAdmin:
    """Stands in for one replica's VllmAdmin: `up` False is an unreachable vLLM, `refuse` one that answers 4xx/5xx to
    a load, `mute` one that loads but does not answer with the adapter, `refuse_unload` one that will not unload."""

    def __init__(self, name: str) -> None:
        self.base_url = f"http://{name}:8000/v1"
        self.up = True
        self.refuse = False
        self.mute = False
        self.refuse_unload = False
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
        if self.refuse_unload:
            raise PublishError(f"vLLM refused to unload {name} (500)")
        self.served.discard(name)

    def models(self) -> set[str]:
        self._reach()
        return set(self.served)

    def check_answers(self, name: str) -> float:
        self._reach()
        if name not in self.served or self.mute:
            raise PublishError(f"{name} is loaded but does not answer (404)")
        return 0.01

    def replicas(self) -> list[FakeAdmin]:
        return [self]


class FakeVllm:
    """vLLM's adapter endpoints over HTTP, answering as vLLM 0.32 does (docs/design.md, "LoRA"), for the real
    VllmAdmin to talk to: load answers 200 with a plain-text body, 400 for a name already loaded, 404 for a path
    that does not exist, 500 when `refuse` is set (the engine failed to load it); unload 200, or 404 for an unknown
    name; /v1/models lists the base model and the loaded names; /v1/completions answers for a listed name, 404
    otherwise.

    `max_loras` is vLLM's --max-loras. vLLM itself refuses nothing past it: it keeps every name and pushes its least
    recently used adapter out of its slots, in-flight calls or not. The fake does the same and counts it:
    `peak` is the most names ever loaded at once, `evicted` what vLLM would have pushed out."""

    def __init__(self, max_loras: int, base_model: str = "smollm2") -> None:
        self.max_loras = max_loras
        self.base_model = base_model
        self.loaded: list[str] = []  # least recently used first
        self.peak = 0
        self.evicted: list[str] = []
        self.refuse = False
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the name http.server looks for
                assert self.path == "/v1/models", self.path
                with fake._lock:
                    names = [fake.base_model, *fake.loaded]
                self._answer(200, {"object": "list", "data": [{"id": name, "object": "model"} for name in names]})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["content-length"])) or b"{}")
                fake.requests.append((self.path, body))
                with fake._lock:
                    status, answer = fake._handle(self.path, body)
                self._answer(status, answer)

            def _answer(self, status: int, answer: dict[str, Any] | str) -> None:
                data = answer.encode() if isinstance(answer, str) else json.dumps(answer).encode()
                self.send_response(status)
                if not isinstance(answer, str):  # vLLM's load/unload success has no content-type
                    self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _handle(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any] | str]:
        name = str(body.get("lora_name") or body.get("model") or "")
        if path == "/v1/load_lora_adapter":
            if name in self.loaded:
                return 400, _error(f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                   "adapter in place, set 'load_inplace' to True.", "InvalidUserInput", 400)
            if not Path(str(body["lora_path"])).exists():
                return 404, _error(f"Loading lora {name} failed: No adapter found for {body['lora_path']}",
                                   "NotFoundError", 404)
            if self.refuse:
                return 500, _error(f"failed to load {name}", "InternalServerError", 500)
            self.loaded.append(name)
            if len(self.loaded) > self.max_loras:
                self.evicted.append(self.loaded[len(self.loaded) - self.max_loras - 1])
            self.peak = max(self.peak, len(self.loaded))
            return 200, f"Success: LoRA adapter '{name}' added successfully."
        if path == "/v1/unload_lora_adapter":
            if name not in self.loaded:
                return 404, _error(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
            self.loaded.remove(name)
            return 200, f"Success: LoRA adapter '{name}' removed successfully."
        assert path == "/v1/completions", path
        if name != self.base_model and name not in self.loaded:
            return 404, _error(f"The model `{name}` does not exist.", "NotFoundError", 404)
        if name in self.loaded:  # used: the most recently used now
            self.loaded.remove(name)
            self.loaded.append(name)
        return 200, {"object": "text_completion", "model": name, "choices": [{"index": 0, "text": "!"}]}

    def start(self) -> FakeVllm:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _error(message: str, kind: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
