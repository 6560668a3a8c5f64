"""Export (Hugging Face folder + compression config) and serving at the student's budget on vLLM's CPU build."""

from __future__ import annotations

import base64
import functools
import io
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import VLLM_FAMILIES, bomb_png, job_for, random_image


@pytest.mark.parametrize("family", VLLM_FAMILIES)
@pytest.mark.parametrize("system_prompt", [None, "You are a helpful assistant."])
def test_question_ids_recovered_from_a_prompt_are_the_query_mask(family, system_prompt, loaded):
    from lt_opd_ray.models.processor import question_messages, question_token_ids

    _, processor, _ = loaded[family]
    prompt = processor.encode(question_messages("Which colour is the top-left shape?", system_prompt), [random_image(0)])
    is_image = prompt.mm_token_type_ids == 1
    first = int(is_image.nonzero()[0])
    collapsed = prompt.input_ids[~is_image | (torch.arange(is_image.numel()) == first)].tolist()  # one placeholder
    assert question_token_ids(collapsed, processor.tokenizer, processor.family) == prompt.input_ids[prompt.query_mask].tolist()


def test_compression_config_round_trips_and_a_broken_one_is_named(tmp_path):
    from lt_opd_ray.core.compression import COMPRESSION_FILE, CompressionConfig

    assert CompressionConfig.read(tmp_path) is None
    CompressionConfig("cdpruner", 500, 2).write(tmp_path)
    assert CompressionConfig.read(tmp_path) == CompressionConfig("cdpruner", 500, 2)
    (tmp_path / COMPRESSION_FILE).write_text(json.dumps({"selector": "cdpruner"}))
    with pytest.raises(ValueError, match=f"{COMPRESSION_FILE}.*budget_bps"):
        CompressionConfig.read(tmp_path)


def test_serving_defaults_round_trip_and_a_broken_file_is_named(tmp_path):
    """The stop strings in lt_opd_serving.json, the end tokens in generation_config.json (whose other fields stay, and
    which never holds stop strings: transformers' generate would refuse them without a tokenizer)."""
    from lt_opd_ray.core.compression import ServingDefaults

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "eos_token_id": 3}))
    assert ServingDefaults.read(tmp_path) == ServingDefaults((), (3,))
    ServingDefaults(("</answer>",), (3, 9)).write(tmp_path)
    assert ServingDefaults.read(tmp_path) == ServingDefaults(("</answer>",), (3, 9))
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"temperature": 0.7, "eos_token_id": [3, 9]}
    with pytest.raises(ValueError, match="at most 4 non-empty strings"):
        ServingDefaults(("a",) * 5, ()).write(tmp_path)
    for name, written, named in (("generation_config.json", "{", "generation_config.json: not JSON (line 1"),
                                 ("generation_config.json", "[]", "expected a JSON object, got list"),
                                 ("generation_config.json", json.dumps({"eos_token_id": [True]}), "eos_token_id must be an integer or a list"),
                                 ("lt_opd_serving.json", json.dumps({"stop": ["a"] * 5}), "lt_opd_serving.json: stop must be a list of at most 4"),
                                 ("lt_opd_serving.json", json.dumps({"stop": [""]}), "stop must be a list of at most 4 non-empty strings")):
        (tmp_path / "generation_config.json").write_text("{}")
        ServingDefaults(("</answer>",), (3,)).write(tmp_path)
        (tmp_path / name).write_text(written)
        with pytest.raises(ValueError, match=re.escape(named)):
            ServingDefaults.read(tmp_path)


