"""`lt-opd serve --engine transformers`: an exported student on transformers behind the OpenAI-style chat API.

For a student vLLM cannot run here (vLLM's CPU attention has no kernel for the toy models' head size 16) and for
checking one without vLLM. Each request runs the evaluation path (`models/evaluation`): the folder's compression
config (`lt_opd_compression.json`: selector, budget, k_min) applied with the question of the request's own prompt
as the selector's query, then greedy decoding or sampling, one request at a time, answered whole or streamed as
server-sent chunks while its tokens are drawn. The front end keeps the rules of
vLLM's server under `lt-opd serve`: the API key, the body, media, image, pixel and token limits (`ServeLimits`),
images inline only (`data:` URLs, PNG, JPEG, WebP, GIF or BMP), the token and choice fields integers within the
limits (`check_token_fields`), every refusal a 4xx naming the field. A request's
time (`request_seconds`) counts from its arrival: one still waiting for the model when it runs out is answered 503,
one still generating is stopped at its next token and answered 504 (a stream past its first token ends with an error
event instead). The API key and the limits come from the environment
`serve_command` sets (`LT_OPD_API_KEY`, `ServeLimits.environment`), never from a command line.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import functools
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lt_opd_ray.serving.limits import LimitError, check_count, check_pixels, check_token_fields, image_size

DEFAULT_MAX_TOKENS = 256
# the chat-completion fields this engine reads; any other is refused by name (never silently ignored)
FIELDS = frozenset({"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "n",
                    "stream", "stream_options", "user"})


class RequestError(LimitError):
    """A request the server refuses (400), naming the field."""


@dataclass(frozen=True)
class ChatRequest:
    question: str
    images: tuple[bytes, ...]
    system_prompt: str | None
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...] = ()
    stream: bool = False
    stream_usage: bool = False  # stream_options.include_usage: a last chunk with the usage

    @classmethod
    def parse(cls, body: object, limits, default_stop: tuple[str, ...] = ()) -> ChatRequest:
        """The one user turn this server answers (its text and inline images; a system message before it), checked;
        without a `stop` of its own, the student's (`default_stop`, ServingDefaults)."""
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        unsupported = sorted(set(body) - FIELDS)
        if unsupported:
            raise RequestError(f"{', '.join(unsupported)}: not supported by the transformers engine (it reads {', '.join(sorted(FIELDS))})")
        for name in ("model", "user"):  # taken, not read: one model is served
            if body.get(name) is not None and not isinstance(body[name], str):
                raise RequestError(f"{name}: expected a string, got {type(body[name]).__name__}")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError("messages: a non-empty list of message objects is required")
        system = [m for m in messages if m.get("role") == "system"]
        turns = [m for m in messages if m.get("role") != "system"]
        if len(turns) != 1 or turns[0].get("role") != "user" or len(system) > 1:
            raise RequestError("messages: this engine answers one user message (after at most one system message); "
                               f"got roles {[m.get('role') for m in messages]}")
        texts, images, pixels = [], [], 0
        content = turns[0].get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content if isinstance(content, list) else []
        pictures = [index for index, part in enumerate(parts) if isinstance(part, dict) and part.get("type") == "image_url"]
        if len(pictures) > limits.images:  # counted before any is decoded
            check_count("image", limits.images + 1, limits, f"messages[-1].content[{pictures[limits.images]}]")
        for index, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind == "image_url" and isinstance(part.get("image_url"), dict):
                where = f"messages[-1].content[{index}]"
                raw, (width, height) = _inline_image(str(part["image_url"].get("url", "")), limits, where)
                pixels = check_pixels(width, height, pixels, limits, where)  # the request's sum, from the headers
                images.append(raw)
            else:
                raise RequestError(f"messages[-1].content[{index}]: a text or image_url part is expected, got {kind!r}")
        if not images:
            raise RequestError("messages[-1].content: no image: this server answers questions about an image")
        question = "\n".join(texts).strip()
        if not question:
            raise RequestError("messages[-1].content: no question text")
        system_prompt = system[0].get("content") if system else None
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise RequestError("messages[0].content: the system message must be text")
        stop = body.get("stop")
        stop = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else default_stop if stop is None else None
        if stop is None or (body.get("stop") is not None and len(stop) > 4) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError("stop: a string or a list of at most 4 non-empty strings")
        check_token_fields(body, limits)  # integers within the limits, as in front of vLLM
        if body.get("n") not in (None, 1):
            raise RequestError(f"n: {body['n']} choices asked; the transformers engine answers one")
        stream, options = body.get("stream", False), body.get("stream_options")
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise RequestError(f"stream: true or false, got {type(stream).__name__}")
        if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_usage"}
                                    or not isinstance(options.get("include_usage", False), bool)):
            raise RequestError("stream_options: only with stream true, and at most {\"include_usage\": true or false}")
        options = options or {}
        tokens = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"  # vLLM's precedence
        return cls(question, tuple(images), system_prompt,
                   _number(body, tokens, int, min(DEFAULT_MAX_TOKENS, limits.max_tokens), 1, limits.max_tokens),
                   _number(body, "temperature", float, 1.0, 0.0, 10.0), _number(body, "top_p", float, 1.0, 1e-6, 1.0),
                   _number(body, "seed", int, 0, 0, 2**63 - 1), stop, stream, bool(options.get("include_usage", False)))


