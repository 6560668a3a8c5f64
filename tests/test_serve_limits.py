"""`lt-opd serve` bounds every request on both engines: a table of requests over each limit, each answered with its
status and one sentence naming the field or limit, against the transformers engine on a real student (the toy) and
against the guard that sits in front of vLLM's server; a body over the limit refused unread on a real socket; a
host beyond loopback without a key refused at start."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import shutil
import socket
import threading
import time

import pytest
from conftest import bomb_png, random_image

API_KEY = "lt-opd-test-key-0123456789"
HEADERS = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}


def _data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def _png(seed: int = 1, side: int = 128) -> bytes:
    out = io.BytesIO()
    random_image(seed, side, side).save(out, format="PNG")
    return out.getvalue()


def _tiff() -> bytes:
    out = io.BytesIO()
    random_image(2, 16, 16).save(out, format="TIFF")
    return out.getvalue()


EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
PNG = _png()  # 128 x 128: 16,384 pixels


def asking(*urls: str, **fields) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Which colour?"}]}], **fields}


def nested(depth: int) -> bytes:
    """A chat body whose JSON nests `depth` deep (arrays in a key of the text part that neither engine reads)."""
    body = asking(_data_url(PNG), max_tokens=2, temperature=0)
    body["messages"][0]["content"][-1]["x"] = "X"
    return json.dumps(body).replace('"X"', "[" * (depth - 5) + "]" * (depth - 5)).encode()


# what each engine's server runs with here: tight enough for small requests to cross each limit
LIMITS = dict(body_bytes=300_000, image_pixels=100_000, images=2, request_pixels=30_000, max_tokens=8)

# (request body, status, what the answer names): every row over one limit
TABLE = [
    (asking(*[_data_url(PNG)] * 3), 400, "messages[-1].content[2]: image 3 of the request refused, more than this server's 2 per request (lt-opd serve --max-images)"),
    (asking(*[_data_url(bomb_png(10))] * 1000), 400, "image 3 of the request refused, more than this server's 2 per request (lt-opd serve --max-images)"),
    (asking(_data_url(PNG), _data_url(PNG)), 400, "messages[-1].content[1]: the request's images come to 32768 pixels or more, more than this server's 30000 per request (lt-opd serve --max-request-pixels)"),
    (asking(_data_url(bomb_png(400))), 400, "image of 400x400 (160000 pixels) refused, more than this server's 100000 (lt-opd serve --max-image-pixels)"),
    (asking(_data_url(PNG), max_tokens=65536), 400, "max_tokens: 65536 is more than this server's 8 (lt-opd serve --max-tokens)"),
    (asking(_data_url(PNG), max_tokens="1000000"), 400, 'max_tokens: expected an integer, got str "1000000"'),
    (asking(_data_url(PNG), max_tokens=True), 400, "max_tokens: expected an integer, got bool true"),
    (asking(_data_url(PNG), n=2), 400, "n: 2 is more than this server's 1 per request (lt-opd serve --max-choices)"),
    (asking(_data_url(EPS)), 400, "messages[-1].content[0]: not an image this server reads: it takes BMP, GIF, JPEG, PNG, WEBP"),
    (asking(_data_url(_tiff(), "image/tiff")), 400, "not an image this server reads: it takes BMP, GIF, JPEG, PNG, WEBP"),
    (b"[" * 100_000 + b"]" * 100_000, 400, "request body refused: its JSON nests more than 64 arrays and objects deep, this server's most"),
    (b"[" * 100_000, 400, "its JSON nests more than 64 arrays and objects deep"),
    (nested(65), 400, "its JSON nests more than 64 arrays and objects deep"),
    (("[" * 1000 + "]" * 1000).encode("utf-16"), 400, "its JSON nests more than 64"),  # json.loads reads UTF-16 too
    (b" " * 300_001, 413, "request body of 300001 bytes refused: this server takes at most 300000 (0.286102 MiB; lt-opd serve --max-body-mb)"),
]


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    from lt_opd_ray.core.compression import CompressionConfig
    from lt_opd_ray.serving.transformers_server import TransformersStudent
    from lt_opd_ray.sources.resolve import resolve_model_dir

    folder = tmp_path_factory.mktemp("served") / "student"
    shutil.copytree(resolve_model_dir("toy:circles"), folder)
    CompressionConfig("cdpruner", 500, 4).write(folder)
    return TransformersStudent(folder)


def _client(student, **limits):
    from starlette.testclient import TestClient

    from lt_opd_ray.serving.limits import ServeLimits
    from lt_opd_ray.serving.transformers_server import build_app

    return TestClient(build_app(student, API_KEY, ServeLimits(**{**LIMITS, **limits})))


def _post(client, body: dict | bytes):
    return client.post("/v1/chat/completions", content=body if isinstance(body, bytes) else json.dumps(body).encode(), headers=HEADERS)


@pytest.mark.parametrize(("body", "status", "named"), TABLE, ids=[f"row{i}" for i in range(len(TABLE))])
def test_the_transformers_engine_refuses_a_request_over_each_limit(student, body, status, named):
    answered = _post(_client(student), body)
    assert answered.status_code == status and named in answered.json()["error"]["message"], answered.text[:2000]


def test_the_transformers_engine_answers_within_the_limits_and_stops_at_the_time_limit(student):
    client = _client(student)
    answered = _post(client, nested(64))  # at the depth limit, at the token limit: answered
    assert answered.status_code == 200, answered.text[:2000]
    answered = _post(client, asking(_data_url(PNG), max_tokens=8, temperature=0))
    assert answered.status_code == 200 and answered.json()["usage"]["completion_tokens"] <= 8
    answered = _post(_client(student, request_seconds=0), asking(_data_url(PNG), max_tokens=8))  # out of time at the first step
    assert answered.status_code == 504, answered.text
    assert answered.json()["error"]["message"] == "request stopped: not answered within this server's 0 s (lt-opd serve --request-timeout)"
    streamed = _post(_client(student, request_seconds=0), asking(_data_url(PNG), max_tokens=8, stream=True))  # before its first token
    assert streamed.status_code == 504 and "not answered within this server's 0 s" in streamed.json()["error"]["message"]
    with student.lock:  # another request holds the model past this one's time
        answered = _post(_client(student, request_seconds=1), asking(_data_url(PNG), max_tokens=2))
    assert answered.status_code == 503 and "server busy: the model was not free within this server's 1 s per request" in answered.text
    assert _post(client, asking(_data_url(PNG), max_tokens=2)).status_code == 200  # the lock was given back


async def _slow_app(scope, receive, send):
    """A stand-in for vLLM's app behind the guard: reads the body, answers 200 after `delay` seconds."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await asyncio.sleep(json.loads(body).get("delay", 0) if body.strip()[:1] == b"{" else 0)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b"{}"})


