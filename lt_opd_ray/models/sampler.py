"""KV-cached batched sampling on reduced prompts (the transformers rollout backend).

Prompts are left-padded; the padding is masked for the full-attention layers and
zeroed for the linear-attention (Gated DeltaNet) layers, so each row decodes as it
would alone. Every row draws from its own seeded generator, so a sample's
response does not depend on which other samples share its batch or worker.

Recorded per response token: the sampled id, its log-prob under the model's
distribution (the learner recomputes exactly this quantity, so the truncated
importance weight is exp(0) = 1 before any update), and the model's top-k ids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lt_opd_ray.models.adapter import PaddedBatch, QwenVLM, ReducedPrompt


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    top_k_logprobs: int | None = 100  # 0: the sampled token's log-prob only; None: no log-probs (answers whose text alone is read)
    stop: tuple[str, ...] = ("</answer>",)
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class Completion:
    token_ids: torch.Tensor  # [T] long, ends with EOS / stop string unless cut by max_new_tokens
    logprobs: torch.Tensor | None  # [T] fp32: log p(sampled token) under the model; None where none were asked
    top_ids: torch.Tensor | None  # [T, k] long: the model's top-k ids at each position; None where none were asked
    finish_reason: str = field(default="length")  # eos | stop | length
    selected: list[torch.Tensor] | None = None  # per visual unit, what a selection inside the language model kept (FastV)


def written_response(tokenizer, text: str, params: SamplingParams) -> tuple[torch.Tensor, str]:
    """A response someone wrote (a row's `response`) as the token ids and finish reason a sampled one would have: it
    ends at a stop string where its text does, otherwise the end-of-sequence token is appended. One longer than
    max_new_tokens is a ValueError: sampling would cut it, but training on a cut response teaches the cut."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    finish = "stop" if any(text.rstrip().endswith(s) for s in params.stop) else "eos"
    if finish == "eos":
        ids = [*ids, params.eos_token_ids[0]]
    if len(ids) > params.max_new_tokens:
        raise ValueError(f"the response is {len(ids)} tokens, above sampling.max_new_tokens ({params.max_new_tokens})")
    return torch.tensor(ids, dtype=torch.long), finish


def choose_tokens(log_probs: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of `log_probs` [B, V] under temperature and nucleus (top-p) sampling, on their device,
    given one uniform in [0, 1) per row (float64 [B], from the row's own generator): its inverse CDF. One uniform a
    token: torch.multinomial draws an exponential per vocabulary entry (benchmarks/bench_sampler.py). A token of zero
    mass owns an empty interval, never drawn. On a GPU every row at once; on the CPU a row at a time, whose float64
    CDF (2 MB at V = 248,320) stays in cache: 7x faster there than all rows at once, the same draws."""
    if params.greedy:
        return log_probs.argmax(-1)
    if log_probs.device.type == "cpu" and len(log_probs) > 1:
        return torch.cat([_inverse_cdf(row[None], params, u[None]) for row, u in zip(log_probs, uniforms)])
    return _inverse_cdf(log_probs, params, uniforms)


def _inverse_cdf(log_probs: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(log_probs / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        outside = torch.cumsum(sorted_probs, -1) - sorted_probs >= params.top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(outside, 0.0))
    cdf = torch.cumsum(probs, -1, dtype=torch.float64)
    u = uniforms.to(cdf.device)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True)[:, 0].clamp(max=cdf.shape[-1] - 1)  # u rounded up to cdf[-1]: the last token


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


class PlainDecoding:
    """Prefill and decoding of left-padded prompts whose visual tokens were chosen before the language model: the
    model's own forward over the batch, then one token a row a step from its cache."""

    selected: tuple = ()  # nothing chosen inside the language model

    def __init__(self, vlm: QwenVLM, prompts: list[ReducedPrompt]):
        self.vlm, self.prompts = vlm, prompts

    def prefill(self) -> torch.Tensor:
        """[B, D]: the final hidden state at each row's last prompt token."""
        batch = self.vlm.pad_batch(self.prompts)
        hidden, self.cache = self.vlm.run_language_model(batch, use_cache=True)
        self.attention_mask = batch.attention_mask
        self.lengths = batch.attention_mask.sum(-1)  # real tokens per row, for the seq_index channel
        return hidden[:, -1]

    def step(self, ids: list[int], step: int) -> torch.Tensor:
        """[B, D]: the final hidden state after each row's next token `ids[b]` (the response's `step`-th, from 0)."""
        vlm, rows, device = self.vlm, len(ids), self.vlm.device
        self.attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones(rows, 1)], dim=1)
        position_ids = torch.empty(4, rows, 1, dtype=torch.long, device=device)
        position_ids[0, :, 0] = self.lengths + step  # seq_index continues after the reduced prompt
        position_ids[1:, :, 0] = torch.tensor([p.next_position + step for p in self.prompts], device=device)  # full-sequence M-RoPE
        step_batch = PaddedBatch(
            inputs_embeds=vlm.embed_tokens(torch.tensor(ids, dtype=torch.long))[:, None],
            attention_mask=self.attention_mask,
            position_ids=position_ids,
            visual_pos_masks=torch.zeros(rows, 1, dtype=torch.bool, device=device),
            deepstack=None,
        )
        hidden, self.cache = vlm.run_language_model(step_batch, past_key_values=self.cache, use_cache=True)
        return hidden[:, -1]


def decoding_of(vlm: QwenVLM, prompts: list[ReducedPrompt]):
    """The language-model side of sampling `prompts`: pruned before it, or inside it (models/lm_pruning.py)."""
    if any(p.inside is not None for p in prompts):
        from lt_opd_ray.models.lm_pruning import PrunedInside

        return PrunedInside(vlm, prompts)
    return PlainDecoding(vlm, prompts)


@torch.no_grad()
def sample(
    vlm: QwenVLM,
    prompts: list[ReducedPrompt],
    params: SamplingParams,
    seeds: list[int],
    tokenizer,
    on_token: Callable[[int, int], None] | None = None,
    before_forward: Callable[[], None] | None = None,
) -> list[Completion]:
    """Sample one response per prompt (repeat a prompt n times for n responses, with distinct seeds). `on_token(row,
    token)` is called with each token as it is drawn (a server streams them); `before_forward()` before each forward
    pass of the language model (a server's deadline: what it raises ends the sampling)."""
    before_forward = before_forward or (lambda: None)
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    stopper = _StopChecker(tokenizer, params.stop)
    eos = set(params.eos_token_ids)
    decoding = decoding_of(vlm, prompts)
    before_forward()
    last_hidden = decoding.prefill()
    rows = len(prompts)
    tokens: list[list[int]] = [[] for _ in range(rows)]
    logprobs: list[list[float]] = [[] for _ in range(rows)]
    tops: list[list[torch.Tensor]] = [[] for _ in range(rows)]
    finish = ["length"] * rows
    done = [False] * rows
    top_k = min(params.top_k_logprobs or 0, vlm.lm_head.weight.shape[0])
    for step in range(params.max_new_tokens):
        # the step stays on the model's device: only each row's token, its log-prob and its top-k ids come to the host
        log_probs = torch.log_softmax(vlm.lm_head(last_hidden).float(), dim=-1)  # [B, V]
        uniforms = torch.tensor([0.0 if done[b] or params.greedy else float(torch.rand((), generator=generators[b], dtype=torch.float64))
                                 for b in range(rows)], dtype=torch.float64)  # a finished row's generator is not advanced
        chosen = choose_tokens(log_probs, params, uniforms)
        chosen_logp = log_probs.gather(-1, chosen[:, None])[:, 0]
        top_ids = torch.topk(log_probs, top_k, dim=-1).indices.cpu()
        chosen, chosen_logp = chosen.tolist(), chosen_logp.tolist()
        next_ids = []
        for b in range(rows):
            if done[b]:
                next_ids.append(tokens[b][-1])  # keeps the batch shape; its outputs are ignored
                continue
            token = chosen[b]
            tokens[b].append(token)
            if on_token is not None:
                on_token(b, token)
            logprobs[b].append(chosen_logp[b])
            tops[b].append(top_ids[b])
            next_ids.append(token)
            if token in eos:
                done[b], finish[b] = True, "eos"
            elif stopper.hit(tokens[b]):
                done[b], finish[b] = True, "stop"
        if all(done) or step == params.max_new_tokens - 1:
            break
        before_forward()
        last_hidden = decoding.step(next_ids, step)
    return [
        Completion(
            token_ids=torch.tensor(tokens[b], dtype=torch.long),
            logprobs=torch.tensor(logprobs[b], dtype=torch.float32),
            top_ids=torch.stack(tops[b]) if tops[b] else torch.zeros(0, top_k, dtype=torch.long),
            finish_reason=finish[b],
            selected=decoding.selected[b] if decoding.selected else None,
        )
        for b in range(rows)
    ]
