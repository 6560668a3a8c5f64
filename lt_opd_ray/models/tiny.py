"""Tiny random VLM checkpoints of every family in core/families.py, built offline as ordinary Hugging Face folders.

Each folder holds config.json + weights, a byte-level BPE tokenizer with the Qwen
special tokens (and the family's own image, video and chat tokens) and the family's chat scaffolding, and
the family's PIL image processor config. Tests and the embedded default job use these;
no hub needed. Shapes are the smallest that keep each family's structure: Qwen3.5's 3
Gated-DeltaNet layers + 1 full-attention layer (linear head dims 128, as vLLM's CPU GDN
kernel needs), Qwen3-VL's deepstack mergers, Qwen2.5-VL's windowed vision blocks,
GLM-4V's interpolated position table, conv downsample and gated projector.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lt_opd_ray.core.families import FAMILIES, GLM_ROLES

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

CONTENT = (  # a message's text and image parts, in order
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}IMAGE"
    "{% elif part['type'] == 'video' %}VIDEO"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
)


@dataclass(frozen=True)
class TinyChat:
    """A family's chat scaffolding, as its releases' templates write it (reduced to what the tiny models need)."""

    tokens: tuple[str, ...]  # special tokens beyond SPECIAL_TOKENS and the family's image and video tokens
    template: str  # Jinja, IMAGE and VIDEO standing for the family's image and video placeholders
    eos: str  # the tokenizer's end-of-sequence token
    ends: tuple[str, ...]  # every token that ends a response (generation_config.json's eos_token_id)


QWEN_CHAT = TinyChat(
    tokens=(),
    template=("{% for message in messages %}<|im_start|>{{ message['role'] }}\n" + CONTENT + "<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    eos="<|im_end|>",
    ends=("<|im_end|>",),
)
GLM_CHAT = TinyChat(  # GLM-4.1V / 4.6V-Flash: `[gMASK]<sop>`, then `<|role|>\n` turns; a response ends at the next turn
    tokens=("[gMASK]", "<sop>", *GLM_ROLES),
    template=("[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n" + CONTENT + "{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
    eos="<|endoftext|>",
    ends=("<|endoftext|>", "<|user|>", "<|observation|>"),
)
TINY_CHAT = {"glm4v": GLM_CHAT}  # the others write Qwen's


def chat_of(family: str) -> TinyChat:
    return TINY_CHAT.get(family, QWEN_CHAT)

# Text the BPE merges are learned from: enough for short questions and <answer> tags.
TOKENIZER_CORPUS = [
    "What colour is the shape in the top left corner? Answer with one word.",
    "How many circles are there in the image? <answer>3</answer>",
    "Which letter is written at the bottom right? <answer>B</answer>",
    "Is there a red square? <answer>yes</answer> <answer>no</answer>",
    "Describe the image. The picture shows a cat on a mat next to a dog.",
    "red green blue yellow black white purple orange square circle triangle",
    "system user assistant You are a helpful assistant.",
    "0 1 2 3 4 5 6 7 8 9 A B C D E F G H I J K L M N O P Q R S T U V W X Y Z",
]


def family_tokens(family: str) -> list[str]:
    """The tiny tokenizer's special tokens: Qwen's, with the family's own image, video and chat tokens where they
    differ (GLM-4V's `<|begin_of_image|><|image|><|end_of_image|>`, `<|user|>`, ...)."""
    own = FAMILIES[family]
    extra = (own.image_start, own.image_token, own.image_end, *own.video_tokens, *chat_of(family).tokens)
    return SPECIAL_TOKENS + list(dict.fromkeys(t for t in extra if t not in SPECIAL_TOKENS))


def build_tokenizer(vocab_size: int = 384, family: str = "qwen3_5"):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    special = family_tokens(family)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(special),
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(TOKENIZER_CORPUS, trainer)
    chat = chat_of(family)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=chat.eos,
        pad_token="<|endoftext|>",
        additional_special_tokens=special[1:],
    )
    tokenizer.add_special_tokens({"additional_special_tokens": special[1:]})
    image = FAMILIES[family]
    tokenizer.chat_template = (chat.template.replace("IMAGE", image.image_start + image.image_token + image.image_end)
                               .replace("VIDEO", "".join(image.video_tokens)))
    return tokenizer


