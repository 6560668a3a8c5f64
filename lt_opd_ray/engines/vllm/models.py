"""Visual-token pruning inside vLLM for the families of core/families.py that name a vLLM model file (a vLLM plugin).

`register()` (entry point `vllm.general_plugins`) replaces those families' vLLM
classes (Qwen3.5, Qwen3-VL, Qwen2.5-VL, GLM-4V) by subclasses that keep only the selected visual tokens, exactly as
the transformers adapter does with `selector.scope: image` (docs/architecture.md §1). A visual unit is an image or
one temporal patch of a clip; each keeps k = tokens_to_keep(N, r, k_min) of its own N tokens:

- the multimodal processor reads the request's selection settings
  (`mm_processor_kwargs`, see `SelectionRequest`) and emits k placeholders per image instead of N, and in a clip the
  family's own replacement (timestamps, markers) with each patch's run cut to its k;
- `embed_multimodal` runs the vision tower and merger, embeds the question tokens,
  lets the selector choose k of each unit's N post-merger tokens (fp32, no gradients, the
  same per-unit seed as the adapter) and returns those rows, each carrying its
  (t, h, w) offset from its run's first slot in three extra channels;
- M-RoPE: text tokens (a clip's timestamps included) get the positions they have in the full-token prompt (a run
  advances the text position by its full grid, never by k), visual slots get their
  final positions once the encoder has chosen them: vLLM's model runner calls
  `recompute_mrope_positions` after the encoder (`register` turns that on for our
  models), and that puts the run's base position plus each kept token's offset
  in place;
- with a learnable token merge in the folder's config (models/token_merge.py), each
  kept row first takes in its discarded neighbours through the same head as the
  transformers adapter's (loaded from the checkpoint, and rewritten by weight syncs);
- the chosen indices (and merge routes) are recorded per (request nonce, unit) for
  the engine to collect (`pop_selections`).

With r = 100% the models are vLLM's own (every token kept, same positions), which is
what the teacher scorer uses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from lt_opd_ray.core.curriculum import tokens_to_keep
from lt_opd_ray.core.families import FAMILIES, family_of
from lt_opd_ray.core.seeding import stable_seed
from lt_opd_ray.core.selectors import SELECTORS, EncoderAttention, SelectionInput, build_selector
from lt_opd_ray.engines.vllm.selection import SELECTOR_NAMES, SelectionRequest
from lt_opd_ray.models.token_merge import assign_to_kept

VLLM_FAMILIES = [family for family in FAMILIES.values() if family.vllm_module]
PRUNED_ARCHITECTURES = {f.architecture: f"lt_opd_ray.engines.vllm.models:Pruned{f.architecture}" for f in VLLM_FAMILIES}
# per image and per clip, int64: budget_bps, k_min, selector, the prompt's seed, nonce, its first visual unit's index
# (an image is one unit, a clip one per temporal patch; the clip's come after the prompt's images)
SELECTION_FIELD = {"image": "lt_opd_selection", "video": "lt_opd_video_selection"}
QUERY_FIELD = {"image": "lt_opd_query", "video": "lt_opd_video_query"}  # per image and per clip: the question's token ids
POSITION_CHANNELS = 3  # (t, h, w) offsets appended to each kept row
MAX_GRID_SIDE = 256  # offsets travel in the embedding dtype; bf16 holds integers exactly up to 256
MAX_RECORDED = 4096  # selections kept for collection (oldest dropped first)


def _merged_grid(grid_thw, merge: int) -> tuple[int, int, int]:
    t, h, w = (int(x) for x in grid_thw)
    return t, h // merge, w // merge


def grid_offsets(grid: tuple[int, int, int]) -> torch.Tensor:
    """[N, 3] (t, h, w) offset of every merged token of one image (or temporal patch), in row-major order."""
    t, h, w = grid
    return torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"), -1).reshape(-1, 3)


def frame_token_id(config) -> int:
    """The token a clip's visual slots carry: the video token, or GLM-4V's image token (its frames are image runs)."""
    family = FAMILIES[config.model_type]
    return config.image_token_id if family.clip_layout == "stamp_after" else config.video_token_id


def patch_times(config, patches: int, second_per_grid_t) -> torch.Tensor:
    """[patches] temporal position of each temporal patch of a clip, from the clip's first: 0 where each patch is a run
    of its own (Qwen3, GLM-4V), the patch's time in rope steps where the clip is one run (Qwen2.5-VL, as transformers'
    rope index computes it: (index * tokens_per_second * second_per_grid_t).long())."""
    if FAMILIES[config.model_type].clip_layout != "one_run":
        return torch.zeros(patches, dtype=torch.long)
    interval = config.vision_config.tokens_per_second * torch.as_tensor(second_per_grid_t, dtype=torch.float32)
    return (torch.arange(patches) * interval).long()


def _runs(is_slot: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of True."""
    edges = torch.diff(torch.cat([is_slot.new_zeros(1), is_slot, is_slot.new_zeros(1)]).int())
    return list(zip((edges == 1).nonzero().flatten().tolist(), (edges == -1).nonzero().flatten().tolist()))