def test_export_of_a_finished_run_is_a_loadable_folder_and_never_half_written(tiny_dirs, tmp_path):
    from transformers import AutoModelForImageTextToText

    from lt_opd_ray.core.compression import CompressionConfig, ServingDefaults
    from lt_opd_ray.models.processor import VLMProcessor
    from lt_opd_ray.serving.export import ExportError, export_student

    job = job_for(tiny_dirs["qwen3_vl"], tmp_path / "run")
    out = tmp_path / "student"
    with pytest.raises(ExportError, match=f"no run at {tmp_path / 'run'} \\(the job's checkpoint.dir\\): nothing to export"):
        export_student(job, out)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "steps.jsonl").write_text("")  # a run that has not finished
    with pytest.raises(ExportError, match="no finished student.*available: none"):
        export_student(job, out)
    assert not out.exists() and not list(tmp_path.glob(".student.incoming-*"))

    shutil.copytree(tiny_dirs["qwen3_vl"], tmp_path / "run" / "final")  # what a finished run leaves
    export_student(job, out)
    assert CompressionConfig.read(out) == CompressionConfig("cdpruner", job.budget.target_bps, job.budget.k_min)
    assert ServingDefaults.read(out) == ServingDefaults(("</answer>",), VLMProcessor(tiny_dirs["qwen3_vl"]).eos_token_ids)
    assert ServingDefaults.read(tiny_dirs["qwen3_vl"]).stop == ()  # the base model it was trained from names none
    exported = AutoModelForImageTextToText.from_pretrained(out)
    assert exported.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2).shape[1] >= 4  # plain generate runs: no stop strings it cannot read
    original = AutoModelForImageTextToText.from_pretrained(tiny_dirs["qwen3_vl"])
    for (name, a), (_, b) in zip(exported.state_dict().items(), original.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(ExportError, match="holds an earlier `lt-opd export` output; pass --force to replace it"):
        export_student(job, out)
    export_student(job, out, force=True)  # an earlier export is replaced
    assert CompressionConfig.read(out) == CompressionConfig("cdpruner", job.budget.target_bps, job.budget.k_min)
    # a folder export did not write is never replaced, not even with --force: the model it was trained from, say
    for folder in (tiny_dirs["qwen3_vl"], tmp_path / "run" / "final"):
        before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        with pytest.raises(ExportError, match="is a folder lt-opd did not write and is not empty: it is left alone"):
            export_student(job, folder, force=True)
        assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "student"]  # no staging folder left beside them


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FUZZED_REQUESTS = 40


API_KEY = "lt-opd-test-key-0123456789"  # every test server takes requests with it only (serve --api-key-file)
HEADERS = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}


def _refused(url: str, body: dict | bytes, code: int = 400, headers: dict = HEADERS) -> str:
    """The error text of a request the server must answer `code` (400: naming the problem)."""
    request = urllib.request.Request(url, body if isinstance(body, bytes) else json.dumps(body).encode(), headers)
    try:
        urllib.request.urlopen(request, timeout=120)
    except urllib.error.HTTPError as error:
        text = error.read().decode()
        assert error.code == code, f"HTTP {error.code}: {text[:2000]}"
        return text
    raise AssertionError("the request was answered 200")


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), HEADERS)
    try:
        return json.loads(urllib.request.urlopen(request, timeout=120).read())
    except urllib.error.HTTPError as error:
        raise AssertionError(f"HTTP {error.code}: {error.read().decode()[:2000]}") from None


def mp4_clip(frames: int) -> bytes:
    """An MP4 of `frames` random 96 x 64 frames at 4 fps (OpenCV's writer)."""
    import tempfile

    import cv2
    import numpy as np

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/clip.mp4"
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), 4.0, (96, 64))
        for _ in range(frames):
            writer.write(rng.integers(0, 255, (64, 96, 3), dtype=np.uint8))
        writer.release()
        return Path(path).read_bytes()


