"""Offline checks of cluster configs against a job: Ray cluster-launcher YAML and KubeRay manifests.

Structure: required keys of the launcher config; the RayCluster / RayJob fields
of KubeRay's ray.io/v1 CRDs (unknown keys are errors, as the API server's
strict field validation would report them). Capacity: every pool that pins itself
with `node_resource` finds nodes advertising that resource, with enough units and
GPUs at the groups' maximum size, and the pools together fit the cluster's GPUs and CPUs (at the
sizes a job starts with: autoscaling headroom never refuses a cluster); a node resource named `lt_opd_<pool>` for a pool
that does not exist is an error. Access: the cluster turns Ray's token auth on (every port of a Ray node runs code
on request), KubeRay through `authOptions`, the launcher in every `ray start` it runs. Imports no Ray.
"""

from __future__ import annotations

import json
import re

from lt_opd_ray.config.schema import JobConfig

POOLS = ("rollout", "teacher", "learner")
POOL_RESOURCE_PREFIX = "lt_opd_"

LAUNCHER_REQUIRED = {"cluster_name", "provider", "available_node_types", "head_node_type"}
LAUNCHER_NODE_REQUIRED = {"resources", "node_config", "max_workers"}

RAYCLUSTER_SPEC = {
    "rayVersion", "enableInTreeAutoscaling", "autoscalerOptions", "headGroupSpec", "workerGroupSpecs",
    "headServiceAnnotations", "suspend", "managedBy", "gcsFaultToleranceOptions", "upgradeStrategy", "authOptions",
}
HEAD_GROUP = {"rayStartParams", "template", "serviceType", "headService", "enableIngress", "suspend", "resources", "labels"}
WORKER_GROUP = {
    "groupName", "replicas", "minReplicas", "maxReplicas", "numOfHosts", "rayStartParams", "template",
    "scaleStrategy", "suspend", "idleTimeoutSeconds", "resources", "labels",
}
RAYJOB_SPEC = {
    "entrypoint", "runtimeEnvYAML", "jobId", "shutdownAfterJobFinishes", "ttlSecondsAfterFinished",
    "activeDeadlineSeconds", "rayClusterSpec", "clusterSelector", "submitterPodTemplate", "submitterConfig",
    "entrypointNumCpus", "entrypointNumGpus", "entrypointResources", "submissionMode", "backoffLimit", "suspend",
    "managedBy", "deletionStrategy", "metadata",
}

Capacity = dict[str, dict[str, float]]  # node group -> total resources at its maximum size


def _unknown(keys, allowed: set[str], where: str) -> list[str]:
    return [f"{where}.{key}: unknown field" for key in sorted(set(keys) - allowed)]


def launcher_capacity(config: dict, source: str) -> tuple[Capacity, list[str]]:
    problems = [f"{source}: missing {key}" for key in sorted(LAUNCHER_REQUIRED - set(config))]
    types = config.get("available_node_types") or {}
    if config.get("head_node_type") not in types:
        problems.append(f"{source}: head_node_type {config.get('head_node_type')!r} is not in available_node_types")
    capacity = {}
    for name, node in types.items():
        problems += [f"{source}: available_node_types.{name}: missing {key}" for key in sorted(LAUNCHER_NODE_REQUIRED - set(node))]
        count = max(int(node.get("max_workers", 0)), 1 if name == config.get("head_node_type") else 0)
        capacity[name] = {r: float(v) * count for r, v in (node.get("resources") or {}).items()}
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        for command in config.get(key) or []:
            if "ray start" in command and not re.search(r"(^|[\s;&|(])RAY_AUTH_MODE=token\s+ray start\b", command):
                problems.append(f"{source}: {key}: {command!r} starts Ray without token auth, so anyone who reaches the node can run a job on it; start it as RAY_AUTH_MODE=token ray start ...")
    return capacity, problems


def _group_capacity(group: dict, where: str) -> tuple[dict[str, float], list[str]]:
    params = group.get("rayStartParams") or {}
    resources: dict[str, float] = {}
    problems = []
    if "resources" in params:
        try:
            # KubeRay passes the value verbatim to `ray start --resources`, so it is a quoted JSON object
            resources = {k: float(v) for k, v in json.loads(json.loads(params["resources"])).items()}
        except (ValueError, TypeError, AttributeError):
            problems.append(f"{where}.rayStartParams.resources: not a quoted JSON object: {params['resources']!r}")
    gpus = cpus = 0.0
    for container in group.get("template", {}).get("spec", {}).get("containers", []):
        limits = container.get("resources", {}).get("limits") or {}
        gpus += float(limits.get("nvidia.com/gpu", 0))
        cpu = str(limits.get("cpu", 0))
        cpus += float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)  # Kubernetes quantities: "40" or "500m"
    resources["GPU"] = float(params.get("num-gpus", gpus))
    resources["CPU"] = float(params.get("num-cpus", cpus))  # what `ray start` advertises: the container's CPU limit
    count = int(group.get("maxReplicas", group.get("replicas", 1))) * int(group.get("numOfHosts", 1))
    return {r: v * count for r, v in resources.items()}, problems


