"""vLLM engines: student rollouts at a visual budget and full-token teacher scoring.

One `VLLMEngine` wraps one in-process `vllm.LLM` on a local model folder, with our
pruning model classes (`engines/vllm/models.py`) serving the families' architectures. Prompts
come in as the same `PromptInputs` the transformers backends use; the engine sends
vLLM the template's token ids with one image placeholder per image and one video placeholder per clip, plus the
decoded images and the clip's sampled frames, and vLLM's processor expands each image and each temporal patch to
its k kept placeholders.

- `generate`: sampled ids, the sampled tokens' log-probs, the top-k ids at every
  position and the selected indices of every image (the rollout interface).
- `score`: the teacher's top-k ids / log-probs and the log-probs at requested ids
  for each response position, on the full-token prompt plus the response. vLLM's V2
  runner scores requested ids in the engine (`prompt_logprob_token_ids`); the V1
  runner (vLLM's CPU build) returns the full vocabulary, gathered here.
- `write_weights` / `EngineSink`: an in-place update streamed into the engine's own
  parameters (the weight sync's sink); `load_weights`: the same from tensors at hand,
  refused before any weight changes when names or shapes do not match.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from lt_opd_ray.config.pools import VLLMSettings
from lt_opd_ray.core.compression import learnable_merge
from lt_opd_ray.core.samples import Clip
from lt_opd_ray.engines.vllm.loop import EngineLoop
from lt_opd_ray.engines.vllm.selection import SelectionRequest
from lt_opd_ray.models.loading import parameter_shapes
from lt_opd_ray.models.processor import IMAGE, TEXT, PromptInputs
from lt_opd_ray.models.sampler import Completion, SamplingParams
from lt_opd_ray.weight_sync.layout import Layout


def configure_environment() -> None:
    """Keep the engine in this process (no engine-core subprocess) and its CPU KV cache small."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, CPU build only
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@dataclass
class EnginePrompt:
    """What vLLM takes for one prompt: token ids with one placeholder per image and per clip, the images, the clip
    (its frames and the metadata vLLM's processor reads them with), the question's ids."""

    token_ids: list[int]
    images: list
    query_ids: list[int]
    full_length: int  # tokens once every image and the clip are expanded to all their visual tokens
    video: tuple | None = None  # ([T, H, W, 3] uint8 frames, metadata) of the prompt's clip


def engine_prompt(prompt: PromptInputs, images: list, video_token_id: int | None = None) -> EnginePrompt:
    """Collapse each image's run of placeholders back to the single token vLLM's processor expands, and the clip's
    ids (its timestamps and frame runs) back to the video placeholder (`video_token_id`, the config's)."""
    ids, types = prompt.input_ids, prompt.mm_token_type_ids
    video = None
    if prompt.clip_span is not None:
        if video_token_id is None:
            raise ValueError("a prompt with a clip needs the model's video placeholder id to collapse it")
        start, end = prompt.clip_span
        ids = torch.cat([ids[:start], torch.tensor([video_token_id]), ids[end:]])
        types = torch.cat([types[:start], torch.tensor([TEXT], dtype=types.dtype), types[end:]])
        video = clip_for_vllm(prompt.clip)
    is_image = types == IMAGE
    run_start = is_image & ~torch.cat([is_image.new_zeros(1), is_image[:-1]])  # an image token after a non-image one
    collapsed = ids[~is_image | run_start].tolist()
    runs = int(run_start.sum())
    if runs != len(images):
        raise ValueError(f"prompt has {runs} image run(s) but {len(images)} image(s)")
    return EnginePrompt(collapsed, list(images), prompt.input_ids[prompt.query_mask].tolist(), prompt.input_ids.numel(), video)


def clip_for_vllm(clip: Clip) -> tuple:
    """A sampled clip as vLLM's video processors take it: the frames, and metadata from which they compute what our
    processor writes. Times travel as frame indices at 1 frame per second (index i is frame i's time in seconds), and
    the source's frame count is the one that makes the sampled rate the clip's (`VideoMetadata.sampled_fps`):
    Qwen3's timestamps are index / fps, GLM-4V's whole seconds int(index / fps), Qwen2.5-VL's seconds per
    temporal patch temporal_patch_size / sampled_fps."""
    import numpy as np

    source_frames = len(clip.frames) / clip.fps
    metadata = {"fps": 1.0, "frames_indices": list(clip.seconds), "total_num_frames": source_frames, "duration": source_frames,
                "video_backend": "opencv", "do_sample_frames": False}
    return np.stack([np.asarray(frame) for frame in clip.frames]), metadata