class serving:
    """`lt-opd serve FOLDER` on a free port, up (its /health answers) inside the block, stopped after it."""

    def __init__(self, student, tmp_path, *extra: str, vllm_options: tuple[str, ...] = ("--trust-request-mm-kwargs",)):
        self.student, self.tmp_path, self.extra, self.vllm_options = student, tmp_path, extra, vllm_options

    def __enter__(self) -> serving:
        self.port = _free_port()
        self.log = open(self.tmp_path / "server.log", "w")
        (self.tmp_path / "api_key").write_text(API_KEY + "\n")
        self.server = subprocess.Popen([sys.executable, "-m", "lt_opd_ray.cli.main", "serve", str(self.student), "--port", str(self.port),
                                        "--max-model-len", "1024", "--api-key-file", str(self.tmp_path / "api_key"), *self.extra,
                                        *(["--", *self.vllm_options] if self.vllm_options else [])],
                                       stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ))
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                return self
            except OSError:
                assert self.alive(), (self.tmp_path / "server.log").read_text()[-3000:]
                assert time.time() < deadline, "server did not come up"
                time.sleep(0.25)

    def __exit__(self, *exc) -> None:
        self.server.terminate()
        self.server.wait(timeout=60)
        self.log.close()

    def alive(self) -> bool:
        return self.server.poll() is None


