"""Keeping secrets out of everything rtnb writes or prints.

Environment variables given to the ranks are recorded by name only. Storage URIs
may carry credentials (``s3://KEY:SECRET@bucket``, ``?access_key=...&secret_key=...``,
``session_token=...``, a presigned URL's ``X-Amz-Signature=...``, ``token=...``, ``sig=...``): wherever a URI is shown or stored, :func:`redact_uri` shows
it with those parts replaced by ``***``. The real URI stays in memory only, where
the filesystem needs it.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, quote

__all__ = ["MASK", "is_secret_name", "redact_text", "redact_uri"]

MASK = "***"
# Names that hold a credential: AWS/GCS/Azure style keys, tokens, passwords.
_SECRET_NAME = re.compile(
    r"(secret|password|passwd|token|credential|access_key|accesskey|api_key|apikey|private_key|"
    r"session_key|account_key|sas|auth|signature)"
    # Azure SAS signs with `sig=`; matched whole, as the word is part of others.
    r"|^sig$",
    re.IGNORECASE,
)
_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def redact_uri(uri: Any) -> Any:
    """``uri`` with its user:password and credential query values masked."""
    if not isinstance(uri, str) or "://" not in uri:
        return uri
    scheme, _, rest = uri.partition("://")
    location, sep, query = rest.partition("?")
    userinfo, at, host_and_path = location.rpartition("@")
    # user@host, or user:password@host (a password may hold an unencoded "/")
    if at and ("/" not in userinfo or ":" in userinfo):
        location = f"{MASK}@{host_and_path}"
    if sep:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = "&".join(
            f"{quote(k, safe='_-.')}={MASK if is_secret_name(k) else quote(v, safe=':/._-')}"
            for k, v in pairs
        )
    return f"{scheme}://{location}" + (f"?{query}" if sep else "")


def redact_text(text: str) -> str:
    """Every URI inside ``text`` redacted (for messages that quote a library's error)."""
    return _URI.sub(lambda m: redact_uri(m.group(0)), text)
