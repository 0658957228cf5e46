"""Which strings every backend can store — PostgreSQL text, SQLite TEXT, an event's JSON payload —
checked once, here, for every string a client or an operator sends that is recorded.

PostgreSQL refuses U+0000 in text and varchar (and `\\u0000` in jsonb); a lone surrogate
(U+D800-U+DFFF) is not a Unicode scalar value, so UTF-8 cannot encode it and psycopg, sqlite3
and orjson all refuse to write it (the stdlib `json` writes it as an escape that reads back as
the same unwritable string). Every other code point — C0 and C1 controls, the noncharacters
U+FFFE, U+FFFF and U+FDD0-U+FDEF, private use, unassigned ones — is valid UTF-8 that all three
store and read back unchanged, so it is not refused here: where a field needs more (a header
value, an identifier), its own rule says so (`check_header_value`).
"""

from __future__ import annotations

import re
from typing import Any, Final

from tollgate_llm.domain.errors import DomainError

_UNSTORABLE: Final = re.compile("[\x00\ud800-\udfff]")
_SURROGATE: Final = re.compile("[\ud800-\udfff]")

# OpenAI's metadata: at most 16 pairs, keys of at most 64 characters, string values of at most
# 512 (chat completions and batches alike).
MAX_METADATA_KEYS: Final = 16
MAX_METADATA_KEY_CHARS: Final = 64
MAX_METADATA_VALUE_CHARS: Final = 512


def unstorable(text: str) -> str | None:
    """Why `text` cannot be stored by every backend, or None if it can."""
    found = _UNSTORABLE.search(text)
    if found is None:
        return None
    if found.group() == "\x00":
        return "must not contain NUL (U+0000)"
    return "must not contain a lone surrogate (U+D800-U+DFFF)"


def has_surrogate(text: str) -> bool:
    """Whether `text` holds a lone surrogate: the one thing no encoder can write (a NUL can be
    sent and escaped in JSON; it only cannot be kept in a text column)."""
    return not text.isascii() and _SURROGATE.search(text) is not None


def check_text(value: Any, field: str, *, max_chars: int, min_chars: int = 1) -> str:
    """`value` as a string of `min_chars` to `max_chars` characters that every backend can
    store, or a DomainError naming `field` (its rule: invalid_type, string_too_short,
    string_above_max_length or unstorable_text). The message names the field and the rule,
    never the value."""
    if not isinstance(value, str):
        raise DomainError("invalid_type", f"'{field}' must be a string", field=field)
    if len(value) < min_chars:
        raise DomainError(
            "string_too_short",
            f"'{field}' must have at least {min_chars} characters",
            field=field,
        )
    if len(value) > max_chars:
        raise DomainError(
            "string_above_max_length",
            f"'{field}' is longer than {max_chars} characters",
            field=field,
        )
    reason = unstorable(value)
    if reason is not None:
        raise DomainError("unstorable_text", f"'{field}' {reason}", field=field)
    return value


def is_header_value(text: str) -> bool:
    """Whether `text` can be sent as (part of) an HTTP header value as it is: visible ASCII and
    spaces (U+0020-U+007E), no space at either end (a server strips it). A newline or any other
    control character cannot be sent at all; a non-ASCII character is encoded differently by
    each client (httpx refuses it)."""
    return text.isascii() and text.isprintable() and text.strip(" ") == text


def check_header_value(value: Any, field: str, *, max_chars: int) -> str:
    """`value` as a string of 1 to `max_chars` characters that can go into an HTTP header as it
    is (`is_header_value`), or a DomainError naming `field`."""
    text = check_text(value, field, max_chars=max_chars)
    if not is_header_value(text):
        raise DomainError(
            "invalid_value",
            f"'{field}' must be printable ASCII (U+0020-U+007E) without a space at either end",
            field=field,
        )
    return text


def check_metadata(value: Any, field: str = "metadata") -> dict[str, str]:
    """OpenAI's metadata object (None: empty), each key and value storable, or a DomainError
    naming the field: `metadata`, or `metadata.<key>` when the key itself is storable."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise DomainError("invalid_type", f"'{field}' must be an object", field=field)
    if len(value) > MAX_METADATA_KEYS:
        raise DomainError(
            "invalid_value", f"'{field}' holds at most {MAX_METADATA_KEYS} pairs", field=field
        )
    for key, item in value.items():
        try:
            check_text(key, f"{field} keys", max_chars=MAX_METADATA_KEY_CHARS)
        except DomainError as exc:
            # A key that cannot be stored cannot be named either: the field is the object.
            raise DomainError(exc.rule, exc.message, field=field) from None
        check_text(item, f"{field}.{key}", max_chars=MAX_METADATA_VALUE_CHARS)
    return dict(value)
