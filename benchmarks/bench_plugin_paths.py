"""The vLLM plugin's per-request paths: the Python loops they had against the tensor code they run now, in one run.

- M-RoPE recompute (`PruningModelMixin.recompute_mrope_positions`), one image of N merged tokens of
  which k are kept, after ~84 text tokens: before, every kept slot walked back to its image's start
  with 0-d tensor comparisons (O(k^2) Python steps; the teacher keeps k = N); now a running maximum.
- The engine prompt (`engine_prompt`): collapsing the image's run of N placeholders to one token.
- Reading vLLM's flat logprobs (`_sampled_and_top` / `flat_rows`): T positions x (1 + k) entries;
  before, a dict per position sorted by rank; now one gather over the flat lists.

The "before" functions below are the previous implementations, kept here only as the baseline.

    python benchmarks/bench_plugin_paths.py
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from lt_opd_ray.engines.vllm.engine import _sampled_and_top, engine_prompt
from lt_opd_ray.engines.vllm.models import POSITION_CHANNELS, PruningModelMixin
from lt_opd_ray.models.processor import IMAGE, PromptInputs

IMAGE_ID, START_ID, TEXT = 7, 6, 84


def best(run, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        run()
        times.append(time.perf_counter() - begin)
    return min(times)


# ------------------------------------------------------------------------------------------ before
def mrope_before(image_token_id, input_ids, multimodal_embeddings, mrope_positions, num_computed_tokens):
    ids = torch.as_tensor(input_ids).cpu()
    positions = mrope_positions.clone()
    slots = (ids == image_token_id).nonzero().flatten()
    slots = slots[slots >= num_computed_tokens]
    cleaned, used = [], 0
    for rows in multimodal_embeddings:
        count = rows.shape[0]
        offsets = rows[:, -POSITION_CHANNELS:].round().long().T.cpu()
        for j, slot in enumerate(slots[used : used + count].tolist()):
            run_start = slot
            while run_start > 0 and ids[run_start - 1] == image_token_id:
                run_start -= 1
            base = positions[0, run_start - 1] + 1
            positions[:, slot] = base + offsets[:, j].to(positions.device)
        used += count
        cleaned.append(rows[:, :-POSITION_CHANNELS])
    return cleaned, positions, int(positions.max()) + 1 - len(ids)


def engine_prompt_before(prompt: PromptInputs) -> list[int]:
    ids, types = prompt.input_ids.tolist(), prompt.mm_token_type_ids.tolist()
    return [tok for i, (tok, kind) in enumerate(zip(ids, types)) if kind != IMAGE or i == 0 or types[i - 1] != IMAGE]


def sampled_and_top_before(flat, tokens: list[int], k: int):
    def ranked(row):
        start, end = flat.start_indices[row], flat.end_indices[row]
        by_rank = {}
        for token, logprob, rank in zip(flat.token_ids[start:end], flat.logprobs[start:end], flat.ranks[start:end]):
            if rank is not None and rank <= k:
                by_rank.setdefault(rank, (token, logprob))
        return [by_rank[r] for r in sorted(by_rank)]

    logprobs, top_ids = [], []
    for row, token in enumerate(tokens):
        logprobs.append(flat.logprobs[flat.start_indices[row]])
        top_ids.append([t for t, _ in ranked(row)])
    return torch.tensor(logprobs), torch.tensor(top_ids).reshape(len(tokens), k)


# ------------------------------------------------------------------------------------------ inputs
def mrope_inputs(n: int, k: int):
    side = int(n**0.5) + 1
    ids = [1] * TEXT + [START_ID] + [IMAGE_ID] * k + [8] + [2] * 20
    offsets = torch.tensor([[0, i // side, i % side] for i in sorted(torch.randperm(n)[:k].tolist())], dtype=torch.float32)
    rows = torch.cat([torch.randn(k, 64), offsets], dim=1)
    positions = torch.arange(len(ids)).expand(3, -1).clone()
    return ids, [rows], positions


def flat_logprobs(rows: int, k: int):
    from vllm.logprobs import FlatLogprobs

    flat, tokens = FlatLogprobs(), []
    for _ in range(rows):
        ids = torch.randint(0, 248320, (k + 1,)).tolist()
        tokens.append(ids[0])
        flat.append_fast(ids, torch.randn(k + 1).tolist(), iter([k + 7] + list(range(1, k + 1))), [None] * (k + 1))
    return flat, tokens


def main() -> None:
    model = SimpleNamespace(config=SimpleNamespace(image_token_id=IMAGE_ID))
    after = PruningModelMixin.recompute_mrope_positions.__get__(model)
    print(f"== M-RoPE recompute: one image of N merged tokens, k kept, after {TEXT} text tokens; best of 3, {torch.get_num_threads()} threads")
    print("| N | k | before (per-slot walk) ms | after (tensor) ms | speed-up |")
    print("|---|---|---|---|---|")
    for n in (728, 980):
        for k in sorted({37, 182, 728, n}):
            if k > n:
                continue
            ids, rows, positions = mrope_inputs(n, k)
            old = mrope_before(IMAGE_ID, ids, rows, positions, 0)
            new = after(ids, rows, positions, 0)
            assert torch.equal(old[1], new[1]) and old[2] == new[2]  # the same positions
            t_old = best(lambda: mrope_before(IMAGE_ID, ids, rows, positions, 0), repeats=1 if k > 200 else 3)
            t_new = best(lambda: after(ids, rows, positions, 0))
            print(f"| {n} | {k} | {t_old * 1e3:.1f} | {t_new * 1e3:.2f} | {t_old / t_new:.0f}x |")

    print("\n== engine prompt: the full prompt with N image placeholders collapsed to one; best of 3")
    print("| N | before ms | after ms | speed-up |")
    print("|---|---|---|---|")
    for n in (728, 980):
        types = torch.tensor([0] * TEXT + [IMAGE] * n + [0] * 20)
        prompt = PromptInputs(input_ids=torch.randint(0, 1000, (types.numel(),)), mm_token_type_ids=types,
                              pixel_values=torch.empty(0), image_grid_thw=torch.empty(0), query_mask=torch.zeros(types.numel(), dtype=torch.bool))
        assert engine_prompt(prompt, [None]).token_ids == engine_prompt_before(prompt)
        t_old, t_new = best(lambda: engine_prompt_before(prompt)), best(lambda: engine_prompt(prompt, [None]))
        print(f"| {n} | {t_old * 1e3:.2f} | {t_new * 1e3:.2f} | {t_old / t_new:.0f}x |")

    print("\n== reading vLLM's flat logprobs: T positions x (1 + k) entries (a response's sampled or scored rows); best of 3")
    print("| T | k | before ms | after ms | speed-up |")
    print("|---|---|---|---|---|")
    for t in (450, 1024):
        for k in (20, 100):
            flat, tokens = flat_logprobs(t, k)
            old, new = sampled_and_top_before(flat, tokens, k), _sampled_and_top(flat, tokens, k)
            assert torch.equal(old[1], new[1]) and torch.allclose(old[0], new[0])
            t_old, t_new = best(lambda: sampled_and_top_before(flat, tokens, k)), best(lambda: _sampled_and_top(flat, tokens, k))
            print(f"| {t} | {k} | {t_old * 1e3:.1f} | {t_new * 1e3:.2f} | {t_old / t_new:.0f}x |")


if __name__ == "__main__":
    main()
