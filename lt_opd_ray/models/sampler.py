"""KV-cached batched sampling on reduced prompts (the transformers rollout backend).

Prompts are left-padded; the padding is masked for the full-attention layers and
zeroed for the linear-attention (Gated DeltaNet) layers, so each row decodes as it
would alone. Every row's uniforms come from its own seeded generator and each step
draws the whole batch's tokens at once from them (inverse CDF, `choose`), so a
sample's response does not depend on which other samples share its batch or worker.

Recorded per response token: the sampled id, its log-prob under the model's
distribution (the learner recomputes exactly this quantity, so the truncated
importance weight is exp(0) = 1 before any update), and the model's top-k ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .adapter import PaddedBatch, QwenVLM, ReducedPrompt


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    top_k_logprobs: int = 100
    stop: tuple[str, ...] = ("</answer>",)
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class Completion:
    token_ids: torch.Tensor  # [T] long, ends with EOS / stop string unless cut by max_new_tokens
    logprobs: torch.Tensor  # [T] fp32: log p(sampled token) under the model
    top_ids: torch.Tensor  # [T, k] long: the model's top-k ids at each position
    finish_reason: str = field(default="length")  # eos | stop | length


def choose(log_probs: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row from log-probs [B, V] under temperature and nucleus (top-p) sampling, by inverse CDF: row b
    takes the first id whose cumulative probability exceeds uniforms[b] (in [0, 1)) x the row's total mass. Each row's
    draw depends only on its own log-probs and uniform, never on the other rows of the batch."""
    if params.greedy:
        return torch.argmax(log_probs, dim=-1)
    probs = torch.softmax(log_probs / params.temperature, dim=-1)
    order = None
    if params.top_p < 1.0:
        probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        probs.masked_fill_(torch.cumsum(probs, -1) - probs >= params.top_p, 0.0)
    cumulative = torch.cumsum(probs, dim=-1)
    total = cumulative[:, -1:].contiguous()
    picked = torch.searchsorted(cumulative, uniforms[:, None] * total, right=True)
    # u x total can round up to the total itself: the last id with mass is where the cumulative sum first reaches it
    picked = torch.minimum(picked, torch.searchsorted(cumulative, total))
    return picked[:, 0] if order is None else order.gather(1, picked)[:, 0]


class _StopChecker:
    """Finds stop strings in the tail of a response without decoding it all each step."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.window = max((len(tokenizer(s, add_special_tokens=False)["input_ids"]) for s in stop), default=0) + 2

    def hit(self, ids: list[int]) -> bool:
        if not self.stop:
            return False
        tail = self.tokenizer.decode(ids[-self.window :])
        return any(s in tail for s in self.stop)


@torch.no_grad()
def sample(
    vlm: QwenVLM,
    prompts: list[ReducedPrompt],
    params: SamplingParams,
    seeds: list[int],
    tokenizer,
) -> list[Completion]:
    """Sample one response per prompt (repeat a prompt n times for n responses, with distinct seeds)."""
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    # every row's uniforms come from its own seed, drawn up front: one per decode step
    uniforms = torch.stack([torch.rand(params.max_new_tokens, generator=torch.Generator().manual_seed(s)) for s in seeds])
    stopper = _StopChecker(tokenizer, params.stop)
    eos = torch.tensor(sorted(params.eos_token_ids), dtype=torch.long)
    batch = vlm.pad_batch(prompts)
    hidden, cache = vlm.run_language_model(batch, use_cache=True)
    last_hidden = hidden[:, -1]
    lengths = batch.attention_mask.sum(-1)  # real tokens per row, for the seq_index channel
    attention_mask = batch.attention_mask
    rows = len(prompts)
    top_k = min(params.top_k_logprobs, vlm.lm_head.weight.shape[0])
    device = vlm.device
    next_positions = torch.tensor([p.next_position for p in prompts], device=device)  # full-sequence M-RoPE
    steps_tokens, steps_logprobs, steps_tops = [], [], []  # per step: [B] ids, [B] log-probs, [B, k] top ids
    response_lengths = torch.full((rows,), params.max_new_tokens, dtype=torch.long)
    finish = ["length"] * rows
    running = torch.ones(rows, dtype=torch.bool)
    for step in range(params.max_new_tokens):
        log_probs = torch.log_softmax(vlm.lm_head(last_hidden).float(), dim=-1).cpu()  # [B, V]
        token = choose(log_probs, params, uniforms[:, step])
        if steps_tokens:  # a finished row keeps the batch shape by repeating its last token; its outputs are ignored
            token = torch.where(running, token, steps_tokens[-1])
        steps_tokens.append(token)
        steps_logprobs.append(log_probs.gather(1, token[:, None])[:, 0])
        steps_tops.append(torch.topk(log_probs, top_k, dim=-1).indices)
        ended = running & torch.isin(token, eos)
        for b in ended.nonzero()[:, 0].tolist():
            finish[b] = "eos"
        if params.stop:  # stop strings are found in the decoded tail of each row still running
            tails = torch.stack(steps_tokens[-stopper.window :], 1).tolist()
            for b in (running & ~ended).nonzero()[:, 0].tolist():
                if stopper.hit(tails[b]):
                    ended[b], finish[b] = True, "stop"
        response_lengths[ended] = step + 1
        running &= ~ended
        if not running.any() or step == params.max_new_tokens - 1:
            break
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(rows, 1)], dim=1)
        position_ids = torch.empty(4, rows, 1, dtype=torch.long, device=device)
        position_ids[0, :, 0] = lengths + step  # seq_index continues after the reduced prompt
        position_ids[1:, :, 0] = next_positions + step
        step_batch = PaddedBatch(
            inputs_embeds=vlm.embed_tokens(token.to(device))[:, None],
            attention_mask=attention_mask,
            position_ids=position_ids,
            visual_pos_masks=torch.zeros(rows, 1, dtype=torch.bool, device=device),
            deepstack=None,
        )
        hidden, cache = vlm.run_language_model(step_batch, past_key_values=cache, use_cache=True)
        last_hidden = hidden[:, -1]
    tokens, logprobs, tops = torch.stack(steps_tokens, 1), torch.stack(steps_logprobs, 1), torch.stack(steps_tops, 1)
    return [
        Completion(
            token_ids=tokens[b, : response_lengths[b]].clone(),
            logprobs=logprobs[b, : response_lengths[b]].clone(),
            top_ids=tops[b, : response_lengths[b]].clone(),
            finish_reason=finish[b],
        )
        for b in range(rows)
    ]
