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
from lt_opd_ray.models.sampler import Completion, SamplingParams, sample, written_response


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
    written: list[str] | None = None,
) -> list[Rollout]:
    """n responses per prompt at the current budget; selection and sampling are seeded by (seed, update, uid).

    The responses are the student's own, sampled on its reduced prompt; or, with `behaviour` (the frozen
    teacher: sequence_kd, teacher_prefix), sampled by it at full tokens; or, with `written` (one per prompt: the
    rows' responses, sft and fixed_prefix), taken as they are. In the last two, the student's log-probs and
    top-k at budget r are read off its teacher-forced forward on them.
    """
    reduced, full, owners, seeds = [], [], [], []
    for index, (prompt, uid) in enumerate(zip(prompts, uids)):
        features = vlm.visual_features(prompt, with_attention=selector.reads_encoder_attention)
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
    if written is not None:
        completions = student_view(vlm, reduced, [read_written(tokenizer, written[o], uids[o], params) for o in owners], params.top_k_logprobs)
    elif behaviour is not None:
        sampled = sample(behaviour, full, params, seeds, tokenizer)
        completions = student_view(vlm, reduced, [(c.token_ids, c.finish_reason) for c in sampled], params.top_k_logprobs)
    else:
        completions = sample(vlm, reduced, params, seeds, tokenizer)
    return [Rollout.sampled(owner, c, red.selected, red.merge_routes, budget_bps) for owner, red, c in zip(owners, reduced, completions)]


def read_written(tokenizer, text: str | None, uid: str, params: SamplingParams) -> tuple[torch.Tensor, str]:
    """Row `uid`'s own response as tokens (models/sampler.written_response); a problem names the row."""
    if not text:
        raise ValueError(f"row {uid} carries no response to train on")
    try:
        return written_response(tokenizer, text, params)
    except ValueError as exc:
        raise ValueError(f"row {uid}: {exc}: raise it or shorten the response") from None


def student_view(vlm: QwenVLM, reduced: list[ReducedPrompt], responses: list[tuple[torch.Tensor, str]], top_k: int) -> list[Completion]:
    """Responses (token ids, finish reason) as the student sees them on its reduced prompts: its log-prob of each
    token and its top-k ids."""
    hidden = vlm.response_hidden(reduced, [ids for ids, _ in responses])
    viewed = []
    for h, (ids, finish_reason) in zip(hidden, responses):
        log_probs = torch.log_softmax(vlm.lm_head(h).float(), dim=-1)  # [T, V], left where it was computed
        viewed.append(
            Completion(
                token_ids=ids,
                logprobs=log_probs.gather(-1, ids[:, None].to(log_probs.device)).squeeze(-1).cpu(),  # what comes back: [T]
                top_ids=torch.topk(log_probs, min(top_k, log_probs.shape[-1]), dim=-1).indices.cpu(),  # and [T, k]
                finish_reason=finish_reason,
            )
        )
    return viewed