def image_question(student, image, question: str, port: int, budget_bps: int, k_min: int) -> tuple[dict, list]:
    """One chat request about `image`; checks the prefill held k of the image's N visual tokens.
    Returns (the request's body, its message content)."""
    from lt_opd_ray.core.curriculum import tokens_to_keep
    from lt_opd_ray.models.processor import VLMProcessor, question_messages

    prompt = VLMProcessor(student).encode(question_messages(question), [image])
    n = int((prompt.mm_token_type_ids == 1).sum())
    png = io.BytesIO()
    image.save(png, format="PNG")
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()}},
               {"type": "text", "text": question}]
    body = {"model": str(student), "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}
    answer = _post(f"http://127.0.0.1:{port}/v1/chat/completions", body)
    assert isinstance(answer["choices"][0]["message"]["content"], str)
    assert answer["usage"]["prompt_tokens"] == prompt.input_ids.numel() - n + tokens_to_keep(n, budget_bps, k_min)
    return body, content


@pytest.mark.slow
def test_a_tied_qwen3_5_student_is_served_at_its_budget(tmp_path):
    """Qwen3.5-4B's shape: tied embeddings and the real tensor names, exported and served (bf16 on vLLM's CPU build)."""
    from lt_opd_ray.models.tiny import build_tiny_model
    from lt_opd_ray.serving.export import export_student

    job = job_for(build_tiny_model("qwen3_5", tmp_path / "tied", seed=0, tied=True), tmp_path / "run")
    shutil.copytree(tmp_path / "tied", tmp_path / "run" / "final")  # what a finished run leaves
    student = export_student(job, tmp_path / "student")
    with serving(student, tmp_path, "--dtype", "bfloat16") as server:
        image_question(student, random_image(3), "What is in the picture?", server.port, job.budget.target_bps, job.budget.k_min)


@pytest.mark.slow
def test_served_student_answers_an_image_question_with_the_compressed_prefill(tiny_dirs, tmp_path):
    from lt_opd_ray.core.compression import CompressionConfig, ServingDefaults
    from lt_opd_ray.core.model_files import write_file_list
    from lt_opd_ray.core.curriculum import tokens_to_keep
    from lt_opd_ray.models.processor import VLMProcessor, question_messages
    from lt_opd_ray.serving.export import export_student

    job = job_for(tiny_dirs["qwen3_vl"], tmp_path / "run")
    job = job.model_copy(update={"budget": job.budget.model_copy(update={"target_bps": 2500})})
    shutil.copytree(tiny_dirs["qwen3_vl"], tmp_path / "run" / "final")  # what a finished run leaves
    student = export_student(job, tmp_path / "student")
    assert CompressionConfig.read(student) == CompressionConfig("cdpruner", 2500, 2)
    # the random student never writes the job's "</answer>": its folder's stop strings become four common letters (a
    # request carries at most 4), so that a plain request visibly ends at the first it writes
    ServingDefaults(("e", "a", "n", "t"), ServingDefaults.read(student).end_token_ids).write(student)
    write_file_list(student)
    image, question = random_image(7), "What is in the picture?"
    prompt = VLMProcessor(student).encode(question_messages(question), [image])
    n = int((prompt.mm_token_type_ids == 1).sum())
    full_length = prompt.input_ids.numel()

    with serving(student, tmp_path, "--max-body-mb", "2", "--max-media-mb", "1", "--max-image-pixels", "1000000") as server:
        port = server.port
        body, content = image_question(student, image, question, port, 2500, 2)  # the compression config's budget
        # the official `openai` client: the folder's stop strings end a plain answer, a request's own `stop` overrides
        # them; a stream carries the same answer; a seed repeats a sampled one; n over --max-choices is refused
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0)
        ask = functools.partial(client.chat.completions.create, model=str(student), messages=body["messages"], max_tokens=8, temperature=0)
        stopped, free = ask(), ask(stop=[])
        assert stopped.choices[0].finish_reason == "stop" and free.choices[0].finish_reason == "length"
        assert free.choices[0].message.content.startswith(stopped.choices[0].message.content)
        chunks = list(ask(stop=[], stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == free.choices[0].message.content
        sampled = [ask(stop=[], temperature=1.0, seed=3).choices[0].message.content for _ in range(2)]
        assert sampled[0] == sampled[1]
        with pytest.raises(openai.BadRequestError, match="n: 2 is more than this server's 1 per request"):
            ask(n=2)
        # a request may set its own budget where the server trusts request mm kwargs (a vLLM option)
        body["mm_processor_kwargs"] = {"lt_opd_budget_bps": 10000}
        assert _post(f"http://127.0.0.1:{port}/v1/chat/completions", body)["usage"]["prompt_tokens"] == full_length

        # requests that must be refused (400, naming the problem) and leave the server up
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        vocab = json.loads((student / "config.json").read_text())["text_config"]["vocab_size"]
        for settings, expected in (({"lt_opd_query_ids": [5, vocab]}, f"lt_opd_query_ids[1]: {vocab} is outside [0, {vocab - 1}]"),
                                   ({"lt_opd_budget_bps": True}, "lt_opd_budget_bps: expected an integer, got bool"),
                                   ({"lt_opd_seed": "7"}, "lt_opd_seed: expected an integer, got str")):
            assert expected in _refused(url, {**body, "mm_processor_kwargs": settings})
        remote = [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}, content[1]]
        assert "remote image URLs are off" in _refused(url, {**body, "mm_processor_kwargs": {}, "messages": [{"role": "user", "content": remote}]})
        bomb = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(bomb_png()).decode()}}, content[1]]
        assert "(400000000 pixels) refused, more than this server's 1000000 (lt-opd serve --max-image-pixels)" in _refused(url, {**body, "mm_processor_kwargs": {}, "messages": [{"role": "user", "content": bomb}]})
        # what a server reachable beyond this host must refuse: no key or a wrong one (401), a body over --max-body-mb
        # (413), media over --max-media-mb, an image of more pixels than --max-image-pixels (from its header, not
        # decoded), what vLLM would fetch however its scheme is spelt, local files
        plain = json.dumps({**body, "mm_processor_kwargs": {}}).encode()
        for headers in ({"Content-Type": "application/json"}, {**HEADERS, "Authorization": "Bearer guessed"}):
            assert "Unauthorized" in _refused(url, plain, 401, headers)
        for route in ("/invocations", "/tokenize"):  # routes vLLM's own key check does not cover
            assert "Unauthorized" in _refused(f"http://127.0.0.1:{port}{route}", plain, 401, {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30)
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30)  # the health check stays open
        with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:  # refused unread: the body never sent
            connection.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                               f"Content-Length: {2**21 + 1}\r\n\r\n".encode())
            answer = b"".join(iter(lambda: connection.recv(65536), b""))  # headers and body, to the close the server sends
        assert answer.startswith(b"HTTP/1.1 413") and b"refused: this server takes at most 2097152 (2 MiB; lt-opd serve --max-body-mb)" in answer
        def asking(url_of_image: str) -> dict:
            return {**body, "mm_processor_kwargs": {}, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url_of_image}}, content[1]]}]}
        big = "data:image/png;base64," + base64.b64encode(os.urandom(1_100_000)).decode()  # 1.05 MiB encoded, in a body under 2 MiB
        assert "more than this server's 1 MiB (lt-opd serve --max-media-mb)" in _refused(url, asking(big))
        wide = "data:image/png;base64," + base64.b64encode(bomb_png(1100)).decode()  # a header claiming 1100 x 1100
        assert "(1210000 pixels) refused, more than this server's 1000000 (lt-opd serve --max-image-pixels)" in _refused(url, asking(wide))
        for fetched in ("HTTP://127.0.0.1:9/cat.png", "httpx://127.0.0.1:9/cat.png"):
            assert "remote image URLs are off" in _refused(url, asking(fetched)), fetched
        assert "file: URLs are off" in _refused(url, asking(f"file://{student / 'config.json'}"))
        # fuzzed selection settings: each answered 200 or 400, never a dead engine
        rng = random.Random(0)
        values = [None, True, -1, 0, 1, 500, 10_000, 10_001, 2**64, 1.5, "7", "cdpruner", "nope", [], [1, 2], [vocab], [-5], {"a": 1}]
        fields = ["lt_opd_budget_bps", "lt_opd_k_min", "lt_opd_selector", "lt_opd_seed", "lt_opd_nonce", "lt_opd_query_ids", "lt_opd_x"]
        for _ in range(FUZZED_REQUESTS):
            settings = {rng.choice(fields): rng.choice(values) for _ in range(rng.randint(1, 3))}
            request = urllib.request.Request(url, json.dumps({**body, "mm_processor_kwargs": settings}).encode(), HEADERS)
            try:
                status = urllib.request.urlopen(request, timeout=120).status
            except urllib.error.HTTPError as error:
                status = error.code
            assert status in (200, 400), (settings, status)
        assert _post(url, {**body, "mm_processor_kwargs": {}})["usage"]["prompt_tokens"] == full_length - n + tokens_to_keep(n, 2500, 2)
        # a clip: sampled by vLLM's rule for the family, each temporal patch of 2 x 3 merged tokens pruned to its own k
        clip = [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(mp4_clip(20)).decode()}},
                {"type": "text", "text": "What happens in the video?"}]
        asked = {**body, "messages": [{"role": "user", "content": clip}]}
        full_clip = _post(url, {**asked, "mm_processor_kwargs": {"lt_opd_budget_bps": 10000}})["usage"]["prompt_tokens"]
        pruned_clip = _post(url, {**asked, "mm_processor_kwargs": {}})["usage"]["prompt_tokens"]
        patches, rest = divmod(full_clip - pruned_clip, 6 - tokens_to_keep(6, 2500, 2))
        assert patches == 5 and rest == 0  # 20 frames at 4 fps, sampled at 2 fps: 10 frames, 5 patches
        assert server.alive()


