"""``python -m benchmarks.cluster`` end to end on tiny models: shapes, then a scale event per pool."""

import json
from types import SimpleNamespace

import pytest
import ray

pytestmark = pytest.mark.slow


def test_the_cluster_benchmark_sizes_ray_for_its_scale_events_and_writes_its_figures(tiny_dir, tmp_path, monkeypatch):
    """Its Ray was sized for the largest shape alone, so on 1x1 the scale event's second drafter
    never came up and the 300 s wait was printed as the scale-up time; and its teardown was called
    the old way, so the run ended in a TypeError with no JSON (review 26 of stop 49)."""
    import shutil

    import support
    from benchmarks import cluster

    models = {name: shutil.copytree(tiny_dir[name], tmp_path / name) for name in ("target16", "draft16")}
    for path in models.values():
        support.save_word_tokenizer(path, 16)  # the benchmark sends text
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster, "load_prompts", lambda dataset, n: [SimpleNamespace(text=f"w{i} w3 w5 w{i + 1}")
                                                                     for i in range(n)])
    try:
        assert cluster.main(["--shapes", "1x1", "--streams", "1", "--requests", "1", "--max-tokens", "4",
                             "--target", str(models["target16"]), "--draft", str(models["draft16"]),
                             "--out", str(tmp_path / "out")]) == 0
    finally:
        ray.shutdown()
    [written] = (tmp_path / "out").glob("cluster-*.json")
    figures = json.loads(written.read_text())
    assert [(r["shape"], r["streams"], r["errors"]) for r in figures["results"]] == [("1x1", 1, 0)]
    assert [event["pool"] for event in figures["scale_events"]] == ["drafter", "target"]
    for event in figures["scale_events"]:  # each pool reached 2 replicas (the run fails where one did not)
        assert event["errors"] == 0 and event["requests"] > 0 and event["overlapping_requests"] > 0
