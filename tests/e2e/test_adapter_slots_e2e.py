"""What vLLM does past `--max-loras` when adapters are loaded at runtime: the facts the trainer's slot accounting
(gateway/store/adapter_slots.py) and tests/support/fake_vllm_admin.py's FakeVllm rest on (docs/design.md, "LoRA
slots"). vLLM refuses nothing: it keeps every name and silently drops its least recently used adapter's weights,
loading them back from disk when a call needs them. If a vLLM upgrade starts refusing, or frees a slot on unload,
this fails and the fake must follow."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from trainer.demo.vllm_cpu import VllmServer, ensure_tiny_model


def _call(base_url: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(base_url + path, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _adapters(tiny: Path, directory: Path, count: int) -> list[Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for seed in range(count):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
        config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        path = directory / f"x{seed}"
        get_peft_model(model, config).save_pretrained(path)
        paths.append(path)
    return paths


@pytest.mark.e2e
def test_vllm_loads_past_max_loras_and_silently_drops_the_least_recently_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny = ensure_tiny_model()
    paths = _adapters(tiny, tmp_path, 3)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # the worker says when it drops an adapter only at debug
    with VllmServer(tiny, "tiny", max_loras=2, max_lora_rank=8, kvcache_gib=1) as server:
        base = server.base_url
        status, metrics = _call(server.root_url, "/metrics")
        assert "max_lora=" not in metrics  # the cap is not readable over HTTP before any adapter had a request
        assert _call(server.root_url, "/server_info")[0] == 404  # a dev endpoint, off by default
        for n, path in enumerate(paths):
            assert _call(base, "/load_lora_adapter", {"lora_name": f"x@{n}", "lora_path": str(path)}) == (
                200, f"Success: LoRA adapter 'x@{n}' added successfully."
            )  # the third too: nothing is refused past --max-loras 2
        listed = {model["id"] for model in json.loads(_call(base, "/models")[1])["data"]}
        assert listed == {"tiny", "x@0", "x@1", "x@2"}
        log = server.log_path.read_text()
        assert "Removing adapter int id: 1" in log  # x@0 dropped to take x@2, said nowhere but a debug line
        for n in range(3):  # every name still answers: a dropped adapter is loaded back from its path
            assert _call(base, "/completions", {"model": f"x@{n}", "prompt": "Hi", "max_tokens": 1})[0] == 200
        assert _call(base, "/load_lora_adapter", {"lora_name": "x@0", "lora_path": str(paths[0])})[0] == 400
        assert _call(base, "/unload_lora_adapter", {"lora_name": "x@0"})[0] == 200
        assert _call(base, "/unload_lora_adapter", {"lora_name": "x@0"})[0] == 404
        assert _call(base, "/completions", {"model": "x@0", "prompt": "Hi", "max_tokens": 1})[0] == 404
        _, metrics = _call(server.root_url, "/metrics")
        assert 'vllm:lora_requests_info{max_lora="2"' in metrics  # readable once adapters had requests
