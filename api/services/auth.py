"""Who is calling: a bearer key looked up by its SHA-256 in the control view, its scope checked
against the route's."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass

from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.domain.control_plane.state import ApiKey, ControlView


@dataclass(frozen=True, slots=True)
class Caller:
    key_id: str
    tenant_id: str
    scope: str
    tier: str
    cache_salt: str


def single_authorization(headers: Iterable[tuple[bytes, bytes]]) -> ApiError | None:
    """The refusal of a request that carries more than one Authorization header (ASGI's raw,
    lower-cased names), or None. Which one a route would read depends on how it looks headers up
    (a dict keeps the last, Starlette's `get` the first): refused on every route alike."""
    seen = False
    for name, _ in headers:
        if name == b"authorization":
            if seen:
                return ApiError(
                    400, "send one Authorization header, not several", param="Authorization",
                    code="duplicate_header",
                )
            seen = True
    return None


class Authenticator:
    def __init__(self, control: ControlView) -> None:
        self.control = control

    def authenticate(self, authorization: str | None, scopes: frozenset[str]) -> Caller:
        if not authorization or not authorization.startswith("Bearer "):
            raise ApiError(
                401, "missing bearer token in the Authorization header",
                type="authentication_error", code="invalid_api_key",
            )
        secret = authorization[7:].strip()
        # Keys are looked up by their SHA-256: the table is keyed by digest, so the comparison a
        # timing attack could probe is a dict lookup on a hash the attacker cannot steer.
        key = self.control.key_by_hash(hashlib.sha256(secret.encode()).hexdigest())
        if key is None or key.revoked:
            raise ApiError(
                401, "invalid or revoked API key", type="authentication_error",
                code="invalid_api_key",
            )
        return self._caller(key, scopes)

    def by_key_id(self, key_id: str, scopes: frozenset[str]) -> Caller:
        """The caller of a web session issued to `key_id` (api/http/sessions.py verified it):
        the key must still be valid, so revoking it ends its sessions."""
        key = self.control.key(key_id)
        if key is None or key.revoked:
            raise ApiError(
                401, "invalid or revoked API key", type="authentication_error",
                code="invalid_api_key",
            )
        return self._caller(key, scopes)

    def _caller(self, key: ApiKey, scopes: frozenset[str]) -> Caller:
        if key.scope not in scopes:
            raise ApiError(
                403, f"a {key.scope} key may not call this endpoint",
                type="permission_error", code="insufficient_scope",
            )
        tenant = self.control.tenant(key.tenant_id)
        assert tenant is not None  # a key is issued in its tenant's stream, after it
        return Caller(key.key_id, key.tenant_id, key.scope, tenant.plan, tenant.cache_salt)

    def on_behalf(self, authorization: str | None, token: str, key_id: str) -> Caller:
        """The batch runner, acting for the key that created a batch: it proves itself with the
        token `tollgate serve` gave it at start (never stored), and the key must still be valid
        (a key revoked mid-batch stops its batch's items)."""
        presented = authorization[7:].strip() if authorization else ""
        if not token or not hmac.compare_digest(presented.encode(), token.encode()):
            raise ApiError(
                401, "invalid batch runner token", type="authentication_error",
                code="invalid_api_key",
            )
        key = self.control.key(key_id)
        if key is None or key.revoked:
            raise ApiError(
                401, "the batch's API key is unknown or revoked", type="authentication_error",
                code="invalid_api_key",
            )
        tenant = self.control.tenant(key.tenant_id)
        assert tenant is not None
        return Caller(key.key_id, key.tenant_id, key.scope, tenant.plan, tenant.cache_salt)
