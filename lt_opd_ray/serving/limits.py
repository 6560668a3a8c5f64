"""What one request to `lt-opd serve` may carry, enforced in the server's front end.

`RequestGuard` is an ASGI middleware, loaded by vLLM's server through its `--middleware` option and by the
transformers engine. In order: with an API key, a request to any route but the health checks without it is answered
401 before its body is read; a body over `LT_OPD_MAX_BODY_BYTES` is answered 413 without reading it (a Content-Length
over the limit at once, a chunked body as soon as it passes the limit; the connection is closed); a JSON body nested
deeper than `JSON_DEPTH` is answered 400 before anything parses it. In front of vLLM (`inspect`) the parsed body is
then checked against the rest of `ServeLimits` (the transformers engine checks its one request shape itself, in
`ChatRequest.parse`): the token fields (`max_tokens`, `max_completion_tokens`, `max_output_tokens`, `min_tokens`:
integers, not above the limit), the choices (`n`, `best_of`) and one prompt (a batched `prompt` list refused), every
content part of its messages or input of a type the guard knows (any other refused), the images and clips one request
carries in any of the part types vLLM reads (OpenAI, Responses, Anthropic `source` blocks, embeddings; audio refused),
each inline image's format (`IMAGE_FORMATS`) and the pixels of them all, from their headers before anything is decoded; and the app's answer is awaited at most `request_seconds` (504 after, the request aborted). The
limit on one image or clip's bytes and on one image's pixels are the media connector's (`engines/vllm/media.py`)
and vLLM's own (`VLLM_MAX_IMAGE_PIXELS`). Pillow, in the processes that load the guard, opens only `IMAGE_FORMATS`
(`restrict_pillow`, in vLLM's server when it loads the guard, in the transformers engine's `main`): its EPS plugin, say, would launch Ghostscript.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import io
import json
import os
import re
from dataclasses import dataclass, fields

from lt_opd_ray.core.samples import IMAGE_FORMATS
from lt_opd_ray.engines.vllm.media import MAX_MEDIA_ENV, MIB

MAX_BODY_ENV = "LT_OPD_MAX_BODY_BYTES"
API_KEY_ENV = "LT_OPD_API_KEY"  # the transformers engine's key (vLLM's server reads VLLM_API_KEY)
SERVED_FOLDER_ENV = "LT_OPD_SERVED_FOLDER"  # the folder vLLM's server serves: the guard reads its serving defaults
PIXELS_ENV = "VLLM_MAX_IMAGE_PIXELS"  # vLLM's own name; the transformers engine reads it too
JSON_DEPTH = 64  # an OpenAI-style chat body nests about 6 deep; a tool's JSON schema a few dozen at most


class LimitError(ValueError):
    """A request over one of the server's limits: its HTTP status and the one sentence naming the field or limit."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ServeLimits:
    """One request's most: its body, one image or clip's encoded bytes, one image's pixels (a 48-megapixel photo
    fits; the processors resize far below that), its images and clips, the pixels of all its images, the tokens it
    may ask for, the seconds it may take."""

    body_bytes: int = 32 * MIB
    media_bytes: int = 24 * MIB
    image_pixels: int = 50_000_000
    images: int = 1
    clips: int = 1
    request_pixels: int = 50_000_000
    max_tokens: int = 4096
    request_seconds: int = 300
    choices: int = 1  # `n` and `best_of`: one answer per request (a client wanting k sends k requests, each bounded)

    ENVIRONMENT = {"body_bytes": MAX_BODY_ENV, "media_bytes": MAX_MEDIA_ENV, "image_pixels": PIXELS_ENV, "images": "LT_OPD_MAX_IMAGES",
                   "clips": "LT_OPD_MAX_CLIPS", "request_pixels": "LT_OPD_MAX_REQUEST_PIXELS", "max_tokens": "LT_OPD_MAX_TOKENS",
                   "request_seconds": "LT_OPD_REQUEST_SECONDS", "choices": "LT_OPD_MAX_CHOICES"}

    def environment(self) -> dict[str, str]:
        """What the server process reads them from (ours, and vLLM's own pixel limit)."""
        return {self.ENVIRONMENT[f.name]: str(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_environment(cls) -> ServeLimits:
        return cls(**{f.name: int(os.environ[cls.ENVIRONMENT[f.name]]) for f in fields(cls)})

    @classmethod
    def from_args(cls, args) -> ServeLimits:
        """`lt-opd serve`'s flags."""
        return cls(args.max_body_mb * MIB, args.max_media_mb * MIB, args.max_image_pixels, args.max_images, args.max_clips,
                   args.max_request_pixels, args.max_tokens, args.request_timeout, args.max_choices)


def restrict_pillow(formats: tuple[str, ...] = IMAGE_FORMATS) -> None:
    """Pillow, in this process, opens only `formats`, whoever calls `Image.open` (vLLM's image loader included)."""
    from PIL import Image

    Image.init()  # every plugin registered now: Image.open never loads the others again
    for name in [name for name in Image.OPEN if name not in formats]:  # kept by name (a caller may ask for one), never accepted
        Image.OPEN[name] = (_refused_format, lambda prefix: False)
    Image.ID[:] = [name for name in Image.ID if name in formats]


def _refused_format(*args):
    raise OSError("an image format this server does not read")


def image_size(raw: bytes, where: str) -> tuple[int, int]:
    """An encoded image's width and height from its header (nothing decoded), one of `IMAGE_FORMATS` only."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(raw), formats=list(IMAGE_FORMATS)) as image:  # the header only
            return image.size
    except Image.DecompressionBombError:  # Pillow's own bound, twice MAX_IMAGE_PIXELS: the size is still what is refused
        return _header_size(raw)
    except Image.UnidentifiedImageError:
        raise LimitError(f"{where}: not an image this server reads: it takes {', '.join(IMAGE_FORMATS)}") from None
    except (ValueError, OSError, Image.DecompressionBombError) as exc:
        raise LimitError(f"{where}: not an image this server reads ({type(exc).__name__}: {exc})") from None


def _header_size(raw: bytes) -> tuple[int, int]:
    """The size in the header, read by the allowed format's own Pillow plugin (what Image.open does, before its
    decompression-bomb check)."""
    from PIL import Image

    for name in IMAGE_FORMATS:
        factory, accept = Image.OPEN[name]
        if accept(raw[:16]):
            with factory(io.BytesIO(raw), None) as image:
                return image.size
    raise LimitError("not an image this server reads")


def check_pixels(width: int, height: int, total: int, limits: ServeLimits, where: str) -> int:
    """The request's pixels so far with this image's, refused past either limit."""
    if width * height > limits.image_pixels:
        raise LimitError(f"{where}: image of {width}x{height} ({width * height} pixels) refused, more than this server's "
                         f"{limits.image_pixels} (lt-opd serve --max-image-pixels)")
    if total + width * height > limits.request_pixels:
        raise LimitError(f"{where}: the request's images come to {total + width * height} pixels or more, more than this "
                         f"server's {limits.request_pixels} per request (lt-opd serve --max-request-pixels)")
    return total + width * height


def check_count(kind: str, count: int, limits: ServeLimits, where: str) -> None:
    """`count` images (or clips) in one request, refused past the limit: `where` names the first one too many."""
    most = limits.images if kind == "image" else limits.clips
    if count > most:
        flag = "--max-images" if kind == "image" else "--max-clips"
        raise LimitError(f"{where}: {kind} {count} of the request refused, more than this server's {most} per request (lt-opd serve {flag})")


TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens")  # OpenAI's, Responses', vLLM's
CHOICE_FIELDS = ("n", "best_of")  # each multiplies the request's work


def check_max_tokens(name: str, value, limits: ServeLimits) -> None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > limits.max_tokens:
        raise LimitError(f"{name}: {value} is more than this server's {limits.max_tokens} (lt-opd serve --max-tokens)")


def check_token_fields(body: dict, limits: ServeLimits) -> None:
    """The fields that size a request's work: the token counts and the choices, JSON integers (vLLM's models would
    take "1000000" or true for one) within the limits, and one prompt (a batched `prompt` list is several requests)."""
    for name in TOKEN_FIELDS + CHOICE_FIELDS:
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise LimitError(f"{name}: expected an integer, got {type(value).__name__} {json.dumps(value)[:40]}")
    for name in TOKEN_FIELDS:
        check_max_tokens(name, body.get(name), limits)
    for name in CHOICE_FIELDS:
        if body.get(name) is not None and body[name] > limits.choices:
            raise LimitError(f"{name}: {body[name]} is more than this server's {limits.choices} per request (lt-opd serve --max-choices)")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and any(isinstance(item, (str, list, dict)) for item in prompt):
        raise LimitError(f"prompt: a batch of {len(prompt)} prompts refused: this server answers one prompt per request")


_ESCAPE = re.compile(rb"\\.", re.S)
_STRING = re.compile(rb'"[^"]*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth_over(body: bytes, limit: int = JSON_DEPTH) -> bool:
    """Whether a JSON body opens more than `limit` arrays and objects inside one another (an unclosed run counted as
    open), found without parsing it: Python's parser recurses once per level."""
    import numpy as np

    encoding = json.detect_encoding(body)
    if encoding not in ("utf-8", "utf-8-sig"):  # json.loads reads UTF-16 and UTF-32 too
        body = body.decode(encoding, "replace").encode()
    if body.lstrip(b" \t\r\n\xef\xbb\xbf")[:1] not in (b"[", b"{"):
        return False
    brackets = _STRING.sub(b"", _ESCAPE.sub(b"", body)).translate(None, _NOT_BRACKETS)
    if len(brackets) <= limit:
        return False
    depth = 0
    for start in range(0, len(brackets), 1 << 20):
        chunk = np.frombuffer(brackets, np.uint8, count=min(1 << 20, len(brackets) - start), offset=start)
        running = np.cumsum(((chunk == 91) | (chunk == 123)).astype(np.int32) * 2 - 1) + depth  # [ and { open
        if int(running.max()) > limit:
            return True
        depth = int(running[-1])
    return False