def _token_ids(tokenizer, family: str) -> dict[str, int]:
    image = FAMILIES[family]
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in family_tokens(family)}
    return {
        "image_token_id": ids[image.image_token],
        "video_token_id": ids[image.video_tokens[1]],
        "image_start_token_id": ids[image.image_start],
        "image_end_token_id": ids[image.image_end],
        "eos_token_id": [ids[t] for t in chat_of(family).ends] if len(chat_of(family).ends) > 1 else ids[chat_of(family).ends[0]],
        "pad_token_id": ids["<|endoftext|>"],
    }


def _mrope_section(rotary_dim: int) -> list[int]:
    """Rotary frequencies (rotary_dim / 2) split over (t, h, w) in Qwen's 2:3:3-like proportion."""
    frequencies = rotary_dim // 2
    spatial = 3 * frequencies // 8
    return [frequencies - 2 * spatial, spatial, spatial]


def tiny_config(family: str, tokenizer, hidden: int = 64, head_dim: int = 32, vocab_size: int | None = None, tied: bool = False,
                layers: int | None = None):
    """A tiny config of `family` whose special-token ids match `tokenizer`.

    `layers`: decoder layers instead of the family's tiny count (Qwen3.5: a multiple of 4, each 3 Gated-DeltaNet
    layers then a full-attention one, as its releases).

    `vocab_size` (default: the tokenizer's) may exceed the tokenizer, as Qwen3.5-4B's
    248,320 rows do: the output head then has the real shape, and ids past the
    tokenizer decode to nothing.

    head_dim 32 is the smallest that vLLM's CPU attention kernels accept, so every
    tiny model also runs in the vLLM engines.
    """
    from transformers import AutoConfig

    if family not in TINY_SHAPES:
        raise ValueError(f"unknown tiny model family {family!r}; known: {', '.join(FAMILIES)}")
    ids = _token_ids(tokenizer, family)
    vocab = vocab_size or len(tokenizer)
    if vocab < len(tokenizer):
        raise ValueError(f"vocab_size {vocab} is below the tokenizer's {len(tokenizer)} tokens")
    heads = 4 if family in ("qwen3_5", "qwen3_vl") else hidden // head_dim  # others: head_dim = hidden / heads
    text_common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=4096,
        eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"],
        bos_token_id=None,
        tie_word_embeddings=tied,
        initializer_range=0.1,  # wider than 0.02 so a random model's next-token choices vary
    )
    vision_common = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden,
                         patch_size=FAMILIES[family].patch_size, spatial_merge_size=2, temporal_patch_size=2)
    text, vision, start_end_keys = TINY_SHAPES[family](text_common, vision_common, head_dim)
    if layers is not None:
        text["num_hidden_layers"] = layers
        if "layer_types" in text:
            if layers % 4:
                raise ValueError(f"a tiny {family} model has layers in fours (3 linear-attention, 1 full): {layers} refused")
            text["layer_types"] = (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)
    token_ids = {"image_token_id": ids["image_token_id"], "video_token_id": ids["video_token_id"],
                 start_end_keys[0]: ids["image_start_token_id"], start_end_keys[1]: ids["image_end_token_id"]}
    if family == "glm4v":  # GLM-4V's clip sits between its own start and end tokens (vLLM writes them from the config)
        token_ids |= {"video_start_token_id": tokenizer.convert_tokens_to_ids(FAMILIES[family].video_tokens[0]),
                      "video_end_token_id": tokenizer.convert_tokens_to_ids(FAMILIES[family].video_tokens[2])}
    config = AutoConfig.for_model(family, text_config=text, vision_config=vision, **token_ids, tie_word_embeddings=tied)
    config.eos_token_id = ids["eos_token_id"]
    config.pad_token_id = ids["pad_token_id"]
    return config


QWEN_START_END = ("vision_start_token_id", "vision_end_token_id")


def _qwen3_5(text, vision, head_dim):
    """3 Gated-DeltaNet layers + 1 full-attention layer; rotary dim = head_dim / 2, its frequencies split over (t, h, w)
    and interleaved, as in Qwen3.5."""
    text = dict(
        text,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": _mrope_section(head_dim // 2), "mrope_interleaved": True},
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
    )
    return text, dict(vision, num_position_embeddings=64), QWEN_START_END