def _block(raw: bytes = PNG, mime: str = "image/png") -> dict:
    """An Anthropic image block (vLLM's /v1/messages), its bytes inline."""
    return {"type": "image", "source": {"type": "base64", "media_type": mime, "data": base64.b64encode(raw).decode()}}


def _anthropic(*blocks, **fields) -> dict:
    return {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [*blocks, {"type": "text", "text": "?"}]}], **fields}


VLLM_TABLE = [
    *[row for row in TABLE if row[1] == 413 or b"nests" in row[2].encode() or "image 3" in row[2] or "pixels" in row[2]
      or "not an image" in row[2] or "expected an integer" in row[2] or "--max-choices" in row[2]],
    # every media part type vLLM reads is counted, its inline bytes read for their pixels
    (_anthropic(_block(), _block(), _block()), 400, "messages[0].content[2].source: image 3 of the request refused, more than this server's 2"),
    (_anthropic(_block(), _block()), 400, "messages[0].content[1].source: the request's images come to 32768 pixels or more"),
    (_anthropic(_block(bomb_png(400))), 400, "messages[0].content[0].source: image of 400x400 (160000 pixels) refused"),
    (_anthropic(_block(EPS, "image/eps")), 400, "messages[0].content[0].source: not an image this server reads"),
    (_anthropic({"type": "tool_result", "tool_use_id": "t", "content": [_block(bomb_png(400))]}), 400,
     "messages[0].content[0].content[0].source: image of 400x400"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": _data_url(PNG)}] * 2}]}, 400,
     "input[0].content[1].image_url: the request's images come to 32768 pixels"),
    ({"messages": [{"role": "user", "content": [{"image_url": {"url": _data_url(PNG)}, "uuid": "a"}, {"type": "image_embeds", "image_embeds": "AA"},
                                                {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]}, 400,
     "messages[0].content[2].image_url: image 3 of the request refused"),
    ({"messages": [{"role": "user", "content": [{"type": "video", "source": {}}, {"type": "input_video", "video_url": "x"}]}]}, 400,
     "messages[0].content[1].video_url: clip 2 of the request refused"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}]}]}, 400,
     "messages[0].content[0].input_audio: audio refused: this server takes images and clips"),
    # a part the guard does not know is refused, not let through
    (_anthropic({"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "AA"}}), 400,
     'messages[0].content[0]: a content part of type "document" refused: this server does not know it'),
    ({"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_data": "AA"}}]}]}, 400, 'messages[0].content[0]: a content part of type "file"'),
    ({"input": [{"type": "mcp_call", "output": "x"}]}, 400, 'input[0]: a content part of type "mcp_call" refused'),
    ({"messages": [{"role": "user", "content": [{"type": ["text"], "text": "x"}]}]}, 400, 'a content part of type ["text"] refused'),
    # what sizes the work: integers, one choice, one prompt
    ({"model": "m", "prompt": "hi", "max_tokens": 9}, 400, "max_tokens: 9 is more than this server's 8 (lt-opd serve --max-tokens)"),
    ({"model": "m", "prompt": "hi", "max_tokens": 4.0}, 400, "max_tokens: expected an integer, got float 4.0"),
    ({"model": "m", "prompt": "hi", "best_of": 3}, 400, "best_of: 3 is more than this server's 1 per request (lt-opd serve --max-choices)"),
    ({"model": "m", "prompt": "hi", "n": "2"}, 400, 'n: expected an integer, got str "2"'),
    ({"model": "m", "prompt": "hi", "min_tokens": 9}, 400, "min_tokens: 9 is more than this server's 8"),
    ({"model": "m", "prompt": ["hi", "ho"], "max_tokens": 8}, 400, "prompt: a batch of 2 prompts refused: this server answers one prompt per request"),
    ({"model": "m", "prompt": [[1, 2], [3]]}, 400, "prompt: a batch of 2 prompts refused"),
    ({"input": "hi", "max_output_tokens": "8"}, 400, 'max_output_tokens: expected an integer, got str "8"'),
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}] * 2}]}, 400,
     "messages[0].content[1].video_url: clip 2 of the request refused, more than this server's 1 per request (lt-opd serve --max-clips)"),
    ({"model": "m", "prompt": "hi", "max_tokens": 9}, 400, "max_tokens: 9 is more than this server's 8 (lt-opd serve --max-tokens)"),
    ({"messages": [], "max_completion_tokens": 100}, 400, "max_completion_tokens: 100 is more than this server's 8"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": _data_url(EPS)}]}], "max_output_tokens": 4}, 400,
     "input[0].content[0].image_url: not an image this server reads"),
    ({"input": "hi", "max_output_tokens": 4096}, 400, "max_output_tokens: 4096 is more than this server's 8"),
    ({"delay": 3}, 504, "request stopped: not answered within this server's 1 s (lt-opd serve --request-timeout)"),
]