# the content parts the guard knows, by `type`: what a part of each media type is (a kind counted, audio refused; the
# field holding it), and the parts that carry none (text, thinking, tool calls and results, Responses' items)
MEDIA_TYPES = {"image_url": "image", "input_image": "image", "image": "image", "image_embeds": "image", "image_pil": "image",
               "video_url": "clip", "input_video": "clip", "video": "clip", "video_embeds": "clip",
               "audio_url": "audio", "input_audio": "audio", "audio": "audio", "audio_embeds": "audio"}
MEDIA_KEYS = ("image_url", "image_pil", "image_embeds", "audio_embeds", "video_embeds", "audio_url", "input_audio", "video_url")  # vLLM's order
TEXT_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking", "redacted_thinking", "summary_text",
                        "reasoning_text", "tool_reference", "function", "tool_use", "tool_result", "message", "function_call",
                        "function_call_output", "reasoning", "item_reference"})
CONTENT_FIELDS = ("messages", "input", "prompt", "system", "query", "documents", "data_1", "data_2", "text_1", "text_2")
OPAQUE_FIELDS = ("input", "arguments", "cache_control", "citations", "encrypted_content")  # inside a part: its own JSON, no parts


def check_request_body(body: object, limits: ServeLimits) -> None:
    """A parsed request body (vLLM's routes) against the limits: the token and choice fields, every content part of
    its messages or input (a type the guard does not know refused), the images and clips it carries (every media
    part type vLLM reads, anywhere in the body), each inline image's format and the pixels of them all."""
    if not isinstance(body, (dict, list)):
        return
    if isinstance(body, dict):
        check_token_fields(body, limits)
    media: dict[str, list[tuple[str, dict]]] = {"image": [], "clip": [], "audio": []}
    stack: list[tuple[str, object, bool]] = [("body", body, False)]
    while stack:  # every image and clip, counted before any is decoded
        where, value, content = stack.pop()
        children: list[tuple[str, object, bool]] = []
        if isinstance(value, dict):
            kind, field = _media_kind(value)
            if kind is not None:
                media[kind].append((f"{where}.{field}", value))
                continue
            kind = value.get("type")
            if content and "type" in value and (not isinstance(kind, str) or kind not in TEXT_TYPES):
                raise LimitError(f"{where}: a content part of type {json.dumps(kind)[:60]} refused: this server does not know it "
                                 "(it takes text, image and video parts, tool calls and their results)")
            for key, item in value.items():
                path = f"{where}.{key}" if where != "body" else str(key)
                if content and "type" in value and key in OPAQUE_FIELDS:
                    continue  # a tool call's own arguments, a cache hint: its own JSON, nothing vLLM reads media from
                children.append((path, item, content or (where == "body" and key in CONTENT_FIELDS)))
        elif isinstance(value, list):
            children = [(f"{where}[{index}]", item, content) for index, item in enumerate(value)]
        stack.extend(reversed(children))  # in the body's own order
    if media["audio"]:
        raise LimitError(f"{media['audio'][0][0]}: audio refused: this server takes images and clips")
    for kind, most in (("image", limits.images), ("clip", limits.clips)):
        if len(media[kind]) > most:
            check_count(kind, most + 1, limits, media[kind][most][0])
    pixels = 0
    for path, part in media["image"]:
        raw = _inline_image_bytes(part, limits, path)
        if raw is not None:  # a fetched one: vLLM's VLLM_MAX_IMAGE_PIXELS; embeddings: no pixels
            width, height = image_size(raw, path)
            pixels = check_pixels(width, height, pixels, limits, path)


