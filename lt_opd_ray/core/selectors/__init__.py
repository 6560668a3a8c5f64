"""Visual-token selectors behind one interface (`Selector.select`)."""

from lt_opd_ray.core.selectors.base import SelectionInput, Selector
from lt_opd_ray.core.selectors.cdpruner import CDPruner
from lt_opd_ray.core.selectors.divprune import DivPrune
from lt_opd_ray.core.selectors.simple import RandomSelector, UniformGridSelector

SELECTORS: dict[str, type[Selector]] = {
    cls.name: cls for cls in (CDPruner, DivPrune, RandomSelector, UniformGridSelector)
}


SCOPES = ("image", "prompt")  # what one budget covers: each image's tokens, or the union of a prompt's images' tokens


def build_selector(name: str, scope: str = "image") -> Selector:
    """Selector `name` applied per image (`scope` image: each image keeps k_i = tokens_to_keep(N_i)) or over the
    prompt (`scope` prompt: k = tokens_to_keep(sum N_i) chosen from the union of its images' tokens; models/adapter.py)."""
    if scope not in SCOPES:
        raise ValueError(f"unknown selection scope {scope!r}; known: {', '.join(SCOPES)}")
    try:
        selector = SELECTORS[name]()
    except KeyError:
        raise ValueError(f"unknown selector {name!r}; known: {sorted(SELECTORS)}") from None
    selector.scope = scope
    return selector


__all__ = ["SCOPES", "SELECTORS", "SelectionInput", "Selector", "build_selector"]