@pytest.mark.parametrize(("body", "status", "named"), VLLM_TABLE, ids=[f"row{i}" for i in range(len(VLLM_TABLE))])
def test_the_guard_in_front_of_vllm_refuses_a_request_over_each_limit(body, status, named):
    from starlette.testclient import TestClient

    from lt_opd_ray.serving.limits import RequestGuard, ServeLimits

    client = TestClient(RequestGuard(_slow_app, ServeLimits(**LIMITS, request_seconds=1), api_key=API_KEY))
    answered = _post(client, body)
    named = re.sub(r"messages\[-1\]\.content\[(\d+)\]:", r"messages[0].content[\1].image_url:", named)  # the guard's path into the body
    assert answered.status_code == status and named in answered.json()["error"]["message"], answered.text[:2000]
    assert _post(client, {"messages": [], "max_tokens": 8, "delay": 0}).status_code == 200


# within the limits: answered (the stand-in app's 200), parts the guard knows in every shape they come in
VLLM_ANSWERED = [
    {"model": "m", "prompt": [1, 2, 3, 4], "max_tokens": 8, "n": 1, "best_of": 1},  # one prompt as token ids
    {"model": "m", "prompt": ["hi"], "max_tokens": None},
    _anthropic(_block(), {"type": "tool_use", "id": "t", "name": "f", "input": {"type": "circle", "image_url": 3}},
               {"type": "thinking", "thinking": "x", "signature": "s"}, {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}},
               system=[{"type": "text", "text": "be brief"}]),
    {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                  {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "ok"}]},
                  {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(PNG)}}, {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}],
     "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": ["string", "null"]}}}}}],
     "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}, "max_completion_tokens": 8},
    {"input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}, {"type": "input_image", "image_url": _data_url(PNG)}]},
               {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}, {"type": "function_call_output", "call_id": "c", "output": "1"},
               {"type": "reasoning", "id": "r", "summary": [{"type": "summary_text", "text": "x"}]}], "max_output_tokens": 8},
]


