import torch

from mirrorspec.sampling import Stream, sample_categorical, uniform, uniforms
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
