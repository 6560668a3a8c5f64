"""The rollout and teacher roles of an update (rollouts.rollout / scoring.teacher_scores) on the vLLM engine.

Same inputs, same outputs, same seeding scheme: the selection of a prompt is seeded
by (seed, update, uid) and response j by (seed, update, uid, j). The sampled tokens
differ from the transformers backend's (vLLM draws from its own generator), the
selections do not.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from lt_opd_ray.core.seeding import response_seeds, selection_seed
from lt_opd_ray.core.wire import Rollout, TeacherScore
from lt_opd_ray.engines.vllm.engine import VLLMEngine, engine_prompt
from lt_opd_ray.engines.vllm.selection import SelectionRequest
from lt_opd_ray.models.processor import PromptInputs
from lt_opd_ray.models.sampler import SamplingParams


def vllm_rollout(
    engine: VLLMEngine,
    prompts: list[PromptInputs],
    images: list[list],
    uids: list[str],
    selector: str,
    budget_bps: int,
    k_min: int,
    params: SamplingParams,
    n: int,
    seed: int,
    update: int,
) -> list[Rollout]:
    """n responses per prompt at `budget_bps`, pruned inside the engine."""
    engine_prompts, selections, seeds, owners = [], [], [], []
    for index, (prompt, prompt_images, uid) in enumerate(zip(prompts, images, uids)):
        request = SelectionRequest(budget_bps=budget_bps, k_min=k_min, selector=selector, seed=selection_seed(seed, update, uid))
        engine_prompts += [engine_prompt(prompt, prompt_images, engine.video_token_id)] * n  # one clip array: one nonce
        selections += [request] * n
        seeds += response_seeds(seed, update, uid, n)
        owners += [index] * n
    results = engine.generate(engine_prompts, selections, params, seeds)
    return [Rollout.sampled(owner, completion, kept.indices, kept.merge_routes, budget_bps) for owner, (completion, kept) in zip(owners, results)]


def vllm_teacher_scores(
    engine: VLLMEngine, prompts: Mapping[int, PromptInputs], images: Mapping[int, list], rollouts: list[Rollout], top_k: int
) -> list[TeacherScore]:
    """The full-token teacher's top-k and its log-probs at the student's top-k ids and the sampled token."""
    collapsed = {index: engine_prompt(prompts[index], images[index], engine.video_token_id) for index in {r.prompt_index for r in rollouts}}
    engine_prompts = [collapsed[r.prompt_index] for r in rollouts]
    requested = [torch.cat([r.student_top_ids, r.response_ids[:, None]], dim=-1) for r in rollouts]
    scored = engine.score(engine_prompts, [r.response_ids for r in rollouts], requested, top_k)
    return [TeacherScore(top_ids=s.top_ids, top_logp=s.top_logp, requested_logp=s.requested_logp) for s in scored]
