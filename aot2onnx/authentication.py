"""Authenticated cache entries: an HMAC with the user's secret (see :func:`aot2onnx.compile.cache.cache_secret`).

A module of its own because two stages seal and open entries: the graph cache (``compile/cache.py``) and
AOTAutograd's cache, which capture runs (``capture/aot.py``).
"""

from __future__ import annotations

import hashlib
import hmac

__all__ = ["Authenticator"]


class Authenticator:
    """HMAC-SHA256 with this user's secret, over an entry and the name it is filed under.

    Binding the name (the key, the directory of AOTAutograd's entries) means an authentic entry copied to
    another key does not authenticate there either.
    """

    MAGIC = b"aot2onnx-hmac-sha256/1\n"

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def mac(self, *parts: bytes) -> bytes:
        message = b"".join(len(part).to_bytes(8, "big") + part for part in parts)
        return hmac.new(self._secret, message, hashlib.sha256).digest()

    def seal(self, payload: bytes, *names: bytes) -> bytes:
        """``payload`` with its HMAC in front, to be opened by :meth:`open` with the same ``names``."""
        return self.MAGIC + self.mac(*names, payload) + payload

    def open(self, data: bytes, *names: bytes) -> bytes | None:
        """The payload of what :meth:`seal` made with ``names``; ``None`` when ``data`` does not authenticate."""
        if not data.startswith(self.MAGIC):
            return None
        tag_end = len(self.MAGIC) + hashlib.sha256().digest_size
        tag, payload = data[len(self.MAGIC) : tag_end], data[tag_end:]
        return payload if hmac.compare_digest(tag, self.mac(*names, payload)) else None
