"""What a rollout engine holds, tensor by tensor, against the learners' weights.

The sync's digest says the engine was handed every byte; these say every tensor the engine computes with is the
learners' copy in the dtype it was sent in, and name the first that is not. The transformers engine holds the
learners' parameter names: each is compared with the learner's tensor cast to the engine's dtype, exactly. vLLM holds
its own layout (q/k/v and gate/up fused, heads repacked), so the learners' tensors, cast to the dtype they are sent
in, are written through vLLM's own reload (not the engine's `write_weights`, the path under test) and every parameter
and buffer it then holds is compared with what it held before: a tensor the sync left stale, or wrote wrong, is one
that the write changes.

The functions run inside a rollout worker (`worker.__ray_call__`), or on an engine at hand in a test.
"""

from __future__ import annotations

import torch


def module_mismatches(module: torch.nn.Module, learners: dict[str, torch.Tensor]) -> list[str]:
    """Each of the module's parameters that is not the learners' tensor cast to its dtype (a name the learners lack
    too), in the module's order."""
    problems = []
    held = dict(module.named_parameters())
    for name in sorted(set(learners) - set(held)):
        problems.append(f"{name}: sent by the learners, held by no parameter")
    for name, parameter in held.items():
        if name not in learners:
            problems.append(f"{name}: not among the learners' weights")
        elif not torch.equal(parameter.detach(), learners[name].to(parameter.dtype)):
            off = (parameter.detach().double() - learners[name].double()).abs().max()
            problems.append(f"{name}: max |held - learners'| {float(off):.3g}")
    return problems


def vllm_model(engine):
    """The model of an in-process vLLM engine (engines/vllm/engine.VLLMEngine)."""
    return engine.llm.collective_rpc(lambda worker: worker.get_model())[0]


def vllm_mismatches(engine, learners: dict[str, torch.Tensor], dtype: torch.dtype) -> list[str]:
    """Each tensor of the vLLM engine that writing the learners' weights (in `dtype`, through vLLM's own reload)
    changes: those it held were not the learners'. The write leaves the engine holding the learners' weights."""
    model = vllm_model(engine)
    before = {n: t.detach().clone() for n, t in model.state_dict().items()}
    # vLLM's own reload, not the engine's write_weights (the path under test): the engine is idle between updates
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter([(n, t.to(dtype)) for n, t in learners.items()])})
    after = model.state_dict()
    problems = [f"{name}: a tensor vLLM held is gone after the write" for name in before if name not in after]
    for name, tensor in after.items():
        if name in before and not torch.equal(before[name], tensor):
            off = (before[name].double() - tensor.double()).abs().max()
            problems.append(f"{name}: max |held - learners'| {float(off):.3g}")
    return problems


def worker_mismatches(worker, learners: dict[str, torch.Tensor], wire_dtype: str) -> list[str]:
    """`module_mismatches` or `vllm_mismatches` of a rollout worker's engine, the learners' weights sent in
    `wire_dtype` (call through `worker.__ray_call__`)."""
    engine = worker.engine
    if engine.runner == "transformers":
        return module_mismatches(engine.vlm.model, learners)
    return vllm_mismatches(engine.engine, learners, getattr(torch, wire_dtype))


def assert_engines_hold(driver, learners: dict, version: int, wire_dtype: str = "float32") -> None:
    """Every rollout worker of a running driver holds weights `version`, which are the learners' (`learners`, sent in
    `wire_dtype`): the digest of what each was sent, and every tensor its engine computes with (`worker_mismatches`,
    naming those that differ)."""
    import ray

    for worker in driver.rollouts.workers:
        problems = ray.get(worker.__ray_call__.remote(worker_mismatches, learners, wire_dtype))
        assert not problems, f"{len(problems)} tensor(s) held are not the learners': " + "; ".join(problems[:4])
    assert driver.rollouts.checksums(wire_dtype) == [(version, driver.learners.weights_checksum(wire_dtype))] * len(driver.rollouts.workers)
