"""The reward's judge (`reward.name: judge`) behind a Ray Serve deployment of its own, `pools.reward`: replicas each
holding the judge model (evals/judge.py), scaled apart from the other pools, asked by the rollout workers for each
call's responses as they sample them. `@serve.batch` joins the calls that arrive together into one request list."""

from __future__ import annotations

from collections.abc import Sequence

from ray import serve

from lt_opd_ray.config.schema import JobConfig
from lt_opd_ray.core.samples import Sample
from lt_opd_ray.core.wire import ActorPlacement
from lt_opd_ray.runtime.resources import placement_here
from lt_opd_ray.runtime.serve_apps import delete_app, deploy, deployment_options, wait_running


def reward_app(job: JobConfig) -> str:
    return f"{job.name}-reward"


@serve.deployment
class JudgeDeployment:
    def __init__(self, job: JobConfig):
        import os

        import transformers

        from lt_opd_ray.evals.judge import Judge

        transformers.logging.set_verbosity_error()
        self.name = f"reward-{os.getpid()}"
        self.judge = Judge(job.reward.judge, job.data, dtype=job.model.dtype)
        self.judge_batch.set_max_batch_size(job.pools.reward.max_batch_size)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)
    async def judge_batch(self, requests: list[tuple]) -> list[list[float]]:
        rows = [row for samples, _ in requests for row in samples]
        values = self.judge(rows, [text for _, responses in requests for text in responses])
        out, offset = [], 0
        for samples, _ in requests:
            out.append(values[offset : offset + len(samples)])
            offset += len(samples)
        return out

    async def score(self, samples: list[Sample], responses: list[str]) -> list[float]:
        return await self.judge_batch((samples, responses))

    async def placement(self) -> tuple[str, ActorPlacement]:
        """(this replica's Serve id, its placement)."""
        return serve.get_replica_context().replica_id.unique_id, placement_here(self.name, "transformers")


class RewardService:
    """Client side: deploys the judge's app (`pools.reward`) and removes it."""

    def __init__(self, job: JobConfig):
        self.app_name = reward_app(job)
        self.handle = deploy(JudgeDeployment.options(**deployment_options(job.pools.reward, job)).bind(job), self.app_name, job.name)

    def wait_ready(self) -> float:
        return wait_running(self.app_name)

    def placements(self, attempts: int = 64) -> list[ActorPlacement]:
        """Every running replica's placement (Serve routes each call to a replica of its choosing)."""
        running = int(serve.status().applications[self.app_name].deployments["JudgeDeployment"].replica_states.get("RUNNING", 0))
        found: dict[str, ActorPlacement] = {}
        for _ in range(attempts):
            if len(found) >= running:
                break
            replica, placement = self.handle.placement.remote().result(timeout_s=60)
            found[replica] = placement
        return sorted(found.values(), key=lambda p: p.actor)

    def shutdown(self) -> None:
        delete_app(self.app_name)


class JudgeClient:
    """The judge as a rollout worker asks it: the reward (`evals/rewards.JobReward`) of its call's responses, from the
    judge's app; waits up to `timeout_s` (schedule.wait_timeout_s)."""

    def __init__(self, app_name: str, timeout_s: float):
        self.app_name, self.timeout_s = app_name, timeout_s
        self.handle = None

    def __call__(self, samples: Sequence[Sample], responses: Sequence[str]) -> list[float]:
        if self.handle is None:
            self.handle = serve.get_app_handle(self.app_name)
        return self.handle.score.remote(list(samples), list(responses)).result(timeout_s=self.timeout_s)
