"""DAPO's dynamic sampling in the driver (core/dynamic_sampling.py): a prompt slot whose group of responses got one
reward is given its next reserved row as soon as that group's rewards are in, sampled by the next live worker in turn,
up to reward.dynamic_sampling_rounds times; every other slot goes on meanwhile, none waits for a round's slowest group.
A worker that dies on them is stopped and its groups sampled again elsewhere (the same rollouts: sampling is seeded by
update, row and response, not by worker)."""

from __future__ import annotations

import itertools
from collections import Counter

from ray.exceptions import RayActorError

from lt_opd_ray.core.dynamic_sampling import is_flat, reserve_rows
from lt_opd_ray.runtime.in_flight import InFlight
from lt_opd_ray.runtime.waits import RoleDiedError, wait_any


class DynamicSampling:
    """The driver's dynamic-sampling part: what it uses of the driver is its job, rows, object store, rollout pool,
    metrics, weight sync and its bookkeeping of lost workers (`live_workers`, `died`, `lost_workers`, `stepping`)."""

    def resample_flat_groups(self, flight: InFlight) -> None:
        """Every slot's group judged, each flat one moved on to its slot's next reserved row until one is not flat or
        the slot's rounds are spent (`flight.flat` counts those). Before a step starts (with max_staleness 1 while the
        learners train on the update before); the learners get the update once every slot's last group is judged."""
        rounds = self.job.reward.dynamic_sampling_rounds
        reserved = reserve_rows(self.samples, self.job.data.shuffle_seed, flight.update, {s.uid for s in flight.batch},
                                [g.start for g in flight.groups], rounds)
        moved = Counter()  # per group: the rows its slot was given
        pending, turn = set(range(len(flight.groups))), itertools.count()
        what = f"rewards of update {flight.update}'s rollout groups (dynamic sampling)"
        while pending:
            for i, rewards in sorted(self.rewards_ready(flight, sorted(pending), what).items()):
                pending.remove(i)
                if not is_flat(rewards):
                    continue
                if moved[i] == rounds:
                    flight.flat += 1
                    continue
                slot = flight.groups[i].start
                flight.batch[slot] = reserved[slot][moved[i]]
                flight.drawn[slot] = flight.batch[slot].uid
                moved[i] += 1
                flight.resampled += 1
                workers = self.live_workers()
                self.sample_slots(flight, [i], [workers[next(turn) % len(workers)]])
                pending.add(i)
        if flight.drawn:
            flight.samples_ref = self.objects.put(flight.batch)  # the rows the learners train on (and a lost group's resample reads)

    def rewards_ready(self, flight: InFlight, indices: list[int], what: str) -> dict[int, tuple[float, ...]]:
        """The rewards of those of `flight.groups[indices]` sampled by now, as soon as any is. A worker that died on
        them is stopped (replaced after the update) and its groups sampled again by the live workers; with none
        left, every worker is replaced now (`replace_every_worker`)."""
        while True:
            groups = [flight.groups[i] for i in indices]
            try:
                ready = wait_any([g.summary for g in groups], [self.rollouts.names[g.worker] for g in groups],
                                 self.job.schedule.wait_timeout_s, what, objects=self.objects)
                return {indices[position]: summary.rewards for position, summary in ready.items()}
            except RayActorError:
                dead = {g.worker for g in groups if self.died(g)}
                if not dead:
                    raise
                again = [i for i in indices if flight.groups[i].worker in dead]
                survivors = [w for w in self.live_workers() if w not in dead]
                if survivors:
                    for worker in sorted(dead):
                        self.rollouts.stop(worker)
                        self.lost_workers.add(worker)
                    how = "replaced after the update"
                else:
                    dead |= self.lost_workers  # stopped earlier inside the update: none lives
                    survivors = self.replace_every_worker(dead, what)
                    how = f"no worker left: all replaced now and given weights v{self.step}"
                self.sample_slots(flight, again, survivors)
                print(f"{', '.join(self.rollouts.names[w] for w in sorted(dead))} lost while sampling {what} ({how}): prompt slots"
                      f" {', '.join(str(flight.groups[i].start) for i in again)} sampled again by"
                      f" {', '.join(self.rollouts.names[w] for w in survivors)}", flush=True)

    def replace_every_worker(self, dead: set[int], what: str) -> list[int]:
        """No rollout worker lives on dynamic sampling's rounds: before the learners' step (max_staleness 0, or the
        first update) each one is replaced now and given the learners' weights, which the rounds sample with; returns
        them. Inside the step (the next update's rounds, max_staleness 1) the weights they sample with, v(step), may
        already be gone from the learners (their optimizer step does not wait for these rounds): the run ends, and
        `--resume` continues from its last checkpoint."""
        gone = sorted(dead)
        names = ", ".join(self.rollouts.names[w] for w in gone)
        if self.stepping:
            raise RoleDiedError(f"{names} died while sampling {what} with no worker left, while the learners train on update {self.step}: the"
                                f" rows must be sampled by weights v{self.step}, which the learners' step moves on from")
        for worker in gone:
            self.rollouts.replace(worker)  # stops the dead one first
            self.metrics.record_restart("rollout")
        self.lost_workers.clear()
        self.sync.connect()
        self.broadcast(version=self.step)
        return gone

    def sample_slots(self, flight: InFlight, indices: list[int], workers: list[int]) -> None:
        """`flight.groups[indices]` (one prompt each) sampled afresh from the rows their slots hold now, dealt over `workers`."""
        rows = self.objects.put({flight.groups[i].start: flight.batch[flight.groups[i].start] for i in indices})  # a worker reads rows[slot]
        bounds = [(flight.groups[i].start, flight.groups[i].stop, flight.groups[i].learner_rank) for i in indices]
        for i, group in zip(indices, self.rollouts.submit_groups(rows, bounds, flight.budget_bps, flight.update, workers)):
            flight.groups[i] = group
