"""API keys: read from a file and the environment, kept only as digests, and matched in constant time.

A client is named by a short hash of its key (or by its address when no keys are configured); keys
themselves are never logged or used as labels.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from .settings import SecurityConfig

API_KEY_ENV = "SPECDEC_API_KEY"


def load_keys(settings: SecurityConfig) -> list[str]:
    """The accepted keys: `api_keys`, the lines of `api_key_file` (# starts a comment), and $SPECDEC_API_KEY."""
    keys = list(settings.api_keys)
    if settings.api_key_file:
        keys += [line.split("#", 1)[0] for line in Path(settings.api_key_file).read_text().splitlines()]
    keys.append(os.environ.get(API_KEY_ENV, ""))
    # An empty key would let `Authorization: Bearer ` in; blank lines and an unset variable are not keys.
    return [key.strip() for key in keys if key.strip()]


class ApiKeys:
    """The accepted keys, kept only as SHA-256 digests."""

    def __init__(self, keys: list[str]):
        self._digests = [hashlib.sha256(key.encode()).digest() for key in set(keys)]

    def __len__(self) -> int:
        return len(self._digests)

    def identify(self, authorization: bytes | None) -> str | None:
        """The short hash naming the key in an `Authorization: Bearer KEY` header; None if missing or unknown."""
        scheme, _, token = (authorization or b"").partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            return None
        # Comparing digests makes every comparison the same length, and no early exit means the
        # time taken says nothing about which key, or how much of one, matched.
        given = hashlib.sha256(token.strip()).digest()
        matched = [digest for digest in self._digests if hmac.compare_digest(given, digest)]
        return f"key:{matched[0].hex()[:8]}" if matched else None