@pytest.mark.parametrize("body", VLLM_ANSWERED, ids=[f"row{i}" for i in range(len(VLLM_ANSWERED))])
def test_the_guard_in_front_of_vllm_lets_a_request_within_the_limits_through(body):
    from starlette.testclient import TestClient

    from lt_opd_ray.serving.limits import RequestGuard, ServeLimits

    answered = _post(TestClient(RequestGuard(_slow_app, ServeLimits(**LIMITS), api_key=API_KEY)), body)
    assert answered.status_code == 200, answered.text[:2000]


def test_a_stream_sends_no_stop_string_nor_a_tail_that_may_begin_one_nor_half_a_character():
    from lt_opd_ray.serving.transformers_server import before_stop, streamable

    stop = ("</answer>", "STOP")
    assert streamable("red </ans", stop) == "red " and streamable("red <", stop) == "red " and streamable("red ST", stop) == "red "
    assert streamable("red </answer> more", stop) == "red " and streamable("a STOP b </answer>", stop) == "a "
    assert streamable("red <b>", stop) == "red <b>" and streamable("caf\ufffd", stop) == "caf" and streamable("x", ()) == "x"
    assert streamable("red <\ufffd", ("<\u00e9>",)) == "red "  # half a character first, then a stop's beginning held back
    assert before_stop("red\n\n", ("\n",)) == "red" and before_stop("red", ("<|vision_end|>",)) == "red"  # the first; none found: all


def test_the_guard_gives_a_generation_request_without_stop_strings_the_students_on_every_route_vllm_generates_on():
    """Each of vLLM's generation routes, its stop field absent or null: the app behind the guard receives the student's
    stop strings there, with a Content-Length that matches; a request's own (`[]` too) stands; a route that generates
    nothing, and a body that is not an object, pass untouched; under a root path the route is read after it."""
    from starlette.testclient import TestClient

    from lt_opd_ray.serving.limits import RequestGuard, ServeLimits

    received = []

    async def recording_app(scope, receive, send):
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        received.append((json.loads(body) if body else None, dict(scope["headers"]).get(b"content-length")))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}"})

    stop = ("</answer>", "STOP")
    client = TestClient(RequestGuard(recording_app, ServeLimits(**LIMITS), api_key=API_KEY, stop=stop))

    def sent(path: str, body, root: str = "") -> dict:
        received.clear()
        assert TestClient(RequestGuard(recording_app, ServeLimits(**LIMITS), api_key=API_KEY, stop=stop), root_path=root).post(
            root + path, content=json.dumps(body).encode(), headers=HEADERS).status_code == 200
        (got, length), = received
        assert int(length) == len(json.dumps(got).encode()), path  # the header the app reads matches the body it gets
        return got

    for path, field in RequestGuard.STOP_FIELDS.items():
        *outer, name = field
        def request(**stop_field):
            inner = {"max_tokens": 3, **stop_field}
            return {"model": "m", outer[0]: inner} if outer else {"model": "m", "messages": [], **inner}
        def read(body):
            return body[outer[0]] if outer else body
        assert read(sent(path, request()))[name] == list(stop), path
        assert read(sent(path, request(**{name: None})))[name] == list(stop), path
        assert read(sent(path, request(**{name: []})))[name] == [], path
        assert read(sent(path, request(**{name: ["mine"]})))[name] == ["mine"], path
    assert sent("/v1/chat/completions", {"messages": []}, root="/served")["stop"] == list(stop)
    assert "stop" not in sent("/v1/embeddings", {"input": "x"}) and sent("/v1/completions", [1, 2]) == [1, 2]
    assert client.get("/health").status_code == 200


