"""VLM adapter for every family in core/families.py (Qwen3.5, Qwen3-VL, Qwen2.5-VL, GLM-4V): visual tokens in,
reduced sequence out.

The student sees a *reduced* prompt (docs/architecture.md §1): image placeholder tokens that the
selector did not keep are dropped; kept visual tokens keep their original M-RoPE
(t, h, w); text tokens keep the positions they have in the full sequence (never
rebased). Positions are passed as 4 channels [seq_index, t, h, w], where seq_index
is the plain index over the shorter (padded) sequence. Decoding continues at the
full sequence's next M-RoPE position, exactly as it would with every token kept.
For Qwen3-VL the deepstack features are pruned with the same indices. What differs between the families
(deepstack or not) is read from their description.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
from dataclasses import dataclass

import torch

from lt_opd_ray.core.curriculum import BPS, tokens_to_keep
from lt_opd_ray.core.families import family_of
from lt_opd_ray.core.seeding import stable_seed
from lt_opd_ray.core.selectors import EncoderAttention, SelectionInput, Selector
from lt_opd_ray.core.fastv_layers import scoring_layer
from lt_opd_ray.models.encoder_attention import recorded_attention, tower_attention
from lt_opd_ray.models.transfer import to_device
from lt_opd_ray.models.processor import IMAGE, TEXT, VIDEO, PromptInputs
from lt_opd_ray.models.token_merge import assign_to_kept, merge_head


@dataclass
class VisualFeatures:
    """Post-merger visual tokens of one prompt's images."""

    embeds: list[torch.Tensor]  # per image [N_i, D]
    deepstack: list[list[torch.Tensor]] | None  # per image, per deepstack layer [N_i, D] (Qwen3-VL only)
    merged_grids: list[tuple[int, int, int]]  # per image (t, h, w) after the spatial merge; N_i = t*h*w
    attention: list[EncoderAttention] | None = None  # per unit, when asked for (a selector that reads it)
    language_attention: list[torch.Tensor] | None = None  # per unit [N_i]: the prompt's last token's, inside the LM (FastV)


@dataclass(frozen=True)
class InsidePruning:
    """A selection the language model makes in its own forward (`Selector.prunes_inside_language_model`: FastV): what
    it needs to choose once the scoring layer's attention is known (models/lm_pruning.py)."""

    prompt: PromptInputs
    features: VisualFeatures
    selector: Selector
    budget_bps: int
    k_min: int
    seed: int


@dataclass
class ReducedPrompt:
    """A prompt with only the kept visual tokens, ready for the language model."""

    inputs_embeds: torch.Tensor  # [L', D]
    positions: torch.Tensor  # [3, L'] original M-RoPE (t, h, w) of every kept token
    visual_mask: torch.Tensor  # [L'] bool, kept image tokens
    deepstack: list[torch.Tensor] | None  # per deepstack layer [kept visual tokens, D]
    next_position: int  # M-RoPE position of the first response token
    selected: list[torch.Tensor]  # per image: sorted kept indices in [0, N_i)
    merge_routes: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per image (assignment, prior) with a token-merge head
    inside: InsidePruning | None = None  # every visual token kept here, pruned inside the language model (FastV)

    @property
    def length(self) -> int:
        return self.inputs_embeds.shape[0]


@dataclass
class PaddedBatch:
    """Language-model inputs for B sequences: left-padded rows, or (`lengths`) one packed row of them end to end."""

    inputs_embeds: torch.Tensor  # [B, L, D]
    attention_mask: torch.Tensor  # [B, L] 1 = real token
    position_ids: torch.Tensor  # [4, B, L]: seq_index (from 0 in each sequence), t, h, w
    visual_pos_masks: torch.Tensor  # [B, L]
    deepstack: list[torch.Tensor] | None  # per layer, kept visual tokens in row-major batch order
    lengths: list[int] | None = None  # packed (B = 1): each sequence's tokens, in the row's order (models/packing.py)


