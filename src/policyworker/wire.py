"""Typed wire messages: the only things that cross a policyworker socket.

Messages are ``msgspec.Struct`` s encoded as msgpack with a ``type`` tag, so a
receiver decodes exactly the union it expects and anything else — unknown tag,
missing field, wrong type, truncated bytes — raises ``ProtocolError``. Nothing is
ever unpickled, and no message can name code to run: handles are rebuilt by fixed
functions from plain fields.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from policyworker.errors import ProtocolError

__all__ = ["Decoder", "Message", "decode", "encode"]

M = TypeVar("M")


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every wire message (``tag_field`` = "type"; the tag is the class name)."""


_encoder = msgspec.msgpack.Encoder()


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


class Decoder:
    """Decode bytes into one of ``types`` (a Message subclass or a Union of them)."""

    def __init__(self, types: Any) -> None:
        self._types = types
        self._decoder = msgspec.msgpack.Decoder(types)

    def decode(self, data: bytes | bytearray | memoryview) -> Any:
        try:
            return self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"malformed wire message: {exc}") from exc


def decode(data: bytes | bytearray | memoryview, types: type[M]) -> M:
    """One-off decode; hot paths keep a :class:`Decoder`."""
    return Decoder(types).decode(data)
