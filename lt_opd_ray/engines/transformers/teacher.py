"""The teacher role of an update (docs/architecture.md §1, step 2), on one process with the transformers backend."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lt_opd_ray.core.microbatch import Sequence, pack
from lt_opd_ray.core.objective import top_k_log_probs
from lt_opd_ray.core.wire import Rollout, TeacherScore
from lt_opd_ray.models.adapter import QwenVLM, ReducedPrompt
from lt_opd_ray.models.processor import PromptInputs


@dataclass(frozen=True)
class TeacherPrefix:
    """A prompt's full-token prefix, run once by the teacher: what each of the prompt's responses continues from.
    It needs no rollouts, so a teacher service can compute it while the rollouts are still sampled."""

    full: ReducedPrompt  # the prompt with every visual token
    mask: torch.Tensor  # its attention mask row
    cache: object  # attention KV and Gated DeltaNet state after the prompt
    first: torch.Tensor  # [1, H] the prompt's last hidden row: it predicts response token 0


@torch.no_grad()
def teacher_prefix(teacher: QwenVLM, prompt: PromptInputs) -> TeacherPrefix:
    """The vision tower, merger and language model over the full-token prompt, alone."""
    features = teacher.visual_features(prompt)
    full = teacher.reduce(prompt, features, teacher.keep_all(features))
    batch = teacher.pad_batch([full])
    prefix_hidden, cache = teacher.run_language_model(batch, use_cache=True)
    return TeacherPrefix(full, batch.attention_mask[0], cache, prefix_hidden[0, -1:])


@torch.no_grad()
def teacher_scores(
    teacher: QwenVLM,
    prompts: Mapping[int, PromptInputs] | list[PromptInputs],
    rollouts: list[Rollout],
    top_k: int,
    chunk_size: int,
    token_budget: int = 16384,
    prefixes: Mapping[int, TeacherPrefix] | None = None,
    packed: bool = False,
) -> list[TeacherScore]:
    """Full-vocabulary log-softmax of the full-token teacher at every response position, compacted to top-k.

    Each prompt's full-token prefix (`teacher_prefix`; taken from `prefixes` when it was run ahead, else run
    here, and then `prompts` need not hold that prompt) runs once, alone; its cache is shared by the prompt's
    responses, which continue from it in micro-batches of at most `token_budget` response tokens: right-padded rows
    (responses x longest), or one packed row (`packed`: the responses end to end, each continuing the prefix alone). Log-probs are
    computed at response positions only. A prompt's scores depend on its own rollouts only, never
    on which other prompts share the call, so the teacher service may batch groups as they arrive
    and the update stays deterministic (a long prefix fills a forward on its own).
    """
    weight = teacher.lm_head.weight
    k = min(top_k, weight.shape[0])
    scores: list[TeacherScore | None] = [None] * len(rollouts)
    by_prompt: dict[int, list[int]] = {}
    for i, r in enumerate(rollouts):
        by_prompt.setdefault(r.prompt_index, []).append(i)
    for prompt_index, indices in by_prompt.items():
        prefix = (prefixes or {}).get(prompt_index) or teacher_prefix(teacher, prompts[prompt_index])
        sequences = [Sequence(i, prompt_index, rollouts[i].response_ids.numel()) for i in indices]
        for micro in pack(sequences, token_budget, packed):
            responses = [rollouts[i] for i in micro.sequences]
            hidden = teacher.continue_hidden(prefix.full, prefix.cache, 0, prefix.mask, [r.response_ids for r in responses], packed)
            for i, r, h in zip(micro.sequences, responses, hidden):
                predicting = torch.cat([prefix.first, h[:-1]])  # response token j is predicted at position j - 1
                requested = torch.cat([r.student_top_ids, r.response_ids[:, None]], dim=-1).to(h.device)
                ids, logp, requested_logp = top_k_log_probs(predicting, weight, k, chunk_size, requested)
                scores[i] = TeacherScore(top_ids=ids.to(torch.int32).cpu(), top_logp=logp.cpu(), requested_logp=requested_logp.cpu())
    return scores