def test_a_body_over_the_limit_is_refused_unread_on_a_real_socket(student):
    """A Content-Length over the limit is answered 413 before any of the body is sent; a chunked body as soon as it
    passes the limit, the rest never sent (the server waited for neither)."""
    import uvicorn

    from lt_opd_ray.serving.limits import ServeLimits
    from lt_opd_ray.serving.transformers_server import build_app

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(student, API_KEY, ServeLimits(**LIMITS)), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 30
        while not server.started:
            assert time.time() < deadline, "server did not come up"
            time.sleep(0.05)
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
        for request in ((head + "Content-Length: 1000000000\r\n\r\n").encode(),  # then nothing
                        (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + b"%x\r\n" % 300_001 + b" " * 300_001 + b"\r\n"):  # no last chunk
            with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
                connection.sendall(request)
                answer = b""
                while chunk := connection.recv(65536):  # the server closes the connection after its answer
                    answer += chunk
            assert answer.startswith(b"HTTP/1.1 413") and b"lt-opd serve --max-body-mb" in answer, answer[:500]
            assert b"connection: close" in answer.lower()
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_pillow_opens_only_the_formats_a_request_may_send():
    from PIL import Image

    from lt_opd_ray.serving.limits import IMAGE_FORMATS, restrict_pillow

    Image.init()
    saved_open, saved_id = dict(Image.OPEN), list(Image.ID)
    try:
        restrict_pillow()
        assert sorted(Image.ID) == sorted(IMAGE_FORMATS)
        for raw in (EPS, _tiff()):
            with pytest.raises(Image.UnidentifiedImageError):
                Image.open(io.BytesIO(raw))
        assert Image.open(io.BytesIO(PNG)).size == (128, 128)
    finally:
        Image.OPEN.clear()
        Image.OPEN.update(saved_open)
        Image.ID[:] = saved_id


def test_serve_refuses_a_host_beyond_loopback_without_a_key_and_passes_the_limits_to_vllm(tiny_dirs, tmp_path, capsys):
    from lt_opd_ray.cli.main import main
    from lt_opd_ray.serving.limits import ServeLimits
    from lt_opd_ray.serving.serve import serve_command

    student = tiny_dirs["qwen3_vl"]
    assert main(["serve", str(student), "--host", "0.0.0.0", "--port", "8123"]) == 2
    assert ("serve: --host 0.0.0.0 without --api-key-file refused: anyone who reaches port 8123 could use the model "
            "(pass --api-key-file, or --allow-no-api-key to serve it open anyway)") in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["serve", str(student), "--max-tokens", "0"])
    assert exited.value.code == 2 and "--max-tokens" in capsys.readouterr().err
    argv, env = serve_command(student, host="0.0.0.0", allow_no_api_key=True,
                              limits=ServeLimits(images=3, clips=2, max_tokens=512, request_seconds=60, request_pixels=7))
    assert "warning: serving on 0.0.0.0 without an API key" in capsys.readouterr().err
    assert json.loads(argv[argv.index("--limit-mm-per-prompt") + 1]) == {"image": 3, "video": 2}
    assert json.loads(argv[argv.index("--override-generation-config") + 1]) == {"max_new_tokens": 512}
    assert (env["LT_OPD_MAX_IMAGES"], env["LT_OPD_MAX_CLIPS"], env["LT_OPD_MAX_TOKENS"], env["LT_OPD_REQUEST_SECONDS"],
            env["LT_OPD_MAX_REQUEST_PIXELS"]) == ("3", "2", "512", "60", "7")
    (tmp_path / "key").write_text("k\n")
    serve_command(student, host="0.0.0.0", api_key_file=tmp_path / "key")  # with a key: served, no warning
    assert "warning" not in capsys.readouterr().err


