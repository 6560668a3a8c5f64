"""The family descriptions (core/families.py) against the libraries they describe: each names a class transformers
defines for its model_type, an image processor it ships, modules its tiny model has, and (where it has one) the file
vLLM defines its architecture in."""

import importlib

import pytest
import transformers
from conftest import FAMILIES, VLLM_FAMILIES

from lt_opd_ray.core.families import FAMILIES as DESCRIPTIONS
from lt_opd_ray.core.families import UnsupportedArchitectureError, family_of


@pytest.mark.parametrize("name", FAMILIES)
def test_a_description_names_what_transformers_defines(name, loaded):
    family = DESCRIPTIONS[name]
    model, processor, vlm = loaded[name]
    assert getattr(transformers, family.architecture).config_class.model_type == name == model.config.model_type
    assert type(model).__name__ == family.architecture and model.config.architectures in (None, [family.architecture])
    assert type(processor.image_processor).__name__ == family.image_processor
    parameters = [n for n, _ in model.named_parameters()]
    for marker in family.projector:  # each projector marker names modules the model has
        assert any(marker in n for n in parameters), (name, marker)
    assert family.deepstack == hasattr(model.model.visual, "deepstack_merger_list")
    assert family.linear_attention == any("linear_attn" in n for n in parameters)
    assert processor.tokenizer.convert_tokens_to_ids(family.image_token) == model.config.image_token_id


@pytest.mark.parametrize("name", VLLM_FAMILIES)
def test_a_vllm_family_names_the_file_vllm_defines_its_architecture_in(name):
    family = DESCRIPTIONS[name]
    assert hasattr(importlib.import_module(f"vllm.model_executor.models.{family.vllm_module}"), family.architecture)


def test_an_unknown_model_type_is_named_with_the_supported_ones():
    with pytest.raises(UnsupportedArchitectureError, match=r"models/x: model_type 'llava' has no visual-token pruning support; supported: .*glm4v \(GLM-4.1V"):
        family_of("llava", "models/x")