def test_serving_beyond_loopback_without_a_key_is_refused_and_a_key_file_is_checked(tiny_dirs, tmp_path, capsys):
    """The server's environment: the key from its file (never on a command line), the limits, redirects off; beyond
    loopback without a key only with --allow-no-api-key (warned)."""
    from lt_opd_ray.serving.limits import ServeLimits
    from lt_opd_ray.serving.serve import serve_command

    student = tiny_dirs["qwen3_vl"]
    serve_command(student, host="127.0.0.1")
    serve_command(student, host="::1")
    assert "warning" not in capsys.readouterr().err
    with pytest.raises(ValueError, match="--host 0.0.0.0 without --api-key-file refused: anyone who reaches port 8123 could use the model"):
        serve_command(student, host="0.0.0.0", port=8123)
    argv, env = serve_command(student, host="0.0.0.0", port=8123, allow_no_api_key=True)
    assert "warning: serving on 0.0.0.0 without an API key: anyone who reaches port 8123 can use the model" in capsys.readouterr().err
    assert env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0" and argv[argv.index("--middleware") + 1] == "lt_opd_ray.serving.limits.RequestGuard"
    assert (env["LT_OPD_MAX_BODY_BYTES"], env["LT_OPD_MAX_MEDIA_BYTES"], env["VLLM_MAX_IMAGE_PIXELS"]) == (str(32 * 2**20), str(24 * 2**20), "50000000")
    (tmp_path / "key").write_text("s3cret-key\n")
    argv, env = serve_command(student, host="0.0.0.0", api_key_file=tmp_path / "key", limits=ServeLimits(body_bytes=1000))
    assert env["VLLM_API_KEY"] == "s3cret-key" and "s3cret-key" not in argv and env["LT_OPD_MAX_BODY_BYTES"] == "1000"
    assert "warning" not in capsys.readouterr().err
    for text, problem in (("", "holds nothing"), ("a\nb\n", "holds more than one line")):
        (tmp_path / "key").write_text(text)
        with pytest.raises(ValueError, match=f"--api-key-file {tmp_path / 'key'}: {problem}"):
            serve_command(student, api_key_file=tmp_path / "key")
    with pytest.raises(ValueError, match="cannot be read"):
        serve_command(student, api_key_file=tmp_path / "missing")
    # a model vLLM cannot run here (the toy's head size 16): the transformers engine, unless vLLM is asked for
    from lt_opd_ray.sources.resolve import resolve_model_dir

    toy = resolve_model_dir("toy:circles")
    argv, env = serve_command(toy)
    assert argv[1:3] == ["-m", "lt_opd_ray.serving.transformers_server"] and "vLLM cannot run it on this machine" in capsys.readouterr().err
    with pytest.raises(ValueError, match="attention head size 16"):
        serve_command(toy, engine="vllm")
    with pytest.raises(ValueError, match="options after -- are vLLM's \\(--trust-request-mm-kwargs\\); the transformers engine takes none"):
        serve_command(toy, extra=["--trust-request-mm-kwargs"])


