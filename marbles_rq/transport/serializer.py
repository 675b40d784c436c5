"""RQ's serializer, replaced: msgspec JSON. No pickle anywhere, so a process that can write
to Redis can make a worker run only marbles-rq's entry point with JSON arguments."""

from __future__ import annotations

from typing import Any

import msgspec

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder()


class JSONSerializer:
    @staticmethod
    def dumps(obj: Any) -> bytes:
        return _encoder.encode(obj)

    @staticmethod
    def loads(data: bytes) -> Any:
        return _decoder.decode(data)
