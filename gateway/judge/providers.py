"""Calling the judge model: litellm for any provider, or a built-in OpenAI-compatible client for `openai/` and
`hosted_vllm/` models when litellm is not installed.

litellm (the `judge` extra) is imported on first use only, in a worker thread: `import litellm` takes seconds, and
the gateway's start-up and event loop must not wait on it. LITELLM_LOCAL_MODEL_COST_MAP is set first so it reads
its bundled model cost map instead of fetching one over the network, and LITELLM_MODE so it does not load a .env
file into the process environment.

The built-in client speaks the OpenAI chat completions API with aiohttp (already a gateway dependency), so a base
install can judge with a local vLLM or any OpenAI-compatible server without litellm and its dependencies.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import aiohttp

from gateway.runs.config import JudgeConfig

# Provider prefixes the built-in client serves, with their default base URL and the variable holding their key.
BUILTIN_PROVIDERS: dict[str, tuple[str | None, str]] = {
    "openai": ("https://api.openai.com/v1", "OPENAI_API_KEY"),
    "hosted_vllm": (None, "HOSTED_VLLM_API_KEY"),
}
# 4xx statuses worth retrying (timeout, conflict, too early, rate limit); other 4xx will fail the same way again.
RETRYABLE_4XX = frozenset({408, 409, 425, 429})

_litellm: ModuleType | None = None
_litellm_lock = threading.Lock()


class JudgeUnavailable(RuntimeError):
    """The configured model cannot be called from this installation (e.g. litellm is missing)."""


class ProviderError(RuntimeError):
    """The judge model's provider failed: a connection error, a timeout, an error status."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def retryable(self) -> bool:
        return self.status is None or self.status >= 500 or self.status in RETRYABLE_4XX


@dataclass(frozen=True, slots=True)
class Completion:
    text: str | None
    finish_reason: str | None
    client: str  # "litellm" | "builtin"


def litellm_installed() -> bool:
    return _litellm is not None or importlib.util.find_spec("litellm") is not None


def _import_litellm() -> ModuleType:
    global _litellm
    with _litellm_lock:
        if _litellm is None:
            # The bundled model cost map, not one fetched over the network at import.
            os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
            # In its default "DEV" mode litellm loads the first .env found walking up from its own install directory
            # (the repo's own .env, with a venv inside the repo) into os.environ: TRAJGATE_* settings would leak in.
            os.environ.setdefault("LITELLM_MODE", "PRODUCTION")
            import litellm

            litellm.suppress_debug_info = True  # no "Give Feedback / Get Help" banners on stdout
            litellm.telemetry = False
            _litellm = litellm
        return _litellm


def client_for(config: JudgeConfig) -> str:
    """Which client serves `config.model`; raises JudgeUnavailable if none can."""
    provider = config.model.split("/", 1)[0]
    if config.client == "litellm" or (config.client == "auto" and litellm_installed()):
        if not litellm_installed():
            raise JudgeUnavailable("judge client 'litellm' requested but litellm is not installed: "
                                   "pip install 'trajgate[judge]'")
        return "litellm"
    if provider not in BUILTIN_PROVIDERS:
        raise JudgeUnavailable(
            f"judge model {config.model!r} needs litellm, which is not installed (pip install 'trajgate[judge]'); "
            f"without it only {', '.join(p + '/' for p in BUILTIN_PROVIDERS)} models can be used"
        )
    if provider == "hosted_vllm" and not (config.api_base or os.environ.get("HOSTED_VLLM_API_BASE")):
        raise JudgeUnavailable(f"judge model {config.model!r} needs api_base (the vLLM server's /v1 URL)")
    return "builtin"


def _api_key(config: JudgeConfig) -> str | None:
    if config.api_key_env:
        key = os.environ.get(config.api_key_env)
        if not key:
            raise JudgeUnavailable(f"api_key_env names {config.api_key_env}, which is not set in the environment")
        return key
    return None