def test_the_transformers_engine_keeps_the_servers_rules(tmp_path):
    """The engine that serves what vLLM cannot run here refuses what vLLM's server under `lt-opd serve` refuses: no
    key (401), a body over the limit (413), a URL that is not inline data, an image of too many pixels, a bad field
    (400, named); a good request is answered at the student's budget."""
    from starlette.testclient import TestClient

    from lt_opd_ray.core.compression import CompressionConfig
    from lt_opd_ray.serving.limits import ServeLimits
    from lt_opd_ray.serving.transformers_server import TransformersStudent, build_app
    from lt_opd_ray.sources.resolve import resolve_model_dir

    shutil.copytree(resolve_model_dir("toy:circles"), tmp_path / "student")
    CompressionConfig("cdpruner", 500, 4).write(tmp_path / "student")
    client = TestClient(build_app(TransformersStudent(tmp_path / "student"), API_KEY, ServeLimits(body_bytes=200_000, image_pixels=100_000)))
    png = io.BytesIO()
    random_image(1).save(png, format="PNG")

    def asking(url: str, **fields) -> dict:
        return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Which colour?"}]}],
                **fields}

    inline = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    post = lambda body, headers=HEADERS: client.post("/v1/chat/completions", json=body, headers=headers)  # noqa: E731
    assert post(asking(inline), {}).status_code == 401 and post(asking(inline), {"Authorization": "Bearer guessed"}).status_code == 401
    assert client.get("/v1/models").status_code == 401 and client.get("/health").status_code == 200
    assert client.post("/v1/chat/completions", content=b" " * 200_001, headers=HEADERS).status_code == 413
    for body, expected in ((asking("http://127.0.0.1:9/cat.png"), "remote image URLs and http: URLs are off"),
                           (asking(f"file://{tmp_path / 'student' / 'config.json'}"), "file: URLs are off"),
                           (asking("data:image/png;base64," + base64.b64encode(bomb_png(400)).decode()), "(160000 pixels) refused, more than this server's 100000"),
                           (asking(inline, max_tokens="4"), "max_tokens: expected an integer, got str"),
                           (asking(inline, stop=["a", 1]), "stop: a string or a list of at most 4 non-empty strings"),
                           ({"messages": [{"role": "assistant", "content": "hi"}]}, "this engine answers one user message")):
        answered = post(body)
        assert answered.status_code == 400 and expected in answered.json()["error"]["message"], (expected, answered.text)
    answered = post(asking(inline, max_tokens=3, temperature=0)).json()
    assert answered["usage"]["completion_tokens"] <= 3 and answered["choices"][0]["finish_reason"] in ("stop", "length")
    from lt_opd_ray.core.curriculum import tokens_to_keep
    from lt_opd_ray.models.processor import VLMProcessor, question_messages

    prompt = VLMProcessor(tmp_path / "student").encode(question_messages("Which colour?"), [png.getvalue()])
    visual = int((prompt.mm_token_type_ids == 1).sum())
    assert answered["usage"]["prompt_tokens"] == prompt.input_ids.numel() - visual + tokens_to_keep(visual, 500, 4)