# vLLM options after `--`: (the options, the spelling the refusal names or None where they pass); every spelling
# vLLM's parser takes for an option `lt-opd serve` sets or the guard relies on
OPTIONS_TABLE = [
    (["--host", "0.0.0.0"], "--host"),
    (["--host=0.0.0.0"], "--host"),
    (["--hos", "0.0.0.0"], "--hos (vLLM's --host)"),
    (["--ho=0.0.0.0"], "--ho (vLLM's --host)"),
    (["--port", "9000"], "--port"),
    (["--port=9000"], "--port"),
    (["--api-key", "k"], "--api-key"),
    (["--api-key=k"], "--api-key"),
    (["--api_key", "k"], "--api_key (vLLM's --api-key)"),
    (["--api-k", "k"], "--api-k (vLLM's --api-key)"),
    (["--middleware", "x.Y"], "--middleware"),
    (["--middleware=x.Y"], "--middleware"),
    (["--middle", "x.Y"], "--middle (vLLM's --middleware)"),
    (["--limit-mm-per-prompt", '{"image": 99}'], "--limit-mm-per-prompt"),
    (["--limit-mm-per-prompt.image", "99"], "--limit-mm-per-prompt.image (vLLM's --limit-mm-per-prompt)"),
    (["--limit_mm_per_prompt.image=99"], "--limit_mm_per_prompt.image (vLLM's --limit-mm-per-prompt)"),
    (["--limit-mm", '{"image": 99}'], "--limit-mm (vLLM's --limit-mm-per-prompt)"),
    (["--override-generation-config", '{"max_new_tokens": 100000}'], "--override-generation-config"),
    (["--override-generation-config.max_new_tokens", "100000"], "--override-generation-config.max_new_tokens"),
    (["--override-generation", "{}"], "--override-generation (vLLM's --override-generation-config)"),
    (["--generation-config", "vllm"], "--generation-config"),
    (["--generation_config=vllm"], "--generation_config (vLLM's --generation-config)"),
    (["--uds", "/tmp/s"], "--uds"),
    (["--grpc"], "--grpc"),
    (["--grpc-port=9"], "--grpc-port"),
    (["--model", "/elsewhere"], "--model"),
    (["--dtype=float32"], "--dtype"),
    (["--max-model-len", "99"], "--max-model-len"),
    (["--config", "CONFIG"], "--config"),
    (["--trust-request-mm-kwargs", "--", "--host", "0.0.0.0"], "a second `--`"),
    # the documented pass-through options, and vLLM's others
    (["--trust-request-mm-kwargs"], None),
    (["--allowed-media-domains", "a.example", "b.example"], None),
    (["--allowed-media-domains=a.example"], None),
    (["--allowed-local-media-path", "/data"], None),
    (["--allowed_local_media_path=/data"], None),
    (["--served-model-name", "m", "--max-num-seqs", "4", "--enable-prefix-caching", "--no-enforce-eager"], None),
    (["--hf-overrides.rope_theta", "1"], None),
    (["-asc", "1"], None),
]


@pytest.mark.parametrize("extra", [["--tensor-parallel-size", "2"], ["--tensor-parallel-size=2"], ["--tensor_parallel_size", "2"],
                                   ["--tensor-para", "4"], ["--te", "2"], ["-tp", "2"], ["-t", "2"], ["-tp=2"],
                                   ["--max-num-seqs", "4", "-tp", "8"], ["-tp", "1", "--tensor-parallel-size", "2"]])
def test_a_hiprune_folder_is_refused_a_tensor_parallel_tower_in_any_spelling(extra, tiny_dirs, tmp_path, monkeypatch):
    """HiPrune reads the whole tower's attention on one rank: a HiPrune folder with a tensor-parallel size above 1 is
    refused before anything starts; another folder is served, and a request there may not pick HiPrune (400)."""
    import shutil

    from lt_opd_ray.core.compression import CompressionConfig
    from lt_opd_ray.engines.vllm.selection import SPLIT_TOWER_ENV, SelectionRequest
    from lt_opd_ray.serving.serve import serve_command, tensor_parallel_size

    assert tensor_parallel_size(["-tp", "1", "--tensor-parallel-size=1", "--max-num-seqs", "4"]) == "1"
    assert tensor_parallel_size(["--max-num-seqs", "4"]) is None and tensor_parallel_size(extra) == extra[-1].split("=")[-1]
    folder = tmp_path / "student"
    shutil.copytree(tiny_dirs["qwen3_vl"], folder)
    CompressionConfig("hiprune", 500, 1).write(folder)
    with pytest.raises(ValueError, match="the folder's selector hiprune scores the vision tower's attention on one rank"):
        serve_command(folder, extra=extra)
    CompressionConfig("cdpruner", 500, 1).write(folder)
    _, env = serve_command(folder, extra=extra)
    monkeypatch.setenv(SPLIT_TOWER_ENV, env[SPLIT_TOWER_ENV])
    with pytest.raises(ValueError, match="lt_opd_selector: hiprune reads the vision tower's attention, which this server splits"):
        SelectionRequest.split({"lt_opd_selector": "hiprune"}, vocab_size=100)
    assert SelectionRequest.split({"lt_opd_selector": "cdpruner"}, vocab_size=100)[0].selector == "cdpruner"
    assert SPLIT_TOWER_ENV not in serve_command(folder, extra=["-tp", "1"])[1]  # one rank: not the shell's setting either


