"""The cluster-launcher YAMLs in ``configs/cluster/`` and the install they rely on.

``ray up`` has no dry run and needs cloud credentials, so these YAMLs are
checked offline with the functions ``ray up`` itself calls before it talks to
a cloud (``prepare_config`` merges the provider's defaults, ``validate_config``
checks Ray's JSON schema and the node types), plus the TPU node checks of Ray's
GCP provider. Ray does not check what popmeta needs from a cluster, so the
tests below do: every node installs popmeta with the JAX of its accelerator
from the pinned versions, and each experiment config of a cluster fits one
actor on every accelerator node that the cluster starts. Seconds, no Ray
instance.
"""

from __future__ import annotations

import copy
import re
import shlex
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from ray._private.accelerators import TPUAcceleratorManager, tpu
from ray.autoscaler._private.util import prepare_config, validate_config

from popmeta.config import load_config
from popmeta.population.placement import actor_request
from popmeta.storage import EXTRAS, is_remote

REPO = Path(__file__).resolve().parents[1]
CLUSTER_DIR = REPO / "configs" / "cluster"
#: Cluster YAML -> (the experiment config written for it, the JAX extra its workers install).
CLUSTERS = {
    "aws-gpu.yaml": ("train-gpu.yaml", "gpu"),
    "gcp-tpu.yaml": ("train-tpu.yaml", "tpu"),
}
#: Cluster YAML -> the storage extra its head installs for the experiment's run_dir.
HEAD_STORAGE = {"aws-gpu.yaml": "s3", "gcp-tpu.yaml": "gcs"}
#: Where the cluster YAMLs sync the repository to (``file_mounts``).
REMOTE_REPO = "~/popmeta"


def _load(name: str) -> dict:
    return yaml.safe_load((CLUSTER_DIR / name).read_text())


def _prepared(name: str) -> dict:
    """The config as ``ray up`` sees it after merging the provider's defaults."""
    return prepare_config(copy.deepcopy(_load(name)))


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _popmeta_installs(commands: list[str]) -> list[list[str]]:
    """The argument lists of the setup commands that install popmeta."""
    return [shlex.split(c) for c in commands if "popmeta[" in c and " install " in c]


def test_every_cluster_yaml_is_listed():
    """A new cluster YAML must be added to CLUSTERS, or it would go unchecked."""
    on_disk = {p.name for p in CLUSTER_DIR.glob("*.yaml") if "provider" in _load(p.name)}
    assert on_disk == set(CLUSTERS)


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_cluster_yaml_passes_rays_own_validation(name):
    validate_config(_prepared(name))


@pytest.mark.parametrize(
    "break_it, error",
    [
        (lambda c: c.update(setup_comands=[]), jsonschema.ValidationError),  # unknown key
        (lambda c: c.update(max_workers="two"), jsonschema.ValidationError),  # wrong type
        (lambda c: c.update(head_node_type="nope"), ValueError),  # no such node type
        (
            lambda c: c["available_node_types"]["gpu_worker"].update(resources={"GPU": "1"}),
            jsonschema.ValidationError,
        ),
    ],
)
def test_rays_validation_rejects_broken_configs(break_it, error):
    """The validation above is not vacuous: the same calls catch these mistakes."""
    config = _load("aws-gpu.yaml")
    break_it(config)
    with pytest.raises(error):
        validate_config(prepare_config(config))


