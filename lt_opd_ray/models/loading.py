"""Resolve a model path (a local HF folder, `tiny:<family>` or `toy:<task>`) and load the VLM in fp32 master weights."""

from __future__ import annotations

from pathlib import Path


def resolve_model_dir(path: str) -> Path:
    if path.startswith("tiny:"):
        from .tiny import tiny_model_dir

        return tiny_model_dir(path.split(":", 1)[1])
    if path.startswith("toy:"):
        from ..toy.teacher import RECIPES, toy_teacher_dir

        task = path.split(":", 1)[1]
        if task not in RECIPES:
            raise FileNotFoundError(f"model.path {path!r}: no toy task {task!r} (known: {', '.join(RECIPES)})")
        return toy_teacher_dir(RECIPES[task])
    model_dir = Path(path)
    if not (model_dir / "config.json").exists():
        raise FileNotFoundError(f"model.path {path!r}: no config.json there (expected a Hugging Face model folder)")
    return model_dir


def load_vlm(path: str, device: str | None = None, token_merge: bool = False):
    """(model_dir, model) with fp32 parameters on `device` (default: CUDA if present, else CPU).

    Compute precision is chosen by the caller (autocast), so master weights stay fp32. A folder whose
    config names a learnable token merge (ours or the paper's release) gets its trained merge head;
    `token_merge` gives one to a folder without (initialised from the gate rows: models/token_merge.py).
    """
    import torch
    from transformers import AutoModelForImageTextToText

    from . import token_merge as merging

    model_dir = resolve_model_dir(path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).to(device)
    if merging.configured(model.config):
        merging.attach(model, merging.saved_tensors(model_dir))
    elif token_merge:
        merging.attach(model)
    return model_dir, model


def compute_precision(dtype: str, device):
    """The context a forward runs in: bf16 autocast over fp32 master weights, or plain fp32."""
    import contextlib

    import torch

    if dtype == "bfloat16":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
