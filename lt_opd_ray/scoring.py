"""The teacher role of an update (docs/architecture.md §1, step 2), on one process with the transformers backend."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .microbatch import Sequence, pack
from .models.adapter import QwenVLM
from .models.processor import PromptInputs
from .objective import top_k_log_probs
from .wire import Rollout, TeacherScore


@torch.no_grad()
def teacher_scores(
    teacher: QwenVLM,
    prompts: Mapping[int, PromptInputs] | list[PromptInputs],
    rollouts: list[Rollout],
    top_k: int,
    chunk_size: int,
    token_budget: int = 16384,
) -> list[TeacherScore]:
    """Full-vocabulary log-softmax of the full-token teacher at every response position, compacted to top-k.

    Each prompt's full-token prefix (vision tower, merger and language model) runs once, alone;
    its cache (attention KV and Gated DeltaNet state) is shared by the prompt's responses, which
    continue from it in micro-batches of at most `token_budget` response tokens. Log-probs are
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
        features = teacher.visual_features(prompts[prompt_index])
        full = teacher.reduce(prompts[prompt_index], features, teacher.keep_all(features))
        batch = teacher.pad_batch([full])
        prefix_hidden, cache = teacher.run_language_model(batch, use_cache=True)
        first = prefix_hidden[0, -1:]  # the prompt's last position predicts response token 0
        sequences = [Sequence(i, prompt_index, rollouts[i].response_ids.numel()) for i in indices]
        for micro in pack(sequences, token_budget):
            responses = [rollouts[i] for i in micro.sequences]
            hidden = teacher.continue_hidden(full, cache, 0, batch.attention_mask[0], [r.response_ids for r in responses])
            for i, r, h in zip(micro.sequences, responses, hidden):
                predicting = torch.cat([first, h[:-1]])  # response token j is predicted at position j - 1
                requested = torch.cat([r.student_top_ids, r.response_ids[:, None]], dim=-1).to(h.device)
                ids, logp, requested_logp = top_k_log_probs(predicting, weight, k, chunk_size, requested)
                scores[i] = TeacherScore(top_ids=ids.to(torch.int32).cpu(), top_logp=logp.cpu(), requested_logp=requested_logp.cpu())
    return scores
