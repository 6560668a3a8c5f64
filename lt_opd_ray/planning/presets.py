"""Built-in model layouts for `lt-opd efficiency --preset` and `lt-opd plan --preset`, when a release's config.json is
not at hand. Each is the config.json subset the calculators read; what was read from a public source and what is
assumed is said above each. Pass the real folder for exact figures."""

from __future__ import annotations

# Qwen3.5-4B.
# Text: the layout of a public Qwen3.5 4B-sized config (hidden 2560, 32 layers with a full-attention
# layer every 4th, head_dim 256, MLP 9216, GDN 16 key / 32 value heads of 128, conv 4, vocabulary
# 248,320). Assumed, not read from the release: 16 query heads and 4 KV heads (4 KV heads is what
# the paper's KV-cache figure implies: 26.59 MB / 32 KiB per token = 811 tokens), and the vision
# tower (24 blocks of width 1024, MLP 4096, patch 16, merge 2, the Qwen3-VL-4B class). Pass the real
# folder (`lt-opd efficiency MODEL_DIR`) for exact figures.
QWEN35_4B = {
    "model_type": "qwen3_5",
    "text_config": {
        "hidden_size": 2560, "intermediate_size": 9216, "num_hidden_layers": 32,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "attn_output_gate": True,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "vocab_size": 248320,
    },
    "vision_config": {
        "depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16, "patch_size": 16,
        "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3, "out_hidden_size": 2560,
    },
}

# Qwen3.5-9B. Text, as public descriptions of the release give it: hidden 4096, 32 layers (a full-attention layer
# every 4th), 16 query / 4 KV heads of 256, MLP 12288, GDN 16 key / 32 value heads of 128, conv 4, vocabulary 248,320.
# Assumed: the vision tower of the Qwen3-VL-8B class (27 blocks of width 1152, MLP 4304, 16 heads, patch 16).
QWEN35_9B = {
    "model_type": "qwen3_5",
    "text_config": {
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "attn_output_gate": True,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "vocab_size": 248320,
    },
    "vision_config": {
        "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "patch_size": 16,
        "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3, "out_hidden_size": 4096,
    },
}

# GLM-4.6V-Flash (9B; model_type glm4v, the GLM-4.1V-9B layout): transformers' Glm4vConfig defaults, which document
# GLM-4.1V-9B: text hidden 4096, 40 layers, 32 query / 2 KV heads of 128, MLP 13696, vocabulary 151,552; vision 24
# blocks of width 1536, 12 heads, patch 14, merge 2, a projector of width 13696 into 4096. Assumed: that 4.6V-Flash
# keeps 4.1V-9B's shapes (both are 9B glm4v releases).
GLM46V_FLASH = {
    "model_type": "glm4v",
    "text_config": {
        "hidden_size": 4096, "intermediate_size": 13696, "num_hidden_layers": 40,
        "num_attention_heads": 32, "num_key_value_heads": 2, "vocab_size": 151552,
    },
    "vision_config": {
        "depth": 24, "hidden_size": 1536, "intermediate_size": 13696, "num_heads": 12, "patch_size": 14,
        "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3, "out_hidden_size": 4096,
    },
}

PRESETS = {"qwen3.5-4b": QWEN35_4B, "qwen3.5-9b": QWEN35_9B, "glm-4.6v-flash": GLM46V_FLASH}


def preset_named_by(model_path: str) -> str | None:
    """The preset a model folder or hub id names by its last part (models/Qwen3.5-4B, Qwen/Qwen3.5-4B: qwen3.5-4b)."""
    name = model_path.rstrip("/").rsplit("/", 1)[-1].lower()
    return name if name in PRESETS else None
