"""The pass-cost benchmark's two GPU leads, run on a tiny model on the CPU. Timings are never
asserted: only that each run is made, written, and refused where it cannot mean anything."""

import json

import pytest

from benchmarks.pass_cost import busy_neighbor, main


def test_a_busy_neighbor_run_is_timed_beside_the_plain_one_and_written(padded_pair, tmp_path, capsys):
    assert main(["--target", str(padded_pair["target"]), "--device", "cpu", "--threads", "1", "--max-k", "2",
                 "--reps", "1", "--busy-neighbor", "--out", str(tmp_path)]) == 0
    [written] = tmp_path.glob("pass-cost-*.json")
    runs = json.loads(written.read_text())["runs"]
    assert {"plain", "plain, a core busy beside it"} <= set(runs)
    assert all(len(run["pass_costs"]) == 2 for run in runs.values())  # K = 1 and 2, in one-token steps
    assert "a core busy beside it" in capsys.readouterr().out


def test_the_busy_neighbor_is_gone_when_its_run_ends_or_fails():
    import psutil

    before = {child.pid for child in psutil.Process().children()}
    with pytest.raises(RuntimeError), busy_neighbor():
        [spinner] = [child for child in psutil.Process().children() if child.pid not in before]
        raise RuntimeError("a run that failed")
    assert not spinner.is_running() or spinner.status() == psutil.STATUS_ZOMBIE


def test_counting_host_waits_on_a_cpu_target_is_refused_naming_the_flag(padded_pair, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--target", str(padded_pair["target"]), "--device", "cpu", "--sync-debug", "--out", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--sync-debug" in err and "--device cuda" in err
