"""Agent and admin keys, compared in constant time, and the runs a bound agent key may use (tenants, docs/design.md
§13). Keys are never logged or recorded."""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Sequence

from pydantic import SecretStr

from gateway.http.errors import GatewayError
from gateway.runs.settings import AgentKey

log = logging.getLogger("trajgate.auth")


def presented_key(headers: dict[str, str]) -> str | None:
    """The key a client sent, as `Authorization: Bearer <key>` or `x-api-key: <key>` (SDKs use either)."""
    authorization = headers.get("authorization")
    if authorization:
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer":
            return value.strip()
    return headers.get("x-api-key")


def _matches(candidate: str | None, keys: list[bytes]) -> bool:
    if candidate is None:
        return False
    given = candidate.encode()
    found = False
    for key in keys:  # no early exit: timing doesn't reveal which key (or whether any) matched
        found |= hmac.compare_digest(given, key)
    return found


class Auth:
    def __init__(self, agent_keys: Sequence[SecretStr], admin_key: SecretStr | None) -> None:
        self._admin = [admin_key.get_secret_value().encode()] if admin_key else []
        self._agent = [key.get_secret_value().encode() for key in agent_keys] + self._admin
        # Only bound keys are here; looked up once a key has matched, so a call pays one dict and one set lookup.
        self._runs = {
            key.get_secret_value(): key.runs
            for key in agent_keys
            if isinstance(key, AgentKey) and key.runs is not None
        }
        if admin_key is not None:
            self._runs.pop(admin_key.get_secret_value(), None)  # the admin key sees every run

    @property
    def agent_open(self) -> bool:
        return not self._agent

    @property
    def admin_open(self) -> bool:
        return not self._admin

    def warn_if_open(self) -> None:
        if self.agent_open:
            log.warning("AUTH OFF: TRAJGATE_AGENT_KEYS is not set; anyone who can reach this port can use the model")
        if self.admin_open:
            log.warning("AUTH OFF: TRAJGATE_ADMIN_KEY is not set; admin and read endpoints are open to anyone")

    def check_agent(self, key: str | None) -> frozenset[str] | None:
        """Agent endpoints accept an agent key or the admin key. Returns the runs the key is bound to, or None when
        it may use any run (an unbound key, the admin key, agent auth off)."""
        if not self._agent:
            return None
        if not _matches(key, self._agent):
            raise GatewayError(401, "missing or invalid API key", "authentication_error", "invalid_api_key")
        return self._runs.get(key) if key is not None else None

    @property
    def bound(self) -> bool:
        """Some key is bound to runs: which runs exist is then itself something a key may not see."""
        return bool(self._runs)

    def tenant(self, key: str | None) -> str | None:
        """Who owns what an agent stores (Responses API): a fingerprint of the key it called with, so one key cannot
        read or continue another's responses, and the owner survives restarts and other gateways reading the record
        without the key itself being stored. None with agent auth off: everything is shared, as one user's."""
        if self.agent_open or key is None:
            return None
        return hashlib.sha256(b"trajgate-tenant-v1\x00" + key.encode()).hexdigest()[:32]

    def check_admin(self, key: str | None) -> None:
        if self._admin and not _matches(key, self._admin):
            raise GatewayError(401, "missing or invalid admin key", "authentication_error", "invalid_api_key")

    def is_admin(self, key: str | None) -> bool:
        """The admin key itself (a script's header on UI pages); always True with auth off."""
        return not self._admin or _matches(key, self._admin)

    @property
    def admin_fingerprint(self) -> str | None:
        """What a UI session records of the admin key it was made with (never the key), so changing the key ends
        every session; None when there is no admin key."""
        if not self._admin:
            return None
        return hashlib.sha256(b"trajgate-ui-admin-v1\x00" + self._admin[0]).hexdigest()
