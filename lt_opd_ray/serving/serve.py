"""`lt-opd serve`: vLLM's OpenAI-compatible server on an exported student, at its budget (or, for a student vLLM
cannot run on this machine, the transformers engine behind the same API: serving/transformers_server.py).

The server is vLLM's own (`vllm.entrypoints.openai.api_server`); our plugin loads in
its engine process through the `vllm.general_plugins` entry point and applies the
folder's `lt_opd_compression.json` to every request, with the question tokens of
the request's own prompt as CDPruner's query. It binds to 127.0.0.1 unless told
otherwise. A request may set its own selection (`mm_processor_kwargs` with
`lt_opd_budget_bps`, ...) only when the server is started with vLLM's
`--trust-request-mm-kwargs` (`lt-opd serve DIR -- --trust-request-mm-kwargs`); each setting is
checked in the front end (a bad one is a 400 naming it). Images and clips are
taken inline (data: URLs) unless the operator allows domains (`-- --allowed-media-domains HOST`, redirects never
followed); a clip is sampled by vLLM's video loader and processor, by the family's own rule (Qwen3-VL: 2 frames a
second), and pruned per temporal patch. What one request may carry is capped (`ServeLimits`, enforced by
`RequestGuard` in front of either engine, and by vLLM's own `--limit-mm-per-prompt` and `--override-generation-config
'{"max_new_tokens": N}'`): its body, each image or clip's bytes, each image's pixels, its images and clips, the
pixels of all its images, its max_tokens, its time, its JSON's nesting. With an API key (the key given in a file
so it is not on a command line) every request must carry it as a bearer token; serving beyond loopback without one
is refused unless the operator passes --allow-no-api-key. The vLLM options after `--` may not set what `lt-opd serve`
sets itself or what the guard relies on (`OWNED_OPTIONS`: where it listens, the key, the middleware, the per-prompt
media and token caps, the model), in any spelling vLLM's parser takes (`--host=X`, `--hos X`, `--api_key X`,
`--limit-mm-per-prompt.image 9`): `check_vllm_options`.
"""

from __future__ import annotations

import ipaddress
import json
import os
import sys
from pathlib import Path

import torch

from lt_opd_ray.serving.limits import ServeLimits


ENGINES = ("auto", "vllm", "transformers")

# vLLM's options that `lt-opd serve` sets itself or that the request guard relies on, and what to use instead; every
# other option passes after `--` (--allowed-media-domains, --allowed-local-media-path, --trust-request-mm-kwargs, ...)
OWNED_OPTIONS = {
    "--host": "lt-opd serve --host", "--port": "lt-opd serve --port",
    "--uds": "lt-opd serve --host and --port (the server listens where they say)",
    "--grpc": "vLLM's HTTP server (a gRPC server would not pass through the request guard)",
    "--grpc-port": "vLLM's HTTP server (a gRPC port would not pass through the request guard)",
    "--api-key": "lt-opd serve --api-key-file (a key on a command line is readable by every user of the machine)",
    "--middleware": "lt-opd serve's request guard (it is the server's middleware)",
    "--limit-mm-per-prompt": "lt-opd serve --max-images and --max-clips",
    "--override-generation-config": "lt-opd serve --max-tokens",
    "--generation-config": "the folder's own generation_config.json (its eos_token_id: the end tokens the student was trained to stop at)",
    "--model": "the folder given to lt-opd serve", "--dtype": "lt-opd serve --dtype", "--max-model-len": "lt-opd serve --max-model-len",
    "--config": "the options themselves after -- (a config file's would pass unchecked)",
}


def check_vllm_options(extra: list[str]) -> None:
    """Refuse (ValueError, naming it) an option after `--` that sets one of `OWNED_OPTIONS`, spelled any way vLLM's
    parser (FlexibleArgumentParser, an argparse parser) takes it: `--flag value`, `--flag=value`, underscores for
    dashes, a dotted JSON key (`--limit-mm-per-prompt.image 9`), `+` appended; or an unambiguous prefix (`--hos`),
    refused here when it is a prefix of an owned option whatever else it could abbreviate."""
    for arg in extra:
        if arg == "--":
            raise ValueError("a second `--` among vLLM's options refused: what follows it would not be read as options")
        if not arg.startswith("--"):
            continue  # a value, or a short option (none of the owned options has one)
        name = arg[2:].split("=", 1)[0].split(".", 1)[0].rstrip("+").replace("_", "-")
        if not name:
            continue
        for option, instead in OWNED_OPTIONS.items():
            if option[2:].startswith(name):
                spelled = f"{arg.split('=', 1)[0]}" + (f" (vLLM's {option})" if arg.split("=", 1)[0] != option else "")
                raise ValueError(f"vLLM option {spelled} after -- refused: lt-opd serve sets it; use {instead}")