def test_the_transformers_engine_answers_the_openai_client_and_ends_where_training_did(tmp_path):
    """The official `openai` client (vLLM's own dependency) against the transformers engine, on the trained circles
    toy: a plain request ends at the student's stop string (its folder's serving defaults), without it in the text;
    `stop: []` overrides it; a stream carries the same answer token by token (never a piece of the stop string), its
    finish reason and usage; a seed repeats a sampled
    answer; n > 1 and a field the engine does not read are refused by name."""
    import openai
    from starlette.testclient import TestClient
    from transformers import AutoTokenizer

    from lt_opd_ray.core.compression import CompressionConfig, ServingDefaults
    from lt_opd_ray.models.processor import end_of_sequence_ids
    from lt_opd_ray.serving.limits import ServeLimits
    from lt_opd_ray.serving.transformers_server import TransformersStudent, build_app
    from lt_opd_ray.sources.resolve import resolve_model_dir

    folder = tmp_path / "student"
    shutil.copytree(resolve_model_dir("toy:circles"), folder)
    CompressionConfig("cdpruner", 500, 4).write(folder)
    ServingDefaults(("</answer>",), end_of_sequence_ids(folder, AutoTokenizer.from_pretrained(folder))).write(folder)  # what export writes
    app = build_app(TransformersStudent(folder), API_KEY, ServeLimits(choices=4))  # n up to 4 passes the limit: the engine refuses it itself
    client = openai.OpenAI(base_url="http://testserver/v1", api_key=API_KEY, http_client=TestClient(app), max_retries=0)
    png = io.BytesIO()
    random_image(1).save(png, format="PNG")
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()}},
                                             {"type": "text", "text": "What colour is the biggest circle?"}]}]
    ask = functools.partial(client.chat.completions.create, model=str(folder), messages=messages, max_tokens=24)

    plain = ask(temperature=0)
    assert plain.choices[0].finish_reason == "stop" and plain.choices[0].message.content.count("<answer>") == 1
    assert "</answer>" not in plain.choices[0].message.content  # as vLLM answers: without the stop string
    unstopped = ask(temperature=0, stop=[])  # the request's own stop stands
    assert unstopped.choices[0].finish_reason == "length" and unstopped.choices[0].message.content.startswith(plain.choices[0].message.content + "</answer>")
    chunks = list(ask(temperature=0, stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == plain.choices[0].message.content and len(pieces) > 3  # as the tokens are drawn
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    sampled = [ask(temperature=3.0, seed=5, stop=[]).choices[0].message.content for _ in range(2)]
    assert sampled[0] == sampled[1] != ask(temperature=3.0, seed=6, stop=[]).choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="n: 2 choices asked; the transformers engine answers one"):
        ask(n=2)

    with pytest.raises(openai.BadRequestError, match="logprobs, top_logprobs: not supported by the transformers engine"):
        ask(logprobs=True, top_logprobs=2)


def test_a_client_that_leaves_a_stream_frees_the_transformers_engine_at_the_next_token(tiny_dirs, tmp_path):
    """On a real socket: a random tiny student streams an answer of up to 4,000 tokens (it writes no end token); the
    client reads the first chunk and closes the connection; the model is free for the next request within a second,
    not after the answer (which takes several seconds on these cores)."""
    import threading

    import uvicorn

    from lt_opd_ray.core.compression import CompressionConfig
    from lt_opd_ray.serving.limits import ServeLimits
    from lt_opd_ray.serving.transformers_server import TransformersStudent, build_app

    folder = tmp_path / "student"
    shutil.copytree(tiny_dirs["qwen3_vl"], folder)
    CompressionConfig("cdpruner", 5000, 1).write(folder)
    student = TransformersStudent(folder)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(student, API_KEY, ServeLimits(max_tokens=4000)), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    try:
        deadline = time.time() + 30
        while not server.started:
            assert time.time() < deadline, "server did not come up"
            time.sleep(0.05)
        png = io.BytesIO()
        random_image(2).save(png, format="PNG")
        body = json.dumps({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()}},
            {"type": "text", "text": "What is it?"}]}], "max_tokens": 4000, "temperature": 0, "stream": True}).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
            connection.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            received = b""
            while b"data:" not in received:
                received += connection.recv(65536)
            assert student.lock.locked()  # the answer is being sampled
        assert student.lock.acquire(timeout=1.0), "the model is still held by the stream its client left"
        student.lock.release()
    finally:
        server.should_exit = True


