"""What one request to `lt-opd serve` may carry, enforced in the server's front end.

`RequestGuard` is an ASGI middleware, loaded by vLLM's server through its `--middleware` option and by the
transformers engine: with an API key, a request to any route but the health checks without it is answered 401
before its body is read; a request body over `LT_OPD_MAX_BODY_BYTES` is answered 413 before the app sees it (counted
as it arrives, whatever Content-Length says; never more than the limit held). The limit on one image or clip's bytes
and on an image's pixel count are the media connector's (`engines/vllm/media.py`) and vLLM's own
(`VLLM_MAX_IMAGE_PIXELS`, checked from the image's header before it is decoded).
"""

from __future__ import annotations

import hmac
import json
import os
from dataclasses import dataclass

from lt_opd_ray.engines.vllm.media import MAX_MEDIA_ENV, MIB

MAX_BODY_ENV = "LT_OPD_MAX_BODY_BYTES"
API_KEY_ENV = "LT_OPD_API_KEY"  # the transformers engine's key (vLLM's server reads VLLM_API_KEY)
PIXELS_ENV = "VLLM_MAX_IMAGE_PIXELS"  # vLLM's own name; the transformers engine reads it too


@dataclass(frozen=True)
class ServeLimits:
    """One request's most: its body, one image or clip's encoded bytes, one image's pixels (a 48-megapixel photo
    fits; the processors resize far below that)."""

    body_bytes: int = 32 * MIB
    media_bytes: int = 24 * MIB
    image_pixels: int = 50_000_000

    def environment(self) -> dict[str, str]:
        """What the server process reads them from (ours, and vLLM's own pixel limit)."""
        return {MAX_BODY_ENV: str(self.body_bytes), MAX_MEDIA_ENV: str(self.media_bytes), PIXELS_ENV: str(self.image_pixels)}

    @classmethod
    def from_environment(cls) -> ServeLimits:
        return cls(int(os.environ[MAX_BODY_ENV]), int(os.environ[MAX_MEDIA_ENV]), int(os.environ[PIXELS_ENV]))


class RequestGuard:
    """The front door of both servers: with an API key, every request but the health checks carries it (vLLM's own key
    check covers only its /v1, /v2, /inference and /cohere routes, not /invocations, /tokenize or /metrics), checked
    before the body is read; then the body limit."""

    OPEN_PATHS = ("/health", "/ping")

    def __init__(self, app, limit: int | None = None, api_key: str | None = None):
        self.app = app
        self.limit = int(os.environ[MAX_BODY_ENV]) if limit is None else limit
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or os.environ.get("VLLM_API_KEY")
        self.expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        if self.expected is not None and scope.get("path") not in self.OPEN_PATHS:
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                if scope["type"] == "websocket":
                    return await send({"type": "websocket.close", "code": 1008})
                return await _answer(send, 401, "Unauthorized: send the server's API key as `Authorization: Bearer KEY`", "Unauthorized")
        if scope["type"] == "websocket":
            return await self.app(scope, receive, send)
        messages, size = [], 0
        while True:  # the whole body, counted as it arrives; past the limit it is read and dropped, then refused
            message = await receive()
            if message["type"] != "http.request":
                if size > self.limit:
                    return None  # the client left before the answer
                messages.append(message)  # the app sees the disconnect too
                break
            size += len(message.get("body", b""))
            if size <= self.limit:
                messages.append(message)
            if not message.get("more_body", False):
                break
        if size > self.limit:  # answered once the client has sent it all: a client still sending would see a broken pipe
            return await _answer(send, 413, f"request body of {size} bytes refused: this server takes at most {self.limit} "
                                            f"({self.limit / MIB:g} MiB; lt-opd serve --max-body-mb)", "RequestEntityTooLarge")

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


async def _answer(send, status: int, text: str, kind: str) -> None:
    body = json.dumps({"error": {"message": text, "type": kind, "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
