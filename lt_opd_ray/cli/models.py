"""Models and data: `lt-opd data`, `eval`, `export`, `serve`, `efficiency`. Heavy libraries are imported inside the commands that need them."""

from __future__ import annotations

import sys
from pathlib import Path

from lt_opd_ray.cli.options import BUDGET_BPS, load_job_or_report, whole_number
from lt_opd_ray.core.samples import DEFAULT_FRAMES
from lt_opd_ray.planning.presets import PRESETS


def cmd_data(args) -> int:
    from tqdm import tqdm

    from lt_opd_ray.core.errors import InputError
    from lt_opd_ray.sources.prepare import DataError, MediaAccess, prepare

    with tqdm(desc="rows", unit="row") as bar:
        def progress(done: int) -> None:
            bar.update(done - bar.n)

        try:
            access = MediaAccess(tuple(args.allowed_media_domains), args.allow_outside_root,
                                 tuple(network for networks in args.allowed_media_addresses for network in networks))
            manifest = prepare(args.source, args.out, args.images, args.shard_rows, args.max_shards, progress, access)
        except (DataError, InputError) as exc:
            bar.close()
            print(f"data: {exc}", file=sys.stderr)
            return 2  # refused input: nothing written
    if manifest is None:
        print(f"stopped after {args.max_shards} new shard(s); run the same command again to continue")
        return 0
    print(f"wrote {args.out}: {manifest['rows']} rows in {len(manifest['shards'])} shard(s) + manifest.json"
          f" (use it as data.path: {args.out})")
    return 0


def cmd_eval(args) -> int:
    import transformers

    from lt_opd_ray.core.errors import InputError
    from lt_opd_ray.core.outputs import OutputFolderError
    from lt_opd_ray.evals.reading import BenchmarkError
    from lt_opd_ray.evals.run import run_eval

    transformers.logging.set_verbosity_error()
    files = {}
    for spec in args.bench:
        name, _, path = spec.partition("=")
        if not path:
            print(f"eval: --bench {spec!r} is not NAME=FILE", file=sys.stderr)
            return 2
        files[name] = path
    try:
        run_eval(args.model, files, args.budgets, args.selectors, args.out, args.k_min, args.max_new_tokens, args.limit, frames=args.frames,
                 force=args.force)
    except (OutputFolderError, FileNotFoundError) as exc:
        print(f"eval: {exc}", file=sys.stderr)
        return 2
    except (BenchmarkError, InputError, ValueError) as exc:
        print(f"eval failed: {exc}", file=sys.stderr)
        return 2
    print((Path(args.out) / "retain_table.md").read_text())
    print(f"wrote {args.out}/results.json, retain_table.md, retain_table.csv, retain.png")
    return 0


def cmd_export(args) -> int:
    from lt_opd_ray.core.compression import CompressionConfig
    from lt_opd_ray.serving.export import ExportError, export_student

    job = load_job_or_report(args.job)
    if job is None:
        return 2
    try:
        out = export_student(job, args.out, step=args.step, force=args.force)
    except ExportError as exc:
        print(f"export failed: {exc}", file=sys.stderr)
        return 1
    compression = CompressionConfig.read(out)
    print(f"wrote {out}: a Hugging Face folder + lt_opd_compression.json ({compression.selector},"
          f" {compression.budget_bps / 100:g}%, k_min {compression.k_min})")
    return 0


def cmd_serve(args) -> int:
    import os

    from lt_opd_ray.serving.limits import ServeLimits
    from lt_opd_ray.serving.serve import serve_command

    limits = ServeLimits.from_args(args)
    try:
        argv, env = serve_command(args.model, args.host, args.port, args.dtype, args.max_model_len, extra=args.train_args,
                                  api_key_file=args.api_key_file, limits=limits, engine=args.engine, allow_no_api_key=args.allow_no_api_key)
    except (FileNotFoundError, ValueError) as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 2
    os.execvpe(argv[0], argv, env)  # the server replaces this process: signals reach it directly


