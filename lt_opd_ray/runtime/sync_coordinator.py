"""Control plane of the weight broadcast: forms the sync group, bounds every broadcast by a timeout, and recovers
from a rollout worker lost mid-broadcast.

Only small control messages pass through here; the weights go learner rank 0 ->
workers over the sync group (gloo on CPU, NCCL on GPU). A broadcast that does not
finish in time fails with the names of the workers that did not answer. A worker
that dies mid-stream leaves the other members blocked in the collective (NCCL never
notices a dead peer; gloo only at its timeout): the survivors and learner rank 0 are
told to abort the group (a call in their control thread), the dead worker is replaced,
the group re-formed under a new generation and the weights sent again. The learners
never leave their own group in between (rank 0 keeps gathering: `broadcast_weights`).
"""

from __future__ import annotations

import ray

from lt_opd_ray.core.wire import SyncResult
from lt_opd_ray.runtime.learner_group import LearnerGroup
from lt_opd_ray.runtime.rollout_pool import RolloutPool
from lt_opd_ray.runtime.waits import wait_for
from lt_opd_ray.weight_sync.ends import WeightSyncError

SETTLE_S = 60.0  # members freed by an abort answer within this; longer: they are stuck for another reason


def wait_all(refs: list, names: list[str], timeout_s: float, what: str) -> list:
    return wait_for(refs, names, timeout_s, what, error=WeightSyncError)


class WeightBroadcaster:
    def __init__(self, learners: LearnerGroup, pool: RolloutPool, timeout_s: float):
        self.learners, self.pool = learners, pool
        self.timeout_s = timeout_s
        self.generation = 0
        self.replaced: list[str] = []  # workers replaced after dying mid-broadcast, in order (the driver's metrics)
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
        """Send the learners' current weights as `version`; every worker checks it received exactly that. A worker
        that died during it is replaced and the broadcast runs again (once)."""
        send, receive = self._start(version)
        try:
            return self._result(version, send, receive)
        except (ray.exceptions.RayActorError, WeightSyncError):
            dead = self.pool.dead_workers()
            if not dead:
                raise  # a learner died (the learner group names it), or the sync failed for another reason
        self._abort(send + receive, dead)
        for index in dead:
            self.pool.replace(index)
            self.replaced.append(self.pool.names[index])
        self.connect()
        return self._result(version, *self._start(version))

    def broadcast_inside_step(self, version: int) -> SyncResult:
        """The weights `version` to every worker while the learners' step waits for rollouts only these workers can
        now sample (all of them were lost inside the update and replaced): learner rank 0 sends from its own thread
        (`send_weights_inside_step`, ZeRO 0-2). A failure here ends the update (no second recovery inside one)."""
        send = [self.learners.actors[0].send_weights_inside_step.remote(version)]
        return self._result(version, send, [worker.receive_weights.remote(version) for worker in self.pool.workers])

    def _start(self, version: int) -> tuple[list, list]:
        send = [actor.broadcast_weights.remote(version) for actor in self.learners.actors]
        receive = [worker.receive_weights.remote(version) for worker in self.pool.workers]
        return send, receive

    def _result(self, version: int, send: list, receive: list) -> SyncResult:
        names = [f"learner-{r}" for r in range(len(send))] + list(self.pool.names)
        results = wait_all(send + receive, names, self.timeout_s, f"weight broadcast v{version}")
        sent = results[0]  # learner rank 0's WeightsSent; then the other ranks', then every worker's WeightsReceived
        return SyncResult(version, sent.bytes, sent.dtype, max(r.seconds for r in results))

    def _abort(self, refs: list, dead: list[int]) -> None:
        """Free every live member of the broken group and wait until each has left its broadcast call."""
        alive = [w for i, w in enumerate(self.pool.workers) if i not in dead]
        ray.wait([member.abort_weight_sync.remote() for member in [self.learners.actors[0], *alive]],
                 num_returns=1 + len(alive), timeout=SETTLE_S)
        _, stuck = ray.wait(refs, num_returns=len(refs), timeout=SETTLE_S)
        if stuck:
            raise WeightSyncError(f"weight broadcast: {len(stuck)} member(s) did not leave the aborted sync group within {SETTLE_S:.0f} s")
