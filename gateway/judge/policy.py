"""Where the judge may take a key from and send it to: operator lists, not the judge config.

A judge config comes from whoever holds the admin key (`POST /v1/runs`, `POST /v1/groups/{id}/judge`), who is not
necessarily whoever runs the process. Unchecked, it could name any environment variable in `api_key_env` and any URL
in `api_base`, and the judge would send that variable's value there as a bearer token. So a key is read only from a
variable listed in TRAJGATE_JUDGE_KEY_ENVS or named TRAJGATE_JUDGE_KEY_*, and a key is sent only to a base URL listed
in TRAJGATE_JUDGE_API_BASES or to one of the vLLM upstreams (a provider's key read by default, such as
OPENAI_API_KEY, goes to its own provider when no api_base is given). The database URL and the gateway's admin and
agent keys are never read, even if listed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gateway.runs.settings import ENV_PREFIX, Settings

KEY_PREFIX = "TRAJGATE_JUDGE_KEY_"
# The gateway's own secrets, by name; their values are refused under any other name too.
NEVER = frozenset({"TRAJGATE_DATABASE_URL", "TRAJGATE_ADMIN_KEY", "TRAJGATE_AGENT_KEYS"})


class JudgeNotAllowed(ValueError):
    """The judge config names a variable or a base URL the operator has not allowed; the message says which."""


@dataclass(frozen=True, slots=True)
class JudgePolicy:
    key_envs: frozenset[str]
    api_bases: frozenset[str]
    secrets: frozenset[str]  # values never handed to a judge

    @classmethod
    def from_settings(cls, settings: Settings) -> JudgePolicy:
        secrets = {settings.database_url, *(key.get_secret_value() for key in settings.agent_keys)}
        if settings.admin_key is not None:
            secrets.add(settings.admin_key.get_secret_value())
        secrets.update(value for name in NEVER if (value := os.environ.get(name)))
        return cls(
            frozenset(settings.judge_key_envs),
            frozenset([*settings.judge_api_bases, *settings.upstream_urls]),
            frozenset(secrets),
        )

    def check(self, api_key_env: object, api_base: object, where: str = "judge") -> None:
        """Raise JudgeNotAllowed if a judge with these settings would read or send what it may not."""
        if isinstance(api_base, str) and api_base.rstrip("/") not in self.api_bases:
            raise JudgeNotAllowed(
                f"{where}.api_base: {api_base[:200]!r} is not an endpoint the judge may call: list it in "
                "TRAJGATE_JUDGE_API_BASES (the vLLM upstreams, TRAJGATE_UPSTREAM_URL, are allowed)"
            )
        if isinstance(api_key_env, str):
            if api_key_env not in self.key_envs and not _judge_key_name(api_key_env):
                raise JudgeNotAllowed(
                    f"{where}.api_key_env: {api_key_env!r} is not a variable the judge may read: list it in "
                    f"TRAJGATE_JUDGE_KEY_ENVS or name it {KEY_PREFIX}..."
                )
            if api_key_env in NEVER or self._secret(os.environ.get(api_key_env)):
                raise JudgeNotAllowed(
                    f"{where}.api_key_env: {api_key_env!r} holds one of the gateway's own secrets (database URL, "
                    "admin or agent key), which never goes to a judge"
                )


    def _secret(self, value: str | None) -> bool:
        """Whether a variable's value is one of the gateway's secrets (a database URL in any form it accepts)."""
        if value is None:
            return False
        value = value.strip()
        for prefix in ("postgres://", "postgresql://"):
            if value.startswith(prefix):
                value = "postgresql+psycopg://" + value.removeprefix(prefix)
        return value in self.secrets


def _judge_key_name(name: str) -> bool:
    """TRAJGATE_JUDGE_KEY_*, other than a setting of the gateway's own (TRAJGATE_JUDGE_KEY_ENVS)."""
    return name.startswith(KEY_PREFIX) and name.removeprefix(ENV_PREFIX).lower() not in Settings.model_fields