@dataclass
class ScoredResponse:
    top_ids: torch.Tensor  # [T, k] int32
    top_logp: torch.Tensor  # [T, k] fp32
    requested_logp: torch.Tensor  # [T, m] fp32


class WeightMismatchError(ValueError):
    pass


# vLLM's V1 runner (its CPU build) answers prompt log-probs over the whole vocabulary, as Python
# lists, at every prompt row: fine for tiny models, hopeless at Qwen3.5's 248,320 ids per row.
V1_SCORING_VOCAB_LIMIT = 32768


def check_teacher_scoring(engine: VLLMEngine) -> None:
    """Refuse a vLLM teacher whose runner would return full-vocabulary prompt log-probs at a real vocabulary."""
    if not engine.v2_runner and engine.vocab_size > V1_SCORING_VOCAB_LIMIT:
        raise ValueError(
            f"pools.teacher.backend vllm: this vLLM runner (V1, e.g. vLLM's CPU build) scores a response by returning"
            f" prompt log-probs over the whole vocabulary ({engine.vocab_size:,} ids) at every prompt row; above"
            f" {V1_SCORING_VOCAB_LIMIT:,} ids that is unusable. Set pools.teacher.backend: transformers (it scores"
            " response rows only and shares each prompt's cache), or run the teacher where vLLM's V2 runner is used (GPU)"
        )


@dataclass
class Kept:
    """What the engine kept of one request's images: the indices per image and, with a token-merge head, each
    image's merge route (assignment, prior), which the learner replays."""

    indices: list[torch.Tensor]
    merge_routes: list[tuple[torch.Tensor, torch.Tensor]] | None

    @classmethod
    def rebuilt(cls, images: list[tuple]) -> Kept:
        """From the model's records, as plain tensors made outside vLLM's inference mode."""
        def plain(t: torch.Tensor) -> torch.Tensor:
            return torch.tensor(t.tolist(), dtype=t.dtype)

        routes = [route for _, route in images]
        return cls([plain(indices) for indices, _ in images],
                   [(plain(a), plain(p)) for a, p in routes] if all(r is not None for r in routes) else None)


