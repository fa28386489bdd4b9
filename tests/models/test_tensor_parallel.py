"""The tensor-parallel target: tp=2 on CPU with gloo, a real follower process and real KV caches.

Rank 0 is this test process, rank 1 a spawned process running the follower loop, as a Ray actor
would. The model splits unevenly on purpose (3 KV groups, 17 vocabulary rows, 51 MLP columns over
2 ranks), like SmolLM2-135M's 9 query heads in 3 groups.
"""

import time

import grpc
import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from mirrorspec import SamplingParams, generate
from mirrorspec.drafting import DraftModelDrafter
from mirrorspec.models import KVSession
from mirrorspec.models import tensor_parallel as tp
from support import MemoSession, chi_square_pvalue, exact_joint, free_port, load, noisy_copy, start_follower

PROMPT = [0, 3, 5, 2]


def test_split_range_deals_evenly_and_covers_everything():
    assert [tp.split_range(17, 2, r) for r in range(2)] == [(0, 9), (9, 17)]
    assert [tp.split_range(5, 3, r) for r in range(3)] == [(0, 2), (2, 4), (4, 5)]


def test_head_shares_for_the_demo_target_and_for_replicated_kv_heads():
    # SmolLM2-135M: 9 query heads in 3 KV groups over 2 ranks -> 6 + 3
    assert tp.head_share(9, 3, 2, 0) == tp.HeadShare((0, 6), (0, 2))
    assert tp.head_share(9, 3, 2, 1) == tp.HeadShare((6, 9), (2, 3))
    # fewer KV heads than ranks: the KV head is replicated and its query heads split
    assert [tp.head_share(4, 1, 2, r) for r in range(2)] == [tp.HeadShare((0, 2), (0, 1)), tp.HeadShare((2, 4), (0, 1))]
    assert tp.head_share(4, 1, 2, 1).groups == 2
    with pytest.raises(tp.UnsupportedForTensorParallel, match="cannot split 3 query heads"):
        tp.head_share(3, 1, 2, 0)


def test_other_architectures_are_refused_with_a_clear_error():
    config = LlamaConfig(vocab_size=8, hidden_size=8, num_attention_heads=2, num_hidden_layers=1)
    config.model_type = "gpt2"
    with pytest.raises(tp.UnsupportedForTensorParallel, match="supports llama models; this target is 'gpt2'"):
        tp.check_supported(config)


def test_an_mlp_narrower_than_the_ranks_is_refused_naming_tp():
    """A rank with no MLP columns passed the check, then failed as it loaded (review 6: a follower
    died in prepack, and `serve --tp 3` waited out its start timeout)."""
    config = LlamaConfig(vocab_size=8, hidden_size=12, intermediate_size=2, num_attention_heads=3,
                         num_key_value_heads=3, num_hidden_layers=1)
    tp.check_shardable(config, 2)
    with pytest.raises(tp.UnsupportedForTensorParallel, match="2 columns cannot be split over tp=3") as err:
        tp.check_shardable(config, 3)
    assert err.value.field == "tp"


def save_uneven_llama(path):
    config = LlamaConfig(vocab_size=17, hidden_size=24, intermediate_size=51, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=16, pad_token_id=0)
    torch.manual_seed(11)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5 / model.lm_head.weight.std())
    model.save_pretrained(path)
    return path


def test_a_rank_lost_mid_operation_makes_the_replica_unavailable_for_good(monkeypatch):
    """A follower killed mid-request: rank 0's broadcast or collective fails with gloo's
    "Connection reset by peer", which the target answered as INTERNAL, and the front door, which
    moves sessions only off replicas that answer UNAVAILABLE, lost the request. Now the ranks are
    known to be out of step for good: UNAVAILABLE for this call and every later one."""
    from mirrorspec.serving.errors import ReplicaLost, status_for

    broadcasts = []

    def broken_broadcast(objects, src, group=None):
        broadcasts.append(objects[0])
        raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:29500: Connection reset by peer")

    monkeypatch.setattr(tp.dist, "broadcast_object_list", broken_broadcast)
    driver = tp.ShardDriver(model=None)
    with pytest.raises(ReplicaLost, match=r"a tensor-parallel rank failed mid-operation \(.*Connection reset by peer"):
        driver.run(("logits_for", "s", [1, 2], 1), lambda: pytest.fail("ran after a failed broadcast"))
    with pytest.raises(ReplicaLost, match="lost a rank earlier .* awaits replacement") as err:
        driver.run(("rollback", "s", 0))
    assert len(broadcasts) == 1  # nothing more is sent to ranks out of step
    assert status_for(err.value) == grpc.StatusCode.UNAVAILABLE


def test_an_idle_replica_keeps_its_followers_past_the_group_s_timeout(tmp_path):
    """A follower waits for rank 0's next operation inside a collective, which times out like any
    other: an idle replica lost its followers after gloo's 30 minutes (NCCL's 10), then every
    request on it failed until it was replaced. Here the timeout is 4 s and the replica idles 8 s.
    (Runs before the module's shared group starts: a process joins one group at a time.)"""
    source = str(save_uneven_llama(tmp_path / "target"))
    init = f"tcp://127.0.0.1:{free_port()}"
    follower = start_follower(source, init, group_timeout_s=4.0)
    try:
        driver = tp.ShardDriver(tp.load_shard(source, 0, 2, init, group_timeout_s=4.0).model, keepalive_s=0.25)
        time.sleep(8)
        context = [0, 5, 9, 16, 3]
        expected = KVSession(load(source)).logits_for(context, 2)
        torch.testing.assert_close(driver.session().logits_for(context, 2), expected, rtol=1e-5, atol=1e-5)
        driver.stop()
        follower.join(timeout=30)
        assert follower.exitcode == 0
    finally:
        if follower.is_alive():
            follower.kill()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """(whole model, rank 0's ShardDriver) with rank 1 following in another process."""
    source = str(save_uneven_llama(tmp_path_factory.mktemp("tp") / "target"))
    init = f"tcp://127.0.0.1:{free_port()}"
    follower = start_follower(source, init)
    loaded = tp.load_shard(source, 0, 2, init)
    driver = tp.ShardDriver(loaded.model)
    yield load(source), driver
    driver.stop()
    follower.join(timeout=30)
    dist.destroy_process_group()
    assert follower.exitcode == 0