def _media_kind(part: dict) -> tuple[str | None, str]:
    """What vLLM would take `part` for (its `type`, or without one or with a `uuid`, its first media field; an
    Anthropic block by its `source`) and the field that holds it; (None, "") for no media part."""
    kind = part.get("type")
    if isinstance(kind, str) and kind in MEDIA_TYPES and part.get("uuid") is None:
        return MEDIA_TYPES[kind], next((field for field in (kind, "source", *MEDIA_KEYS) if field in part), kind)
    for field in MEDIA_KEYS:
        if field in part:
            return MEDIA_TYPES[field], field
    if isinstance(kind, str) and kind in MEDIA_TYPES:
        return MEDIA_TYPES[kind], "source" if "source" in part else kind
    return None, ""


def _inline_image_bytes(part: dict, limits: ServeLimits, where: str) -> bytes | None:
    """An image part's inline bytes (a base64 data: URL, or an Anthropic base64 `source`), or None for one vLLM
    fetches, reads from its own cache (a `uuid`) or takes as embeddings."""
    source = part.get("source")
    if isinstance(source, dict) and part.get("type") == "image":  # Anthropic: {"type": "base64", "media_type", "data"} or a URL
        if source.get("type") == "base64" or "data" in source:
            data = source.get("data")
            if not isinstance(data, str):
                raise LimitError(f"{where}: an image's base64 data is expected in `data`")
            return _base64_bytes(data, limits, where)
        url = source.get("url")
    else:
        url = next((part[key] for key in ("image_url", "image", "url") if key in part), None)
        url = url.get("url") if isinstance(url, dict) else url
    if isinstance(url, str) and url[:5].lower() == "data:":
        return _data_url_bytes(url, limits, where)
    return None