def _number(body: dict, name: str, kind: type, default, low, high):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not float(value).is_integer()):
        raise RequestError(f"{name}: expected {'an integer' if kind is int else 'a number'}, got {type(value).__name__}")
    if not low <= value <= high:
        raise RequestError(f"{name}: {value} is outside [{low}, {high}]")
    return kind(value)


def _inline_image(url: str, limits, where: str) -> tuple[bytes, tuple[int, int]]:
    """A `data:` URL's image and its size, within the media limit, of a format this server reads (its header read,
    nothing decoded)."""
    if url[:5].lower() != "data:":
        scheme = url.split(":", 1)[0] if ":" in url else "no scheme"
        raise RequestError(f"{where}: remote image URLs and {scheme}: URLs are off on this server: send the image inline (a data: URL with base64)")
    header, comma, data = url[5:].partition(",")
    if not comma or not header.endswith(";base64"):
        raise RequestError(f"{where}: only base64 data URLs are read")
    if len(data) > 4 * (limits.media_bytes + 2) // 3:
        raise RequestError(f"{where}: media refused, more than this server's {limits.media_bytes / 2**20:g} MiB (lt-opd serve --max-media-mb)")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(f"{where}: not an image this server reads ({type(exc).__name__}: {exc})") from None
    return raw, image_size(raw, where)


def check_deadline(deadline: float, seconds: float) -> None:
    """Before each forward pass of a request's sampling: stopped (504) once its time is up."""
    if time.monotonic() > deadline:
        raise LimitError(f"request stopped: not answered within this server's {seconds:g} s (lt-opd serve --request-timeout)", 504)