def raycluster_capacity(spec: dict, where: str) -> tuple[Capacity, list[str]]:
    problems = _unknown(spec, RAYCLUSTER_SPEC, where)
    if (spec.get("authOptions") or {}).get("mode") != "token":
        problems.append(f"{where}.authOptions: token auth is off, so anyone who reaches the head can run a job on the cluster; set authOptions: {{mode: token}} (KubeRay >= 1.5.1)")
    if "headGroupSpec" not in spec:
        problems.append(f"{where}.headGroupSpec: missing")
    else:
        problems += _unknown(spec["headGroupSpec"], HEAD_GROUP, f"{where}.headGroupSpec")
    capacity = {}
    for i, group in enumerate(spec.get("workerGroupSpecs") or []):
        at = f"{where}.workerGroupSpecs[{i}]"
        problems += _unknown(group, WORKER_GROUP, at)
        if "groupName" not in group or "template" not in group:
            problems.append(f"{at}: groupName and template are required")
        if int(group.get("minReplicas", 0)) > int(group.get("maxReplicas", 2**31)):
            problems.append(f"{at}: minReplicas exceeds maxReplicas")
        group_capacity, group_problems = _group_capacity(group, at)
        capacity[group.get("groupName", at)] = group_capacity
        problems += group_problems
    return capacity, problems


def manifest_capacity(doc: dict, source: str) -> tuple[Capacity, list[str]]:
    if doc.get("apiVersion") != "ray.io/v1":
        return {}, [f"{source}: apiVersion must be ray.io/v1, got {doc.get('apiVersion')!r}"]
    kind, spec = doc.get("kind"), doc.get("spec") or {}
    if kind == "RayCluster":
        return raycluster_capacity(spec, f"{source}: spec")
    if kind == "RayJob":
        problems = _unknown(spec, RAYJOB_SPEC, f"{source}: spec")
        if not spec.get("entrypoint"):
            problems.append(f"{source}: spec.entrypoint: missing")
        capacity, more = raycluster_capacity(spec.get("rayClusterSpec") or {}, f"{source}: spec.rayClusterSpec")
        return capacity, problems + more
    return {}, [f"{source}: kind must be RayCluster or RayJob, got {kind!r}"]


def check_capacity(capacity: Capacity, job: JobConfig, source: str) -> list[str]:
    from lt_opd_ray.runtime.resources import pool_sizes

    problems = []
    for group, resources in capacity.items():
        for resource in resources:
            if resource.startswith(POOL_RESOURCE_PREFIX) and resource[len(POOL_RESOURCE_PREFIX) :] not in POOLS:
                problems.append(f"{source}: {group} advertises {resource}, a resource of unknown pool {resource[len(POOL_RESOURCE_PREFIX):]!r} (pools: {', '.join(POOLS)})")
    for pool, size in pool_sizes(job).items():
        spec = getattr(job.pools, pool)
        if not spec.node_resource or size == 0:  # no teacher where the objective reads no teacher scores
            continue
        groups = {g: r for g, r in capacity.items() if spec.node_resource in r}
        if not groups:
            problems.append(f"{source}: pool {pool} requests {spec.node_resource}, which no node group advertises")
            continue
        units = sum(r[spec.node_resource] for r in groups.values())
        gpus = sum(r.get("GPU", 0.0) for r in groups.values())
        if units < size:
            problems.append(f"{source}: pool {pool} needs {size} x {spec.node_resource}, the groups {sorted(groups)} offer {units:g}")
        if gpus < size * spec.gpus:
            problems.append(f"{source}: pool {pool} needs {size * spec.gpus:g} GPUs on {sorted(groups)}, which have {gpus:g}")
    for resource in ("GPU", "CPU"):  # every pool, pinned or not, somewhere in the cluster
        need = sum(size * getattr(getattr(job.pools, pool), resource.lower() + "s") for pool, size in pool_sizes(job).items())
        have = sum(r.get(resource, 0.0) for r in capacity.values())
        if resource in {r for c in capacity.values() for r in c} and need > have + 1e-9:
            problems.append(f"{source}: the pools need {need:g} {resource}s in all, the node groups offer {have:g} at their largest")
    return problems


def check_cluster_file(doc: dict, job: JobConfig, source: str) -> list[str]:
    """All problems of one cluster YAML (launcher config or KubeRay manifest) for `job`."""
    if "available_node_types" in doc:
        capacity, problems = launcher_capacity(doc, source)
    else:
        capacity, problems = manifest_capacity(doc, source)
    return problems + check_capacity(capacity, job, source)
