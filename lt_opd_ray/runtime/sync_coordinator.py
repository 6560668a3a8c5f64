"""Control plane of the weight broadcast: forms the sync group and bounds every broadcast by a timeout.

Only small control messages pass through here; the weights go learner rank 0 ->
workers over the gloo group. A broadcast that does not finish in time fails with
the names of the workers that did not answer.
"""

from __future__ import annotations

from ..wire import SyncResult
from .learner_group import LearnerGroup
from .rollout_pool import RolloutPool
from .waits import wait_for
from .weight_sync import WeightSyncError


def wait_all(refs: list, names: list[str], timeout_s: float, what: str) -> list:
    return wait_for(refs, names, timeout_s, what, error=WeightSyncError)


class WeightBroadcaster:
    def __init__(self, learners: LearnerGroup, pool: RolloutPool, timeout_s: float):
        self.learners, self.pool = learners, pool
        self.timeout_s = timeout_s
        self.generation = 0
        self.host, self.port = wait_all([learners.actors[0].host_weight_sync.remote()], ["learner-0"], timeout_s, "hosting the weight-sync store")[0]
        self.connect()

    def connect(self) -> None:
        """(Re)form the group of learner rank 0 + every current rollout worker, under a fresh generation."""
        self.generation += 1
        world = 1 + len(self.pool.workers)
        refs = [self.learners.actors[0].join_weight_sync.remote(world, self.generation)]
        refs += [
            worker.join_weight_sync.remote(self.host, self.port, rank, world, self.generation, self.timeout_s)
            for rank, worker in enumerate(self.pool.workers, start=1)
        ]
        wait_all(refs, ["learner-0", *self.pool.names], self.timeout_s, "joining the weight-sync group")

    def broadcast(self, version: int) -> SyncResult:
        """Send the learners' current weights as `version`; every worker checks it received exactly that."""
        send = [actor.broadcast_weights.remote(version) for actor in self.learners.actors]
        receive = [worker.receive_weights.remote(version) for worker in self.pool.workers]
        names = [f"learner-{r}" for r in range(len(send))] + list(self.pool.names)
        results = wait_all(send + receive, names, self.timeout_s, f"weight broadcast v{version}")
        sent = results[0]  # learner rank 0's WeightsSent; then the other ranks', then every worker's WeightsReceived
        return SyncResult(version, sent.bytes, sent.dtype, max(r.seconds for r in results))