class TransformersStudent:
    """The student folder loaded for answering: its model, processor and compression config."""

    def __init__(self, model_dir: Path):
        from lt_opd_ray.core.compression import CompressionConfig, ServingDefaults
        from lt_opd_ray.core.selectors import build_selector
        from lt_opd_ray.models.adapter import QwenVLM
        from lt_opd_ray.models.loading import load_vlm
        from lt_opd_ray.models.processor import VLMProcessor

        self.compression = CompressionConfig.read(model_dir)
        merge = self.compression is not None and self.compression.merge == "learnable"
        model_dir, model = load_vlm(model_dir, token_merge=merge)
        self.name, self.vlm, self.processor = str(model_dir), QwenVLM(model.eval()), VLMProcessor(model_dir)
        self.choose = build_selector(self.compression.selector) if self.compression else None
        if self.choose is not None:
            self.vlm.check_selector(self.choose)  # refused at start, not per request
        self.stop = ServingDefaults.read(model_dir).stop  # a request without `stop` ends where training did
        self.lock = threading.Lock()  # one request at a time: the model is not shared across threads

    def answer(self, request: ChatRequest, deadline: float | None = None, seconds: float = 0, uid: str | None = None,
               on_token: Callable[[int], None] | None = None) -> dict:
        """The OpenAI-style completion: the text, its finish reason, and the prompt's tokens as the language model took
        them in (the kept visual tokens only; a selector pruning inside it takes in every one). Past `deadline` (time.monotonic; `seconds` from the request's arrival) it is refused:
        503 while waiting for the model, 504 once answering. `on_token`: called with each token as it is drawn."""
        import torch

        from lt_opd_ray.core.curriculum import BPS
        from lt_opd_ray.core.samples import Sample
        from lt_opd_ray.models.processor import encode_samples
        from lt_opd_ray.models.sampler import SamplingParams, sample

        sample_uid = uid or f"request-{uuid.uuid4().hex[:12]}"
        params = SamplingParams(max_new_tokens=request.max_tokens, temperature=max(request.temperature, 1e-6), top_p=request.top_p,
                                greedy=request.temperature == 0, top_k_logprobs=1, stop=request.stop, eos_token_ids=self.processor.eos_token_ids)
        if not self.lock.acquire(timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())):
            raise LimitError(f"server busy: the model was not free within this server's {seconds:g} s per request "
                             "(lt-opd serve --request-timeout); try again", 503)
        try:
            with torch.inference_mode():  # grad mode is per thread: this request's thread, not the process
                (prompt,) = encode_samples(self.processor, [Sample(sample_uid, request.images, request.question)], request.system_prompt)
                features = self.vlm.visual_features(prompt, with_attention=self.choose is not None and self.choose.reads_encoder_attention)
                compression = self.compression
                reduced = self.vlm.reduced_prompt(prompt, features, self.choose, compression.budget_bps if compression else BPS,
                                                  compression.k_min if compression else 1, seed=request.seed)
                (completion,) = sample(self.vlm, [reduced], params, [request.seed], self.processor.tokenizer,
                                       None if on_token is None else lambda _, token: on_token(token),
                                       None if deadline is None else functools.partial(check_deadline, deadline, seconds))
        finally:
            self.lock.release()
        text = self.processor.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        if completion.finish_reason == "stop":  # as OpenAI's API and vLLM answer: without the stop string
            text = before_stop(text, request.stop)
        prompt_tokens, completion_tokens = int(reduced.inputs_embeds.shape[0]), int(completion.token_ids.numel())
        return {
            "id": f"chatcmpl-{sample_uid}", "object": "chat.completion", "created": int(time.time()), "model": self.name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "stop" if completion.finish_reason in ("eos", "stop") else "length"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens},
        }


def build_app(student: TransformersStudent, api_key: str | None, limits):
    """The ASGI app: /health, /v1/models, /v1/chat/completions, behind the request guard (the API key on every route
    but /health, then the body limit)."""
    import json

    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from lt_opd_ray.serving.limits import RequestGuard

    def error(status: int, message: str, kind: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)

    async def health(request):
        return JSONResponse({})

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": student.name, "object": "model", "owned_by": "lt-opd"}]})

    async def chat(request):
        deadline = time.monotonic() + limits.request_seconds  # from the request's arrival, waiting for the model included
        try:
            parsed = ChatRequest.parse(json.loads(await request.body()), limits, student.stop)
            if parsed.stream:
                return await streamed(parsed, deadline)
            return JSONResponse(await run_in_threadpool(student.answer, parsed, deadline, limits.request_seconds))
        except json.JSONDecodeError as exc:
            return error(400, f"the body is not JSON: {exc}", "BadRequestError")
        except LimitError as exc:  # RequestError included: the field or limit named
            kind = {503: "ServiceUnavailable", 504: "TimeoutError"}.get(exc.status, "BadRequestError")
            return error(exc.status, str(exc), kind)
        except ValueError as exc:  # what the processor refuses about the request's images
            return error(400, str(exc), "BadRequestError")

    async def streamed(parsed: ChatRequest, deadline: float):
        """Server-sent chunks as the tokens are drawn; a refusal before the first token is answered with its status."""
        uid, loop, events = f"request-{uuid.uuid4().hex[:12]}", asyncio.get_running_loop(), asyncio.Queue()
        cancelled = threading.Event()  # the client left: the worker stops at its next token and frees the model
        tokens, shown = [], [""]

        def put(event) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        def on_token(token: int) -> None:  # on the worker's thread, where the tokenizer is already in use
            if cancelled.is_set():
                raise StreamCancelled("the client left")
            tokens.append(token)
            text = streamable(student.processor.tokenizer.decode(tokens, skip_special_tokens=True), parsed.stop)
            if len(text) > len(shown[0]) and text.startswith(shown[0]):
                put(("text", text[len(shown[0]) :]))
                shown[0] = text

        def work() -> None:
            try:
                put(("done", student.answer(parsed, deadline, limits.request_seconds, uid, on_token)))
            except StreamCancelled:
                pass
            except Exception as exc:  # noqa: BLE001 - handed to the stream, which answers it
                put(("error", exc))

        threading.Thread(target=work, daemon=True).start()
        first = await events.get()
        if first[0] == "error":
            raise first[1]
        return StreamingResponse(_chunks(first, events, cancelled, shown, uid, student, parsed), media_type="text/event-stream")

    app = Starlette(routes=[Route("/health", health), Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])])
    app.add_middleware(RequestGuard, limits=limits, api_key=api_key or "", inspect=False)  # the key, the body, the JSON depth
    return app


