"""Admission's end-user step: who the caller's customer is (the X-Tollgate-End-User header,
else the body's `safety_identifier`, else its `user`), kept as the tenant's keyed hash only,
and the request's path with that end user's level below its key when its project sets
per-end-user limits (the rules: `domain.governance.end_users`).

The header wins: it is Tollgate's own, set on purpose by the tenant's server, while `user`
may be whatever an SDK or a library put there.
"""

from __future__ import annotations

from typing import Final

from tollgate_llm.api.services.auth import Caller
from tollgate_llm.api.services.chat_request import ChatRequest
from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.governance.end_users import MAX_END_USER_CHARS, end_user_hash, on_path
from tollgate_llm.domain.governance.state import PathPolicy
from tollgate_llm.domain.text import unstorable
from tollgate_llm.domain.views import AdmissionViews

__all__ = ["END_USER_HEADER", "end_user_path", "identify"]

END_USER_HEADER: Final = "X-Tollgate-End-User"


def identify(caller: Caller, req: ChatRequest, header: str | None) -> None:
    """Name the request's end user (the header over the body) and hash it with the tenant's
    key; the identifier itself is dropped from the request here. A header longer than
    MAX_END_USER_CHARS (or that no store could hold) is a 400 naming it."""
    if header is not None:
        if len(header) > MAX_END_USER_CHARS:
            raise ApiError(
                400, f"{END_USER_HEADER} is longer than {MAX_END_USER_CHARS} characters",
                param=END_USER_HEADER, code="string_above_max_length",
            )  # fmt: skip
        if unstorable(header):
            raise ApiError(
                400, f"{END_USER_HEADER} holds a character that cannot be stored",
                param=END_USER_HEADER, code="invalid_value",
            )  # fmt: skip
        req.end_user = header
    req.end_user_hash = end_user_hash(caller.cache_salt, req.end_user)
    req.end_user = ""


def end_user_path(
    control: ControlView, views: AdmissionViews, path: PathPolicy | None, model: str,
    req: ChatRequest,
) -> PathPolicy | None:  # fmt: skip
    """`path` with the request's end-user level, when its project limits its end users."""
    if not req.end_user_hash:
        return path
    return on_path(path, control.hierarchy, views.paths.end_users, model, req.end_user_hash)
