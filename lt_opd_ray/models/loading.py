"""Load a VLM from its Hugging Face folder in fp32 master weights (`sources.resolve` turns `tiny:` / `toy:` paths into folders)."""

from __future__ import annotations

from pathlib import Path


def model_folder(path: str | Path) -> Path:
    """`path` as a Hugging Face model folder, or a FileNotFoundError saying what is missing."""
    folder = Path(path)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"model.path {str(path)!r}: no config.json there (expected a Hugging Face model folder)")
    return folder


def load_vlm(path: str | Path, device: str | None = None, token_merge: bool = False, zero3_config: dict | None = None,
             dtype: str = "float32"):
    """(model_dir, model) with `dtype` parameters on `device` (default: CUDA if present, else CPU).

    A model that trains keeps fp32 parameters (its optimizer's masters) and the caller picks the compute precision
    (autocast). A frozen one (the teacher, a rollout engine's copy, which only receives weights) loads in the job's
    compute dtype: autocast keeps a cast copy only of weights that require grad, so a frozen fp32 model would be
    cast again on every op and hold twice the memory. A folder whose
    config names a learnable token merge (ours or the paper's release) gets its trained merge head;
    `token_merge` gives one to a folder without (initialised from the gate rows: models/token_merge.py).
    `zero3_config` (a DeepSpeed ZeRO-3 config): every parameter is created partitioned over the ranks
    (deepspeed.zero.Init, through transformers' DeepSpeed integration) and the checkpoint is loaded shard by
    shard into the partitions, so no rank ever holds the whole model; a collective, every rank calls it.
    """
    import torch
    from transformers import AutoModelForImageTextToText

    from lt_opd_ray.models import token_merge as merging
    from lt_opd_ray.models.patch_embedding import patches_as_matmul

    model_dir = model_folder(path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if zero3_config is not None:
        from transformers.integrations import HfDeepSpeedConfig

        partitioned = HfDeepSpeedConfig(zero3_config)  # transformers partitions while this object lives
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)  # partitions on the rank's device
        del partitioned
    else:
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).to(device)
    patches_as_matmul(model)  # the vision tower's patch embedding as the matrix product it is (models/patch_embedding.py)
    if merging.configured(model.config) or token_merge:
        saved = merging.saved_tensors(model_dir) if merging.configured(model.config) else None
        gate = model.model.language_model.layers[0].mlp.gate_proj.weight  # the head starts from it (no saved head)
        with _gathered([gate, model.lm_head.weight], enabled=zero3_config is not None):
            merging.attach(model, saved)
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))  # after the fp32 load: the rounding of one cast, merge head included
    return model_dir, model


def _gathered(params, enabled: bool):
    """ZeRO-3 partitions gathered whole while a block reads them (a collective, every rank enters it)."""
    import contextlib

    if not enabled:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


class CheckpointNamesError(ValueError):
    """A model folder whose tensor names are not the ones its transformers class loads."""


MERGE_HEAD_PREFIX = "model.vision_token_compressor."  # the token merge's tensors, attached by us (models/token_merge.py)


def check_checkpoint_names(model_dir: Path) -> None:
    """Refuse a folder whose tensors transformers would not load by name (before any actor starts).

    transformers itself reads the folder's tensor names against its class for the config, on the meta device
    (no weights are read): with the same renamings, tied weights and ignored extras (Qwen3.5's `mtp.*`) as a
    real load. A name it would not load means a learner starting from random weights there, and a first
    weight sync that the engines refuse.
    """
    from transformers import AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    previous, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # its load report would print the names; the error below names them
    hf_logging.disable_progress_bar()
    try:
        _, info = AutoModelForImageTextToText.from_pretrained(model_dir, device_map="meta", output_loading_info=True)
    finally:
        hf_logging.set_verbosity(previous)
        if bars:
            hf_logging.enable_progress_bar()
    unexpected = sorted(n for n in info["unexpected_keys"] if not n.startswith(MERGE_HEAD_PREFIX))
    missing = sorted(info["missing_keys"])
    mismatched = sorted(str(m[0]) if isinstance(m, tuple) else str(m) for m in info["mismatched_keys"])
    if not (unexpected or missing or mismatched):
        return
    parts = [f"{label} ({len(names)}): {', '.join(names[:8])}{', ...' if len(names) > 8 else ''}"
             for label, names in (("in the folder but not loaded", unexpected), ("expected but not in the folder", missing),
                                  ("shape differs", mismatched)) if names]
    raise CheckpointNamesError(f"model.path {str(model_dir)!r}: the checkpoint's tensors do not match what transformers loads for its"
                               f" config ({'; '.join(parts)}); convert the folder to the Hugging Face layout of its model_type")


def parameter_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of the folder's transformers class for its config (what a learner of it sends: a
    tied output head once, under the embedding's name), built on the meta device: no weights are read."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    return {name: tuple(parameter.shape) for name, parameter in model.named_parameters()}


def compute_precision(dtype: str, device):
    """The context a forward runs in: bf16 autocast over fp32 master weights, or plain fp32."""
    import contextlib

    import torch

    if dtype == "bfloat16":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
