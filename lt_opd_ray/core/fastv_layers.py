"""Where FastV prunes in a language model (core/selectors/fastv.py): torch-free, so `lt-opd validate` and the
efficiency calculator read it from a config.json without loading a model.

The scoring layer is K - 1 (FASTV_LAYER = K = 2, its release's); where the language model mixes in linear-attention
layers (Qwen3.5's Gated DeltaNet, which has no attention weights to rank by), the first full-attention layer at or
after K - 1 (Qwen3.5-4B: layer 3 of 32, so its layers 4-31 see the kept tokens). A language model with no layer after
it has nothing to prune in: refused.
"""

from __future__ import annotations

FASTV_LAYER = 2  # K: the release's default; layers 0 .. K-1 see every visual token


def layer_types(config) -> list[str]:
    """Each decoder layer's kind, from a text config object or a parsed config.json (its text_config where it has one);
    every layer full attention where it names none."""
    if isinstance(config, dict):
        text = config.get("text_config", config)
        return list(text.get("layer_types") or ["full_attention"] * text["num_hidden_layers"])
    return list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)


def scoring_layer(config) -> int:
    """0-based: the layer whose attention ranks the visual tokens; pruning follows it. A ValueError where no such layer
    has a layer after it."""
    types = layer_types(config)
    index = next((i for i in range(FASTV_LAYER - 1, len(types)) if types[i] == "full_attention"), None)
    if index is None:
        raise ValueError(f"fastv: the language model has no full-attention layer at or after layer {FASTV_LAYER - 1} to rank visual tokens by")
    if index + 1 >= len(types):
        raise ValueError(f"fastv: the language model has {len(types)} layers and FastV ranks at layer {index} (0-based): no layer"
                         " after it sees the pruned prompt")
    return index
