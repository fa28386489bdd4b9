"""Why a replica's placement group fits no node: each case names the setting to change."""

import pytest

from cluster.node_fit import unplaceable


def node(alive=True, **resources):
    return {"Alive": alive, "Resources": resources}


FOUR_CPU_NODES = [node(CPU=4, drafter=4), node(CPU=4, target=4)]


def test_a_group_some_node_holds_in_all_is_placeable_even_when_that_node_is_busy():
    assert unplaceable("drafter", {"CPU": 4, "drafter": 1}, 1, FOUR_CPU_NODES) is None
    assert unplaceable("target", {"CPU": 2, "target": 1}, 2, FOUR_CPU_NODES) is None  # tp=2 packed: CPU 4, target 2


@pytest.mark.parametrize("pool, bundle, ranks, field, says", [
    ("drafter", {"CPU": 8, "drafter": 1}, 1, "replica_cpus", "the largest has CPU 4: lower --replica-cpus"),
    ("target", {"CPU": 3, "target": 1}, 2, "replica_cpus", "CPU 6, target 2 (2 ranks of --tp"),
    ("target", {"CPU": 1, "GPU": 1, "target": 1}, 1, "target_gpus", "lower --target-gpus"),
    ("drafter", {"CPU": 1, "GPU": 0.5, "drafter": 1}, 1, "drafter_gpus", "lower --drafter-gpus"),
    ("target", {"CPU": 1, "GPU": 1, "target": 1}, 4, "tp", "lower --tp"),
    # a cluster started by hand without the role resources the cluster configs give
    ("drafter", {"CPU": 1, "drafter": 1}, 1, "address", "no node offers the 'drafter' resource"),
])
def test_a_group_no_node_holds_names_what_to_change(pool, bundle, ranks, field, says):
    nodes = FOUR_CPU_NODES if pool != "drafter" or field != "address" else [node(CPU=4), node(CPU=4, target=4)]
    refusal = unplaceable(pool, bundle, ranks, nodes)
    assert refusal is not None and refusal.field == field and says in str(refusal), refusal


def test_every_shortfall_is_named_and_the_flag_is_the_first_a_serve_flag_sets():
    """A hand-started head of 4 CPUs: the CPUs first, then the role resource it lacks."""
    refusal = unplaceable("drafter", {"CPU": 8, "drafter": 1}, 1, [node(CPU=4)])
    assert refusal is not None and refusal.field == "replica_cpus"
    assert "lower --replica-cpus" in str(refusal) and "no node offers the 'drafter' resource" in str(refusal)


def test_resources_spread_over_nodes_are_not_one_node_that_holds_them():
    refusal = unplaceable("target", {"CPU": 4, "target": 1}, 1, [node(CPU=8), node(CPU=1, target=4)])
    assert refusal is not None and refusal.field == "address" and "at once" in str(refusal)


def test_dead_nodes_hold_nothing():
    nodes = [node(alive=False, CPU=16, drafter=4), node(CPU=1, drafter=1)]
    refusal = unplaceable("drafter", {"CPU": 2, "drafter": 1}, 1, nodes)
    assert refusal is not None and "the largest has CPU 1" in str(refusal) and "live nodes (1)" in str(refusal)