def _qwen3_vl(text, vision, head_dim):
    """Two decoder layers fed deepstack features from both vision blocks."""
    text = dict(text, num_hidden_layers=2, head_dim=head_dim,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": _mrope_section(head_dim), "mrope_interleaved": True})
    return text, dict(vision, num_position_embeddings=64, deepstack_visual_indexes=[0, 1]), QWEN_START_END


def _qwen2_5_vl(text, vision, head_dim):
    """Windowed vision blocks but the last (full attention)."""
    heads = text["num_attention_heads"]
    text = dict(text, num_hidden_layers=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": _mrope_section(text["hidden_size"] // heads)})
    return text, dict(vision, window_size=56, fullatt_block_indexes=[1]), QWEN_START_END


def _glm4v(text, vision, head_dim):
    """GLM-4V: half the head dimension rotary (as GLM-4.1V / 4.6V-Flash), a position-embedding table interpolated to
    each image's grid (112 px: 8 x 8 patches), the strided-conv downsample and gated projector."""
    heads = text["num_attention_heads"]
    rotary = text["hidden_size"] // heads // 2
    text = dict(text, num_hidden_layers=2, attention_bias=True,  # as the releases' text_config: vLLM builds the q/k/v biases from it
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": _mrope_section(rotary)})
    return text, dict(vision, image_size=112), ("image_start_token_id", "image_end_token_id")


TINY_SHAPES = {"qwen3_5": _qwen3_5, "qwen3_vl": _qwen3_vl, "qwen2_5_vl": _qwen2_5_vl, "glm4v": _glm4v}


def _vision_processing(family: str, min_pixels: int, max_pixels: int) -> dict:
    """What the family's image and video processors share: patch, merge, pixel bounds, normalisation."""
    return {
        "patch_size": FAMILIES[family].patch_size,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }


def image_processor_config(family: str, min_pixels: int = 64 * 64, max_pixels: int = 256 * 256) -> dict:
    return {"image_processor_type": FAMILIES[family].image_processor, **_vision_processing(family, min_pixels, max_pixels),
            "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True}


def video_processor_config(family: str, min_pixels: int = 64 * 64, max_pixels: int = 16 * 128 * 128) -> dict:
    """The family's video processor: a clip's pixels, all frames together, within [min_pixels, max_pixels]."""
    return {"video_processor_type": FAMILIES[family].video_processor, **_vision_processing(family, min_pixels, max_pixels)}


def build_tiny_model(family: str, out_dir: str | Path, seed: int = 0, hidden: int = 64, vocab_size: int | None = None,
                     tied: bool = False, layers: int | None = None) -> Path:
    """Write a tiny random `family` VLM to `out_dir` (an ordinary HF folder) and return the path; `tied`: the output
    head is the input embedding (one tensor, as Qwen3.5-4B's checkpoint has it)."""
    import torch
    from transformers import AutoModelForImageTextToText

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(family=family)
    config = tiny_config(family, tokenizer, hidden=hidden, vocab_size=vocab_size, tied=tied, layers=layers)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "preprocessor_config.json").write_text(json.dumps(image_processor_config(family), indent=2))
    if FAMILIES[family].video_processor:
        (out_dir / "video_preprocessor_config.json").write_text(json.dumps(video_processor_config(family), indent=2))
    return out_dir


def tiny_model_dir(name: str, cache_root: str | Path | None = None) -> Path:
    """The embedded tiny model `name` (`<family>`, `<family>-vocab<N>`, either with `-tied`), built once into a
    cache folder (seed 0) named by its recipe. `-tied`: embeddings tied to the output head, as Qwen3.5-4B's are.

    `qwen3_5-vocab248320` is the narrow model of the paper-shaped job: the tiny body with
    Qwen3.5-4B's real output vocabulary. The folder name carries a hash of this file and of the
    family descriptions it reads (core/families.py), so a changed recipe builds anew.
    """
    import hashlib
    import os
    import shutil

    root = Path(cache_root or os.environ.get("LT_OPD_CACHE", Path.home() / ".cache" / "lt-opd-ray"))
    from lt_opd_ray.core import families

    recipe = hashlib.sha256(Path(__file__).read_bytes() + Path(families.__file__).read_bytes()).hexdigest()[:12]  # the recipe
    base, tied = (name[: -len("-tied")], True) if name.endswith("-tied") else (name, False)
    family, _, vocab = base.partition("-vocab")
    if family not in FAMILIES or (vocab and not vocab.isdigit()):
        raise ValueError(f"model.path tiny:{name}: expected tiny:<family>[-vocab<N>][-tied], family one of {', '.join(FAMILIES)}")
    target = root / "tiny" / f"{name}-{recipe}"
    if not (target / "config.json").exists():
        staging = target.with_name(target.name + f".tmp{os.getpid()}")
        build_tiny_model(family, staging, vocab_size=int(vocab) if vocab else None, tied=tied)
        try:
            staging.rename(target)  # atomic: a half-built folder never looks complete
        except OSError:  # another process finished first
            shutil.rmtree(staging, ignore_errors=True)
    return target
