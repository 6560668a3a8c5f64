"""The reward's judge (`reward.name: judge`) behind a Ray Serve deployment of its own, `pools.reward`: replicas each
holding the judge model (evals/judge.py), scaled apart from the other pools, asked by the rollout workers for each
call's responses as they sample them. `@serve.batch` joins the calls that arrive together into one request list."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from ray import serve

from lt_opd_ray.config.schema import JobConfig
from lt_opd_ray.core.samples import Sample
from lt_opd_ray.core.wire import ActorPlacement
from lt_opd_ray.evals.rewards import RewardError
from lt_opd_ray.runtime.resources import placement_here
from lt_opd_ray.runtime.serve_apps import delete_app, deploy, deployment_options, replica_placements, wait_running


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
        self.judge = Judge(job.reward.judge, job.data, job.model.dtype, micro_batch_tokens=job.pools.reward.micro_batch_tokens)
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

    def placements(self) -> list[ActorPlacement]:
        running = serve.status().applications[self.app_name].deployments["JudgeDeployment"].replica_states.get("RUNNING", 0)
        return replica_placements(self.handle, int(running))

    def shutdown(self) -> None:
        delete_app(self.app_name)


class JudgeClient:
    """The judge as a rollout worker asks it, from any of its threads: the reward (`evals/rewards.JobReward`) of a
    call's responses, from the judge's app. A call the app does not answer in `timeout_s` (schedule.liveness_timeout_s,
    shorter than the driver's wait on the worker), or whose replica dies twice, is a RewardError naming the app, not a
    worker's death."""

    def __init__(self, app_name: str, timeout_s: float):
        self.app_name, self.timeout_s = app_name, timeout_s
        self._handle = None
        self._handle_made = threading.Lock()

    def handle(self):
        with self._handle_made:  # made on first use: the app starts while the workers do
            if self._handle is None:
                self._handle = serve.get_app_handle(self.app_name)
            return self._handle

    def __call__(self, samples: Sequence[Sample], responses: Sequence[str]) -> list[float]:
        from ray.exceptions import RayActorError

        try:
            return self.ask(samples, responses)
        except RayActorError:  # Serve replaces a replica that dies: the call is asked again, once
            try:
                return self.ask(samples, responses)
            except RayActorError as exc:
                raise RewardError(f"reward judge: the replica of {self.app_name} serving a call died twice ({type(exc).__name__})") from None

    def ask(self, samples: Sequence[Sample], responses: Sequence[str]) -> list[float]:
        try:
            return self.handle().score.remote(list(samples), list(responses)).result(timeout_s=self.timeout_s)
        except TimeoutError:
            raise RewardError(f"reward judge: the Serve app {self.app_name} answered no call in {self.timeout_s:g} s"
                              " (schedule.liveness_timeout_s)") from None
