"""Agent and admin keys, compared in constant time. Keys are never logged or recorded."""

from __future__ import annotations

import hashlib
import hmac
import logging

from pydantic import SecretStr

from gateway.errors import GatewayError

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
    def __init__(self, agent_keys: list[SecretStr], admin_key: SecretStr | None) -> None:
        self._admin = [admin_key.get_secret_value().encode()] if admin_key else []
        self._agent = [key.get_secret_value().encode() for key in agent_keys] + self._admin

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

    def check_agent(self, key: str | None) -> None:
        """Agent endpoints accept an agent key or the admin key."""
        if self._agent and not _matches(key, self._agent):
            raise GatewayError(401, "missing or invalid API key", "authentication_error", "invalid_api_key")

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

    def ui_session(self) -> str | None:
        """The web UI's session cookie value: derived from the admin key (HMAC), so the browser never holds the key
        itself and changing the key logs every browser out. None when there is no admin key."""
        if not self._admin:
            return None
        return hmac.new(self._admin[0], b"trajgate-ui-session-v1", hashlib.sha256).hexdigest()

    def admin_session_ok(self, cookie: str | None, key: str | None) -> bool:
        """The UI's check: the session cookie, or the admin key itself in a header; always True with auth off."""
        if not self._admin:
            return True
        session = self.ui_session()
        assert session is not None
        cookie_ok = cookie is not None and hmac.compare_digest(cookie.encode(), session.encode())
        return _matches(key, self._admin) or cookie_ok