def response_format(config: JudgeConfig, schema: dict[str, Any]) -> dict[str, Any] | None:
    if config.response_format == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": "judge_scores", "schema": schema, "strict": False}}
    if config.response_format == "json_object":
        return {"type": "json_object"}
    return None


async def complete(
    config: JudgeConfig, messages: list[dict[str, str]], schema: dict[str, Any], max_tokens: int
) -> Completion:
    """One call to the judge model; raises ProviderError or JudgeUnavailable."""
    client = client_for(config)
    api_key = _api_key(config)
    fmt = response_format(config, schema)
    if client == "litellm":
        return await _complete_litellm(config, messages, fmt, max_tokens, api_key)
    return await _complete_builtin(config, messages, fmt, max_tokens, api_key)


async def _complete_litellm(
    config: JudgeConfig,
    messages: list[dict[str, str]],
    fmt: dict[str, Any] | None,
    max_tokens: int,
    api_key: str | None,
) -> Completion:
    litellm = _litellm if _litellm is not None else await asyncio.to_thread(_import_litellm)
    kwargs: dict[str, Any] = {
        "model": config.model,
        "messages": messages,
        "temperature": config.temperature,
        "max_tokens": max_tokens,
        "timeout": config.timeout_s,
        "num_retries": 0,  # retries are ours (with backoff, and a corrective turn for malformed answers)
        "drop_params": True,  # a provider without response_format still gets asked; the parser copes
    }
    if fmt is not None:
        kwargs["response_format"] = fmt
    if config.api_base:
        kwargs["api_base"] = config.api_base
    if api_key:
        kwargs["api_key"] = api_key
    try:
        response = await litellm.acompletion(**kwargs)
    except Exception as exc:  # litellm maps every provider's failures onto its own exception classes
        status = getattr(exc, "status_code", None)
        raise ProviderError(
            f"{type(exc).__name__}: {_short(str(exc))}", status if isinstance(status, int) else None
        ) from exc
    choice = response.choices[0]
    return Completion(choice.message.content, choice.finish_reason, "litellm")


async def _complete_builtin(
    config: JudgeConfig,
    messages: list[dict[str, str]],
    fmt: dict[str, Any] | None,
    max_tokens: int,
    api_key: str | None,
) -> Completion:
    provider, name = config.model.split("/", 1)
    default_base, key_env = BUILTIN_PROVIDERS[provider]
    base = config.api_base or os.environ.get(f"{provider.upper()}_API_BASE") or default_base
    key = api_key or os.environ.get(key_env)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body: dict[str, Any] = {
        "model": name,
        "messages": messages,
        "temperature": config.temperature,
        "max_tokens": max_tokens,
    }
    if fmt is not None:
        body["response_format"] = fmt
    url = f"{str(base).rstrip('/')}/chat/completions"
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=config.timeout_s)) as session,
            session.post(url, json=body, headers=headers) as response,
        ):
            text = await response.text()
            if response.status != 200:
                raise ProviderError(f"HTTP {response.status} from {url}: {_error_message(text)}", response.status)
            data = await response.json(content_type=None)
    except ProviderError:
        raise
    except TimeoutError:
        raise ProviderError(f"no answer from {url} within {config.timeout_s:g}s") from None
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        raise ProviderError(f"{type(exc).__name__} calling {url}: {_short(str(exc))}") from None
    try:
        choice = data["choices"][0]
        return Completion(choice["message"].get("content"), choice.get("finish_reason"), "builtin")
    except (KeyError, IndexError, TypeError, AttributeError):
        raise ProviderError(f"malformed chat completion from {url}: {_short(str(data))}") from None


def _error_message(text: str) -> str:
    """The `error.message` of an OpenAI-style error body, else the body itself (shortened)."""
    try:
        error = json.loads(text).get("error")
        if isinstance(error, dict) and error.get("message"):
            return _short(str(error["message"]))
    except (ValueError, AttributeError):
        pass
    return _short(text)


def _short(text: str, limit: int = 500) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
