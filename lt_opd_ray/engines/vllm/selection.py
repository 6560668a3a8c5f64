"""What a request asks of the pruning model (`SelectionRequest`, passed as `mm_processor_kwargs`), checked field by
field before it reaches the model: a bad request is refused by name, never run."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

from lt_opd_ray.core.curriculum import BPS
from lt_opd_ray.core.selectors import SELECTORS

SELECTOR_NAMES = sorted(SELECTORS)  # a selector travels to the model as its index in this list
SPLIT_TOWER_ENV = "LT_OPD_SPLIT_VISION_TOWER"  # set by `lt-opd serve` for a tensor-parallel server: no HiPrune request
MAX_QUERY_IDS = 8192  # a request's query tokens (CDPruner's relevance averages their embeddings)
MAX_K_MIN = 1 << 20
INT64 = (-(1 << 63), (1 << 63) - 1)  # seed and nonce travel to the engine in an int64 tensor


@dataclasses.dataclass(frozen=True)
class SelectionRequest:
    """What a request asks of the pruning model, passed as `mm_processor_kwargs`.

    budget_bps: visual budget r in basis points (10000 = every token); k_min: the
    per-image floor; selector: a name from `lt_opd_ray.core.selectors`; seed: the prompt's
    selection seed (image i uses stable_seed(seed, i), as the adapter does);
    query_ids: the question's token ids (CDPruner's query); nonce: names the request
    when its selections are collected.
    """

    budget_bps: int = BPS
    k_min: int = 1
    selector: str = "cdpruner"
    seed: int = 0
    query_ids: tuple[int, ...] = ()
    nonce: int = 0

    PREFIX = "lt_opd_"

    @classmethod
    def split(cls, kwargs: Mapping[str, object], vocab_size: int) -> tuple[SelectionRequest, dict[str, object]]:
        """(our request, the kwargs meant for the Hugging Face processor). Every setting is checked here, in the
        server's front end, so a bad request is answered 400 naming the field and never reaches the engine."""
        ours = {k[len(cls.PREFIX) :]: v for k, v in kwargs.items() if k.startswith(cls.PREFIX)}
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(ours) - fields)
        if unknown:
            raise ValueError(f"unknown selection setting(s) {[cls.PREFIX + k for k in unknown]}; known: {[cls.PREFIX + f for f in sorted(fields)]}")
        for name, (low, high) in {"budget_bps": (1, BPS), "k_min": (1, MAX_K_MIN), "seed": INT64, "nonce": INT64}.items():
            if name in ours:
                _check_integer(cls.PREFIX + name, ours[name], low, high)
        if "selector" in ours and ours["selector"] not in SELECTOR_NAMES:
            raise ValueError(f"{cls.PREFIX}selector: unknown selector {str(ours['selector'])[:40]!r}; known: {SELECTOR_NAMES}")
        if "selector" in ours and SELECTORS[ours["selector"]].prunes_inside_language_model:
            raise ValueError(f"{cls.PREFIX}selector: {ours['selector']} prunes inside the language model, which vLLM's model runner"
                             " does not (it takes the kept visual tokens before the language model runs): serve with --engine transformers")
        if "selector" in ours and SELECTORS[ours["selector"]].reads_encoder_attention and os.environ.get(SPLIT_TOWER_ENV):
            raise ValueError(f"{cls.PREFIX}selector: {ours['selector']} reads the vision tower's attention, which this server"
                             " splits over tensor-parallel ranks")
        if "query_ids" in ours:
            ids = ours["query_ids"]
            if not isinstance(ids, (list, tuple)) or len(ids) > MAX_QUERY_IDS:
                raise ValueError(f"{cls.PREFIX}query_ids: expected a list of at most {MAX_QUERY_IDS} token ids, got {type(ids).__name__}"
                                 + (f" of {len(ids)}" if isinstance(ids, (list, tuple)) else ""))
            _check_token_ids(f"{cls.PREFIX}query_ids", ids, vocab_size)
            ours["query_ids"] = tuple(ids)
        return cls(**ours), cls.processor_kwargs(kwargs)

    @classmethod
    def processor_kwargs(cls, kwargs: Mapping[str, object]) -> dict[str, object]:
        """The kwargs meant for the Hugging Face processor (ours removed)."""
        return {k: v for k, v in kwargs.items() if not k.startswith(cls.PREFIX)}

    def as_kwargs(self) -> dict[str, object]:
        return {self.PREFIX + f.name: getattr(self, f.name) for f in dataclasses.fields(self)} | {
            self.PREFIX + "query_ids": list(self.query_ids)
        }


def _check_integer(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an integer, got {type(value).__name__} {str(value)[:40]!r}")
    if not low <= value <= high:
        raise ValueError(f"{name}: {value} is outside [{low}, {high}]")


def _check_token_ids(name: str, ids: Sequence, vocab_size: int) -> None:
    """Every entry a Python int in [0, vocab_size): checked by C-level passes (set, min, max); only a bad list is
    walked, to name its first bad entry."""
    if not set(map(type, ids)) <= {int}:  # bools, floats, strings, numpy scalars
        bad = next(i for i, v in enumerate(ids) if type(v) is not int)
        _check_integer(f"{name}[{bad}]", ids[bad], 0, vocab_size - 1)
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(i for i, v in enumerate(ids) if not 0 <= v < vocab_size)
        _check_integer(f"{name}[{bad}]", ids[bad], 0, vocab_size - 1)
