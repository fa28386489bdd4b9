"""`mirrorspec demo --rebuild`, end to end at a toy budget: both stages, then the rebuilt draft in use."""

import pytest
import torch

from mirrorspec.models.demo_target import CHECKPOINT_NAME, cache_root


@pytest.mark.slow
def test_rebuild_writes_a_draft_that_loads_by_path_and_speculates_exactly(demo_target, tmp_path, monkeypatch,
                                                                          capsys):
    from mirrorspec import SamplingParams, generate
    from mirrorspec.cli import main
    from mirrorspec.models import encode_prompt, load_causal_lm

    converted = cache_root() / CHECKPOINT_NAME  # the demo_target fixture converted it
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / CHECKPOINT_NAME).symlink_to(converted)
    monkeypatch.setenv("MIRRORSPEC_CACHE", str(cache))  # the toy teacher shards and assembly stay here
    out = tmp_path / "rebuilt" / "draft.safetensors"
    threads = torch.get_num_threads()
    try:
        assert main(["demo", "--rebuild", "--teacher-prompts", "2", "--epochs", "0.01", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and f"--draft demo-draft,{out}" in printed
    assert len(list((cache / "distill").glob("teacher-*/shard-*.pt"))) == 1

    draft = load_causal_lm(str(out), tokenizer=False).model
    ids = encode_prompt(demo_target.tokenizer, "Name three colours.")
    params = SamplingParams(max_new_tokens=16, stop_token_ids=demo_target.stop_token_ids())
    alone = generate(demo_target.model, None, ids, params)
    spec = generate(demo_target.model, draft, ids, params, num_speculative_tokens=4)
    assert spec.token_ids == alone.token_ids and spec.stats.drafted > 0
