"""The learner group as Ray actors in a placement group, and the weight broadcast it drives."""

from __future__ import annotations

import dataclasses
import socket
import time

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..config import JobConfig
from ..wire import LearnerStepResult


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class LearnerActor:
    """One DeepSpeed rank; rank 0 also hosts the weight-sync store and sends the weights."""

    def __init__(self, job: JobConfig, rank: int, world: int):
        import transformers

        from .metrics import LearnerMetrics

        transformers.logging.set_verbosity_error()
        self.job, self.rank, self.world = job, rank, world
        self.learner = None  # set by setup, after the process group exists
        self.sync_store = None  # rank 0 only: hosts the weight-sync TCPStore
        self.sync = None  # rank 0 only: the current weight-sync group
        self.metrics = LearnerMetrics(job.name, f"learner-{rank}")

    def address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master_addr: str, master_port: int) -> int:
        from .learner import Learner, init_process_group

        init_process_group(self.rank, self.world, master_addr, master_port)
        self.learner = Learner(self.job, self.rank, self.world)
        return self.rank

    def host_weight_sync(self) -> tuple[str, int]:
        from .weight_sync import host_store

        host, port = ray.util.get_node_ip_address(), free_port()
        self.sync_store = host_store(host, port, 0, self.job.pools.learner.sync_timeout_s)
        return host, port

    def join_weight_sync(self, world: int, generation: int) -> int:
        from .rollout_pool import sync_device
        from .weight_sync import SyncGroup

        self.sync = SyncGroup(self.sync_store, 0, world, generation, self.job.pools.learner.sync_timeout_s, device=sync_device())
        return 0

    def train_step(self, samples: dict, shard_refs: list, payload_refs: list, total_sequences: int):
        """One optimizer step on this rank's shards (and their teacher payloads) only; `samples`: its prompts by index."""
        from .teacher import unpack_scores

        shards = ray.get(shard_refs)
        payloads = ray.get(payload_refs)
        begin = time.perf_counter()  # compute only: waiting for rollouts and teacher is not learner time
        rollouts, scores = [], []
        vocab = self.learner.module.model.config.text_config.vocab_size  # not lm_head.shape: a ZeRO-3 shard is empty
        for shard, payload in zip(shards, payloads):
            rollouts += shard.rollouts
            scores += unpack_scores(payload, shard.rollouts, vocab, source=payload.replica or "teacher")
        result = self.learner.train_step(samples, rollouts, scores, total_sequences)
        result = dataclasses.replace(
            result,
            seconds=time.perf_counter() - begin,
            teacher_seconds=max((p.seconds for p in payloads), default=0.0),
            payload_bytes=sum(p.nbytes for p in payloads),
            payload_tokens=sum(int(p.lengths.sum()) for p in payloads),
        )
        self.metrics.record_step(result)
        return result

    def broadcast_weights(self, version: int) -> dict:
        """Every rank gathers bucket by bucket (ZeRO-3 is a collective); rank 0 sends each bucket in the wire dtype."""
        begin = time.perf_counter()
        bucket_bytes = int(self.job.pools.learner.sync_bucket_mb * 2**20)
        send = None
        if self.rank == 0:
            layout = self.learner.wire_layout()
            self.sync.send_header(layout, version, bucket_bytes)
            send = lambda tensors: self.sync.send_bucket(tensors, layout.torch_dtype)  # noqa: E731
        nbytes = self.learner.stream_weights(send, bucket_bytes)
        if self.rank != 0:
            return {"rank": self.rank}
        seconds = time.perf_counter() - begin
        self.metrics.record_sync(seconds, nbytes)
        return {"rank": 0, "bytes": nbytes, "seconds": seconds, "dtype": self.learner.wire_dtype}

    def full_state_dict(self) -> dict | None:
        """Rank 0 answers; the other ranks take part in the ZeRO-3 gather and answer None."""
        state = self.learner.full_state_dict()
        return state if self.rank == 0 else None

    def save_pretrained(self, directory: str) -> None:
        self.learner.save_pretrained(directory)

    def save(self, directory: str, tag: str) -> None:
        self.learner.engine.save_checkpoint(directory, tag=tag)

    def load(self, directory: str, tag: str) -> None:
        self.learner.engine.load_checkpoint(directory, tag=tag)

    def finish(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()  # without it some gloo runs abort at exit
            dist.destroy_process_group()


class LearnerGroup:
    def __init__(self, job: JobConfig):
        pool = job.pools.learner
        self.job = job
        bundle = {"CPU": pool.cpus, **({"GPU": pool.gpus} if pool.gpus else {}), **pool.ray_resources()}
        self.placement = placement_group([bundle] * pool.ranks, strategy="PACK")
        ray.get(self.placement.ready())
        actor_cls = ray.remote(LearnerActor)
        self.actors = [
            actor_cls.options(
                num_cpus=pool.cpus,
                num_gpus=pool.gpus,
                resources=pool.ray_resources(),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=rank),
            ).remote(job, rank, pool.ranks)
            for rank in range(pool.ranks)
        ]
        master_addr, master_port = ray.get(self.actors[0].address.remote())
        ray.get([a.setup.remote(master_addr, master_port) for a in self.actors])  # rendezvous: all at once

    def train_step(self, batch: list, shards: list, payload_refs: list, total_sequences: int) -> list[LearnerStepResult]:
        """One optimizer step; each rank gets only its own prompts' samples, shards (`ShardRef.learner_rank`) and payloads."""
        mine = [([], []) for _ in self.actors]
        for shard, payload in zip(shards, payload_refs):
            mine[shard.learner_rank][0].append(shard.shard)
            mine[shard.learner_rank][1].append(payload)
        own_samples = [ray.put({i: batch[i] for i in range(start, stop)}) for start, stop in self.prompt_ranges(len(batch))]
        refs = [a.train_step.remote(own, s, p, total_sequences) for a, own, (s, p) in zip(self.actors, own_samples, mine)]
        return ray.get(refs)

    def prompt_ranges(self, prompts: int) -> list[tuple[int, int]]:
        """Each rank's [start, stop) of an update's prompts."""
        from ..microbatch import split_evenly

        return split_evenly(prompts, len(self.actors))

    def full_state_dict(self) -> dict:
        return ray.get([a.full_state_dict.remote() for a in self.actors])[0]

    def save_pretrained(self, directory: str) -> None:
        """The current student as a Hugging Face folder at `directory` (written by rank 0)."""
        ray.get([a.save_pretrained.remote(directory) for a in self.actors])

    def weights_checksum(self, dtype: str = "float32") -> str:
        """A digest of the learners' weights in `dtype` (the wire dtype compares with the rollout workers')."""
        from .weight_sync import WIRE_DTYPES, weights_checksum

        return weights_checksum(self.full_state_dict().items(), WIRE_DTYPES[dtype])

    def shutdown(self) -> None:
        ray.get([a.finish.remote() for a in self.actors])
        for actor in self.actors:
            ray.kill(actor)
        ray.util.remove_placement_group(self.placement)
