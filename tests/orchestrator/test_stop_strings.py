"""Stop strings cut a window at the token that completes one, searching only the new text."""

import random

import pytest
from transformers import AutoTokenizer

import support
from mirrorspec.models.detokenize import decode_text
from orchestrator.servicer import _StopStrings
from support import CountingTokenizer


@pytest.fixture(scope="module")
def words(tmp_path_factory):
    return AutoTokenizer.from_pretrained(support.save_word_tokenizer(tmp_path_factory.mktemp("words"), 12))


def cut_by_decoding_everything(tokenizer, stops, tokens: list[int]) -> tuple[int, bool]:
    """The rule, the slow way: the first prefix of the output whose whole text holds a stop."""
    for i in range(1, len(tokens) + 1):
        if any(stop in decode_text(tokenizer, tokens[:i]) for stop in stops):
            return i, True
    return len(tokens), False


def cut_in_windows(tokenizer, stops, tokens: list[int], rng) -> tuple[int, bool]:
    check, kept, at = _StopStrings(tokenizer, stops), 0, 0
    while at < len(tokens):
        window = tokens[at:at + rng.randint(1, 6)]
        sent, hit = check.cut(window)
        kept, at = kept + len(sent), at + len(window)
        if hit:
            return kept, True
    return kept, False


@pytest.mark.parametrize("seed", range(40))
def test_windows_are_cut_where_decoding_the_whole_output_would_cut_them(words, seed):
    """Stops that span windows and tokens, that start inside a token, one character long or not
    found at all: each cut is where the whole text first holds a stop."""
    rng = random.Random(seed)
    tokens = [rng.randrange(12) for _ in range(60)]
    text = words.decode(tokens)
    start = rng.randrange(len(text) - 6)
    stops = (text[start:start + rng.randint(1, 6)], rng.choice(["zz", "w1 w1 w1", "1 w"]))
    assert cut_in_windows(words, stops, tokens, rng) == cut_by_decoding_everything(words, stops, tokens)


def test_a_long_answer_without_its_stop_decodes_each_token_a_bounded_number_of_times(words):
    """Each window's check decoded the whole output again for each of its tokens: O(n^2), 5.3 s
    of decoding on a 4k-token answer (a review's find)."""
    counting = CountingTokenizer(words)
    assert cut_in_windows(counting, ("never there",), [i % 12 for i in range(2000)], random.Random(0)) == (2000, False)
    assert counting.decoded <= 40 * 2000  # the old check: ~2e6


def test_a_stop_at_the_start_of_the_output_that_spans_two_windows_is_found(words):
    """The text kept to search across windows was cut with ``[len(seen) - reach:]``, which wrapped
    round while the output was shorter than the longest stop and kept its end alone: "w1 w2 w3"
    over windows [w1 w2] and [w3] ran past its stop (a review's find)."""
    check = _StopStrings(words, ("w1 w2 w3",))
    w1, w2, w3, w4 = words.convert_tokens_to_ids(["w1", "w2", "w3", "w4"])
    assert check.cut([w1, w2]) == ([w1, w2], False)
    assert check.cut([w3, w4]) == ([w3], True)
