"""What every section of the job schema shares: the strict base model and the bounds on every count and size."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# Upper bounds on counts and sizes: far above any real job, low enough that a typo (an extra 000) is named by
# `validate` instead of starting. What a machine or cluster can hold is checked at preflight (runtime/resources.py).
MAX_ACTORS_PER_POOL = 4096  # rollout workers, teacher replicas, learner ranks
MAX_RESPONSES_PER_PROMPT = 1024  # sampling.n
MAX_PROMPTS_PER_STEP = 65_536
MAX_SEQUENCE_TOKENS = 262_144  # response lengths and token budgets: Qwen3.5's context length
MAX_TOP_K = 1024  # the support of the divergence; the paper's is 100
MAX_UPDATES = 1_000_000  # curriculum lengths and intervals, in updates
MAX_DYNAMIC_SAMPLING_ROUNDS = 64  # reward.dynamic_sampling_rounds: each round waits for a whole generation
MAX_PIXELS = 89_478_485  # PIL's decompression-bomb limit: no larger image decodes
MAX_ACTOR_CPUS, MAX_ACTOR_GPUS = 1024.0, 64.0
MAX_WAIT_S = 7 * 24 * 3600.0  # a week: any longer wait is a hang


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True, allow_inf_nan=False)


def check_data_spec(spec: str) -> str:
    """A generated form (`synthetic:<n>[@<W>x<H>]`, `toy-<task>[-test]:<n>`) checked for shape and task; a file or
    folder is read by `validate` and at preflight, with its own named errors."""
    from lt_opd_ray.sources.resolve import generated_rows

    generated_rows(spec)
    return spec
