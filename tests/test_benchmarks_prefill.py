"""benchmarks.prefill: flag errors (fast), and one small run on the demo target (slow).

Timings are never asserted: they depend on the machine and on whatever else runs on it.
"""

import json

import pytest

from benchmarks import prefill
from support import assert_flag_refused


@pytest.mark.parametrize("argv, flag", [
    (["--chunks", "512,x"], "--chunks"),
    (["--chunks", "-1"], "--chunks"),
    (["--long-tokens", "0"], "--long-tokens"),
    (["--short-tokens", "4"], "--short-tokens"),
])
def test_bad_flags_are_argparse_errors_naming_the_flag(argv, flag, capsys):
    assert_flag_refused(prefill.main, argv, flag, capsys)


def test_a_model_without_a_tokenizer_is_refused_naming_the_flag(tiny_dir, capsys):
    assert_flag_refused(prefill.main, ["--model", str(tiny_dir["target16"])], "--model", capsys)


@pytest.mark.slow
def test_chunk_sizes_are_run_side_by_side_and_written_with_a_plot(tmp_path, capsys):
    assert prefill.main(["--long-tokens", "300", "--short-tokens", "24", "--chunks", "0,100",
                         "--out", str(tmp_path)]) == 0
    [result] = tmp_path.glob("prefill-*.json")
    rows = json.loads(result.read_text())["rows"]
    assert [r["chunk"] for r in rows] == [0, 100]
    for r in rows:
        assert r["long_prompt_tokens"] == 300 and len(r["arrivals_s"]) == 24
        start, first_token = r["long_prefill_s"]
        assert 0 < start < first_token and r["long_ttft_s"] == pytest.approx(first_token - start)
    assert result.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "chunk 100 vs unchunked: A's longest stall" in capsys.readouterr().out
