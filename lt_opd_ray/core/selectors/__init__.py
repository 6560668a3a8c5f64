"""Visual-token selectors behind one interface (`Selector.select`)."""

from lt_opd_ray.core.selectors.base import SelectionInput, Selector
from lt_opd_ray.core.selectors.cdpruner import CDPruner
from lt_opd_ray.core.selectors.divprune import DivPrune
from lt_opd_ray.core.selectors.simple import RandomSelector, UniformGridSelector

SELECTORS: dict[str, type[Selector]] = {
    cls.name: cls for cls in (CDPruner, DivPrune, RandomSelector, UniformGridSelector)
}


def build_selector(name: str) -> Selector:
    try:
        return SELECTORS[name]()
    except KeyError:
        raise ValueError(f"unknown selector {name!r}; known: {sorted(SELECTORS)}") from None


__all__ = ["SELECTORS", "SelectionInput", "Selector", "build_selector"]