# --------------------------------------------------------------------------- processor
class PruningProcessorMixin:
    """Emits k placeholders per image and attaches the selection settings to each image.

    A request that leaves settings out gets them from the model folder's compression
    config (`lt_opd_compression.json`, written by `lt-opd export`; none: every token)
    and, without query ids, the question tokens of its own prompt.
    """

    def apply(self, inputs, *args, **kwargs):
        completed = self._with_defaults(inputs.prompt, inputs.hf_processor_mm_kwargs)
        return super().apply(dataclasses.replace(inputs, hf_processor_mm_kwargs=completed), *args, **kwargs)

    @functools.cached_property
    def _compression(self):
        """The model folder's compression config, read once per processor (not per request)."""
        from lt_opd_ray.core.compression import CompressionConfig

        return CompressionConfig.read(self.info.ctx.model_config.model)

    def _with_defaults(self, prompt_ids, kwargs: Mapping[str, object]) -> dict[str, object]:
        from lt_opd_ray.models.processor import question_token_ids

        completed = dict(kwargs)
        compression = self._compression
        if compression is not None:
            for name in ("selector", "budget_bps", "k_min"):
                completed.setdefault(SelectionRequest.PREFIX + name, getattr(compression, name))
        if SelectionRequest.PREFIX + "query_ids" not in completed and isinstance(prompt_ids, list):
            family = FAMILIES[self.info.get_hf_config().model_type]
            completed[SelectionRequest.PREFIX + "query_ids"] = question_token_ids(prompt_ids, self.info.get_tokenizer(), family)
        return completed

    def _apply_hf_processor_main(self, mm_items, hf_kwargs):
        request, rest = SelectionRequest.split(hf_kwargs, self.info.get_hf_config().get_text_config().vocab_size)
        data = super()._apply_hf_processor_main(mm_items, rest)
        merge = self.info.get_hf_config().vision_config.spatial_merge_size
        selector = SELECTOR_NAMES.index(request.selector)
        first_unit = 0
        for modality in ("image", "video"):  # a clip's patches are numbered after the prompt's images
            grids = data.get(f"{modality}_grid_thw")
            if grids is None or not len(grids):
                continue
            rows = []
            for index, grid in enumerate(grids.tolist()):
                t, h, w = _merged_grid(grid, merge)
                if max(h, w) > MAX_GRID_SIDE:
                    raise ValueError(
                        f"{modality} {index}: merged grid {h}x{w} exceeds {MAX_GRID_SIDE} tokens a side;"
                        " lower the processor's max_pixels so it is resized"
                    )
                rows.append([request.budget_bps, request.k_min, selector, request.seed, request.nonce, first_unit])
                first_unit += t if modality == "video" else 1
            data[SELECTION_FIELD[modality]] = torch.tensor(rows, dtype=torch.long)
            data[QUERY_FIELD[modality]] = torch.tensor(request.query_ids, dtype=torch.long).expand(len(rows), -1).clone()
        return data

    def _get_mm_fields_config(self, hf_inputs, hf_processor_mm_kwargs):
        from vllm.multimodal.inputs import MultiModalFieldConfig

        fields = dict(super()._get_mm_fields_config(hf_inputs, SelectionRequest.processor_kwargs(hf_processor_mm_kwargs)))
        for modality in ("image", "video"):
            fields[SELECTION_FIELD[modality]] = MultiModalFieldConfig.batched(modality, keep_on_cpu=True)
            fields[QUERY_FIELD[modality]] = MultiModalFieldConfig.batched(modality, keep_on_cpu=True)
        return fields

    def _get_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs):
        from vllm.multimodal.processing import PromptUpdateDetails

        updates = super()._get_prompt_updates(mm_items, SelectionRequest.processor_kwargs(hf_processor_mm_kwargs), out_mm_kwargs)
        config = self.info.get_hf_config()
        merge = config.vision_config.spatial_merge_size

        def kept_per_patch(item, modality: str) -> tuple[int, int]:
            """(tokens of one image or temporal patch, how many of them are kept)."""
            _, h, w = _merged_grid(item[f"{modality}_grid_thw"].data.tolist(), merge)
            budget_bps, k_min = (int(v) for v in item[SELECTION_FIELD[modality]].data[:2])
            return h * w, tokens_to_keep(h * w, budget_bps, k_min)

        def kept_placeholders(item_idx: int) -> list[int]:
            return [config.image_token_id] * kept_per_patch(out_mm_kwargs["image"][item_idx], "image")[1]

        def kept_clip(full_replacement):
            """The family's own clip replacement (timestamps, markers, frame runs), each patch's run cut to its k."""
            def replacement(item_idx: int):
                full = full_replacement(item_idx)
                ids = torch.tensor(full.full if isinstance(full, PromptUpdateDetails) else full)
                n, k = kept_per_patch(out_mm_kwargs["video"][item_idx], "video")
                frame = frame_token_id(config)
                keep = ids != frame
                for start, end in _runs(~keep):  # a run is one patch (or, Qwen2.5-VL, every patch of the clip)
                    if (end - start) % n:
                        raise ValueError(f"clip {item_idx}: a run of {end - start} frame tokens is not whole patches of {n}")
                    keep[start:end] = torch.arange(end - start) % n < k
                return PromptUpdateDetails.select_token_id(ids[keep].tolist(), frame)

            return replacement

        return [
            dataclasses.replace(u, replacement=kept_placeholders) if u.modality == "image"
            else dataclasses.replace(u, replacement=kept_clip(u.replacement)) if u.modality == "video" else u
            for u in updates
        ]


