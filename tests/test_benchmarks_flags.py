"""Flags every benchmark command shares (``benchmarks/flags.py``), checked as they are read."""

import importlib
import json

import pytest

from support import assert_flag_refused

# each command's main and the argv before its flags
COMMANDS = [("run", []), ("acceptance", []), ("mirror", []), ("hints", []), ("pass_cost", []), ("prefill", []),
            ("trees", []), ("data_plane", []), ("cluster", []), ("eagle_head", ["replay", "--head", __file__])]


@pytest.mark.parametrize("command,head", COMMANDS, ids=[c for c, _ in COMMANDS])
def test_an_out_folder_that_cannot_be_made_is_refused_before_the_run(command, head, tmp_path, capsys):
    """Each wrote its results at the end only: a bad --out cost the whole run, then a traceback."""
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    main = importlib.import_module(f"benchmarks.{command}").main
    assert_flag_refused(main, [*head, "--out", str(in_the_way / "results")], "--out", capsys)


# the commands that take --threads (the rest start servers with threads of their own choosing)
THREADED = [(c, head) for c, head in COMMANDS if c not in ("hints", "prefill", "cluster")]


@pytest.mark.parametrize("threads", ["0", "1500"])
@pytest.mark.parametrize("command,head", THREADED, ids=[c for c, _ in THREADED])
def test_a_thread_count_generate_would_refuse_is_refused(command, head, threads, capsys):
    """Unbounded, --threads 1500 loaded a 2-core machine to 70 and hung at exit (a review); the
    mirror and data-plane benchmarks passed any integer to their servers."""
    main = importlib.import_module(f"benchmarks.{command}").main
    assert_flag_refused(main, [*head, "--threads", threads], "--threads", capsys)


def test_the_out_folder_is_made_as_the_flags_are_read(tmp_path):
    from benchmarks.flags import output_dir

    assert output_dir(str(tmp_path / "a" / "b")) == tmp_path / "a" / "b"
    assert (tmp_path / "a" / "b").is_dir()


def test_a_default_out_folder_is_left_alone_until_results_are_written(tmp_path, monkeypatch):
    """argparse converts a string default as it parses: the default folder was made even by
    ``--reprint``, which writes nothing, and refused where the install is read-only (review 4)."""
    from benchmarks import flags, run

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(flags, "DEFAULT_OUT", tmp_path / "not-yet")
    args = run.build_parser().parse_args(["--reprint", "some.json"])
    assert args.out == tmp_path / "not-yet" and not args.out.exists()


def test_a_json_of_another_benchmark_is_named_as_such_by_reprint(tmp_path, capsys):
    """It said only "cannot read records from ...: 'records'" (review 24 of stop 48)."""
    from benchmarks.run import main

    other = tmp_path / "mirror.json"
    other.write_text(json.dumps({"config": {}, "results": {}}))
    with pytest.raises(SystemExit) as exc:
        main(["--reprint", str(other)])
    assert exc.value.code == 2
    assert "not a `bench mirror` or `bench acceptance` one" in capsys.readouterr().err


@pytest.mark.parametrize("bench", [["bench", "mirror"], ["bench", "acceptance"]])
def test_ctrl_c_ends_a_benchmark_with_130_and_a_line_not_a_traceback(bench, monkeypatch, capsys):
    """`bench mirror` and `bench acceptance` printed a KeyboardInterrupt traceback from wherever
    it fell; `bench` and `demo` already ended with 130 (review 24 of stop 48)."""
    import benchmarks.acceptance
    import benchmarks.mirror
    from mirrorspec.cli import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(benchmarks.mirror if bench[1] == "mirror" else benchmarks.acceptance, "main", interrupted)
    assert main(bench) == 130
    assert capsys.readouterr().err == "interrupted: nothing written\n"
