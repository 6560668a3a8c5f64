"""Visual-token selectors behind one interface (`Selector.select`)."""

from .base import SelectionInput, Selector
from .cdpruner import CDPruner
from .divprune import DivPrune
from .simple import RandomSelector, UniformGridSelector

SELECTORS: dict[str, type[Selector]] = {
    cls.name: cls for cls in (CDPruner, DivPrune, RandomSelector, UniformGridSelector)
}


def build_selector(name: str) -> Selector:
    try:
        return SELECTORS[name]()
    except KeyError:
        raise ValueError(f"unknown selector {name!r}; known: {sorted(SELECTORS)}") from None


__all__ = ["SELECTORS", "SelectionInput", "Selector", "build_selector"]