class StreamCancelled(Exception):
    """A streamed request whose client left: its sampling stops at the next token."""


async def _chunks(first: tuple, events: asyncio.Queue, cancelled: threading.Event, shown: list[str], uid: str,
                  student: TransformersStudent, request: ChatRequest):
    """OpenAI's server-sent chat-completion chunks: the role, the text as its tokens are drawn (never a stop string, nor
    a tail that may begin one, nor half a character: `streamable`), the finish reason, the usage when asked, then
    [DONE]. A refusal after the first token (the time limit) ends the stream with an error event; a client that
    leaves stops the sampling."""
    import json

    ident, created, sent = f"chatcmpl-{uid}", int(time.time()), ""

    def chunk(delta: dict | None, finish: str | None = None, **extra) -> str:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
        body = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": student.name, "choices": choices, **extra}
        return f"data: {json.dumps(body)}\n\n"

    try:
        yield chunk({"role": "assistant", "content": ""})
        kind, value = first
        while kind == "text":
            sent += value
            yield chunk({"content": value})
            kind, value = await events.get()
        if kind == "error":
            status = value.status if isinstance(value, LimitError) else 500
            yield f"data: {json.dumps({'error': {'message': str(value), 'type': type(value).__name__, 'code': status}})}\n\n"
            yield "data: [DONE]\n\n"
            return
        choice = value["choices"][0]
        text = choice["message"]["content"]
        if not text.startswith(sent):  # the stream and the answer are one text: a gap is a bug, named rather than hidden
            raise RuntimeError(f"streamed {sent!r} is not the start of the answer {text!r}")
        if len(text) > len(sent):
            yield chunk({"content": text[len(sent) :]})
        yield chunk({}, choice["finish_reason"])
        if request.stream_usage:
            yield chunk(None, usage=value["usage"])
        yield "data: [DONE]\n\n"
    finally:
        cancelled.set()  # a client that left mid-stream (the generator closed) frees the model at the next token


def before_stop(text: str, stop: tuple[str, ...]) -> str:
    """The text before its first stop string (all of it where none is in it: one that ended generation may sit in
    special tokens the decoded text skips)."""
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[: min(found)] if found else text


def streamable(text: str, stop: tuple[str, ...]) -> str:
    """What of a response's text so far may be sent: an unfinished character (decoded as U+FFFD) dropped, then up to
    its first stop string, less a tail that may begin one."""
    text = text.rstrip("\ufffd")
    cut = before_stop(text, stop)
    if len(cut) < len(text):
        return cut
    for length in range(min(len(text), max((len(s) - 1 for s in stop), default=0)), 0, -1):
        if any(s.startswith(text[-length:]) for s in stop):
            return text[:-length]
    return text


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from lt_opd_ray.serving.limits import API_KEY_ENV, ServeLimits, restrict_pillow

    parser = argparse.ArgumentParser(prog="python -m lt_opd_ray.serving.transformers_server")
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    limits = ServeLimits.from_environment()
    restrict_pillow()  # the processor's decoding too: only the formats a request's image may be
    app = build_app(TransformersStudent(Path(args.model)), os.environ.get(API_KEY_ENV) or None, limits)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