def test_tpu_nodes_are_single_host_slices_with_their_chips_declared():
    """Ray's GCP provider checks, run offline (its module needs Google's API client).

    Every TPU node type names a valid accelerator type, is a single host (popmeta
    runs one actor per host; a multi-host slice would need all hosts to run the
    same program), and declares as many ``TPU`` as the host has chips, which the
    launcher passes to ``ray start`` as the node's resources. The head is a
    plain VM: TPU VMs cannot be head nodes.
    """
    config = _prepared("gcp-tpu.yaml")
    node_types = config["available_node_types"]
    assert "machineType" in node_types[config["head_node_type"]]["node_config"]
    tpu_types = {k: v for k, v in node_types.items() if "acceleratorType" in v["node_config"]}
    assert tpu_types
    for node_type in tpu_types.values():
        accelerator = node_type["node_config"]["acceleratorType"]
        assert TPUAcceleratorManager.is_valid_tpu_accelerator_type(accelerator)
        cores = int(accelerator.split("-")[1])
        chips = cores // tpu.get_tpu_cores_per_chip(accelerator)
        assert chips <= tpu.get_num_tpu_visible_chips_per_host(accelerator)
        assert node_type["resources"]["TPU"] == chips
        assert node_type["node_config"]["runtimeVersion"]


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_experiment_config_fits_one_actor_on_every_accelerator_node(name):
    """``one_actor_per_node_with: R`` puts an actor on each node carrying R.

    The cluster must start such nodes with the run (not on demand: actors are
    placed on the nodes alive at the start), each node must hold the actor's
    whole request, and the head must not carry R (it hosts the learner).
    """
    experiment, _ = CLUSTERS[name]
    run = load_config(str(CLUSTER_DIR / experiment))
    resource = run.population.one_actor_per_node_with
    assert resource is not None
    request = actor_request(run.population)
    assert request.get(resource, 0) > 0, "the actor must claim the accelerator it is placed by"
    config = _prepared(name)
    head = config["available_node_types"][config["head_node_type"]]
    assert resource not in head["resources"]
    carriers = [
        t for t in config["available_node_types"].values() if resource in t.get("resources", {})
    ]
    assert carriers and sum(t.get("min_workers", 0) for t in carriers) >= 1
    for node_type in carriers:
        for key, amount in request.items():
            assert node_type["resources"].get(key, 0) >= amount, (key, node_type["resources"])


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_nodes_install_popmeta_with_their_accelerators_jax(name):
    """Head: CPU JAX; workers: the accelerator's; all from the synced repo and pinned.

    The repository is synced to ``~/popmeta`` (no published package needed) and
    installed with ``-c constraints.txt``, the versions CI tests.
    """
    _, worker_extra = CLUSTERS[name]
    config = _load(name)
    assert config["file_mounts"] == {REMOTE_REPO: "."}
    assert (REPO / "constraints.txt").is_file()
    head_extras = f"cpu,{HEAD_STORAGE[name]}"
    for key, extras in (
        ("head_setup_commands", head_extras),
        ("worker_setup_commands", worker_extra),
    ):
        installs = _popmeta_installs(config[key])
        assert len(installs) == 1, (key, config[key])
        args = installs[0]
        assert args[args.index("-c") + 1] == f"{REMOTE_REPO}/constraints.txt"
        assert args[args.index("-e") + 1] == f"$HOME/popmeta[{extras}]"
        assert set(extras.split(",")) <= set(_extras())
    # Ray, popmeta and tensorboard must come from the environment the setup built.
    path_setup = " ".join(config["setup_commands"])
    assert "popmeta-env/bin" in path_setup and ".bashrc" in path_setup


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_runs_of_a_cluster_live_in_a_bucket_its_head_can_write(name):
    """A run must outlive the head node, so its run_dir is a storage URI.

    The head (where the learner writes the run) installs the extra whose
    fsspec implementation serves that URI's scheme.
    """
    experiment, _ = CLUSTERS[name]
    run_dir = load_config(str(CLUSTER_DIR / experiment)).run_dir
    assert is_remote(run_dir), run_dir
    scheme = run_dir.split("://", 1)[0]
    assert EXTRAS[scheme] == HEAD_STORAGE[name]
    assert f"{REMOTE_REPO}/" not in run_dir and "~" not in run_dir


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            assert canonicalize_name(name) not in pins, f"{name} pinned twice"
            pins[canonicalize_name(name)] = version
    return pins


def test_constraints_pin_every_dependency_within_its_range():
    """CI's exact versions must satisfy pyproject's ranges, or CI tests another install."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = [
        *project["dependencies"],
        *project["optional-dependencies"]["cpu"],
        *project["optional-dependencies"]["test"],
    ]
    pins = _pins()
    for text in requirements:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is not pinned in constraints.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (text, pins[name])
    for extra in ("cpu", "gpu", "tpu"):
        (jax,) = project["optional-dependencies"][extra]
        assert canonicalize_name(Requirement(jax).name) == "jax"


def _install_args(text: str) -> str:
    """The arguments of the first ``pip install`` command line in ``text``."""
    match = re.search(r"^\s*(?:python -m )?pip install (.+)$", text, re.M)
    assert match, "no pip install line"
    return match.group(1).strip()


def test_ci_installs_the_way_the_readme_says():
    """CI (``.ci/run``) must install exactly as the README's set-up tells a user to."""
    readme = _install_args((REPO / "README.md").read_text())
    ci = _install_args((REPO / ".ci" / "run").read_text())
    assert ci == readme
    assert "-c constraints.txt" in ci