def cmd_efficiency(args) -> int:
    import json

    from lt_opd_ray.core.compression import learnable_merge
    from lt_opd_ray.core.families import UnsupportedArchitectureError, family_of_config
    from lt_opd_ray.planning.efficiency import clip_text_tokens, fastv_cut, merge_parameters, patch_grid, prefill_cost

    if args.preset:
        config = PRESETS[args.preset]
    elif args.model is None:
        print(f"efficiency: give a model folder or --preset (one of {', '.join(PRESETS)})", file=sys.stderr)
        return 2
    else:
        path = Path(args.model) / "config.json"
        if not path.exists():
            print(f"efficiency: {path} not found (give a model folder or --preset)", file=sys.stderr)
            return 2
        config = json.loads(path.read_text())
        try:
            family_of_config(config, str(path))
        except UnsupportedArchitectureError as exc:
            print(f"efficiency: {exc}", file=sys.stderr)
            return 2
    try:
        height, width = (int(v) for v in args.image.lower().split("x"))
    except ValueError:
        print(f"efficiency: --image {args.image!r} is not HEIGHTxWIDTH in pixels", file=sys.stderr)
        return 2
    grid = patch_grid(config, height, width)
    merging = args.token_merge or learnable_merge(config) is not None
    if args.images is None:
        args.images = 0 if args.frames else 1
    if args.images < (0 if args.frames else 1) or args.frames < 0 or args.frames % 2:
        print(f"efficiency: --images {args.images} --frames {args.frames}: a prompt shows an image or a clip of an even number"
              " of frames (two frames make one temporal patch)", file=sys.stderr)
        return 2
    patches = args.frames // 2  # a clip's temporal patches: each costs the vision tower what one image of its size does
    grids = [grid] * (args.images + patches)  # each image and each temporal patch pruned to the budget on its own (selector.scope image)
    text_tokens = args.text_tokens + clip_text_tokens(config, patches)
    budgets = sorted(set(args.budgets + [10000]), reverse=True)
    try:
        pruned_after = fastv_cut(config) if args.fastv or _prunes_inside(args.model) else None
    except ValueError as exc:
        print(f"efficiency: {exc}", file=sys.stderr)
        return 2
    rows = [prefill_cost(config, text_tokens, grids, bps, args.k_min, token_merge=merging, pruned_after=pruned_after) for bps in budgets]
    full = rows[0]
    shown = [f"one {height}x{width} image" if args.images == 1 else f"{args.images} images of {height}x{width}" if args.images else "",
             f"a {args.frames}-frame clip of {height}x{width} frames ({patches} temporal patches, +{clip_text_tokens(config, patches)}"
             " timestamp and marker tokens)" if args.frames else ""]
    pruned = "each image and temporal patch pruned to the budget" if args.frames else "each pruned to the budget" if args.images > 1 else ""
    print(f"{args.preset or args.model}: {args.text_tokens} text tokens + {' + '.join(filter(None, shown))}"
          f"{', ' + pruned if pruned else ''} ({full.visual_tokens} visual tokens), bf16 KV; FLOPs = 2 per multiply-accumulate"
          + (f"; pruned inside the language model as FastV does, after layer {pruned_after - 1} (0-based)" if pruned_after else ""))
    print(f"{'budget':>7} {'tokens':>7} {'LM prefill TFLOPs':>18} {'vision TFLOPs':>14} {'KV cache MB':>12} {'GDN state MB':>13}"
          + (f" {'merge GFLOPs':>14}" if merging else ""))
    for bps, row in zip(budgets, rows):
        print(f"{bps / 100:>6g}% {row.prefill_tokens:>7} {row.lm_flops / 1e12:>10.3f} ({row.lm_flops / full.lm_flops - 1:>+6.1%})"
              f" {row.vision_flops / 1e12:>14.3f} {row.kv_cache_bytes / 1e6:>6.2f} ({row.kv_cache_bytes / full.kv_cache_bytes - 1:>+6.1%})"
              f" {row.linear_state_bytes / 1e6:>13.2f}" + (f" {row.merge_flops / 1e9:>14.3f}" if merging else ""))
    if merging:
        print(f"learnable token merge: {merge_parameters(config):,} parameters; its GFLOPs (last column) are"
              f" {rows[-1].merge_flops / rows[-1].lm_flops:.3%} of the LM prefill at {min(args.budgets) / 100:g}%")
    if args.measure:
        if args.model is None:
            print("efficiency: --measure times a model folder's serving engine: give the folder, not --preset", file=sys.stderr)
            return 2
        if args.images != 1 or args.frames:
            print("efficiency: --measure times one image per request (--image's size); --images and --frames are the calculator's",
                  file=sys.stderr)
            return 2
        return _measured(args, config, (height, width), budgets, merging)
    return 0