class VLLMEngine:
    """One vLLM engine on a local model folder (fp32 or bf16; on CPU the Qwen3.5 family needs bf16)."""

    _nonces = itertools.count(1)

    def __init__(self, model_dir: str | Path, dtype: str = "float32", max_model_len: int = 4096,
                 max_logprobs: int = 128, max_images: int = 1, max_videos: int = 0, seed: int = 0,
                 min_pixels: int | None = None, max_pixels: int | None = None, token_merge: bool = False,
                 tuning: VLLMSettings | None = None):
        """`token_merge`: give the student a learnable token-merge head although its folder has none (a run
        starting from the base model; a folder that has one gets it anyway). `tuning`: the pool's engine
        settings (memory share, batch size, CUDA graphs, prefix caching)."""
        import json

        from lt_opd_ray.core.families import family_of_config
        from lt_opd_ray.models.token_merge import merge_parameter_shapes, settings

        self.model_dir = Path(model_dir)
        check_architecture(self.model_dir)
        config = json.loads((self.model_dir / "config.json").read_text())
        dim = config.get("text_config", config)["hidden_size"]
        family = family_of_config(config, str(self.model_dir))
        merging = token_merge or learnable_merge(config) is not None
        self.merge_shapes = merge_parameter_shapes(dim) if merging else {}
        self._learner_shapes = None  # weight_shapes, read once
        configure_environment()
        from vllm import LLM

        from lt_opd_ray.engines.vllm.models import register

        register()
        on_gpu = torch.cuda.is_available()
        tuning = tuning or VLLMSettings()
        self.llm = LLM(
            model=str(self.model_dir),
            dtype=dtype,
            max_model_len=max_model_len,
            # the V1 runner (vLLM's CPU build) scores requested ids from the full vocabulary
            max_logprobs=max_logprobs if on_gpu else -1,
            limit_mm_per_prompt={"image": max_images, "video": max_videos},
            mm_processor_kwargs=image_bounds(family, min_pixels, max_pixels),
            enforce_eager=tuning.enforce_eager or not on_gpu,
            max_num_seqs=tuning.max_num_seqs,
            enable_prefix_caching=tuning.enable_prefix_caching,
            seed=seed,
            logprobs_mode="raw_logprobs",  # log p under the model's distribution, before temperature / top-p
            gpu_memory_utilization=tuning.gpu_memory_utilization if on_gpu else 0.9,
            hf_overrides={"vision_token_compressor": settings(dim)} if token_merge and "vision_token_compressor" not in config else None,
        )
        self.loop = EngineLoop(self.llm)  # every caller's requests in one continuously batched engine
        self.tokenizer = self.llm.get_tokenizer()
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self.v2_runner = bool(getattr(self.llm.llm_engine.vllm_config, "use_v2_model_runner", False))
        self.video_token_id = config["video_token_id"]  # the clip's placeholder in an engine prompt

    @property
    def runner(self) -> str:
        """Which of vLLM's model runners this engine uses, as the start-up line names it."""
        return "vLLM V2 runner" if self.v2_runner else f"vLLM V1 runner ({'CPU build' if not torch.cuda.is_available() else 'VLLM_USE_V2_MODEL_RUNNER=0'})"

    # --------------------------------------------------------------- rollouts
    def generate(
        self,
        prompts: list[EnginePrompt],
        selections: list[SelectionRequest],
        params: SamplingParams,
        seeds: list[int],
    ) -> list[tuple[Completion, Kept]]:
        """One sampled response per prompt, with what was kept of each of its images. Safe to call from several
        threads at once: their requests share the engine's batch (`EngineLoop`)."""
        from vllm import SamplingParams as VLLMSamplingParams

        if not len(prompts) == len(selections) == len(seeds):
            raise ValueError(f"{len(prompts)} prompts, {len(selections)} selections, {len(seeds)} seeds")
        requests, vllm_params = [], []
        nonces: dict[tuple, int] = {}
        for prompt, selection, seed in zip(prompts, selections, seeds):
            # identical requests (the n samples of a prompt) share one nonce: their multimodal inputs and
            # hashes are then equal, so vLLM runs the vision tower and the selection once and can reuse the prefix
            same = (selection, tuple(prompt.token_ids), tuple(id(image) for image in prompt.images), id(prompt.video))
            nonce = nonces.setdefault(same, next(self._nonces))
            requests.append(self._request(prompt, _with_nonce(selection, nonce)))
            vllm_params.append(
                VLLMSamplingParams(
                    max_tokens=params.max_new_tokens,
                    temperature=0.0 if params.greedy else params.temperature,
                    top_p=params.top_p,
                    seed=seed,
                    logprobs=params.top_k_logprobs,
                    stop=list(params.stop),
                    include_stop_str_in_output=True,
                    stop_token_ids=list(params.eos_token_ids),
                    skip_special_tokens=False,
                    detokenize=bool(params.stop),  # text is only needed to find stop strings
                    flat_logprobs=True,  # a few flat lists instead of a dict per position
                )
            )
        outputs = self.loop.run(requests, vllm_params)
        kept = self.selections(list(nonces.values()))
        results = []
        for request, output in zip(requests, outputs):
            completion = output.outputs[0]
            logprobs, top_ids = (None, None) if params.top_k_logprobs is None else _sampled_and_top(
                completion.logprobs, completion.token_ids, params.top_k_logprobs)
            finish = "length"
            if completion.finish_reason == "stop":  # vLLM's stop: a stop string (str reason) or an end token
                finish = "stop" if isinstance(completion.stop_reason, str) else "eos"
            results.append(
                (
                    Completion(
                        token_ids=torch.tensor(completion.token_ids, dtype=torch.long),
                        logprobs=logprobs,
                        top_ids=top_ids,
                        finish_reason=finish,
                    ),
                    kept[request["mm_processor_kwargs"][SelectionRequest.PREFIX + "nonce"]],
                )
            )
        return results

    def _request(self, prompt: EnginePrompt, selection: SelectionRequest) -> dict:
        selection = SelectionRequest(**{**selection.__dict__, "query_ids": tuple(prompt.query_ids)})
        media = {"image": prompt.images if len(prompt.images) > 1 else prompt.images[0]} if prompt.images else {}
        if prompt.video is not None:
            media["video"] = prompt.video
        return {"prompt_token_ids": prompt.token_ids, "multi_modal_data": media, "mm_processor_kwargs": selection.as_kwargs()}

    def selections(self, nonces: list[int]) -> dict[int, Kept]:
        """What the model recorded for these request nonces: kept indices, and merge routes with a merge head."""
        recorded = self.loop.call(lambda llm: llm.collective_rpc(_pop_selections, args=(list(nonces),))[0])
        # rebuilt outside vLLM's inference mode, so they can index tensors that need gradients
        found = {nonce: Kept.rebuilt(images) for nonce, images in recorded.items()}
        missing = [n for n in nonces if n not in found]
        if missing:
            raise RuntimeError(f"the engine recorded no selection for request nonce(s) {missing}")
        return found

    # ---------------------------------------------------------------- scoring
    def score(
        self,
        prompts: list[EnginePrompt],
        responses: list[torch.Tensor],
        requested: list[torch.Tensor],
        top_k: int,
    ) -> list[ScoredResponse]:
        """Full-token log-probs at each response position: top-k ids and values, and at the requested ids [T, m]."""
        from vllm import SamplingParams as VLLMSamplingParams

        requests, vllm_params = [], []
        full = SelectionRequest()  # every visual token
        for prompt, response, ids in zip(prompts, responses, requested):
            if ids.shape[0] != response.numel():
                raise ValueError(f"{ids.shape[0]} rows of requested ids for a response of {response.numel()} tokens")
            request = self._request(prompt, full)
            request["prompt_token_ids"] = prompt.token_ids + response.tolist()
            requests.append(request)
            extra = {}
            if self.v2_runner:
                # rows count in vLLM's expanded prompt: the full-token prompt, then the response
                extra = dict(prompt_logprob_token_ids=ids.tolist(), prompt_logprob_start=prompt.full_length - 1)
            vllm_params.append(
                VLLMSamplingParams(
                    max_tokens=1,
                    prompt_logprobs=top_k if self.v2_runner else -1,
                    detokenize=False,
                    flat_logprobs=True,
                    **extra,
                )
            )
        outputs = self.loop.run(requests, vllm_params)
        scored = []
        for response, ids, output in zip(responses, requested, outputs):
            scored.append(self._read_scores(output, response.numel(), ids, top_k))
        return scored

    def _read_scores(self, output, length, ids, top_k) -> ScoredResponse:
        # prompt_logprobs row i is the distribution that predicted prompt token i: the last `length` rows are the
        # response's; each row holds the prompt token's entry, then ranks 1..k (V1: the whole vocabulary)
        token_ids, logprobs = flat_rows(output.prompt_logprobs, length, top_k if self.v2_runner else self.vocab_size)
        if self.v2_runner:
            requested_logp = torch.as_tensor(output.prompt_token_id_logprobs, dtype=torch.float32)
            return ScoredResponse(token_ids[:, 1:].to(torch.int32), logprobs[:, 1:], requested_logp)
        full = torch.full((length, self.vocab_size), float("-inf")).scatter_(1, token_ids[:, 1:], logprobs[:, 1:])
        top_logp, top_ids = torch.topk(full, min(top_k, self.vocab_size), dim=-1)
        return ScoredResponse(top_ids.to(torch.int32), top_logp, full.gather(-1, ids.long()))

    # ---------------------------------------------------------------- weights
    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """The weights an update must bring: what the learner sends, its transformers class's parameters for the
        folder's config (a tied output head once, under the embedding's name; no multi-token-prediction head, which
        Qwen3.5 checkpoints carry and the student neither has nor samples with) and, with a token merge, its head's
        tensors. Whatever names the folder's own tensors use: Qwen2.5-VL releases keep the pre-4.52 `visual.*` /
        `model.layers.*` layout, which transformers renames on load and vLLM's loader maps as it maps the new one."""
        if self._learner_shapes is None:
            self._learner_shapes = parameter_shapes(self.model_dir)
        return self._learner_shapes | self.merge_shapes

    def write_weights(self, stream) -> None:
        """Write (name, tensor) pairs in checkpoint format into the engine's own parameters, in place.

        vLLM's layerwise reload buffers a layer's tensors until the layer is complete, then loads
        and repacks it: with a stream that brings each layer in one piece (the weight sync's buckets
        never split a layer), no more than a layer is held besides the model. Refused while any request is
        being sampled: no sequence is sampled across a weight change.
        """
        def write(llm):
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream})
            llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

        self.loop.call(write, idle=True)

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Replace weights in place from tensors at hand; names and shapes are checked first, and a mismatch is refused whole."""
        problems = Layout.of(named_tensors, "float32").mismatches(self.weight_shapes(), complete=False)  # as a sync checks
        if problems:
            raise WeightMismatchError(f"weight update refused, nothing changed ({len(problems)} problem(s)): " + "; ".join(problems[:8]))
        self.write_weights(iter(named_tensors))


def image_bounds(family, min_pixels: int | None, max_pixels: int | None) -> dict | None:
    """The engine's processor kwargs for VLMProcessor's image resize bounds (None: the model folder's). A clip's frames
    keep the video processor's own bounds, as VLMProcessor's clips do: vLLM's Qwen processors would route flat bounds
    to their video processor too, so theirs are scoped to images; GLM-4V's route flat ones to images only (and take
    no scoped ones)."""
    bounds = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v}
    if not bounds:
        return None
    return bounds if family.clip_layout == "stamp_after" else {"images_kwargs": bounds}


def flat_rows(flat, rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last `rows` positions of vLLM's flat logprobs as tensors: ids [rows, 1 + k] and log-probs [rows, 1 + k].

    vLLM writes every position as the position's own token (sampled, or the prompt's) followed by ranks 1..k in
    rank order, so a position is a fixed-width slice of the flat lists: read with one gather, no per-entry Python.
    """
    starts = torch.tensor(flat.start_indices[len(flat.start_indices) - rows :], dtype=torch.long)
    ends = torch.tensor(flat.end_indices[len(flat.end_indices) - rows :], dtype=torch.long)
    if rows and not bool((ends - starts == k + 1).all()):
        bad = int((ends - starts != k + 1).nonzero()[0])
        raise RuntimeError(f"vLLM logprobs: position {bad} of the last {rows} holds {int(ends[bad] - starts[bad])} entries, expected 1 + {k}")
    first = int(starts[0]) if rows else 0
    entries = slice(first, first + rows * (k + 1))  # the positions are contiguous in the flat lists
    if rows and list(flat.ranks[first + 1 : first + k + 1]) != list(range(1, k + 1)):
        raise RuntimeError("vLLM logprobs: the entries after a position's own token are not ranks 1..k in order")
    token_ids = torch.tensor(flat.token_ids[entries], dtype=torch.long).reshape(rows, k + 1)
    logprobs = torch.tensor(flat.logprobs[entries], dtype=torch.float32).reshape(rows, k + 1)
    return token_ids, logprobs


def _sampled_and_top(flat, tokens: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per generated token: its log-prob [T] and the top-k ids [T, k], from vLLM's flat sample logprobs."""
    token_ids, logprobs = flat_rows(flat, len(tokens), k)
    off = (token_ids[:, 0] != torch.tensor(tokens, dtype=torch.long)).nonzero()
    if off.numel():
        raise RuntimeError(f"vLLM logprobs out of step with the sampled tokens at position {int(off[0])}")
    return logprobs[:, 0], token_ids[:, 1:]


def _with_nonce(selection: SelectionRequest, nonce: int) -> SelectionRequest:
    return SelectionRequest(**{**selection.__dict__, "nonce": nonce})


def check_architecture(model_dir: Path) -> None:
    import json

    from lt_opd_ray.core.families import UnsupportedArchitectureError, vllm_model_problem

    config_path = model_dir / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{config_path}: no model config (a vLLM engine needs a local Hugging Face model folder)")
    config = json.loads(config_path.read_text())
    if problem := vllm_model_problem(config, str(config_path)):
        raise UnsupportedArchitectureError(problem)
    if not torch.cuda.is_available():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        text = config.get("text_config", config)
        head_size = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
        supported = CPUAttentionBackend.get_supported_head_sizes()
        if head_size not in supported:
            raise UnsupportedArchitectureError(
                f"{config_path}: attention head size {head_size}; vLLM's CPU attention runs head sizes"
                f" {', '.join(map(str, supported))} only: serve or sample it on a GPU; a job can run it on this machine"
                " with the transformers engine (pools.rollout.backend and pools.teacher.backend: transformers)"
            )


def _pop_selections(worker, nonces):
    return worker.get_model().pop_selections(nonces)
