"""What the pools that run as Ray Serve apps share (the teacher, the reward judge): their deployment options, their
deploy, and waits at SERVE_POLL_S until an app is up or gone."""

from __future__ import annotations

from ray import serve

from lt_opd_ray.config.pools import ServePool
from lt_opd_ray.config.schema import JobConfig
from lt_opd_ray.core.wire import ActorPlacement
from lt_opd_ray.runtime.waits import LIVENESS_TICK_S


def deployment_options(pool: ServePool, job: JobConfig) -> dict:
    """Serve's options for a pool's deployment (the teacher's, the reward judge's): resources, liveness, draining,
    and a fixed replica count or the autoscaler's bounds."""
    actor = {"num_cpus": pool.cpus, "num_gpus": pool.gpus, **({"resources": pool.ray_resources()} if pool.node_resource else {})}
    # Serve's health check is the replicas' liveness: one that does not answer it for schedule.liveness_timeout_s (a
    # frozen process) is replaced, and a learner whose request it held asks again (group_receiver.GroupReceiver)
    liveness = {"health_check_period_s": LIVENESS_TICK_S, "health_check_timeout_s": job.schedule.liveness_timeout_s}
    # a replica being stopped (scaled down, the run's end) checks for unfinished requests every 0.25 s, not Serve's
    # default 2 s: it still drains what it holds, and an idle one is gone in a quarter second
    draining = {"graceful_shutdown_wait_loop_s": 0.25}
    options = {"ray_actor_options": actor, "max_ongoing_requests": pool.max_ongoing_requests, **liveness, **draining,
               "logging_config": {"log_level": "WARNING"}}
    if pool.max_replicas > pool.min_replicas:
        options["autoscaling_config"] = {
            "min_replicas": pool.min_replicas,
            "initial_replicas": pool.replicas,
            "max_replicas": pool.max_replicas,
            "target_ongoing_requests": pool.target_queue_per_replica,
            "upscale_delay_s": pool.upscale_delay_s,
            "downscale_delay_s": pool.downscale_delay_s,
            "look_back_period_s": pool.load_window_s,
        }
    else:
        options["num_replicas"] = pool.replicas
    return options


def deploy(app, name: str, job_name: str):
    """Deploy `app` as the Serve app `name` (one a killed driver of the job left is removed first); returns its handle
    at once: Serve starts the replicas while the other pools start (`wait_running`)."""
    import warnings

    serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})  # handles only, no HTTP
    if name in serve.status().applications:  # left by a driver of this job that was killed
        warnings.warn(f"removing the Serve app {name!r} an earlier driver of job {job_name!r} left running", stacklevel=3)
        delete_app(name)
    (handle,) = serve.run_many([serve.RunTarget(app, name=name, route_prefix=None)], wait_for_applications_running=False)
    return handle


def wait_running(name: str) -> float:
    """When the app was RUNNING (its initial replicas answer), waiting for it at SERVE_POLL_S (serve.run asks every
    1 s); a deployment that failed (a replica's constructor raised) is a RuntimeError with Serve's message."""
    import time

    while True:
        status = serve.status().applications.get(name)
        if status is not None and status.status == "RUNNING":
            return time.time()
        if status is not None and status.status == "DEPLOY_FAILED":
            raise RuntimeError(f"Deploying application {name} failed: {status.message}")
        time.sleep(SERVE_POLL_S)


def replica_placements(handle, running: int, *args, attempts: int = 64, timeout_s: float = 60.0) -> list[ActorPlacement]:
    """Every running replica's placement, asked through `handle` (a deployment's `placement(*args)`: its Serve id and
    its placement), each call answered within `timeout_s`. Serve routes each call to a replica of its choosing, so
    this asks until it has heard from `running` replicas (bounded by `attempts`)."""
    found: dict[str, ActorPlacement] = {}
    for _ in range(attempts):
        if len(found) >= running:
            break
        replica, placement = handle.placement.remote(*args).result(timeout_s=timeout_s)
        found[replica] = placement
    return sorted(found.values(), key=lambda p: p.actor)


# How often the driver asks Serve whether its app is up or gone. serve.run and serve.delete ask every 1 s, which
# adds half a second on average to every start and every stop of a run.
SERVE_POLL_S = 0.05


def delete_app(name: str, timeout_s: float = 60.0) -> None:
    """`serve.delete(name)`, waiting at SERVE_POLL_S until Serve no longer lists the app (its replicas stopped)."""
    import time

    serve.delete(name, _blocking=False)
    deadline = time.monotonic() + timeout_s
    while name in serve.status().applications:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the Serve app {name!r} was not deleted within {timeout_s:g} s")
        time.sleep(SERVE_POLL_S)
