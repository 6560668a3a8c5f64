"""The VLM families the recipe adapts, one description each: everything that differs between them.

The adapter, the processor, the tiny-model builder, the learner's learning-rate groups, the efficiency calculator
and the vLLM plugin read a family's description here instead of branching on `model_type` strings. Adding a
family is one entry (and, where its layers are new, a tiny config in models/tiny.py and a vLLM subclass).

Every family here is a decoder language model fed by a vision tower whose merged tokens carry 3-D M-RoPE positions
(t, h, w) from the model's own `get_rope_index`; what a kept token's position is, and how decoding continues after
a reduced prompt, is therefore the same for all of them (models/adapter.py). Video goes through the model's own video
path, in the family's clip layout (`clip_layout`): Qwen3.5 and Qwen3-VL write each temporal patch of two frames after
its `<t seconds>` text, a run of tokens between its own vision start and end, placed like an image; GLM-4V writes each
patch's run between image start and end, then its first frame's whole seconds; Qwen2.5-VL writes the clip as one run
of every patch's tokens, its temporal positions spaced by the seconds each patch spans (`second_per_grid_ts`).
"""

from __future__ import annotations

from dataclasses import dataclass


class UnsupportedArchitectureError(ValueError):
    pass


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's `model_type`
    name: str  # as its users know it
    architecture: str  # config.json's `architectures[0]`: the transformers class, and the vLLM class the plugin subclasses
    vllm_module: str | None  # vLLM's model file defining `architecture`; None: no pruned vLLM class yet (transformers only)
    image_token: str  # the placeholder its chat template writes once per image (expanded to the image's N tokens)
    image_start: str  # the tokens its chat template puts around each image's placeholders
    image_end: str
    video_tokens: tuple[str, str, str]  # a clip's (start, placeholder, end) tokens, which its processors expect in the vocabulary
    user_turn: tuple[str, str]  # what opens the user's turn in its chat template: a special token, then plain text
    turn_ends: tuple[str, ...]  # the special tokens that close a user's turn
    image_processor: str  # transformers' PIL image processor class of its checkpoints
    video_processor: str  # transformers' video processor class of its checkpoints
    clip_layout: str  # a clip's temporal patches: each after its `<t seconds>` ("stamp_before": Qwen3), each before its
    #                   first frame's whole seconds ("stamp_after": GLM-4V), or all in one run ("one_run": Qwen2.5-VL)
    patch_size: int  # its releases' vision patch side (tiny models use it too)
    projector: tuple[str, ...]  # parameter-name markers of the modules that map vision features into the LM (the `merger` learning rate)
    deepstack: bool = False  # Qwen3-VL: merged features of early vision blocks also enter the first decoder layers
    linear_attention: bool = False  # Qwen3.5: Gated DeltaNet layers (GPU kernels: models/kernels.py; vLLM's CPU kernels run them in bf16 only)
    attention_output_gate: bool = False  # Qwen3.5: q_proj also emits the full-attention layers' output gate
    windowed_vision: bool = False  # Qwen2.5-VL: vision blocks attend within windows except `fullatt_block_indexes`
    vision_mlp: str = "fc"  # vision blocks' MLP: "fc" (fc1 -> fc2, intermediate_size), "swiglu" (gate/up/down, intermediate_size),
    #                          "swiglu_out" (gate/up/down of width out_hidden_size: GLM-4V)
    text_qkv_bias_flag: bool = False  # GLM-4V: transformers always builds the text q/k/v biases, vLLM only when
    #                                  text_config.attention_bias is true (the releases set it; a folder without it loses them in vLLM)
    image_beside_clip: bool = True  # GLM-4V: False, its model marks images and frames with one token and takes one or the other
    merged_by: str = "mlp"  # how 2x2 patches become one LM token: "mlp" (Qwen's PatchMerger over the concatenation),
    #                          "conv_glu" (GLM-4V: a strided Conv2d, then a gated projection of width intermediate_size)


QWEN_VIDEO = ("<|vision_start|>", "<|video_pad|>", "<|vision_end|>")
QWEN_CHAT = {"user_turn": ("<|im_start|>", "user\n"), "turn_ends": ("<|im_end|>",)}
GLM_ROLES = ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")

FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        Family(
            model_type="qwen3_5", name="Qwen3.5", architecture="Qwen3_5ForConditionalGeneration", vllm_module="qwen3_5",
            image_token="<|image_pad|>", image_start="<|vision_start|>", image_end="<|vision_end|>",
            video_tokens=QWEN_VIDEO, **QWEN_CHAT, image_processor="Qwen2VLImageProcessorPil", video_processor="Qwen3VLVideoProcessor", clip_layout="stamp_before",
            patch_size=16, projector=("visual.merger",), linear_attention=True, attention_output_gate=True,
        ),
        Family(
            model_type="qwen3_vl", name="Qwen3-VL", architecture="Qwen3VLForConditionalGeneration", vllm_module="qwen3_vl",
            image_token="<|image_pad|>", image_start="<|vision_start|>", image_end="<|vision_end|>",
            video_tokens=QWEN_VIDEO, **QWEN_CHAT, image_processor="Qwen2VLImageProcessorPil", video_processor="Qwen3VLVideoProcessor",
            clip_layout="stamp_before", patch_size=16, projector=("visual.merger", "visual.deepstack_merger_list"), deepstack=True,
        ),
        Family(
            model_type="qwen2_5_vl", name="Qwen2.5-VL", architecture="Qwen2_5_VLForConditionalGeneration", vllm_module="qwen2_5_vl",
            image_token="<|image_pad|>", image_start="<|vision_start|>", image_end="<|vision_end|>",
            video_tokens=QWEN_VIDEO, **QWEN_CHAT, image_processor="Qwen2VLImageProcessorPil", video_processor="Qwen2VLVideoProcessor",
            clip_layout="one_run", patch_size=14, projector=("visual.merger",), windowed_vision=True, vision_mlp="swiglu",
        ),
        Family(
            model_type="glm4v", name="GLM-4.1V / GLM-4.6V-Flash", architecture="Glm4vForConditionalGeneration", vllm_module="glm4_1v",
            image_token="<|image|>", image_start="<|begin_of_image|>", image_end="<|end_of_image|>",
            video_tokens=("<|begin_of_video|>", "<|video|>", "<|end_of_video|>"),
            user_turn=("<|user|>", "\n"), turn_ends=GLM_ROLES, image_processor="Glm4vImageProcessorPil", video_processor="Glm4vVideoProcessor", clip_layout="stamp_after",
            patch_size=14,
            projector=("visual.downsample", "visual.merger"),
            vision_mlp="swiglu_out", merged_by="conv_glu", text_qkv_bias_flag=True, image_beside_clip=False,
        ),
    )
}


def family_of(model_type: str | None, what: str = "the model") -> Family:
    """The description of `model_type`; an UnsupportedArchitectureError naming the supported ones otherwise."""
    if model_type not in FAMILIES:
        raise UnsupportedArchitectureError(
            f"{what}: model_type {model_type!r} has no visual-token pruning support; supported:"
            f" {', '.join(f'{f.model_type} ({f.name})' for f in FAMILIES.values())}"
        )
    return FAMILIES[model_type]


def family_of_config(config: dict, what: str = "the model") -> Family:
    """The family of a parsed config.json."""
    return family_of(config.get("model_type"), what)


def vllm_model_problem(config: dict, where: str) -> str | None:
    """Why our vLLM plugin cannot serve the model of this parsed config.json (`where` names it), wherever the engine
    runs; None where it can. (What vLLM's CPU build adds, head sizes and dtypes, depends on the engine's machine:
    engines/vllm/engine.check_architecture.) Torch-free: `lt-opd validate` asks it."""
    served = {f.architecture for f in FAMILIES.values() if f.vllm_module}
    architectures = config.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    unsupported = [a for a in architectures if a not in served] or ([] if architectures else ["(none given)"])
    if unsupported:
        return (f"{where}: architecture {', '.join(unsupported)} has no visual-token pruning support in the vLLM engine;"
                f" supported: {', '.join(sorted(served))}")
    family = family_of_config(config, where)
    if family.text_qkv_bias_flag and (config.get("text_config") or {}).get("attention_bias") is not True:
        return (f"{where}: text_config.attention_bias is not true; transformers builds {family.name}'s q/k/v biases"
                " regardless, vLLM only when it is true (so its engine would drop them and sample another model). The"
                " releases set it: add \"attention_bias\": true to text_config")
    return None