def _prunes_inside(folder: str | None) -> bool:
    """Whether the model folder's compression config names a selector that prunes inside the language model."""
    from lt_opd_ray.core.compression import CompressionConfig

    compression = CompressionConfig.read(folder) if folder else None
    if compression is None:
        return False
    from lt_opd_ray.core.selectors import build_selector

    return build_selector(compression.selector).prunes_inside_language_model


def _measured(args, config: dict, size: tuple[int, int], budgets: list[int], merging: bool) -> int:
    """The serving engine's measured latency at each budget, beside the calculator's prediction for the same prompt."""
    from lt_opd_ray.core.selectors import build_selector
    from lt_opd_ray.planning.efficiency import fastv_cut, prefill_cost
    from lt_opd_ray.serving.latency import measure, serving_engine

    engine = serving_engine(Path(args.model))
    measured = measure(engine, *size, budgets, args.max_new_tokens, args.repeats)
    full = measured[0]
    inside = build_selector(engine.compression.selector).prunes_inside_language_model
    predicted = [prefill_cost(config, row.text_tokens, [row.grid_thw], row.budget_bps, engine.compression.k_min, token_merge=merging,
                              pruned_after=fastv_cut(config) if inside else None) for row in measured]
    print(f"\nmeasured on {engine.name} ({'GPU' if _on_gpu() else 'CPU'}), one request at a time, medians of {args.repeats}"
          f" (a fresh {size[0]}x{size[1]} noise image each, {full.text_tokens} text tokens), greedy answers of at most"
          f" {args.max_new_tokens} tokens ending as served; beside them the calculator's figures for that prompt:")
    print(f"{'budget':>7} {'prompt':>7} {'first token ms':>18} {'decode ms/token':>16} {'end-to-end ms':>18} {'tokens':>7}"
          f" {'LM prefill TFLOPs':>18} {'KV cache MB':>12}")
    for row, cost in zip(measured, predicted):
        first = f"{row.first_token_s * 1e3:.1f} ({full.first_token_s / row.first_token_s:.2f}x)"
        whole = f"{row.end_to_end_s * 1e3:.1f} ({full.end_to_end_s / row.end_to_end_s:.2f}x)"
        flops = f"{cost.lm_flops / 1e12:.4f} ({cost.lm_flops / predicted[0].lm_flops - 1:+.1%})"
        decode = "n/a" if row.per_token_s is None else f"{row.per_token_s * 1e3:.2f}"  # no answer past its first token
        print(f"{row.budget_bps / 100:>6g}% {row.prompt_tokens:>7} {first:>18} {decode:>16} {whole:>18} {row.tokens:>7}"
              f" {flops:>18} {cost.kv_cache_bytes / 1e6:>12.2f}")
    mismatched = [row.budget_bps for row, cost in zip(measured, predicted) if cost.prefill_tokens != row.prompt_tokens]
    if mismatched:
        print(f"note: at {mismatched} bps the calculator's prefill tokens differ from what the engine prefilled")
    print("(the speed-ups are against every visual token)")
    return 0


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def register(sub) -> None:
    """This module's subcommands on the `lt-opd` parser."""
    from lt_opd_ray.sources.fetch import media_addresses

    data = sub.add_parser("data", help="verify and shard a training set (LT-14K layout, datasets folder, JSONL/parquet)")
    data.add_argument("source", help="LT-14K folder, datasets save_to_disk folder, or .jsonl/.parquet file")
    data.add_argument("--out", required=True, help="output folder (manifest.json is written last)")
    data.add_argument("--images", default=None, help="folder of a JSONL/parquet source's images and videos (default: its folder)")
    data.add_argument("--shard-rows", type=whole_number(1), default=1000, help="rows per parquet shard (default 1000)")
    data.add_argument("--max-shards", type=whole_number(1), default=None, help="stop after N new shards (run again to continue)")
    data.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="HOST",
                      help="hosts whose image URLs in the rows are fetched (default: none, a URL is refused; redirects are never followed)")
    data.add_argument("--allowed-media-addresses", nargs="+", default=[], metavar="ADDRESSES", type=media_addresses,
                      help="loopback, private, link-local, ... addresses or networks (comma-separated, e.g. 10.0.0.0/8,127.0.0.1) an"
                           " allowed host may resolve to (default: none, a host resolving to one is refused; public addresses need no listing)")
    data.add_argument("--allow-outside-root", action="store_true",
                      help="let rows name files outside the source's folder (absolute paths, climbing out with .., or through a link leading out)")
    data.set_defaults(func=cmd_data)

    evaluate = sub.add_parser("eval", help="score a model at full tokens and at budgets over local benchmarks; the retain table")
    evaluate.add_argument("model", help="model folder (or tiny:<family>, toy:<task>)")
    evaluate.add_argument("--bench", action="append", required=True, metavar="NAME=FILE",
                          help="a benchmark file; NAME one of mmbench, mmmu, vstar, hrbench, pope, gqa, textvqa, mme, ocrbench, muirbench, mvbench")
    evaluate.add_argument("--budgets", type=BUDGET_BPS, nargs="+", default=[500, 1000, 2500], help="budgets in basis points, 1-10000 (default 500 1000 2500: 5%%, 10%%, 25%%)")
    evaluate.add_argument("--selectors", nargs="+", default=["cdpruner"], help="token selectors to score (default cdpruner; also divprune, fastv, hiprune, random, uniform)")
    evaluate.add_argument("--k-min", type=whole_number(1), default=1, help="visual tokens kept per image at the least (default 1)")
    evaluate.add_argument("--max-new-tokens", type=whole_number(1), default=16, help="longest answer generated (default 16)")
    evaluate.add_argument("--limit", type=whole_number(1), default=None, help="first N items of each benchmark (default: all)")
    evaluate.add_argument("--frames", type=whole_number(1), default=DEFAULT_FRAMES, help="frames each video is sampled to (default 16, as MVBench)")
    evaluate.add_argument("--out", default="runs/eval", help="output folder (default runs/eval); refused when it holds anything but an earlier eval's results")
    evaluate.add_argument("--force", action="store_true", help="replace the results an earlier `lt-opd eval` wrote in --out (never another folder)")
    evaluate.set_defaults(func=cmd_eval)

    export = sub.add_parser("export", help="write the trained student as a Hugging Face folder + its compression config")
    export.add_argument("job", help="the job YAML the student was trained with")
    export.add_argument("--out", required=True, help="output folder (assembled beside it, renamed into place)")
    export.add_argument("--step", type=whole_number(1), default=None, help="export checkpoint step-N (default: <checkpoint.dir>/final)")
    export.add_argument("--force", action="store_true", help="replace an earlier `lt-opd export` in --out (never another folder)")
    export.set_defaults(func=cmd_export)

    serve = sub.add_parser("serve", help="serve an exported student at its budget (vLLM, OpenAI-compatible); -- passes vLLM options")
    serve.add_argument("model", help="exported model folder")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: localhost only)")
    serve.add_argument("--port", type=whole_number(1, 65535), default=8000, help="port (default 8000)")
    serve.add_argument("--dtype", default=None, help="vLLM dtype (default: bf16 for Qwen3.5 on CPU, else auto)")
    serve.add_argument("--max-choices", type=whole_number(1, 16), default=1,
                       help="most answers one request may ask for (`n`, `best_of`; default 1: a client wanting k sends k requests)")
    serve.add_argument("--max-model-len", type=whole_number(1), default=8192, help="longest prompt + answer in tokens (default 8192, or the model's own limit if lower)")
    serve.add_argument("--engine", choices=["auto", "vllm", "transformers"], default="auto",
                       help="auto (default): vLLM, or transformers where vLLM cannot run the model on this machine (the toy models' head size on CPU)")
    serve.add_argument("--api-key-file", default=None, help="a file holding the API key every request must send as `Authorization: Bearer KEY`")
    serve.add_argument("--max-body-mb", type=whole_number(1, 4096), default=32, help="largest request body in MiB (default 32)")
    serve.add_argument("--max-media-mb", type=whole_number(1, 4096), default=24, help="largest image or clip in MiB, inline or fetched (default 24)")
    serve.add_argument("--max-image-pixels", type=whole_number(1), default=50_000_000, help="most pixels in one image, checked before it is decoded (default 50,000,000)")
    serve.add_argument("--max-images", type=whole_number(1, 1000), default=1, help="most images in one request (default 1)")
    serve.add_argument("--max-clips", type=whole_number(1, 1000), default=1, help="most video clips in one request, vLLM only (default 1)")
    serve.add_argument("--max-request-pixels", type=whole_number(1), default=50_000_000,
                       help="most pixels of all a request's images together, checked before any is decoded (default 50,000,000)")
    serve.add_argument("--max-tokens", type=whole_number(1), default=4096, help="largest max_tokens a request may ask for (default 4096)")
    serve.add_argument("--request-timeout", type=whole_number(1, 86400), default=300,
                       help="seconds a request may take, waiting for the model included; then it is stopped and answered 503/504 (default 300)")
    serve.add_argument("--allow-no-api-key", action="store_true", help="serve on a --host beyond loopback without --api-key-file (refused otherwise)")
    serve.set_defaults(func=cmd_serve)

    efficiency = sub.add_parser("efficiency", help="analytic prefill FLOPs and KV-cache bytes of a model at visual budgets")
    efficiency.add_argument("model", nargs="?", default=None, help="model folder (its config.json)")
    efficiency.add_argument("--preset", choices=list(PRESETS), default=None, help="a built-in config instead of a folder")
    efficiency.add_argument("--text-tokens", type=whole_number(0), default=84, help="text tokens of the prompt (default 84; --measure asks its own question and counts its tokens)")
    efficiency.add_argument("--image", default="896x832", help="image size HEIGHTxWIDTH in pixels (default 896x832)")
    efficiency.add_argument("--images", type=whole_number(0), default=None, help="images per prompt, each of --image's size (default 1; 0 with --frames)")
    efficiency.add_argument("--frames", type=whole_number(0), default=0, help="a clip of this many frames of --image's size (MVBench: 16)")
    efficiency.add_argument("--budgets", type=BUDGET_BPS, nargs="+", default=[2500, 1000, 500], help="budgets in basis points, 1-10000 (default 2500 1000 500)")
    efficiency.add_argument("--k-min", type=whole_number(1), default=1, help="visual tokens kept per image at the least (default 1)")
    efficiency.add_argument("--token-merge", action="store_true", help="add the learnable token merge (on by itself for a folder that has one)")
    efficiency.add_argument("--fastv", action="store_true", help="prune inside the language model as FastV does: the layers up to its"
                            " scoring layer see every visual token (on by itself for a folder whose selector is fastv)")
    efficiency.add_argument("--measure", action="store_true",
                            help="also time the folder on its serving engine: first token, decode per token, end-to-end, at each budget")
    efficiency.add_argument("--repeats", type=whole_number(1), default=5, help="requests per budget with --measure (medians; default 5)")
    efficiency.add_argument("--max-new-tokens", type=whole_number(2), default=32, help="the longest answer timed with --measure (default 32)")
    efficiency.set_defaults(func=cmd_efficiency)
