"""The same adapter, sampler and reference update on a CUDA device (skipped where there is none)."""

import pytest
import torch
from conftest import FAMILIES, random_image

from lt_opd_ray.core.objective import gather_log_probs
from lt_opd_ray.core.selectors import build_selector
from lt_opd_ray.models.processor import question_messages
from lt_opd_ray.models.sampler import SamplingParams, sample

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_cuda_reduced_sampler_matches_teacher_forced_and_cpu(tiny_dirs, family):
    from transformers import AutoModelForImageTextToText

    from lt_opd_ray.models.adapter import QwenVLM
    from lt_opd_ray.models.processor import VLMProcessor

    processor = VLMProcessor(tiny_dirs[family])
    prompts = [processor.encode(question_messages(q), [random_image(i, 96 + 32 * i, 128)], f"s{i}") for i, q in enumerate(["How many?", "Which letter is it?"])]
    per_device = {}
    for device in ("cpu", "cuda"):
        model = AutoModelForImageTextToText.from_pretrained(tiny_dirs[family], dtype=torch.float32).to(device).eval()
        vlm = QwenVLM(model)
        reduced = []
        for prompt in prompts:
            features = vlm.visual_features(prompt)
            reduced.append(vlm.reduce(prompt, features, vlm.select(prompt, features, build_selector("cdpruner"), 2500, 2)))
        completions = sample(vlm, reduced, SamplingParams(max_new_tokens=8, greedy=True, stop=()), [0, 1], processor.tokenizer)
        for red, c in zip(reduced, completions):
            hidden = vlm.response_hidden([red], [c.token_ids])[0]
            scored = gather_log_probs(hidden, vlm.lm_head.weight, c.token_ids[:, None].to(device), 4)[:, 0].cpu()
            assert (scored - c.logprobs).abs().max().item() <= 1e-5
        per_device[device] = ([r.selected[0] for r in reduced], [c.token_ids for c in completions])
    assert all(torch.equal(a, b) for a, b in zip(per_device["cpu"][0], per_device["cuda"][0]))
    assert all(torch.equal(a, b) for a, b in zip(per_device["cpu"][1], per_device["cuda"][1]))


def test_cuda_reference_update_in_bf16(tiny_dirs):
    from lt_opd_ray.config.loading import parse_job
    from lt_opd_ray.reference import ReferenceTrainer
    from lt_opd_ray.sources.resolve import load_samples

    job = parse_job(
        f'model: {{path: "{tiny_dirs["qwen3_5"]}", dtype: bfloat16}}\n'
        'data: {path: "synthetic:4", max_pixels: 65536}\n'
        "budget: {k_min: 2}\nobjective: {top_k: 8}\nsampling: {prompts_per_step: 2, n: 2, max_new_tokens: 6}\n"
    )
    trainer = ReferenceTrainer(job)
    assert trainer.student.device.type == "cuda"
    report = trainer.update(load_samples("synthetic:4")[:2])
    assert torch.isfinite(torch.tensor(report.stats.loss)) and report.stats.tokens > 0


def test_nccl_takes_the_lockstep_flags_and_the_weight_sync_on_the_device(tmp_path):
    """World size 1 over NCCL: the learners' flags reduced where NCCL wants them, a sync group broadcasting a bucket
    finished on the device, and an abort that frees the group (core/collectives.py, weight_sync/group.py)."""
    from datetime import timedelta

    import torch.distributed as dist

    from lt_opd_ray.core.collectives import all_reduce_max, install_guard
    from lt_opd_ray.runtime.rollout_pool import sync_device
    from lt_opd_ray.weight_sync.ends import WeightSyncAborted
    from lt_opd_ray.weight_sync.group import SyncGroup, host_store

    install_guard()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        assert all_reduce_max([True, False]) == [1, 0]
        group = SyncGroup(host_store("127.0.0.1", 0, 1, 60.0), 0, 1, 1, 60.0, device=sync_device())
        assert group._broadcast(torch.arange(4, device="cuda")).tolist() == [0, 1, 2, 3]
        group.abort()
        with pytest.raises(WeightSyncAborted):
            group._broadcast(torch.arange(4, device="cuda"))
    finally:
        dist.destroy_process_group()


def test_a_packed_row_through_the_varlen_kernels_equals_the_per_sequence_loop(monkeypatch):
    """On CUDA in bf16 a packed row's attention is one variable-length flash-attention call (`varlen_kernels`); it
    gives what the per-sequence SDPA loop (the fallback, the CPU's path) gives, forward and backward, within bf16's
    rounding; so does fla's varlen delta rule against the loop, where fla is installed."""
    from test_packing import Attention, packed_qkv

    from lt_opd_ray.models import packing

    assert "attention" in packing.varlen_kernels(torch.device("cuda"), torch.bfloat16)
    found = packing.varlen_kernels

    def both(run):
        """(output, gradients) through the varlen kernels, then through the per-sequence loop."""
        results = []
        for kernels in (found, lambda device, dtype: frozenset()):
            monkeypatch.setattr(packing, "varlen_kernels", kernels)
            out, inputs = run()
            out.float().square().sum().backward()
            results.append((out.detach().float(), [t.grad.float() for t in inputs]))
        return results

    def attention():
        q, k, v, bounds = packed_qkv("cuda", torch.bfloat16, lengths=(130, 7, 512, 64))
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        return packing.packed_attention(Attention(), q, k, v, None, cu_seq_lens_q=bounds)[0], (q, k, v)

    (fused, fused_grads), (looped, looped_grads) = both(attention)
    torch.testing.assert_close(fused, looped, rtol=2e-2, atol=2e-2)
    for a, b in zip(fused_grads, looped_grads):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)
    if "delta_rule" not in found(torch.device("cuda"), torch.bfloat16):
        return  # fla is not installed here: the delta rule loops either way
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

    packing.segment_linear_attention()
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = (130, 7, 512, 64)
    bounds = packing.row_bounds(list(lengths))["cu_seq_lens_q"]

    def delta_rule():
        g.manual_seed(0)  # the same inputs for both paths
        L = sum(lengths)
        q, k, v = (torch.randn(1, L, 4, 64, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_(True) for _ in range(3))
        gate = -torch.rand(1, L, 4, device="cuda", generator=g)
        beta = torch.rand(1, L, 4, device="cuda", generator=g, dtype=torch.bfloat16)
        out, _ = qwen3_5.torch_chunk_gated_delta_rule(q, k, v, g=gate, beta=beta, initial_state=None, output_final_state=False,
                                                      use_qk_l2norm_in_kernel=True, cu_seqlens=bounds)
        return out, (q, k, v)

    (fused, fused_grads), (looped, looped_grads) = both(delta_rule)
    torch.testing.assert_close(fused, looped, rtol=5e-2, atol=5e-2)
    for a, b in zip(fused_grads, looped_grads):
        torch.testing.assert_close(a, b, rtol=1e-1, atol=1e-1)
