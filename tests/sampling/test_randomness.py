import random

import pytest
import torch

from mirrorspec.sampling import Stream, randomness, sample_categorical, uniform, uniforms
from mirrorspec.sampling.randomness import race_noise


def test_draws_are_pure_functions_of_their_coordinates():
    assert uniform(7, 100, Stream.ACCEPT) == uniform(7, 100, Stream.ACCEPT)
    assert uniforms(7, [1, 2, 3], Stream.NEXT).tolist() == [uniform(7, p, Stream.NEXT) for p in (1, 2, 3)]


def test_streams_seeds_positions_and_branches_differ():
    base = uniform(1, 5, Stream.DRAFT)
    others = {uniform(2, 5, Stream.DRAFT), uniform(1, 6, Stream.DRAFT), uniform(1, 5, Stream.ACCEPT),
              uniform(1, 5, Stream.DRAFT, branch=1)}
    assert base not in others and len(others) == 4


def test_uniforms_lie_in_unit_interval_and_look_uniform():
    u = uniforms(3, range(100_000), Stream.NEXT)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005
    hist = [int(((u >= i / 10) & (u < (i + 1) / 10)).sum()) for i in range(10)]
    assert max(hist) - min(hist) < 1_000  # ~10,000 each; binomial sd ~95


def test_race_noise_is_positive_even_where_a_column_s_bits_are_all_ones():
    """For this uniform, column 3's 53 bits are all ones: its unit plus 2**-54 rounded to 1.0, its
    noise was -0.0, and a zero-probability column 3 won the race (0 / -0.0 is NaN; review 3 found
    the uniform by inverting splitmix64)."""
    u = torch.tensor([0.053782515553622456], dtype=torch.float64)
    assert (race_noise(u, 4) > 0).all()
    assert sample_categorical(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), u).tolist() == [0]


def test_seeded_draws_keep_the_values_earlier_releases_gave():
    """A seed replays a request across versions too (a client's stored seed, a replica on an older
    release): the draws below were computed before small draws moved to Python ints."""
    assert uniforms(7, [0, 1, 2**64 + 3], Stream.ACCEPT, branch=2).tolist() == [
        0.887055373957237, 0.8865714633518132, 0.037211362320101804]
    assert race_noise(torch.tensor([0.25, 0.75], dtype=torch.float64), 3).tolist() == [
        [2.040627569705548, 3.6594192832359758, 2.082098257220288],
        [1.458432553648797, 0.007340005828096331, 1.276734887779906]]


@pytest.mark.parametrize("count", [1, 3, 17, 64])
def test_small_draws_on_python_ints_give_the_bits_of_the_array_path(count, monkeypatch):
    """Below ``SCALAR_HASHES`` hashes, draws are computed on Python ints; every bit must match the
    numpy path that larger draws take, for any seed, position or branch (negative, past 2**63)."""
    rng = random.Random(count)
    coordinates = [(rng.getrandbits(70) - 2**69, [rng.getrandbits(66) - 2**65 for _ in range(count)],
                    rng.choice(list(Stream)), rng.choice([0, 1, -1, rng.getrandbits(70)])) for _ in range(20)]
    # the edge keys first, so every slice below holds some: 0, the largest uniform, review 3's all-ones column
    keys = torch.tensor([0.053782515553622456, 1 - 2**-53, 0.0] + [rng.random() for _ in range(count)],
                        dtype=torch.float64)

    def draws():
        return ([uniforms(*c) for c in coordinates],
                [race_noise(keys[:n], width) for n in (1, 2, count) for width in (1, 4, 7, 64 // n)])

    scalar = draws()
    monkeypatch.setattr(randomness, "SCALAR_HASHES", -1)
    arrays = draws()
    for ours, theirs in zip(sum(scalar, []), sum(arrays, [])):
        assert ours.dtype == theirs.dtype == torch.float64
        assert torch.equal(ours, theirs)
