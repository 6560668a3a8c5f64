"""Visual-token selectors behind one interface (`Selector.select`)."""

from lt_opd_ray.core.selectors.base import EncoderAttention, SelectionInput, Selector
from lt_opd_ray.core.selectors.cdpruner import CDPruner
from lt_opd_ray.core.selectors.divprune import DivPrune
from lt_opd_ray.core.selectors.fastv import FastV
from lt_opd_ray.core.selectors.hiprune import HiPrune
from lt_opd_ray.core.selectors.simple import RandomSelector, UniformGridSelector

SELECTORS: dict[str, type[Selector]] = {
    cls.name: cls for cls in (CDPruner, DivPrune, FastV, HiPrune, RandomSelector, UniformGridSelector)
}


SCOPES = ("image", "clip", "prompt")  # what one budget covers: each image's (each frame's) tokens, a clip's, or the prompt's


def build_selector(name: str, scope: str = "image") -> Selector:
    """Selector `name` applied per image and per temporal patch of a clip (`scope` image: each keeps
    k_i = tokens_to_keep(N_i)), per image and per whole clip (`scope` clip), or over the prompt (`scope` prompt:
    k = tokens_to_keep(sum N_i) chosen from the union of its tokens; models/adapter.py)."""
    if scope not in SCOPES:
        raise ValueError(f"unknown selection scope {scope!r}; known: {', '.join(SCOPES)}")
    try:
        selector = SELECTORS[name]()
    except KeyError:
        raise ValueError(f"unknown selector {name!r}; known: {sorted(SELECTORS)}") from None
    if selector.reads_encoder_attention and scope != "image":
        raise ValueError(f"{name} selects each image on its own grid (its buffers are grid neighbours): selection scope {scope} refused; use image")
    selector.scope = scope
    return selector


__all__ = ["SCOPES", "SELECTORS", "EncoderAttention", "SelectionInput", "Selector", "build_selector"]