def tensor_parallel_size(extra: list[str]) -> str | None:
    """The tensor-parallel size vLLM's options after `--` set (its last setting, as argparse keeps), in any spelling
    vLLM's parser takes: `--tensor-parallel-size 2`, `=2`, underscores, an abbreviation, `-tp 2`; None if unset."""
    size = None
    for i, arg in enumerate(extra):
        flag, equals, value = arg.partition("=")
        name = flag[2:].replace("_", "-") if flag.startswith("--") else None
        if flag in ("-tp", "-t") or (name and "tensor-parallel-size".startswith(name)):  # argparse takes any unique prefix
            size = (value if equals else extra[i + 1] if i + 1 < len(extra) else "").strip()
    return size


def serve_command(model_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, dtype: str | None = None,
                  max_model_len: int = 8192, extra: list[str] | None = None, api_key_file: str | Path | None = None,
                  limits: ServeLimits = ServeLimits(), engine: str = "auto", allow_no_api_key: bool = False) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of the server process for `model_dir`: vLLM's server, or (`engine` transformers, or auto
    where vLLM cannot run the model on this machine) the transformers engine's (serving/transformers_server.py).
    A host beyond loopback without an API key is refused (ValueError) unless `allow_no_api_key`."""
    from lt_opd_ray.core.compression import CompressionConfig, ServingDefaults
    from lt_opd_ray.core.families import UnsupportedArchitectureError, family_of_config
    from lt_opd_ray.core.model_files import check_model_folder
    from lt_opd_ray.core.selectors import build_selector
    from lt_opd_ray.engines.vllm.selection import SPLIT_TOWER_ENV
    from lt_opd_ray.serving.limits import API_KEY_ENV, SERVED_FOLDER_ENV

    if engine not in ENGINES:
        raise ValueError(f"--engine {engine!r}: one of {', '.join(ENGINES)}")
    model_dir = Path(model_dir).resolve()
    check_model_folder(model_dir)  # its listed files at their sizes, its safetensors headers whole
    compression = CompressionConfig.read(model_dir)  # validates the file before anything starts
    ServingDefaults.read(model_dir)  # and the stop strings and end tokens it answers with
    config = json.loads((model_dir / "config.json").read_text())
    family = family_of_config(config, str(model_dir))  # a family neither engine runs is refused here
    if engine != "transformers":
        refusal = vllm_refusal(model_dir, compression)
        if refusal is None:
            engine = "vllm"
        elif engine == "vllm":
            raise UnsupportedArchitectureError(refusal)
        else:
            print(f"the transformers engine serves it, one request at a time: {refusal}", file=sys.stderr, flush=True)
            engine = "transformers"
    check_vllm_options(extra or [])  # before anything reads --host: none of what serve sets is overridden after --
    tensor_parallel = tensor_parallel_size(extra or [])
    split_tower = tensor_parallel not in (None, "1")
    if split_tower and compression is not None and build_selector(compression.selector).reads_encoder_attention:
        raise ValueError(f"vLLM option --tensor-parallel-size {tensor_parallel} after -- refused: the folder's selector"
                         f" {compression.selector} scores the vision tower's attention on one rank (tensor_parallel_size 1)")
    key = _read_key(Path(api_key_file)) if api_key_file is not None else None
    env = {**os.environ, **limits.environment()}
    key = key if key is not None else env.get("VLLM_API_KEY") or None  # vLLM's own variable: the transformers engine takes it too
    if key is None and not _loopback(host):
        if not allow_no_api_key:
            raise ValueError(f"--host {host} without --api-key-file refused: anyone who reaches port {port} could use the model "
                             "(pass --api-key-file, or --allow-no-api-key to serve it open anyway)")
        print(f"warning: serving on {host} without an API key: anyone who reaches port {port} can use the model"
              " (--allow-no-api-key; docs/operating.md, \"Security\")", file=sys.stderr, flush=True)
    if engine == "transformers":
        if extra:
            raise ValueError(f"options after -- are vLLM's ({' '.join(extra)}); the transformers engine takes none")
        argv = [sys.executable, "-m", "lt_opd_ray.serving.transformers_server", str(model_dir), "--host", host, "--port", str(port)]
        env.pop(API_KEY_ENV, None)
        if key is not None:
            env[API_KEY_ENV] = key
    else:
        argv = _vllm_argv(model_dir, config, family, host, port, dtype, max_model_len, extra or [], limits)
        if key is not None:
            env["VLLM_API_KEY"] = key
        env[SERVED_FOLDER_ENV] = str(model_dir)  # the guard gives a request without `stop` the folder's stop strings
        env.pop(SPLIT_TOWER_ENV, None)  # never the operator's shell's: set here, where the tower is split
        if split_tower:  # a request may not pick a selector that reads the tower's attention (selection.SelectionRequest)
            env[SPLIT_TOWER_ENV] = "1"
        _vllm_environment(env)
    merging = bool(((config.get("vision_token_compressor") or {}).get("learnable_merge") or {}).get("enabled"))
    budget = f"{compression.selector} at {compression.budget_bps / 100:g}% (k_min {compression.k_min})" if compression else "every visual token (no lt_opd_compression.json)"
    budget += ", kept tokens merged with their discarded neighbours (learnable token merge)" if merging else ""
    print(f"serving {model_dir} on http://{host}:{port}/v1 ({engine}) with {budget}", flush=True)
    return argv, env


def vllm_refusal(model_dir: Path, compression) -> str | None:
    """Why the vLLM engine cannot serve `model_dir` with its compression config on this machine (its architecture
    here, or a selector that prunes inside the language model: vLLM's model runner takes the kept visual tokens before
    its language model runs); None where it can."""
    from lt_opd_ray.core.families import UnsupportedArchitectureError
    from lt_opd_ray.core.selectors import build_selector
    from lt_opd_ray.engines.vllm.engine import check_architecture

    if compression is not None and build_selector(compression.selector).prunes_inside_language_model:
        return (f"its selector {compression.selector} prunes inside the language model, which vLLM's model runner does not"
                " (the transformers engine does)")
    try:
        check_architecture(model_dir)
    except UnsupportedArchitectureError as exc:
        return f"vLLM cannot run it on this machine ({exc})"
    return None


def _vllm_argv(model_dir: Path, config: dict, family, host: str, port: int, dtype: str | None, max_model_len: int,
               extra: list[str], limits: ServeLimits = ServeLimits()) -> list[str]:
    on_gpu = torch.cuda.is_available()
    if dtype is None:  # vLLM's CPU kernels run Qwen3.5's Gated DeltaNet only in bf16
        dtype = "bfloat16" if family.linear_attention and not on_gpu else "auto"
    positions = int(config.get("text_config", config).get("max_position_embeddings", max_model_len))
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        *extra,  # first: were one of ours ever spelled past check_vllm_options, argparse keeps the last, ours
        "--model", str(model_dir),
        "--host", host,
        "--port", str(port),
        "--dtype", dtype,
        "--max-model-len", str(min(max_model_len, positions)),
        "--limit-mm-per-prompt", json.dumps({"image": limits.images, "video": limits.clips}),
        "--override-generation-config", json.dumps({"max_new_tokens": limits.max_tokens}),  # vLLM's cap where the guard does not look
        *([] if on_gpu else ["--enforce-eager"]),
        "--middleware", "lt_opd_ray.serving.limits.RequestGuard",
    ]


def _vllm_environment(env: dict[str, str]) -> None:
    from lt_opd_ray.engines.vllm.media import CONNECTOR_NAME

    env.setdefault("VLLM_MEDIA_CONNECTOR", CONNECTOR_NAME)  # inline images only, unless --allowed-media-domains
    env.setdefault("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "0")  # an allowed host cannot send the fetch on to another
    if not torch.cuda.is_available():
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB


def _read_key(path: Path) -> str:
    try:
        key = path.read_text().strip()
    except OSError as exc:
        raise ValueError(f"--api-key-file {path}: cannot be read ({exc.strerror})") from None
    if not key or "\n" in key:
        raise ValueError(f"--api-key-file {path}: holds {'nothing' if not key else 'more than one line'}; put the key alone in it")
    return key


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere
