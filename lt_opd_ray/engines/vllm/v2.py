"""The pruned models under vLLM's V2 model runner (vLLM's default on CUDA).

V2 builds a model state per engine (`vllm/v1/worker/gpu/model_states/`): it asks the
model for its class first (`get_model_state_cls`), else picks the hybrid state for
models with recurrent layers (Qwen3.5) or the default one. That state creates its
multimodal pruner, which splits a pruned image's position channels off its rows and
calls the model's `recompute_mrope_positions`, only when pruning is enabled in the
multimodal config (vLLM's video pruning). Our models prune every image, so their state
is V2's own class with the pruner always created; every other line is vLLM's.
"""

from __future__ import annotations

import functools


def base_model_state(model_cls):
    """The state class V2 picks for a model class that does not choose its own."""
    from vllm.model_executor.models.interfaces import is_hybrid

    if is_hybrid(model_cls):
        from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState

        return MambaHybridModelState
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    return DefaultModelState


def pruning_model_state(model_cls):
    """V2's state class for `model_cls`, with the multimodal pruner on whatever the multimodal config says."""
    return _with_pruner(base_model_state(model_cls))


@functools.cache
def _with_pruner(base):
    from vllm.v1.worker.gpu.model_states.mm_pruning import MultiModalPruner

    class PruningModelState(base):
        def __init__(self, vllm_config, model, encoder_cache, device):
            super().__init__(vllm_config, model, encoder_cache, device)
            if self.mm_pruner is None:
                if self.rope_state is None or encoder_cache is None:
                    raise ValueError(f"{type(model).__name__}: visual-token pruning needs M-RoPE positions and an encoder cache")
                self.mm_pruner = MultiModalPruner(model, self.rope_state, encoder_cache, self.model_config.get_inputs_embeds_size())

    PruningModelState.__name__ = PruningModelState.__qualname__ = f"Pruning{base.__name__}"
    return PruningModelState
