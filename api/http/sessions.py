"""Signed, expiring sessions for the /ui pages: the browser's cookie holds
`key_id.expiry.signature` (HMAC-SHA256 under the server's session secret), never the API key.
Each request checks the signature in constant time and the expiry, then looks the key up in
the control view: a revoked key ends its sessions as soon as the edge follows the revocation.

The secret comes from TOLLGATE_SESSION_SECRET (give every edge the same one, so that a session
signed by one is accepted by the others) or, embedded, from `session-secret` in the data
directory, made on first use with mode 600.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

SESSION_TTL_S = 8 * 3600
ENV = "TOLLGATE_SESSION_SECRET"


def load_secret(data_dir: Path, configured: str | None = None) -> bytes:
    """The configured secret (the session_secret setting, TOLLGATE_SESSION_SECRET), else the one
    drawn once into `data_dir`."""
    if configured:
        return configured.encode()
    path = data_dir / "session-secret"
    if not path.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return path.read_text().strip().encode()


class Sessions:
    def __init__(
        self, secret: bytes, ttl_s: int = SESSION_TTL_S, clock: Callable[[], float] = time.time
    ) -> None:
        if len(secret) < 16:
            raise ValueError(f"{ENV}: a session secret needs at least 16 bytes")
        self._secret = secret
        self.ttl_s = ttl_s
        self._clock = clock

    def _sign(self, payload: str) -> str:
        digest = hmac.new(self._secret, payload.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def issue(self, key_id: str) -> str:
        payload = f"{key_id}.{int(self._clock()) + self.ttl_s}"
        return f"{payload}.{self._sign(payload)}"

    def key_id_of(self, token: str) -> str | None:
        """The key a session was issued to; None when it is malformed, forged or expired."""
        if len(token) > 512:
            return None
        payload, _, signature = token.rpartition(".")
        key_id, _, expiry = payload.rpartition(".")
        if not key_id or not expiry.isdigit():
            return None
        if not hmac.compare_digest(signature.encode(), self._sign(payload).encode()):
            return None
        if int(expiry) <= self._clock():
            return None
        return key_id