def _data_url_bytes(url: str, limits: ServeLimits, where: str) -> bytes:
    header, comma, data = url[5:].partition(",")
    if not comma or not header.lower().endswith(";base64"):
        raise LimitError(f"{where}: only base64 data URLs are read")
    return _base64_bytes(data, limits, where)


def _base64_bytes(data: str, limits: ServeLimits, where: str) -> bytes:
    if len(data) > 4 * (limits.media_bytes + 2) // 3:
        raise LimitError(f"{where}: media refused, more than this server's {limits.media_bytes / MIB:g} MiB (lt-opd serve --max-media-mb)")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise LimitError(f"{where}: not base64 ({exc})") from None


class RequestGuard:
    """The front door of both servers: with an API key, every request but the health checks carries it (vLLM's own key
    check covers only its /v1, /v2, /inference and /cohere routes, not /invocations, /tokenize or /metrics), checked
    before the body is read; then the body limit and the JSON depth; with `inspect` (vLLM's server), the body's
    fields against the limits and the time limit."""

    OPEN_PATHS = ("/health", "/ping")
    # vLLM's generation routes and where each request names its stop strings: one without them gets the student's
    STOP_FIELDS = {"/v1/chat/completions": ("stop",), "/v1/chat/completions/batch": ("stop",), "/v1/completions": ("stop",),
                   "/v1/responses": ("stop",), "/invocations": ("stop",), "/v1/messages": ("stop_sequences",),
                   "/inference/v1/generate": ("sampling_params", "stop")}

    def __init__(self, app, limits: ServeLimits | None = None, api_key: str | None = None, inspect: bool = True,
                 stop: tuple[str, ...] | None = None):
        self.app = app
        self.limits = ServeLimits.from_environment() if limits is None else limits
        self.limit = self.limits.body_bytes
        self.inspect = inspect
        if stop is None:  # vLLM's server: the served folder's stop strings (its generation config's, ServingDefaults)
            from lt_opd_ray.core.compression import ServingDefaults

            folder = os.environ.get(SERVED_FOLDER_ENV)
            stop = ServingDefaults.read(folder).stop if folder else ()
        self.stop = stop
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or os.environ.get("VLLM_API_KEY")
        self.expected = f"Bearer {key}".encode() if key else None
        if limits is None:  # loaded by vLLM's server from the environment `lt-opd serve` set: that process's Pillow
            restrict_pillow()

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
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.strip().isdigit() and int(declared) > self.limit:  # refused unread; the connection is closed
            return await self._too_large(send, f"{int(declared)} bytes")
        messages, size = [], 0
        while True:  # the body, counted as it arrives; refused the moment it passes the limit
            message = await receive()
            if message["type"] != "http.request":
                messages.append(message)  # the client left: the app sees the disconnect too
                break
            size += len(message.get("body", b""))
            if size > self.limit:
                return await self._too_large(send, f"more than {self.limit} bytes")
            messages.append(message)
            if not message.get("more_body", False):
                break
        body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
        try:
            if json_depth_over(body):
                raise LimitError(f"request body refused: its JSON nests more than {JSON_DEPTH} arrays and objects deep, this server's most")
            if self.inspect and body:
                try:
                    parsed = json.loads(body)
                except (ValueError, UnicodeDecodeError):
                    parsed = None  # not JSON: the app answers it
                check_request_body(parsed, self.limits)
                if self.stop and (stopped := self._with_default_stop(scope, parsed)) is not None:
                    body = json.dumps(stopped).encode()
                    scope = {**scope, "headers": [(k, v) for k, v in scope.get("headers") or [] if k != b"content-length"]
                             + [(b"content-length", str(len(body)).encode())]}
        except LimitError as exc:
            return await _answer(send, exc.status, str(exc), "BadRequestError")
        messages = [{"type": "http.request", "body": body, "more_body": False}] + [m for m in messages if m["type"] != "http.request"]

        async def replay():
            return messages.pop(0) if messages else await receive()

        if not self.inspect:
            return await self.app(scope, replay, send)
        started = False

        async def sending(message):
            nonlocal started
            started = True
            await send(message)

        try:
            await asyncio.wait_for(self.app(scope, replay, sending), self.limits.request_seconds)
        except asyncio.TimeoutError:  # the app's task is cancelled: vLLM aborts the request
            if started:  # a stream cut short: ended, no status left to send
                return await send({"type": "http.response.body", "body": b"", "more_body": False})
            await _answer(send, 504, f"request stopped: not answered within this server's {self.limits.request_seconds} s "
                                     "(lt-opd serve --request-timeout)", "TimeoutError")

    def _with_default_stop(self, scope, parsed) -> dict | None:
        """The request with the student's stop strings where it is a generation request naming none (a request's own,
        `[]` included, stands); None where nothing changes."""
        path, root = scope.get("path", ""), scope.get("root_path", "")
        field = self.STOP_FIELDS.get(path[len(root):] if root and path.startswith(root) else path)
        if field is None or not isinstance(parsed, dict):
            return None
        *outer, name = field
        holder = parsed.get(outer[0]) if outer else parsed
        if not isinstance(holder, dict) or holder.get(name) is not None:
            return None
        holder = {**holder, name: list(self.stop)}
        return {**parsed, outer[0]: holder} if outer else holder

    async def _too_large(self, send, size: str) -> None:
        await _answer(send, 413, f"request body of {size} refused: this server takes at most {self.limit} "
                                 f"({self.limit / MIB:g} MiB; lt-opd serve --max-body-mb)", "RequestEntityTooLarge", close=True)


async def _answer(send, status: int, text: str, kind: str, close: bool = False) -> None:
    body = json.dumps({"error": {"message": text, "type": kind, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + ([(b"connection", b"close")] if close else [])})
    await send({"type": "http.response.body", "body": body})
