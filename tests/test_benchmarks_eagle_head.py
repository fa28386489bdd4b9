import pytest
import torch

from benchmarks.acceptance import replay_greedy
from benchmarks.eagle_head import build_parser, replay_head
from mirrorspec.distill.eagle import EagleHead


def opinionated_head(target, vocab):
    head = EagleHead(target, vocab).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return head


def test_one_draft_windows_replay_as_a_plain_drafts_do(tiny_dir):
    """At K=1 every draft starts from true features, so the head's windows must be exactly the
    ones replay_greedy runs on its teacher-forced agreement with the answer."""
    import support

    target = support.load(tiny_dir["target16"])
    head = opinionated_head(target, list(range(16)))
    sequence = torch.tensor([0, 4, 9, 2, 7, 7, 1, 12, 3, 5, 6, 11, 14, 2, 9, 9, 4])
    prompt_length = 5
    with torch.inference_mode():
        features = target.get_decoder()(input_ids=sequence[None, :-1]).last_hidden_state[0]
        index = torch.arange(len(sequence) - 2)
        predicted = head(features[index][None], sequence[index + 1][None])[0]  # row i predicts token i + 2
        drafts = head.vocab[head.logits(predicted).argmax(-1)]
    answer = sequence[prompt_length:]
    agrees = (drafts[prompt_length - 2:] == answer).tolist()
    assert any(agrees) and not all(agrees)  # the test would tell windows apart
    replay, tested, kept = replay_head(head, features, sequence, prompt_length, k=1)
    assert replay == replay_greedy(agrees, 1)
    assert tested == [replay.drafted] and kept == [replay.accepted]


def test_deeper_windows_count_tests_and_depths_consistently(tiny_dir):
    import support

    target = support.load(tiny_dir["target16"])
    head = opinionated_head(target, list(range(16)))
    sequence = torch.tensor([0, 4, 9, 2, 7, 7, 1, 12, 3, 5, 6, 11, 14, 2, 9, 9, 4])
    with torch.inference_mode():
        features = target.get_decoder()(input_ids=sequence[None, :-1]).last_hidden_state[0]
    replay, tested, kept = replay_head(head, features, sequence, 5, k=4)
    answer_length = len(sequence) - 5
    assert replay.windows + replay.accepted == answer_length  # every answer token committed once
    assert sum(tested) == replay.tests and sum(kept) == replay.accepted
    assert all(d <= 4 for d in replay.drafts_per_window)


@pytest.mark.parametrize("argv, flag", [
    *[(["train", "--prompts", value, "--out", "x.safetensors"], "--prompts") for value in ["3", "5:2", "a:b", "-1:4"]],
    *[(["train", "--prompts", "0:4", "--epochs", value, "--out", "x.safetensors"], "--epochs")
      for value in ["0", "-1", "nan", "inf", "four"]],
    (["replay", "--head", "/nonexistent/head.safetensors"], "--head"),
])
def test_bad_flags_name_the_flag(argv, flag, capsys):
    """Refused at parse time, before the target loads or the teacher stage's hour of work."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert f"argument {flag}" in capsys.readouterr().err


def test_a_file_that_is_no_head_is_refused_naming_the_flag(tiny_dir, tmp_path):
    import support
    from safetensors.torch import save_file

    from benchmarks.eagle_head import load_head
    from mirrorspec.models import LoadedModel

    save_file({"model.norm.weight": torch.ones(4)}, str(tmp_path / "draft.safetensors"))
    target = LoadedModel(model=support.load(tiny_dir["target16"]), tokenizer=None, source="tiny")
    with pytest.raises(SystemExit, match="--head .*not a head"):
        load_head(target, tmp_path / "draft.safetensors")


def test_a_one_token_prompts_first_window_drafts_nothing(tiny_dir):
    """The head needs one committed feature: a window right after a one-token prompt is a plain
    target step, as replay_greedy counts it, and the next ones draft."""
    import support

    target = support.load(tiny_dir["target16"])
    head = opinionated_head(target, list(range(16)))
    sequence = torch.tensor([3, 4, 9, 2, 7, 7])
    with torch.inference_mode():
        features = target.get_decoder()(input_ids=sequence[None, :-1]).last_hidden_state[0]
    replay, _, _ = replay_head(head, features, sequence, 1, k=2)
    assert replay.drafts_per_window[0] == 0 and replay.drafted > 0


@pytest.mark.slow
def test_replay_runs_end_to_end_beside_the_target_as_its_own_draft(tmp_path, capsys):
    """On the demo target: the plain rows (the target as its own draft) must accept everything,
    which a draft replay read one position off would not; the head's rows cover the same answers."""
    import json

    from safetensors.torch import save_file

    from benchmarks.eagle_head import main
    from mirrorspec.models import load_causal_lm
    from mirrorspec.models.demo_draft import shipped_vocabulary

    target = load_causal_lm("demo-target", prepack=False, tokenizer=False)
    save_file(EagleHead(target.model, shipped_vocabulary()).trained_state(), str(tmp_path / "head.safetensors"))
    assert main(["replay", "--head", str(tmp_path / "head.safetensors"), "--compare", "demo-target",
                 "--draft-quantize", "none", "--datasets", "humaneval", "--num-prompts", "1", "--max-tokens", "12",
                 "--k", "4", "--threads", "1", "--no-progress", "--out", str(tmp_path)]) == 0
    rows = json.loads(next(tmp_path.glob("eagle-head-*.json")).read_text())["rows"]
    plain, head = rows
    assert plain["draft"] == "demo-target" and plain["accept"] == 1.0 and plain["tokens_per_pass"] > 3
    assert head["positions"] == plain["positions"] == 12 and len(head["by_depth"]) == 4
    assert 0 <= head["alpha"] <= 1
    assert "by depth" in capsys.readouterr().out
