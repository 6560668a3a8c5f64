"""The paper-shaped job (jobs/train_qwen35_shape.yaml) for one update on CPU: the main job's shapes on a narrow model.

Real vocabulary (248,320), ~800-token full prompts (728 visual tokens), the 5% budget,
responses of up to 1,024 tokens, top-100 supports, 2 ZeRO-3 learner ranks in token-budgeted
micro-batches. The job samples n = 8 per prompt; the test samples 4, which halves the sampling
over the 248,320-way vocabulary (most of the update) and changes no shape a sequence has.
"""

import pytest

from lt_opd_ray.config.loading import load_job
from lt_opd_ray.core.batch_order import batches
from lt_opd_ray.core.curriculum import tokens_to_keep
from lt_opd_ray.core.microbatch import Packer, Sequence
from lt_opd_ray.core.wire import payload_bytes_per_position
from lt_opd_ray.runtime.driver import Driver
from lt_opd_ray.runtime.resources import check_resources
from lt_opd_ray.sources.resolve import load_samples, resolve_model_dir


@pytest.mark.slow
def test_one_update_of_the_paper_shaped_job(cluster, tmp_path):
    job = load_job("jobs/train_qwen35_shape.yaml")
    assert job.sampling.n == 8  # the paper's
    job = job.model_copy(update={"checkpoint": job.checkpoint.model_copy(update={"dir": str(tmp_path / "run")}),
                                 "sampling": job.sampling.model_copy(update={"n": 4})})
    check_resources(job, {"CPU": 2.0})  # the pools fit a 2-core box, as the job's header says (the shared cluster has 8)
    driver = Driver(job)
    try:
        log = driver.run_step()
        vocab = driver.learners.full_state_dict()["lm_head.weight"].shape[0]
    finally:
        driver.shutdown()
    assert vocab == 248320
    assert log.sequences == 8 and 8 <= log.tokens <= 8 * 1024
    # the 5% budget on 728 visual tokens a prompt: each sequence the learners trained is its prompt with 37 of them
    # kept, then its response (the prompts encoded here, as update 0 drew them)
    from lt_opd_ray.models.processor import VLMProcessor, encode_samples

    assert log.budget_bps == 500 and tokens_to_keep(728, 500, job.budget.k_min) == 37
    rows = next(batches(load_samples(job.data.path, job.data.image_root, job.seed), 2, job.data.shuffle_seed))
    encoded = encode_samples(VLMProcessor.for_data(resolve_model_dir(job.model.path), job.data), rows, job.data.system_prompt)
    assert [int((p.mm_token_type_ids == 1).sum()) for p in encoded] == [728, 728]
    reduced = sum(p.input_ids.numel() - 728 + 37 for p in encoded)
    assert sum(n for rank in log.sequence_lengths for lengths in rank for n in lengths) == 4 * reduced + log.tokens
    # the learners ran the packer's micro-batches on the lengths they logged (packed rows: each rank's 4 sequences of
    # ~1,090 tokens do not fit one 4,096-token micro-batch), and the ranks in lockstep: each rank as many passes as the
    # busiest, the difference zero-weighted fillers
    assert job.pools.learner.packing
    counts, computed = [], 0
    for prompts in log.sequence_lengths:
        packer = Packer(job.pools.learner.micro_batch_tokens, packed=True)
        micro_batches = [batch for p, lengths in enumerate(prompts) for batch in packer.add([Sequence(i, p, n) for i, n in enumerate(lengths)])]
        micro_batches += packer.flush()
        counts.append(len(micro_batches))
        computed += sum(batch.computed_tokens for batch in micro_batches)
    real = sum(n for prompts in log.sequence_lengths for lengths in prompts for n in lengths)
    assert computed == real and log.padding_share == 0.0  # packed rows compute the sequences' own tokens, no padding
    assert [sum(len(lengths) for lengths in prompts) for prompts in log.sequence_lengths] == [4, 4]
    assert log.micro_batches == sum(counts) >= 4, (counts, log.sequence_lengths)
    assert log.filler_micro_batches == len(counts) * max(counts) - sum(counts)
    # the payload, byte for byte: per position top-100 int32 ids, their fp32 log-probs and 101 requested log-probs;
    # per sequence one int32 length
    per_position = payload_bytes_per_position(job.objective.top_k, job.pools.teacher.payload_dtype)
    assert per_position == 100 * 4 + 100 * 4 + 101 * 4
    assert log.payload_bytes_per_token == pytest.approx(per_position + 4 * log.sequences / log.tokens, rel=1e-12)
    # update 0 trains the weights that sampled it, in the same dtype: the truncated importance weight is 1 up to the
    # rounding of the sampler's batch against the learner's micro-batches, over the 248,320-way vocabulary
    assert log.importance_weight == pytest.approx(1.0, abs=1e-3)
