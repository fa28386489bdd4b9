import torch

from mirrorspec.config import DistillRecipe
from mirrorspec.distill.build import teacher_dir
from mirrorspec.distill.teacher import LENGTH_GROUP, TeacherShard, generate_batch, write_teacher_data

PROMPTS = [[0, 3, 5, 2], [1, 4], [2, 6, 1, 3, 3, 5, 4]]


def test_greedy_rows_match_hf_generate_despite_left_padding(tiny_target):
    eos = 7  # HF stops there too
    shard = generate_batch(tiny_target, PROMPTS, max_new_tokens=6, stop_ids=[eos], temperature=0.0, top_k=4,
                           generator=torch.Generator().manual_seed(0))
    for prompt, tokens, start in zip(PROMPTS, shard.tokens, shard.starts):
        reference = tiny_target.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                         eos_token_id=eos, pad_token_id=0)[0].tolist()
        assert start == len(prompt)
        assert tokens.tolist() == reference


def test_top_k_rows_are_the_targets_log_probabilities(tiny_target):
    shard = generate_batch(tiny_target, PROMPTS[:1], max_new_tokens=3, stop_ids=[], temperature=0.0, top_k=4,
                           generator=torch.Generator().manual_seed(0))
    tokens = shard.tokens[0].long()
    with torch.inference_mode():
        logp = torch.log_softmax(tiny_target(tokens[None, :-1]).logits[0, len(PROMPTS[0]) - 1:], -1)
    top = logp.topk(4, dim=-1)
    assert torch.equal(shard.top_ids.long(), top.indices)
    assert torch.allclose(shard.top_logp.float(), top.values, atol=2e-3)


def test_rows_stop_at_a_stop_token_and_leave_the_batch(tiny_target):
    greedy = generate_batch(tiny_target, PROMPTS, max_new_tokens=6, stop_ids=[], temperature=0.0, top_k=2,
                            generator=torch.Generator().manual_seed(0))
    stop = int(greedy.tokens[0][len(PROMPTS[0]) + 1])  # row 0's second answer token
    shard = generate_batch(tiny_target, PROMPTS, max_new_tokens=6, stop_ids=[stop], temperature=0.0, top_k=2,
                           generator=torch.Generator().manual_seed(0))
    answer = shard.tokens[0][shard.starts[0]:].tolist()
    assert answer[-1] == stop and stop not in answer[:-1]
    assert shard.num_generated == sum(len(t) - s for t, s in zip(shard.tokens, shard.starts))


def test_shards_are_reproducible_and_resumable(tiny_target, tmp_path):
    prompts = PROMPTS * 3
    kwargs = dict(batch_size=2, max_new_tokens=4, stop_ids=[7], top_k=3, seed=1, shard_batches=2)
    first = write_teacher_data(tiny_target, prompts, tmp_path / "a", **kwargs)
    first[-1].unlink()  # an interrupted run: the last shard is missing
    again = write_teacher_data(tiny_target, prompts, tmp_path / "a", **kwargs)
    fresh = write_teacher_data(tiny_target, prompts, tmp_path / "b", **kwargs)
    assert len(again) == len(fresh) == 3
    for a, b in zip(again, fresh):
        sa, sb = TeacherShard.load(a), TeacherShard.load(b)
        assert [t.tolist() for t in sa.tokens] == [t.tolist() for t in sb.tokens]
        assert torch.equal(sa.top_ids, sb.top_ids)


def test_whole_spans_of_a_smaller_run_are_the_first_shards_of_a_bigger_one(tiny_target, tmp_path):
    span = LENGTH_GROUP  # prompts per length-sorted span at batch size 1
    prompts = [PROMPTS[i % len(PROMPTS)][: 1 + i % 5] for i in range(2 * span)]
    kwargs = dict(batch_size=1, max_new_tokens=2, stop_ids=[7], top_k=3, seed=1, shard_batches=4)
    small = write_teacher_data(tiny_target, prompts[:span], tmp_path / "small", **kwargs)
    big = write_teacher_data(tiny_target, prompts, tmp_path / "big", **kwargs)
    assert len(big) == 2 * len(small)
    for a, b in zip(small, big):
        sa, sb = TeacherShard.load(a), TeacherShard.load(b)
        assert [t.tolist() for t in sa.tokens] == [t.tolist() for t in sb.tokens]
        assert torch.equal(sa.top_ids, sb.top_ids) and torch.equal(sa.top_logp, sb.top_logp)


def test_the_teacher_cache_is_shared_by_runs_on_whole_spans_only():
    span = 128 * LENGTH_GROUP
    assert teacher_dir(DistillRecipe(teacher_prompts=3 * span)) == teacher_dir(DistillRecipe(teacher_prompts=5 * span))
    assert teacher_dir(DistillRecipe(teacher_prompts=3 * span)) != teacher_dir(DistillRecipe(teacher_prompts=3 * span + 1))
    assert teacher_dir(DistillRecipe(teacher_prompts=3 * span)) != teacher_dir(DistillRecipe(teacher_prompts=3 * span,
                                                                                           max_new_tokens=64))


def test_kept_features_are_the_targets_at_every_position_it_read(tiny_target):
    """Rows are left-padded and leave the batch as they stop; each row's features must still be
    its own sequence's, as a single unpadded forward over it gives them."""
    eos = 7
    shard = generate_batch(tiny_target, PROMPTS, max_new_tokens=6, stop_ids=[eos], temperature=0.0, top_k=2,
                           generator=torch.Generator().manual_seed(0), features=True)
    plain = generate_batch(tiny_target, PROMPTS, max_new_tokens=6, stop_ids=[eos], temperature=0.0, top_k=2,
                           generator=torch.Generator().manual_seed(0))
    assert plain.features is None
    assert [t.tolist() for t in shard.tokens] == [t.tolist() for t in plain.tokens]
    for tokens, features in zip(shard.tokens, shard.features):
        assert features.dtype == torch.float16 and features.shape[0] == len(tokens) - 1
        with torch.inference_mode():
            expected = tiny_target.get_decoder()(input_ids=tokens[None, :-1].long()).last_hidden_state[0]
        torch.testing.assert_close(features.float(), expected, atol=5e-3, rtol=5e-3)


def test_features_survive_a_shard_round_trip(tiny_target, tmp_path):
    paths = write_teacher_data(tiny_target, PROMPTS, tmp_path, batch_size=2, max_new_tokens=3, stop_ids=[],
                               top_k=2, seed=0, features=True)
    shards = [TeacherShard.load(p) for p in paths]
    assert sum(len(s.features) for s in shards) == len(PROMPTS)
    for s in shards:
        assert [f.shape[0] for f in s.features] == [len(t) - 1 for t in s.tokens]