def test_tp2_logits_agree_with_tp1_to_float32_tolerance(sharded):
    whole, driver = sharded
    session = driver.session()
    context = [0, 5, 9, 16, 3, 3, 12, 1]
    expected = KVSession(whole).logits_for(context, 4)
    torch.testing.assert_close(session.logits_for(context, 4), expected, rtol=1e-5, atol=1e-5)
    # roll back into the cache and extend along another branch: both ranks' caches follow
    branch = context[:5] + [7, 7]
    torch.testing.assert_close(session.logits_for(branch, 3), KVSession(whole).logits_for(branch, 3),
                               rtol=1e-5, atol=1e-5)
    session.close()


def test_tp2_greedy_output_is_token_identical_to_tp1(sharded, tiny_dir):
    whole, driver = sharded
    params = SamplingParams(max_new_tokens=40)
    for prompt in ([0, 3, 5], [16, 2, 2, 9, 1], [4]):
        alone = generate(whole, None, prompt, params).token_ids
        session = driver.session()
        assert generate(session, None, prompt, params).token_ids == alone
        session.close()
        session = driver.session()
        spec = generate(session, DraftModelDrafter(whole), prompt, params, num_speculative_tokens=3)
        assert spec.token_ids == alone
        session.close()


def test_tp2_runner_up_rows_agree_with_tp1_and_keep_the_followers_in_step(sharded):
    """The runner-up's tree pass on the sharded target: every rank replays it (the collectives
    line up), the rows match the whole model's, and the caches roll back in step after it."""
    whole, driver = sharded
    session, reference = driver.session(), KVSession(whole)
    context = [0, 5, 9, 16, 3, 3, 12, 1]
    torch.testing.assert_close(session.logits_with_runner_up(context, 4, 7),
                               reference.logits_with_runner_up(context, 4, 7), rtol=1e-5, atol=1e-5)
    branch = context[:5] + [7, 2]  # the runner-up's branch, after rolling back to before it
    session.rollback(5)
    torch.testing.assert_close(session.logits_for(branch, 2), KVSession(whole).logits_for(branch, 2),
                               rtol=1e-5, atol=1e-5)
    session.close()


def test_tp2_runner_up_windows_are_token_identical_to_tp1_and_take_runner_ups(sharded):
    whole, driver = sharded
    draft = noisy_copy(whole)
    params = SamplingParams(max_new_tokens=40)
    hits = 0
    for prompt in ([0, 3, 5], [16, 2, 2, 9, 1], [4]):
        session = driver.session()
        spec = generate(session, DraftModelDrafter(draft), prompt, params, num_speculative_tokens=3, runner_up=True)
        session.close()
        assert spec.token_ids == generate(whole, None, prompt, params).token_ids
        hits += spec.stats.runner_up_hits
    assert hits > 0


def reversed_gather(self, x):
    """Planted bug: the vocabulary shards concatenated in the wrong order."""
    local = torch.nn.functional.linear(x, self.weight, self.bias)
    width = max(self.sizes)
    parts = [torch.empty_like(torch.nn.functional.pad(local, (0, width - local.shape[-1]))) for _ in self.sizes]
    dist.all_gather(parts, torch.nn.functional.pad(local, (0, width - local.shape[-1])).contiguous())
    return torch.cat([p[..., :n] for p, n in reversed(list(zip(parts, self.sizes)))], dim=-1)


@pytest.mark.slow
@pytest.mark.parametrize("planted", [False, True], ids=["exact", "shards-gathered-out-of-order-bug"])
def test_sampled_output_of_the_sharded_target_follows_the_exact_distribution(sharded, monkeypatch, planted):
    """Seeded speculative sampling (K=3, temperature 1) with the sharded target's real KV caches,
    against the distribution enumerated from the whole model."""
    whole, driver = sharded
    if planted:  # rank 0 only: the collectives still line up, the logits are just wrong
        monkeypatch.setattr(tp.GatheredHead, "forward", reversed_gather)
    expected = exact_joint(MemoSession(whole), PROMPT, 2, temperature=1.0)
    params = SamplingParams(temperature=1.0, max_new_tokens=4)
    drafter = DraftModelDrafter(MemoSession(whole), proposal_top_k=4)
    samples = []
    session = driver.session()
    for seed in range(800 if planted else 3000):  # the bug is gross: 800 draws reject it decisively
        samples.append(tuple(generate(session, drafter, PROMPT, params, num_speculative_tokens=3,
                                      seed=seed).token_ids[:2]))
    session.close()
    pvalue = chi_square_pvalue(samples, expected)
    if planted:
        assert pvalue < 1e-6, f"the planted bug went unnoticed (p={pvalue:.2e})"
    else:
        assert pvalue > 1e-4, f"chi-square p={pvalue:.2e}"
