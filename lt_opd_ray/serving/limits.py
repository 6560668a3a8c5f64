"""What one request to `lt-opd serve` may carry, enforced in the server's front end.

`BodyLimit` is an ASGI middleware that vLLM's server loads by its `--middleware` option: a request body over
`LT_OPD_MAX_BODY_BYTES` is answered 413 before the app sees it (counted as it arrives, whatever Content-Length says;
never more than the limit held). The limit on one image or clip's bytes
and on an image's pixel count are the media connector's (`engines/vllm/media.py`) and vLLM's own
(`VLLM_MAX_IMAGE_PIXELS`, checked from the image's header before it is decoded).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from lt_opd_ray.engines.vllm.media import MAX_MEDIA_ENV, MIB

MAX_BODY_ENV = "LT_OPD_MAX_BODY_BYTES"
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


class BodyLimit:
    def __init__(self, app, limit: int | None = None):
        self.app = app
        self.limit = int(os.environ[MAX_BODY_ENV]) if limit is None else limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
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
            return await self._refuse(send, size)

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send, size: int) -> None:
        text = (f"request body of {size} bytes refused: this server takes at most {self.limit} "
                f"({self.limit / MIB:g} MiB; lt-opd serve --max-body-mb)")
        body = json.dumps({"error": {"message": text, "type": "RequestEntityTooLarge", "code": 413}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