class QwenVLM:
    """Wraps a transformers VLM (`*ForConditionalGeneration` of a family in core/families.py) for reduced-token
    forwards."""

    def __init__(self, model):
        self.family = family_of(model.config.model_type, type(model).__name__)
        self.model = model
        self.merge = model.config.vision_config.spatial_merge_size

    @property
    def token_merge(self):
        """The learnable token-merge head, when the model has one."""
        return merge_head(self.model)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    # ----------------------------------------------------------------- parts
    @property
    def language_model(self):
        return self.model.model.language_model

    @property
    def lm_head(self) -> torch.nn.Linear:
        return self.model.lm_head

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(to_device(ids, self.device))

    # ---------------------------------------------------------- full prompt
    def visual_features(self, prompt: PromptInputs, with_attention: bool = False) -> VisualFeatures:
        """Vision tower + merger (differentiable: the learner trains both), one unit per image and per temporal patch
        of the clip, in prompt order (`PromptInputs.visual_units`); `with_attention`: also the attention each merged
        token receives inside the tower (for a selector that reads it, models/encoder_attention.py)."""
        parts = {IMAGE: self._encoded(prompt.pixel_values, prompt.image_grid_thw, self.model.model.get_image_features, with_attention),
                 VIDEO: self._encoded(prompt.pixel_values_videos, prompt.video_grid_thw, self.model.model.get_video_features, with_attention)}
        units = [next(parts[kind]) for kind, _ in prompt.visual_units]
        grids = [(t, h // self.merge, w // self.merge) for _, (t, h, w) in prompt.visual_units]
        deepstack = [layers for _, layers, _ in units] if self.family.deepstack else None
        return VisualFeatures(embeds=[embeds for embeds, _, _ in units], deepstack=deepstack, merged_grids=grids,
                              attention=[attention for _, _, attention in units] if with_attention else None)

    def _encoded(self, pixels: torch.Tensor | None, grid_thw: torch.Tensor | None, encode, with_attention: bool):
        """(embeds, deepstack layers or None, encoder attention or None) per unit of one modality: per image, or per
        temporal patch of each clip (a clip's t*h*w merged tokens are t runs of h*w in the prompt)."""
        if pixels is None or grid_thw is None or not len(grid_thw):
            return iter(())
        visual = self.model.model.visual
        with recorded_attention(visual) if with_attention else contextlib.nullcontext() as record:
            out = encode(to_device(pixels, self.device), to_device(grid_thw, self.device), return_dict=True)
        attention = None
        if with_attention:
            attention = tower_attention(visual, record, grid_thw, self.merge, self.family.windowed_vision)
        per_item = [list(layers) for layers in zip(*out.deepstack_features)] if self.family.deepstack else [None] * len(grid_thw)
        start = 0
        for embeds, layers, (t, h, w) in zip(out.pooler_output, per_item, grid_thw.tolist()):
            size = h * w // self.merge**2
            for frame in range(t):
                piece = slice(frame * size, (frame + 1) * size)
                received = None if attention is None else EncoderAttention(attention.object_block[start : start + size], attention.last_block[start : start + size])
                start += size
                yield embeds[piece], None if layers is None else [layer[piece] for layer in layers], received

    def query_embedding(self, prompt: PromptInputs) -> torch.Tensor:
        """Mean LLM input embedding of the question tokens (CDPruner's q before normalisation)."""
        with torch.no_grad():
            return self.embed_tokens(prompt.input_ids[prompt.query_mask]).float().mean(0)

    def full_positions(self, prompt: PromptInputs) -> torch.Tensor:
        """[3, L] M-RoPE positions of the full-token prompt, from the model's own rope index."""
        kwargs = dict(
            input_ids=prompt.input_ids[None],
            mm_token_type_ids=prompt.mm_token_type_ids[None],
            image_grid_thw=prompt.image_grid_thw,
            video_grid_thw=prompt.video_grid_thw,
        )
        if prompt.second_per_grid_ts is not None:  # Qwen2.5-VL: a clip's temporal positions step by the seconds a patch spans
            kwargs["second_per_grid_ts"] = prompt.second_per_grid_ts
        positions, _ = self.model.model.get_rope_index(**kwargs)
        return positions[:, 0].cpu()

    # ------------------------------------------------------------ selection
    def select(
        self,
        prompt: PromptInputs,
        features: VisualFeatures,
        selector: Selector,
        budget_bps: int,
        k_min: int,
        seed: int = 0,
    ) -> list[torch.Tensor]:
        """Per unit (image, temporal patch of a clip): indices chosen in fp32 without gradients, under the selector's
        scope: `image`, each unit keeps k = min(N, max(k_min, ceil(N*r))) of its own N tokens; `clip`, each image alone
        and a clip's patches jointly; `prompt`, one budget over every unit. A joint budget is k for N = the group's
        sum of N_i, chosen from the union of its tokens (concatenated in prompt order, on a 1 x N grid), then split back
        per unit; a one-unit group picks the same either way."""
        query = self.query_embedding(prompt)
        selected = []
        for group in _selection_groups([kind for kind, _ in prompt.visual_units], selector.scope):
            if len(group) == 1:
                i = group[0]
                embeds, grid = features.embeds[i], features.merged_grids[i]
                k = tokens_to_keep(embeds.shape[0], budget_bps, k_min)
                item = SelectionInput(embeds.detach().float(), query, (grid[0] * grid[1], grid[2]), seed=stable_seed(seed, i),  # per unit, any size of seed
                                      attention=features.attention[i] if features.attention else None,
                                      language_attention=features.language_attention[i] if features.language_attention else None)
                selected.append(selector.select(item, k))
                continue
            union = torch.cat([features.embeds[i].detach().float() for i in group])
            k = tokens_to_keep(union.shape[0], budget_bps, k_min)
            scores = torch.cat([features.language_attention[i] for i in group]) if features.language_attention else None
            chosen = selector.select(SelectionInput(union, query, (1, union.shape[0]), seed=stable_seed(seed, group[0]), language_attention=scores), k)  # no union for HiPrune
            bounds = list(itertools.accumulate((features.embeds[i].shape[0] for i in group), initial=0))  # each unit's range in the union
            selected += [chosen[(chosen >= lo) & (chosen < hi)] - lo for lo, hi in zip(bounds, bounds[1:])]
        return selected

    def check_selector(self, selector: Selector) -> None:
        """A ValueError where this model cannot run `selector`: one that prunes inside the language model needs a
        layer after its scoring layer, and drops tokens a learnable token merge would have taken in."""
        if not selector.prunes_inside_language_model:
            return
        scoring_layer(self.language_model.config)
        if self.token_merge is not None:
            raise ValueError(f"{selector.name} prunes inside the language model, where the model's learnable token merge has no"
                             " discarded tokens to take in: score it with a selector that prunes before the language model")

    def reduced_prompt(self, prompt: PromptInputs, features: VisualFeatures, selector: Selector | None, budget_bps: int,
                       k_min: int, seed: int = 0) -> ReducedPrompt:
        """What the language model is given at `budget_bps` under `selector` (None, or a budget of 10000: every visual
        token): the kept tokens alone, or, for a selector that prunes inside the language model, every token and the
        selection it makes there (`ReducedPrompt.inside`)."""
        if selector is None or budget_bps >= BPS:
            return self.reduce(prompt, features, self.keep_all(features))
        if selector.prunes_inside_language_model:
            self.check_selector(selector)
            full = self.reduce(prompt, features, self.keep_all(features))
            return dataclasses.replace(full, inside=InsidePruning(prompt, features, selector, budget_bps, k_min, seed))
        return self.reduce(prompt, features, self.select(prompt, features, selector, budget_bps, k_min, seed=seed))

    def keep_all(self, features: VisualFeatures) -> list[torch.Tensor]:
        return [torch.arange(e.shape[0]) for e in features.embeds]

    def reduce(self, prompt: PromptInputs, features: VisualFeatures, selected: list[torch.Tensor],
               merge_routes: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> ReducedPrompt:
        """Drop unkept image tokens; everything kept keeps its full-sequence M-RoPE position. With a token-merge
        head, each kept token takes in its discarded neighbours along `merge_routes` (computed here when None:
        a rollout computes them, the learner replays them)."""
        if len(selected) != len(prompt.visual_units):
            raise ValueError(f"{len(selected)} index sets for {len(prompt.visual_units)} visual unit(s) (images and temporal patches)")
        is_image = prompt.mm_token_type_ids != TEXT
        keep = ~is_image
        visual_at = torch.nonzero(is_image).flatten()  # unit i's tokens are the next N_i of these, in prompt order
        unit_starts = itertools.accumulate((e.shape[0] for e in features.embeds), initial=0)
        kept_parts, kept_deepstack = [], []
        head, routes = self.token_merge, []
        for i, (start, indices) in enumerate(zip(unit_starts, selected)):
            n = features.embeds[i].shape[0]
            if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= n):
                unit = f"image {i}" if prompt.visual_units[i][0] == IMAGE else f"the clip's temporal patch {i - prompt.num_images}"
                raise ValueError(f"{unit}: selected index outside [0, {n})")
            keep[visual_at[start + indices]] = True
            on_device = to_device(indices, self.device)
            if head is None:
                kept_parts.append(features.embeds[i][on_device])
            else:  # each kept token also carries its discarded neighbours (models/token_merge.py)
                routes.append(merge_routes[i] if merge_routes is not None else assign_to_kept(features.embeds[i], on_device))
                kept_parts.append(head(features.embeds[i], on_device, routes[i]))
            if features.deepstack is not None:
                kept_deepstack.append([layer[on_device] for layer in features.deepstack[i]])

        text_embeds = self.embed_tokens(prompt.input_ids)
        embeds = text_embeds.clone()
        visual = torch.cat(kept_parts).to(embeds.dtype)
        kept_visual_mask = is_image & keep
        # rows as integer positions found on the host: indexing the device's embeddings by a mask would wait for it
        embeds[to_device(kept_visual_mask.nonzero().flatten(), self.device)] = visual  # image 0's kept tokens, then image 1's ...
        full_pos = self.full_positions(prompt)
        deepstack = None
        if features.deepstack is not None:
            deepstack = [torch.cat(per_layer).to(embeds.dtype) for per_layer in zip(*kept_deepstack)]
        return ReducedPrompt(
            inputs_embeds=embeds.index_select(0, to_device(keep.nonzero().flatten(), self.device)),
            positions=full_pos[:, keep],
            visual_mask=kept_visual_mask[keep],
            deepstack=deepstack,
            next_position=int(full_pos.max()) + 1,  # = what decoding the full prompt would use next
            selected=[s.clone() for s in selected],
            merge_routes=[(a.cpu(), p.cpu()) for a, p in routes] if head is not None else None,
        )

    # ------------------------------------------------------------- forwards
    def pad_batch(self, sequences: list[ReducedPrompt], extra_ids: list[torch.Tensor] | None = None) -> PaddedBatch:
        """Left-pad reduced prompts (each optionally followed by response tokens) into one batch."""
        extra_ids = extra_ids or [torch.zeros(0, dtype=torch.long)] * len(sequences)
        lengths = [seq.length + ids.numel() for seq, ids in zip(sequences, extra_ids)]
        width, dim = max(lengths), sequences[0].inputs_embeds.shape[-1]
        batch, device = len(sequences), self.device
        embeds = sequences[0].inputs_embeds.new_zeros(batch, width, dim)
        mask = torch.zeros(batch, width, dtype=torch.long, device=device)
        positions = torch.zeros(4, batch, width, dtype=torch.long, device=device)
        visual = torch.zeros(batch, width, dtype=torch.bool, device=device)
        for b, (seq, ids, length) in enumerate(zip(sequences, extra_ids, lengths)):
            pad = width - length
            response_pos = seq.next_position + torch.arange(ids.numel())
            embeds[b, pad:] = torch.cat([seq.inputs_embeds, self.embed_tokens(ids).to(embeds.dtype)])
            mask[b, pad:] = 1
            positions[0, b, pad:] = torch.arange(length, device=device)  # plain index over the reduced sequence
            positions[1:, b, pad:] = to_device(torch.cat([seq.positions, response_pos.expand(3, -1)], dim=1), device)
            visual[b, pad : pad + seq.length] = to_device(seq.visual_mask, device)
        deepstack = None
        if sequences[0].deepstack is not None:
            deepstack = [torch.cat(layer) for layer in zip(*(seq.deepstack for seq in sequences))]
        return PaddedBatch(embeds, mask, positions, visual, deepstack)

    def pack_batch(self, sequences: list[ReducedPrompt], extra_ids: list[torch.Tensor]) -> PaddedBatch:
        """Reduced prompts, each followed by its response tokens, end to end in one row: no padding."""
        from lt_opd_ray.models.packing import use_packed_attention

        use_packed_attention(self.model)
        embeds, positions, visual, lengths = [], [], [], []
        for seq, ids in zip(sequences, extra_ids, strict=True):
            lengths.append(seq.length + ids.numel())
            response_pos = (seq.next_position + torch.arange(ids.numel())).expand(3, -1)
            embeds += [seq.inputs_embeds, self.embed_tokens(ids).to(seq.inputs_embeds.dtype)]
            positions.append(torch.cat([torch.arange(lengths[-1])[None], torch.cat([seq.positions, response_pos], dim=1)]))
            visual += [seq.visual_mask.cpu(), torch.zeros(ids.numel(), dtype=torch.bool)]
        deepstack = None
        if sequences[0].deepstack is not None:
            deepstack = [torch.cat(layer) for layer in zip(*(seq.deepstack for seq in sequences))]
        row, device = torch.cat(embeds), self.device
        return PaddedBatch(row[None], torch.ones(1, row.shape[0], dtype=torch.long, device=device),
                           to_device(torch.cat(positions, dim=1)[:, None], device), to_device(torch.cat(visual)[None], device), deepstack, lengths)

    def run_language_model(self, batch: PaddedBatch, past_key_values=None, use_cache: bool = False):
        """Language model over a padded or packed batch; returns (final hidden [B, L, H], cache). A packed row's cache
        is None: it holds no one sequence's state."""
        import contextlib

        from lt_opd_ray.models.packing import packed_call, row_bounds

        extra = row_bounds(batch.lengths) if batch.lengths is not None else {}
        if self.family.deepstack and batch.deepstack is not None:
            extra |= {"visual_pos_masks": batch.visual_pos_masks, "deepstack_visual_embeds": batch.deepstack}
        with packed_call() if batch.lengths is not None else contextlib.nullcontext():
            out = self.language_model(
                inputs_embeds=batch.inputs_embeds,
                attention_mask=batch.attention_mask,
                position_ids=batch.position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                **extra,
            )
        return out.last_hidden_state, out.past_key_values if batch.lengths is None else None

    def response_hidden(self, prompts: list[ReducedPrompt], responses: list[torch.Tensor], packed: bool = False) -> list[torch.Tensor]:
        """Teacher-forced: hidden states that predict each response token, per sequence [T_i, H]; from left-padded
        rows, or from one packed row (`packed`: no padding computed)."""
        return self.teacher_forced(prompts, responses, packed)[0]

    def teacher_forced(self, prompts: list[ReducedPrompt], responses: list[torch.Tensor], packed: bool) -> tuple[list[torch.Tensor], int]:
        """`response_hidden`, and the positions its forward computed (rows x width of the batch it ran)."""
        if any(p.inside is not None for p in prompts):
            raise ValueError("a prompt pruned inside the language model (FastV) is sampled, not teacher-forced: its forward is models/lm_pruning.py's")
        batch = self.pack_batch(prompts, responses) if packed else self.pad_batch(prompts, responses)
        hidden, _ = self.run_language_model(batch)
        rows, width = hidden.shape[:2]
        # the token at column end - t + j is predicted by the hidden state one column earlier; a sequence ends where
        # the next begins in a packed row, at the last column in a padded one
        ends = itertools.accumulate(batch.lengths) if packed else [width] * rows
        return [hidden[0 if packed else b, end - r.numel() - 1 : end - 1] for b, (end, r) in enumerate(zip(ends, responses))], rows * width


    def continue_hidden(
        self, prefix: ReducedPrompt, prefix_cache, row: int, prefix_mask: torch.Tensor, responses: list[torch.Tensor], packed: bool = False
    ) -> list[torch.Tensor]:
        """Teacher-forced hidden states of responses that all continue one prefix from a cache, per response [T_i, H].

        `prefix_cache` holds a batch of left-padded prefixes (attention KV and, for Qwen3.5, Gated
        DeltaNet conv/recurrent state); row `row` is this prefix, `prefix_mask` its padding mask.
        Padded: the row is copied once per response and the responses are right-padded, which cannot reach
        their real positions in a causal model. Packed (`packed`, a prefix without padding): the responses lie end
        to end in one row after the one prefix, each continuing it alone (models/packing.py).
        """
        if packed:
            return self._continue_packed(prefix, prefix_cache, row, prefix_mask, responses)
        rows, width, device = len(responses), max(r.numel() for r in responses), self.device
        cache = copy.deepcopy(prefix_cache)  # the continuation appends to it; the prefixes' own stays for the next rows
        cache.reorder_cache(torch.full((rows,), row, dtype=torch.long, device=device))  # this prefix for every response
        ids = torch.zeros(rows, width, dtype=torch.long)
        mask = torch.zeros(rows, prefix_mask.numel() + width, dtype=torch.long, device=device)
        mask[:, : prefix_mask.numel()] = prefix_mask
        for b, response in enumerate(responses):
            ids[b, : response.numel()] = response
            mask[b, prefix_mask.numel() : prefix_mask.numel() + response.numel()] = 1
        steps = torch.arange(width, device=device)
        positions = torch.empty(4, rows, width, dtype=torch.long, device=device)
        positions[0] = prefix.length + steps  # seq_index continues after the prefix's real tokens
        positions[1:] = prefix.next_position + steps  # M-RoPE continues where the full sequence would
        batch = PaddedBatch(
            inputs_embeds=self.embed_tokens(ids).to(prefix.inputs_embeds.dtype),
            attention_mask=mask,
            position_ids=positions,
            visual_pos_masks=torch.zeros(rows, width, dtype=torch.bool, device=device),
            deepstack=None,
        )
        hidden, _ = self.run_language_model(batch, past_key_values=cache, use_cache=True)
        return [hidden[b, : r.numel()] for b, r in enumerate(responses)]

    def _continue_packed(self, prefix: ReducedPrompt, prefix_cache, row: int, prefix_mask: torch.Tensor, responses: list[torch.Tensor]) -> list[torch.Tensor]:
        from lt_opd_ray.models.packing import use_packed_attention

        if row != 0 or not bool(prefix_mask.all()):
            raise ValueError("a packed continuation needs a prefix run alone (one row, no padding)")
        use_packed_attention(self.model)
        device, lengths = self.device, [r.numel() for r in responses]
        cache = copy.deepcopy(prefix_cache)  # the continuation appends to it; the prefix's own stays for the next micro-batch
        steps = torch.cat([torch.arange(n) for n in lengths]).to(device)  # each response from its own first token
        batch = PaddedBatch(
            inputs_embeds=self.embed_tokens(torch.cat(responses)[None]).to(prefix.inputs_embeds.dtype),
            attention_mask=torch.ones(1, prefix_mask.numel() + sum(lengths), dtype=torch.long, device=device),
            position_ids=torch.stack([prefix.length + steps, *[prefix.next_position + steps] * 3])[:, None],
            visual_pos_masks=torch.zeros(1, sum(lengths), dtype=torch.bool, device=device),
            deepstack=None,
            lengths=lengths,
        )
        hidden, _ = self.run_language_model(batch, past_key_values=cache, use_cache=True)
        return list(hidden[0].split(lengths))

def _selection_groups(kinds: list[int], scope: str) -> list[list[int]]:
    """The visual units (indices into `kinds`, in order) that share one budget under `scope`."""
    if scope == "prompt":
        return [list(range(len(kinds)))]
    if scope == "clip":
        frames = [i for i, kind in enumerate(kinds) if kind == VIDEO]
        groups = [[i] for i, kind in enumerate(kinds) if kind == IMAGE]
        return sorted(groups + ([frames] if frames else []))
    return [[i] for i in range(len(kinds))]