# ------------------------------------------------------------------------------- model
class PruningModelMixin:
    """Selection inside `embed_multimodal`, full-prompt M-RoPE positions for what is kept."""

    supports_multimodal_pruning = True  # the interface of recompute_mrope_positions

    def _init_pruning(self) -> None:
        from lt_opd_ray.models.token_merge import VisionTokenCompressor, configured

        # vLLM's own EVS post-processing keys off this flag; our rows carry their positions themselves
        self.is_multimodal_pruning_enabled = False
        self._selections: OrderedDict[tuple[int, int], tuple[torch.Tensor, tuple | None]] = OrderedDict()
        if configured(self.config):  # the folder's student merges tokens: the same head as the transformers adapter's
            self.vision_token_compressor = VisionTokenCompressor(getattr(self.config, "text_config", self.config).hidden_size)

    def load_weights(self, weights):
        """vLLM's loading, plus the merge head: from the checkpoint's tensors (mapped by the class's weights mapper)
        or, for a folder without them (a run starting from the base model), initialised from the first gate rows
        as the transformers side does; the learners' first weight broadcast then brings theirs."""
        loaded = super().load_weights(weights)
        head = getattr(self, "vision_token_compressor", None)
        if head is not None:
            names = {f"vision_token_compressor.{name}" for name, _ in head.named_parameters()}
            if not names <= loaded:
                gate_up = self.get_language_model().model.layers[0].mlp.gate_up_proj.weight  # [gate; up]
                head.learnable_summary.initialize_from_gate(gate_up[: gate_up.shape[0] // 2])
                loaded |= names
        return loaded

    @property
    def _merge(self) -> int:
        return self.config.vision_config.spatial_merge_size

    def _main_width(self) -> int:
        """Columns of an image row that are the token's embedding (Qwen3-VL appends deepstack levels)."""
        return getattr(self, "visual_dim", None) or self.config.vision_config.out_hidden_size

    def embed_multimodal(self, **kwargs: object):
        """Per image and per clip (vLLM encodes one modality per call): the kept rows of each visual unit, in unit
        order, each with its (t, h, w) position offset from its run's first slot in three extra channels."""
        modality = "video" if kwargs.get("pixel_values_videos") is not None or kwargs.get("video_embeds") is not None else "image"
        ours = {name: kwargs.pop(name, None) for name in (*SELECTION_FIELD.values(), *QUERY_FIELD.values())}  # not the tower's
        selection, query = ours[SELECTION_FIELD[modality]], ours[QUERY_FIELD[modality]]
        reads_attention = selection is not None and any(SELECTORS[SELECTOR_NAMES[int(row[2])]].reads_encoder_attention for row in selection)
        with self._recorded_attention() if reads_attention else contextlib.nullcontext() as record:
            embeddings = super().embed_multimodal(**kwargs)
        if embeddings is None:
            return None
        if selection is None:
            raise ValueError(f"{modality} inputs without {SELECTION_FIELD[modality]}: the request did not pass through the pruning processor")
        grids = kwargs[f"{modality}_grid_thw"]
        units = iter(self._unit_attention(record, grids.tolist()) if reads_attention else ())
        kept = []
        for i, rows in enumerate(embeddings):
            budget_bps, k_min, selector, seed, nonce, first_unit = (int(v) for v in selection[i])
            t, h, w = _merged_grid(grids[i].tolist(), self._merge)
            ids = query[i]
            ids = ids[ids >= 0].to(rows.device)
            q = self.get_language_model().embed_input_ids(ids).float().mean(0) if ids.numel() else None
            times = patch_times(self.config, t, kwargs["second_per_grid_ts"][i] if "second_per_grid_ts" in kwargs else 1.0)
            if int(times[-1]) > MAX_GRID_SIDE:
                raise ValueError(f"clip {i}: its last temporal patch sits {int(times[-1])} rope steps in, beyond the {MAX_GRID_SIDE} offsets carry")
            parts = []
            for patch in range(t):  # an image is one unit; a clip's temporal patches are one each
                unit = rows[patch * h * w : (patch + 1) * h * w]
                picked, indices = self._keep(unit, (h, w), tokens_to_keep(h * w, budget_bps, k_min), SELECTOR_NAMES[selector],
                                             stable_seed(seed, first_unit + patch), q, nonce, first_unit + patch, next(units, None))
                offsets = grid_offsets((1, h, w))[indices]
                offsets[:, 0] = times[patch]
                parts.append(torch.cat([picked, offsets.to(device=rows.device, dtype=rows.dtype)], dim=-1))
            kept.append(torch.cat(parts))
        return tuple(kept)

    def _recorded_attention(self):
        """The tower's attention recorded during its forward (engines/vllm/encoder_attention.py), on one rank only."""
        from lt_opd_ray.engines.vllm.encoder_attention import recorded_attention

        if getattr(self, "use_data_parallel", False):
            raise ValueError("hiprune on vLLM: the vision tower runs data-parallel (images split over ranks); serve it with tensor_parallel_size 1")
        return recorded_attention(self.visual, self.config.vision_config.num_heads)

    def _unit_attention(self, record, grids: list[list[int]]) -> Iterator[EncoderAttention]:
        """Per visual unit of this call (each image, each temporal patch of a clip), in order: its tokens' attention."""
        from lt_opd_ray.engines.vllm.encoder_attention import tower_attention

        attention = tower_attention(self.visual, record, grids, self._merge, family_of(self.config.model_type).windowed_vision)
        start = 0
        for grid in grids:
            t, h, w = _merged_grid(grid, self._merge)
            for _ in range(t):
                yield EncoderAttention(attention.object_block[start : start + h * w], attention.last_block[start : start + h * w])
                start += h * w

    def _keep(self, rows: torch.Tensor, grid: tuple[int, int], k: int, selector: str, seed: int, query, nonce: int, unit: int,
              attention: EncoderAttention | None = None):
        """(kept rows, their indices) of one visual unit's [N, D] rows on its (h, w) grid; recorded for collection."""
        n, width = rows.shape[0], self._main_width()
        if k == n:
            indices = torch.arange(n)
        else:
            indices = build_selector(selector).select(SelectionInput(rows[:, :width].float(), query, grid, seed=seed, attention=attention), k)
        on_device = indices.to(rows.device)
        head, route = getattr(self, "vision_token_compressor", None), None
        if head is None:
            picked = rows[on_device]
        else:  # each kept token takes in its discarded neighbours (models/token_merge.py); deepstack columns are pruned
            route = assign_to_kept(rows[:, :width], on_device)
            picked = torch.cat([head.learnable_summary(rows[:, :width], on_device, route), rows[on_device, width:]], dim=-1)
            route = tuple(r.cpu() for r in route)
        self._record(nonce, unit, indices, route)
        return picked, indices

    def _record(self, nonce: int, unit: int, indices: torch.Tensor, route: tuple | None) -> None:
        self._selections[(nonce, unit)] = (indices.cpu(), route)
        while len(self._selections) > MAX_RECORDED:
            self._selections.popitem(last=False)

    def pop_selections(self, nonces: Sequence[int]) -> dict[int, list[tuple[torch.Tensor, tuple | None]]]:
        """The kept indices (and merge route, with a merge head) of each request nonce's visual units (images, then a
        clip's temporal patches), in unit order (removed once read)."""
        wanted = set(nonces)
        found: dict[int, dict[int, tuple]] = {}
        for key in [k for k in self._selections if k[0] in wanted]:
            found.setdefault(key[0], {})[key[1]] = self._selections.pop(key)
        return {nonce: [units[i] for i in sorted(units)] for nonce, units in found.items()}

    # ------------------------------------------------------------------ positions
    def get_mrope_input_positions(self, input_tokens: list[int], mm_features) -> tuple[torch.Tensor, int]:
        """Positions of the reduced prompt: text (a clip's timestamps and markers included) as in the full prompt,
        each image's and temporal patch's slots at its run's base.

        The slots are filled with their own offsets by `recompute_mrope_positions` once the encoder has chosen
        them. A run advances the text after it by its full grid's extent, max(h, w), whatever k is (the rope
        index's rule, a clip in one run included); the delta counts the full prompt's largest position, which
        for a clip in one run may be its last patch's time rather than the text after it.
        """
        positions = torch.empty(3, len(input_tokens), dtype=torch.long)
        ids = torch.tensor(input_tokens)
        cursor, next_position, highest = 0, 0, -1
        for feature in sorted(mm_features, key=lambda f: f.mm_position.offset):
            if feature.modality not in ("image", "video"):
                raise ValueError(f"visual-token pruning covers images and video, got {feature.modality!r}")
            start, length = feature.mm_position.offset, feature.mm_position.length
            grid = feature.data[f"{feature.modality}_grid_thw"].data.tolist()
            t, h, w = _merged_grid(grid, self._merge)
            slot = self.config.image_token_id if feature.modality == "image" else frame_token_id(self.config)
            runs = [(start + a, start + b) for a, b in _runs(ids[start : start + length] == slot)]
            seconds = feature.data["second_per_grid_ts"].data if "second_per_grid_ts" in feature.data else 1.0
            last_time = int(patch_times(self.config, t, seconds)[-1])
            for run_start, run_end in runs:
                text = run_start - cursor
                positions[:, cursor:run_start] = torch.arange(next_position, next_position + text)
                base = next_position + text
                positions[:, run_start:run_end] = base  # final: base + offset, see recompute_mrope_positions
                highest = max(highest, base + last_time)
                next_position = base + max(h, w)
                cursor = run_end
        positions[:, cursor:] = torch.arange(next_position, next_position + len(input_tokens) - cursor)
        highest = max(highest, int(positions.max()))
        return positions, highest + 1 - len(input_tokens)

    def recompute_mrope_positions(self, input_ids, multimodal_embeddings, mrope_positions, num_computed_tokens):
        """Strip the offset channels and put base + offset at this chunk's visual slots, on the positions' device.

        Each slot's base is one past the position of the token before its run (<|vision_start|>, GLM-4V's image
        start): a run's start is found for every slot at once (a running maximum over the run starts), no Python walk.
        """
        positions = mrope_positions.clone()
        ids = torch.as_tensor(input_ids, device=positions.device)
        is_slot = (ids == self.config.image_token_id) | (ids == frame_token_id(self.config))
        index = torch.arange(ids.numel(), device=positions.device)
        starts_here = is_slot & ~torch.cat([is_slot.new_zeros(1), is_slot[:-1]])
        run_start = torch.where(starts_here, index, torch.zeros_like(index)).cummax(0).values
        slots = index[is_slot & (index >= num_computed_tokens)]
        counts = [rows.shape[0] for rows in multimodal_embeddings]
        if counts:
            offsets = torch.cat([rows[:, -POSITION_CHANNELS:] for rows in multimodal_embeddings]).round().long().to(positions.device)
            filled = slots[: sum(counts)]
            base = positions[0, run_start[filled] - 1] + 1
            positions[:, filled] = base + offsets.T
        cleaned = [rows[:, :-POSITION_CHANNELS] for rows in multimodal_embeddings]
        return cleaned, positions, int(positions.max()) + 1 - ids.numel()

    @classmethod
    def get_model_state_cls(cls):
        """vLLM's V2 model runner (its default on CUDA) asks a model for its state class before choosing one: ours
        is the class V2 would choose (the hybrid state for Qwen3.5's Gated DeltaNet layers, else the default)
        with its multimodal pruner always on, so the kept rows' offset channels are consumed as on V1."""
        from lt_opd_ray.engines.vllm.v2 import pruning_model_state

        return pruning_model_state(cls)


def _pruned(base_model):
    """The pruning subclass of a vLLM Qwen VLM, registered with a pruning subclass of its processor."""
    from vllm.model_executor.models.utils import WeightsMapper
    from vllm.multimodal import MULTIMODAL_REGISTRY

    factories = base_model._processor_factory  # set by vLLM's register_processor on the base class
    base_processor = factories.processor
    processor = type(f"Pruning{base_processor.__name__}", (PruningProcessorMixin, base_processor), {})

    class Pruned(PruningModelMixin, base_model):
        # the merge head's checkpoint names (the release's) onto the module `_init_pruning` adds; a regex, because
        # vLLM applies those before the prefixes (Qwen2.5-VL maps every other `model.` into the language model)
        hf_to_vllm_mapper = base_model.hf_to_vllm_mapper | WeightsMapper(
            orig_to_new_regex={re.compile(r"^model\.vision_token_compressor\."): "vision_token_compressor."}
        )

        def __init__(self, *, vllm_config, prefix: str = "model"):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            self._init_pruning()

    Pruned.__name__ = Pruned.__qualname__ = f"Pruned{base_model.__name__}"
    return MULTIMODAL_REGISTRY.register_processor(
        processor, info=factories.info, dummy_inputs=factories.dummy_inputs
    )(Pruned)


def _build_classes() -> dict[str, Any]:
    """`Pruned<architecture>` for each family vLLM implements, subclassing vLLM's own class of that architecture."""
    import importlib

    return {
        f"Pruned{f.architecture}": _pruned(getattr(importlib.import_module(f"vllm.model_executor.models.{f.vllm_module}"), f.architecture))
        for f in VLLM_FAMILIES
    }


def __getattr__(name: str):
    """The pruned classes are built on first use (importing vLLM's model files is slow)."""
    if name in {f"Pruned{f.architecture}" for f in VLLM_FAMILIES}:
        classes = _build_classes()
        globals().update(classes)
        return classes[name]
    raise AttributeError(name)


def _turn_on_pruned_positions(runner_cls) -> None:
    """After loading one of our models, a model runner calls `recompute_mrope_positions`.

    vLLM turns that hook on only when video pruning is configured (GPU runner) or
    never (its CPU runner's `load_model` skips the check); our models need it for
    every image, so the runner's `load_model` is wrapped once per process.
    """
    original = runner_cls.load_model
    if getattr(original, "lt_opd_wrapped", False):
        return

    def load_model(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if isinstance(self.get_model(), PruningModelMixin):
            self.is_multimodal_pruning_enabled = True

    load_model.lt_opd_wrapped = True
    runner_cls.load_model = load_model


def register() -> None:
    """vLLM plugin entry point: our pruning classes serve the families' vLLM architectures; `lt-opd serve`'s media
    connector (engines/vllm/media.py) is there to be chosen."""
    from vllm import ModelRegistry
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from lt_opd_ray.engines.vllm.media import register_media_connector

    register_media_connector()
    for architecture, target in PRUNED_ARCHITECTURES.items():
        ModelRegistry.register_model(architecture, target)
    _turn_on_pruned_positions(GPUModelRunner)
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError:  # a CUDA build of vLLM
        return
    _turn_on_pruned_positions(CPUModelRunner)
