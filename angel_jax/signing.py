"""Messages signed with a job's token: HMAC-SHA256 over the body's canonical JSON (sorted keys, no spaces), sent as
`{"body": ..., "mac": "<hex>"}`. The watchdog's heartbeats (tol/heartbeat.py, one per line) and the peer copies'
frames (checkpoint/peer_wire.py, length-prefixed) are both signed and checked here.

    raw = envelope(token, {"op": "put", ...})
    body = verified(raw, token, Refused)          # or Refused("unauthenticated: ..."), Refused("malformed: ...")
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any, Callable, Mapping


def canonical(body: Mapping[str, Any], allow_nan: bool = False) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=allow_nan).encode()


def sign(token: str, body: Mapping[str, Any], allow_nan: bool = False) -> str:
    return hmac.new(token.encode(), canonical(body, allow_nan), hashlib.sha256).hexdigest()


def envelope(token: str, body: Mapping[str, Any], allow_nan: bool = False) -> bytes:
    """`body` and its MAC, as the JSON the other end reads with `verified`."""
    return json.dumps({"body": dict(body), "mac": sign(token, body, allow_nan)}, allow_nan=allow_nan).encode()


def verified(raw: bytes, token: str, refuse: Callable[[str], Exception], *, allow_nan: bool = False,
             object_body: bool = False) -> Any:
    """The body of an envelope whose MAC is the token's; else `refuse(reason)` is raised, the reason starting with
    'malformed:' (not JSON, not an envelope, a body that cannot be canonicalised) or 'unauthenticated:'.
    `object_body`: the body must be a JSON object too."""
    try:
        outer = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):  # ValueError: also an integer of > 4300 digits
        raise refuse("malformed: not JSON (or a number too long to read)") from None
    if (not isinstance(outer, dict) or set(outer) != {"body", "mac"} or not isinstance(outer["mac"], str)
            or not outer["mac"].isascii()  # (compare_digest refuses non-ASCII strings)
            or (object_body and not isinstance(outer["body"], dict))):
        raise refuse("malformed: expected {\"body\": {...}, \"mac\": \"<hex>\"}")
    try:
        expected = sign(token, outer["body"], allow_nan)
    except (TypeError, ValueError, RecursionError):
        raise refuse("malformed: body cannot be canonicalised (NaN, too deep)") from None
    if not hmac.compare_digest(expected, outer["mac"]):
        raise refuse("unauthenticated: the MAC does not match the job's token")
    return outer["body"]
