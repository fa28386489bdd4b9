"""The streamed text: deltas that concatenate to the full decode, at a cost linear in the output."""

import random

import pytest

import support
from mirrorspec.models.detokenize import IncrementalDetokenizer, decode_text
from support import CountingTokenizer

TEXT = ("def área(r):\n    return 3.14159 * r ** 2  # 円の面積 🙂🚀\n"
        "Ünïcödé, naïve café — «quotes» and emoji 👩‍💻 split over tokens. ") * 3


def streamed(tokenizer, tokens: list[int], seed: int) -> tuple[list[str], str]:
    """The deltas of ``tokens`` pushed in windows of 1 to 9, as the stream sends them, and the flush."""
    detokenizer, rng, deltas, at = IncrementalDetokenizer(tokenizer), random.Random(seed), [], 0
    while at < len(tokens):
        size = rng.randint(1, 9)
        deltas.append(detokenizer.push(tokens[at:at + size]))
        at += size
    return deltas, detokenizer.flush()


@pytest.mark.parametrize("seed", range(4))
def test_the_deltas_of_the_demo_tokenizer_make_the_full_text_and_never_half_a_character(demo_target, seed):
    tokenizer = demo_target.tokenizer
    tokens = tokenizer.encode(TEXT, add_special_tokens=False) + [tokenizer.eos_token_id]
    deltas, rest = streamed(tokenizer, tokens, seed)
    assert "".join(deltas) + rest == tokenizer.decode(tokens, skip_special_tokens=True) == TEXT
    assert not [d for d in deltas if "\ufffd" in d]  # a character split over tokens waits for its end


@pytest.mark.parametrize("seed", range(4))
def test_the_deltas_of_a_sentencepiece_style_tokenizer_keep_the_space_its_decoder_strips_first(tmp_path, seed):
    """Llama's and Mistral's decoders drop the first token's leading space: text decoded from a
    window of tokens alone would lose a space at each window's start. EOS ids in the output (as
    ignore_eos leaves them) add nothing, and characters it never learnt span byte tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(support.save_sentencepiece_style_tokenizer(tmp_path, TEXT))
    words = TEXT.split(" ")
    tokens = [t for word in words[seed:] for t in tokenizer.encode(word, add_special_tokens=False)  # "▁" + word
              + ([tokenizer.eos_token_id] if word.endswith(".") else [])]
    deltas, rest = streamed(tokenizer, tokens, seed)
    assert "".join(deltas) + rest == tokenizer.decode(tokens, skip_special_tokens=True)
    assert tokenizer.decode(tokens[:3], skip_special_tokens=True)[0] != " "  # it does strip the first space


def test_the_deltas_of_a_word_tokenizer_keep_the_spaces_it_writes_between_tokens(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(support.save_word_tokenizer(tmp_path, 12))
    tokens = [random.Random(0).randrange(12) for _ in range(40)]
    deltas, rest = streamed(tokenizer, tokens, 0)
    assert "".join(deltas) + rest == tokenizer.decode(tokens, skip_special_tokens=True) and rest == ""


@pytest.mark.parametrize("seed", range(4))
def test_the_deltas_of_a_tokenizer_that_cleans_up_spaces_make_the_unary_text(tmp_path, seed):
    """transformers' clean-up of a whole decode (" 's" -> "'s") is not one of its pieces: with it
    on, the streamed text lost characters against the unary one ("o 'rien" for "o'brien"). The
    output's text is decoded without it, streamed or not (a review's find)."""
    from transformers import AutoTokenizer

    words = "I don't think O'Brien's dog can't run. Hello , world ! Is it ? Yes, it's fine; we'll see. "
    tokenizer = AutoTokenizer.from_pretrained(support.save_wordpiece_tokenizer(tmp_path, words))
    tokens = tokenizer.encode(words * 3, add_special_tokens=False) + [tokenizer.eos_token_id]
    deltas, rest = streamed(tokenizer, tokens, seed)
    assert "".join(deltas) + rest == decode_text(tokenizer, tokens)
    assert tokenizer.decode(tokens, skip_special_tokens=True) != decode_text(tokenizer, tokens)  # it does clean up


def test_streaming_a_long_answer_decodes_each_token_a_bounded_number_of_times(tmp_path):
    """It decoded the whole output at every push: O(n^2), 2.8 s of decoding on a 4k-token answer."""
    from transformers import AutoTokenizer

    counting = CountingTokenizer(AutoTokenizer.from_pretrained(support.save_word_tokenizer(tmp_path, 12)))
    tokens = [i % 12 for i in range(2000)]
    deltas, rest = streamed(counting, tokens, 1)
    assert "".join(deltas) + rest == counting.tokenizer.decode(tokens, skip_special_tokens=True)
    assert counting.decoded <= 6 * len(tokens)  # whole decodes at each push would be ~250 times more


def test_a_run_of_special_tokens_is_not_decoded_again_at_every_push(tmp_path):
    """A run of special tokens (EOS after EOS, as ignore_eos gives) adds no text, so the offsets
    stayed put and each push decoded the whole run again: 3,347 decodes a token at 4k tokens (a
    review's find). Here w0 is the tokenizer's one special token."""
    from transformers import AutoTokenizer

    counting = CountingTokenizer(AutoTokenizer.from_pretrained(support.save_word_tokenizer(tmp_path, 12)))
    counting.all_special_ids = counting.tokenizer.all_special_ids
    tokens = [1, 2, 3] + [0] * 2000 + [4]
    deltas, rest = streamed(counting, tokens, 2)
    assert "".join(deltas) + rest == "w1 w2 w3 w4" and counting.decoded <= 6 * len(tokens)
