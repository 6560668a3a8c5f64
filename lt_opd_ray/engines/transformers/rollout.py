"""The rollout role of an update (docs/architecture.md §1, step 1), on one process with the transformers backend.

n responses per prompt at the budget, with the selection and sampling seeded by
(seed, update, sample uid, response index); what the learner replays is recorded
in each `wire.Rollout`.
"""

from __future__ import annotations

import torch

from lt_opd_ray.core.seeding import response_seeds, selection_seed
from lt_opd_ray.core.selectors import Selector
from lt_opd_ray.core.wire import Rollout
from lt_opd_ray.models.adapter import QwenVLM, ReducedPrompt
from lt_opd_ray.models.processor import PromptInputs
from lt_opd_ray.models.sampler import Completion, SamplingParams, sample


@torch.no_grad()
def rollout(
    vlm: QwenVLM,
    tokenizer,
    prompts: list[PromptInputs],
    uids: list[str],
    selector: Selector,
    budget_bps: int,
    k_min: int,
    params: SamplingParams,
    n: int,
    seed: int,
    update: int,
    behaviour: QwenVLM | None = None,
) -> list[Rollout]:
    """n responses per prompt at the current budget; selection and sampling are seeded by (seed, update, uid).

    With `behaviour` (the frozen teacher; the fixed-prefix and SFT ablations) the
    responses are sampled by it at full tokens, and the student's log-probs and
    top-k at budget r are read off its teacher-forced forward on them.
    """
    reduced, full, owners, seeds = [], [], [], []
    for index, (prompt, uid) in enumerate(zip(prompts, uids)):
        features = vlm.visual_features(prompt)
        selected = vlm.select(prompt, features, selector, budget_bps, k_min, seed=selection_seed(seed, update, uid))
        prompt_reduced = vlm.reduce(prompt, features, selected)
        prompt_full = None
        if behaviour is not None:
            behaviour_features = behaviour.visual_features(prompt)
            prompt_full = behaviour.reduce(prompt, behaviour_features, behaviour.keep_all(behaviour_features))
        reduced += [prompt_reduced] * n
        full += [prompt_full] * n
        owners += [index] * n
        seeds += response_seeds(seed, update, uid, n)
    if behaviour is None:
        completions = sample(vlm, reduced, params, seeds, tokenizer)
    else:
        completions = student_view(vlm, reduced, sample(behaviour, full, params, seeds, tokenizer), params.top_k_logprobs)
    return [Rollout.sampled(owner, c, red.selected, red.merge_routes, budget_bps) for owner, red, c in zip(owners, reduced, completions)]


def student_view(vlm: QwenVLM, reduced: list[ReducedPrompt], completions: list[Completion], top_k: int) -> list[Completion]:
    """The same responses with the student's log-prob of each token and its top-k ids, on its reduced prompts."""
    hidden = vlm.response_hidden(reduced, [c.token_ids for c in completions])
    viewed = []
    for h, c in zip(hidden, completions):
        log_probs = torch.log_softmax(vlm.lm_head(h).float(), dim=-1).cpu()  # [T, V]
        viewed.append(
            Completion(
                token_ids=c.token_ids,
                logprobs=log_probs.gather(-1, c.token_ids[:, None]).squeeze(-1),
                top_ids=torch.topk(log_probs, min(top_k, log_probs.shape[-1]), dim=-1).indices,
                finish_reason=c.finish_reason,
            )
        )
    return viewed