@pytest.mark.parametrize(("extra", "named"), OPTIONS_TABLE, ids=[f"row{i}" for i in range(len(OPTIONS_TABLE))])
def test_the_options_after_the_separator_set_nothing_serve_sets(extra, named):
    from lt_opd_ray.serving.serve import check_vllm_options

    if named is None:
        check_vllm_options(extra)
        return
    with pytest.raises(ValueError) as refused:
        check_vllm_options(extra)
    text = str(refused.value)
    assert text.startswith(f"vLLM option {named} after -- refused: lt-opd serve sets it; use ") or named in text, text


def test_vllms_own_parser_reads_each_refused_spelling_as_an_option_serve_sets(tmp_path):
    """The table against vLLM's own parser (its underscores, dotted JSON keys, prefixes, config file): each refused row,
    placed last as it used to be, changes one of the values `lt-opd serve` passes or is an error; each passing row
    changes none."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from lt_opd_ray.serving.serve import OWNED_OPTIONS

    ours = ["--model", "/m", "--host", "127.0.0.1", "--port", "8000", "--dtype", "auto", "--max-model-len", "64",
            "--limit-mm-per-prompt", '{"image": 1, "video": 1}', "--override-generation-config", '{"max_new_tokens": 8}',
            "--middleware", "lt_opd_ray.serving.limits.RequestGuard"]
    (tmp_path / "c.yaml").write_text("api-key: k\n")  # a config file's options go before the command line's
    owned = [option[2:].replace("-", "_") for option in OWNED_OPTIONS]

    def parsed(argv):
        try:
            namespace = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        except SystemExit:
            return None
        return {name: getattr(namespace, name) for name in owned}

    expected = parsed(ours)
    for extra, named in OPTIONS_TABLE:
        extra = [str(tmp_path / "c.yaml") if arg == "CONFIG" else arg for arg in extra]
        if named is None:
            assert parsed(ours + extra) == expected, extra
        elif "--" not in extra:
            assert parsed(ours + extra) != expected, extra


def test_serve_refuses_an_option_after_the_separator_that_it_sets(tiny_dirs, capsys):
    from lt_opd_ray.cli.main import main
    from lt_opd_ray.serving.serve import serve_command

    student = tiny_dirs["qwen3_vl"]
    assert main(["serve", str(student), "--", "--host", "0.0.0.0"]) == 2  # the reviewer's: past the loopback check before
    assert "serve: vLLM option --host after -- refused: lt-opd serve sets it; use lt-opd serve --host" in capsys.readouterr().err
    assert main(["serve", str(student), "--", "--api-key=k"]) == 2
    assert "vLLM option --api-key after -- refused" in capsys.readouterr().err
    argv, _ = serve_command(student, extra=["--allowed-media-domains", "a.example", "--trust-request-mm-kwargs"])
    assert argv[3:7] == ["--allowed-media-domains", "a.example", "--trust-request-mm-kwargs", "--model"]  # ours after: argparse keeps them


def test_training_decodes_only_the_image_formats_a_request_may_send():
    from lt_opd_ray.core.errors import InputError
    from lt_opd_ray.core.samples import IMAGE_FORMATS
    from lt_opd_ray.models.processor import ImageError, decode_image, load_image
    from lt_opd_ray.serving import limits

    assert limits.IMAGE_FORMATS is IMAGE_FORMATS
    assert decode_image(PNG).size == (128, 128)
    for raw, name in ((EPS, "EPS"), (_tiff(), "TIFF")):
        with pytest.raises(ImageError, match=f"is {name}, an image format refused here: images may be BMP, GIF, JPEG, PNG, WEBP"):
            decode_image(raw)
    with pytest.raises(InputError, match=rf"uid-1: image 0 \({len(EPS)} bytes\) is EPS, an image format refused here"):
        load_image(EPS, "uid-1: image 0")
    with pytest.raises(ImageError, match="does not decode"):
        decode_image(b"not an image")
