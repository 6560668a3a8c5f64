"""Shared fixtures: tiny real Qwen VLMs built in-test, offline, and small random images."""

from __future__ import annotations

import numpy as np
import pytest
import torch

FAMILIES = ["qwen3_5", "qwen3_vl", "qwen2_5_vl"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is present on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    from lt_opd_ray.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return {family: build_tiny_model(family, root / family, seed=0) for family in FAMILIES}


def random_image(seed: int, height: int = 128, width: int = 128):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="session")
def loaded(tiny_dirs):
    """family -> (model in fp32, processor, adapter), loaded once per session."""
    from transformers import AutoModelForImageTextToText

    from lt_opd_ray.models.adapter import QwenVLM
    from lt_opd_ray.models.processor import VLMProcessor

    out = {}
    for family, path in tiny_dirs.items():
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()  # CPU
        out[family] = (model, VLMProcessor(path), QwenVLM(model))
    return out