def test_a_student_cut_short_is_named_by_export_eval_and_serve_before_anything_loads(tiny_dirs, tmp_path, capsys):
    """final/ lists its files and sizes (the learner writes it; export writes its own): a model.safetensors cut to
    100 KB is named by `export`, `eval` and `serve`, each exit 2 before a loader meets it; a folder from elsewhere,
    without the list, still has its safetensors headers read."""
    from lt_opd_ray.cli.main import main
    from lt_opd_ray.core.model_files import FILE_LIST, check_model_folder, write_file_list
    from lt_opd_ray.serving.export import ExportError, export_student

    job = job_for(tiny_dirs["qwen3_vl"], tmp_path / "run")
    final = tmp_path / "run" / "final"
    shutil.copytree(tiny_dirs["qwen3_vl"], final)
    write_file_list(final)  # as the learner leaves final/
    student = export_student(job, tmp_path / "student")
    check_model_folder(student)
    assert json.loads((student / FILE_LIST).read_text())["files"]["lt_opd_compression.json"] > 0  # the export's own list
    weights = final / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(100_000)
    with pytest.raises(ExportError, match=f"{final}/model.safetensors: 100000 bytes, lt_opd_files.json says [0-9]+ \\(cut short or overwritten\\)"):
        export_student(job, tmp_path / "again")
    shutil.copy(weights, student / "model.safetensors")
    pope = tmp_path / "pope.jsonl"
    pope.write_text(json.dumps({"question_id": 0, "text": "Is there a cat?", "image": "x.png", "label": "no"}) + "\n")
    random_image(0).save(tmp_path / "x.png")
    for argv in (["eval", str(student), "--bench", f"pope={pope}", "--out", str(tmp_path / "scores")], ["serve", str(student)]):
        assert main(argv) == 2
        assert f"{student}/model.safetensors: 100000 bytes, lt_opd_files.json says" in capsys.readouterr().err, argv
    (student / FILE_LIST).unlink()  # a folder from elsewhere: its header says what is missing
    with pytest.raises(ValueError, match="model.safetensors: its tensors end at byte [0-9]+, the file has 100000: cut short"):
        check_model_folder(student)
