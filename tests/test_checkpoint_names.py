"""A real Qwen3.5 checkpoint's shape through our paths: its tensor names, tied embeddings, and a folder refused by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lt_opd_ray.models.loading import CheckpointNamesError, check_checkpoint_names, load_vlm
from lt_opd_ray.models.tiny import build_tiny_model

FIXTURE = Path(__file__).parent / "fixtures" / "qwen3_5_tensor_names.txt"


def real_patterns() -> set[str]:
    return {line.strip() for line in FIXTURE.read_text().splitlines() if line.strip() and not line.startswith("#")}


def folder_names(folder: Path) -> list[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        return list(handle.keys())


@pytest.fixture(scope="module")
def tied_folder(tmp_path_factory):
    return build_tiny_model("qwen3_5", tmp_path_factory.mktemp("tied"), seed=0, tied=True)


def test_the_tiny_tied_model_has_the_real_checkpoints_tensor_names(tied_folder):
    assert {re.sub(r"\.\d+\.", ".N.", name) for name in folder_names(tied_folder)} == real_patterns()


def test_the_learner_sends_exactly_the_checkpoints_names(tied_folder):
    """The weight sync's layout is transformers' named_parameters (a tied head once, under the embedding's name);
    the vLLM sink expects the folder's tensor names: the two are the same set."""
    _, model = load_vlm(str(tied_folder), device="cpu")
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    assert {name for name, _ in model.named_parameters()} == set(folder_names(tied_folder))


def rewritten(folder: Path, target: Path, change) -> Path:
    import shutil

    shutil.copytree(folder, target)
    tensors = load_file(str(target / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def test_a_folder_transformers_loads_by_name_passes_with_its_mtp_head(tied_folder, tmp_path):
    check_checkpoint_names(tied_folder)
    check_checkpoint_names(rewritten(tied_folder, tmp_path / "mtp", lambda t: t.update({"mtp.fc.weight": torch.zeros(2, 2)})))


def test_a_renamed_or_missing_tensor_is_refused_naming_it(tied_folder, tmp_path):
    old = "model.language_model.layers.0.linear_attn.in_proj_qkv.weight"
    renamed = rewritten(tied_folder, tmp_path / "renamed", lambda t: t.update({"model.layers.0.linear_attn.in_proj_qkv.weight": t.pop(old)}))
    with pytest.raises(CheckpointNamesError) as refused:
        check_checkpoint_names(renamed)
    message = str(refused.value)
    assert "in the folder but not loaded (1): model.layers.0.linear_attn.in_proj_qkv.weight" in message
    assert f"expected but not in the folder (1): {old}" in message and str(renamed) in message
    missing = rewritten(tied_folder, tmp_path / "missing", lambda t: t.pop("model.visual.merger.norm.bias"))
    with pytest.raises(CheckpointNamesError, match=r"expected but not in the folder \(1\): model.visual.merger.norm.bias"):
        check_checkpoint_names(missing)
