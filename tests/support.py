"""Shared test helpers: tiny real Llama models, exact enumerated distributions, chi-square.

The reference distribution code here is written independently of ``mirrorspec.sampling``
(numpy, float64, explicit loops) so that a bug in the library's top-k/top-p cannot hide itself.
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
import select
import signal
import socket
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from scipy import stats
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM


def save_tiny_llama(path: Path, seed: int, vocab: int = 8, hidden: int = 16, layers: int = 1,
                    logit_scale: float = 3.0, eos_token_id: int | list[int] | None = None,
                    sliding_window: int | None = None) -> Path:
    """A random Llama with a tiny vocabulary, saved as an ordinary checkpoint (with a
    ``sliding_window``, a Mistral: the same model whose layers see that many positions back).

    The LM head is scaled so next-token distributions are far from uniform (default init gives
    nearly flat ones, which would make every test weak). No EOS by default: a server stops at its
    target's EOS ids, and tests compare with target-only decoding run to max_new_tokens.
    """
    from transformers import MistralConfig, MistralForCausalLM

    config_type, model_type = (LlamaConfig, LlamaForCausalLM) if sliding_window is None else (MistralConfig,
                                                                                              MistralForCausalLM)
    window = {} if sliding_window is None else {"sliding_window": sliding_window}
    config = config_type(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=eos_token_id, pad_token_id=0, **window)
    torch.manual_seed(seed)
    model = model_type(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale / model.lm_head.weight.std())
    model.save_pretrained(path)
    return path


def save_word_tokenizer(path: Path, num_words: int, prefix: str = "w") -> Path:
    """A word-level tokenizer of ``num_words`` words (``w0`` is id 0, ...), saved beside a tiny
    model so loaders find it: tiny models that must share, or not share, a tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"{prefix}{i}": i for i in range(num_words)}, unk_token=f"{prefix}0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token=f"{prefix}0").save_pretrained(path)
    return path


def save_sentencepiece_style_tokenizer(path: Path, text: str) -> Path:
    """A Llama-2-style tokenizer trained on ``text``: "▁" for spaces, a decoder that strips the
    first token's leading space, and byte-fallback tokens for characters it never learnt, so a
    character can span tokens. Streamed text must keep the spaces such a decoder drops."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained.train_from_iterator([text] * 20, trainers.BpeTrainer(vocab_size=200, special_tokens=specials,
                                                                 limit_alphabet=30))
    learnt = json.loads(trained.to_str())["model"]
    vocab = {token: i for i, token in enumerate(specials)} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for token in sorted(learnt["vocab"], key=learnt["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learnt["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = trained.normalizer
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens(specials)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)
    return path


def save_wordpiece_tokenizer(path: Path, text: str) -> Path:
    """A BERT-style tokenizer trained on ``text``: WordPiece with "##" pieces, and transformers'
    ``clean_up_tokenization_spaces`` on, which rewrites a whole decode (" 's" -> "'s") in a way
    text decoded in pieces does not add up to."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.train_from_iterator([text] * 10, trainers.WordPieceTrainer(vocab_size=150, special_tokens=["[UNK]", "[SEP]"]))
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="[SEP]",
                            clean_up_tokenization_spaces=True).save_pretrained(path)
    return path


class HeldTokenizing:
    """Holds the front door's prompt tokenizing (``encode_prompt``) until ``release`` is set:
    ``entered`` says a request reached it, ``threads`` names the threads it ran on."""

    def __init__(self, monkeypatch):
        import threading

        import orchestrator.servicer as front_door

        self.entered, self.release, self.threads = threading.Event(), threading.Event(), []
        encode = front_door.encode_prompt

        def held(*args, **kwargs):
            self.threads.append(threading.current_thread().name)
            self.entered.set()
            self.release.wait(30)
            return encode(*args, **kwargs)

        monkeypatch.setattr(front_door, "encode_prompt", held)


class CountingTokenizer:
    """Counts the tokens it is asked to decode: the cost of detokenizing, without a clock."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, tokens, **kwargs):
        self.decoded += len(tokens)
        return self.tokenizer.decode(tokens, **kwargs)


def test_device() -> torch.device:
    """Where the tiny models run: CPU unless ``MIRRORSPEC_TEST_DEVICE`` names another device
    (``cuda`` on a GPU machine, to run the statistical tests through the CUDA sampling path)."""
    return torch.device(os.environ.get("MIRRORSPEC_TEST_DEVICE", "cpu"))


def load(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(test_device()).eval()


def load_as_served_draft(path: Path) -> torch.nn.Module:
    """A draft as a drafter server loads it by default (int8 linears on CPU): a seeded sampled
    request served by it draws the very tokens the in-process engine draws with this one. With a
    float32 draft beside an int8 server, logits ~1% apart flip a sampled token now and then (a
    review's fuzz: 11 of 1,328 cases; 0 of 326 with the server on float32)."""
    from mirrorspec.config import DEFAULT_DRAFT_QUANTIZE
    from mirrorspec.models import load_causal_lm

    return load_causal_lm(str(path), tokenizer=False, quantize=DEFAULT_DRAFT_QUANTIZE).model


class MemoSession:
    """A ``LogitSession`` that runs full (uncached) forwards of a real model, memoised by context.

    Statistical tests draw tens of thousands of samples from the same few contexts; memoising the
    real model's logits keeps them fast while the engine and sampling code run unchanged.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.vocab_size = int(model.config.vocab_size)
        self._memo: dict[tuple[int, ...], torch.Tensor] = {}

    def next_logits(self, context: Sequence[int]) -> torch.Tensor:
        key = tuple(context)
        if key not in self._memo:
            with torch.inference_mode():
                self._memo[key] = self.model(torch.tensor([key], device=self.model.device)).logits[0, -1].float()
        return self._memo[key]

    def logits_for(self, context: Sequence[int], num_positions: int) -> torch.Tensor:
        n = len(context)
        return torch.stack([self.next_logits(context[: n - num_positions + i + 1]) for i in range(num_positions)])

    def logits_with_runner_up(self, context: Sequence[int], num_positions: int, runner_up: int) -> torch.Tensor:
        """``KVSession.logits_with_runner_up``: one more row, after ``runner_up`` put in place of the
        first of the last ``num_positions - 1`` tokens."""
        first = len(context) - num_positions + 1
        runner_up_row = self.next_logits([*context[:first], runner_up])[None]
        return torch.cat([self.logits_for(context, num_positions), runner_up_row])

    def rollback(self, length: int) -> None:
        pass

    def close(self) -> None:
        pass


def reference_probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """Plain-sampling distribution, the textbook way: temperature, top-k, then nucleus."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    order = list(np.argsort(-z, kind="stable"))
    kept = order[:top_k] if top_k else order
    w = np.exp(z[kept] - z[kept].max())
    w /= w.sum()
    if top_p < 1.0:
        total, cut = 0.0, len(kept)
        for i, wi in enumerate(w):
            total += wi
            if total >= top_p:
                cut = i + 1
                break
        kept, w = kept[:cut], w[:cut] / w[:cut].sum()
    out = np.zeros_like(z)
    out[kept] = w
    return out


def exact_joint(session: MemoSession, prompt: Sequence[int], depth: int, temperature: float,
                top_k: int = 0, top_p: float = 1.0) -> dict[tuple[int, ...], float]:
    """P(t_1..t_depth | prompt) for every sequence, by enumeration."""
    vocab = session.vocab_size
    joint: dict[tuple[int, ...], float] = {}
    for seq in itertools.product(range(vocab), repeat=depth):
        prob = 1.0
        for i in range(depth):
            prob *= reference_probs(session.next_logits(list(prompt) + list(seq[:i])).cpu().numpy(),
                                    temperature, top_k, top_p)[seq[i]]
            if prob == 0.0:
                break
        joint[seq] = prob
    return joint


def chi_square_pvalue(samples: Sequence[tuple[int, ...]], expected: dict[tuple[int, ...], float],
                      min_expected: float = 5.0) -> float:
    """Goodness of fit of sampled outcomes to an exact distribution.

    Outcomes with expected count < ``min_expected`` are pooled into one cell. An outcome of
    probability zero that was sampled makes the p-value 0 outright.
    """
    counts = Counter(samples)
    n = len(samples)
    if any(expected.get(outcome, 0.0) == 0.0 for outcome in counts):
        return 0.0
    big = [o for o, p in expected.items() if p * n >= min_expected]
    observed = [counts.get(o, 0) for o in big]
    wanted = [expected[o] * n for o in big]
    rest_expected = n - sum(wanted)
    if rest_expected > 1e-9:
        observed.append(n - sum(observed))
        wanted.append(rest_expected)
    wanted = np.array(wanted) * (sum(observed) / np.sum(wanted))  # guard float drift
    return float(stats.chisquare(observed, wanted).pvalue)


def wait_until(condition, timeout: float = 10.0, every: float = 0.05):
    """Poll ``condition`` until it holds, and return what it returned then (falsy once ``timeout``
    seconds pass). Use that value rather than asking again: state a test waits on can change
    between two reads (a replica seen busy has finished its request by the next status call)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := condition():
            return found
        time.sleep(every)
    return False


def record_rpc(monkeypatch, servicer: type, method: str, note=lambda request: request) -> list:
    """Wrap a servicer's unary RPC so that each call appends ``note(request)`` to the list returned."""
    seen = []
    original = getattr(servicer, method)

    async def recorded(self, request, context):
        seen.append(note(request))
        return await original(self, request, context)

    monkeypatch.setattr(servicer, method, recorded)
    return seen


def assert_flag_refused(main, argv: Sequence[str], flag: str, capsys) -> None:
    """``main(argv)`` exits as argparse does on a bad value (status 2), naming ``flag``, before any
    model is loaded."""
    import pytest

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def free_port() -> int:
    """A loopback port free right now (a server started soon after can bind it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def live_threads() -> str:
    """This process's threads by name, most first: Python's by their ``threading`` names, the native
    ones (gRPC's, Ray's, torch's, which ``threading`` does not list) by their kernel names."""
    import threading

    python_names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        named = Counter(python_names.values())
    else:
        named = Counter()
        for task in tasks.iterdir():
            try:
                named[python_names.get(int(task.name)) or task.joinpath("comm").read_text().strip()] += 1
            except (OSError, ValueError):  # a thread that ended while we looked
                continue
    return f"{sum(named.values())}: " + ", ".join(f"{n} {name}" for name, n in named.most_common())


def counts_by_label(counter, label: str) -> dict[str, float]:
    """A labelled Prometheus counter's totals, by that label's value."""
    return {sample.labels[label]: sample.value for family in counter.collect() for sample in family.samples
            if sample.name.endswith("_total")}


def noisy_copy(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with seeded noise on every weight: a draft that agrees with it at about a third
    of greedy positions (a random draft agrees at none, which would test nothing)."""
    import copy

    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in draft.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator).to(weight.device) * 0.5 * weight.std())
    return draft


def start_follower(source: str, init: str, **kwargs):
    """Rank 1 of a tp=2 group in a spawned process, started once its imports are done: a spawned
    interpreter takes ~6 s to import torch and transformers on the 2-core VM, past a 4 s group
    timeout's rendezvous, so the group failed to form before the test began (stop 49)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    follower = context.Process(target=_follow_once_imported, args=(ready, source, 1, 2, init), kwargs=kwargs,
                               daemon=True)
    follower.start()
    if not ready.wait(300):
        follower.kill()
        raise RuntimeError("the follower process did not start within 300 s")
    return follower


def _follow_once_imported(ready, *args, **kwargs) -> None:
    from mirrorspec.models import tensor_parallel

    ready.set()
    tensor_parallel.run_follower(*args, **kwargs)


def run_halves_in_two_processes(run: Callable[[int, int], list], first: int, count: int) -> list:
    """``run(first, count)``, the per-index results of indices first .. first + count - 1, with the
    second half computed by a forked child while this process computes the first.

    The statistical tests draw each sample from its own seed, so a sample does not depend on which
    process drew it, and the list is the one a single process would build. They were the largest
    part of the suite's time, and are single-threaded (one torch thread per process), so on CI's 2
    cores this nearly halves them (1.85x over the planted-bug tests; less where each process
    computes many of the same memo misses). The child inherits everything: models, memoised logits,
    monkeypatched planted bugs.

    Forking a process that has run gRPC or Ray threads is safe only as long as the child touches
    neither, and no lock a dead thread held: so the child exits with ``os._exit`` (no finalisers),
    and if it fails, dies or outlasts a generous deadline, its half is computed here instead: a
    result is never lost or changed, only slower.

    A process that has used CUDA does not fork at all: CUDA cannot be initialised again in a forked
    child, so on a GPU (``MIRRORSPEC_TEST_DEVICE=cuda``) every child failed and its half was drawn
    here after it, with a warning per test (seen on an H200)."""
    half = count // 2
    if half == 0 or not hasattr(os, "fork") or torch.cuda.is_initialized():
        return run(first, count)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compute the second half, send it (or why not), exit without cleanup
        os.close(read_end)
        try:
            torch.set_num_threads(1)
            payload = pickle.dumps(run(first + half, count - half))
        except BaseException:  # noqa: BLE001 - its traceback would die with it: the parent's warning says it
            payload = pickle.dumps(ChildFailed(traceback.format_exc(limit=-4)))
        finally:
            try:
                with os.fdopen(write_end, "wb") as pipe:
                    pipe.write(payload)
            finally:
                os._exit(0)
    os.close(write_end)
    started = time.monotonic()
    try:
        mine = run(first, half)
        theirs = _read_child(read_end, deadline=time.monotonic() + 60 + 4 * (time.monotonic() - started))
    finally:
        os.close(read_end)
        _reap(pid)
    if theirs is None or isinstance(theirs, ChildFailed):
        why = f": {theirs.traceback}" if theirs is not None else " (it died or outlasted its deadline)"
        warnings.warn(f"the forked half of samples {first + half}..{first + count - 1} came back empty, "
                      f"drawn here instead{why}", RuntimeWarning)
        theirs = run(first + half, count - half)
    return mine + theirs


@dataclass(frozen=True)
class ChildFailed:
    """What a forked half sends instead of its samples: the CI log then says why it failed."""

    traceback: str


def _read_child(read_end: int, deadline: float) -> list | ChildFailed | None:
    """The child's pickled results (or failure), or None if it exits without them or the deadline
    passes."""
    chunks = []
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([read_end], [], [], left)[0]:
            break
        chunk = os.read(read_end, 1 << 20)
        if not chunk:  # the child closed its end: whole payload, or nothing if it failed
            return pickle.loads(b"".join(chunks)) if chunks else None
        chunks.append(chunk)
    return None


def _reap(pid: int) -> None:
    """Wait for the child, killing it first if it is still running (a deadline passed)."""
    finished, _ = os.waitpid(pid, os.WNOHANG)
    if not finished:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def record_instances(monkeypatch, module, name: str, note: Callable) -> list:
    """Replace ``module.name`` (a class) for the test by a subclass that appends ``note(instance)``
    to the returned list as each instance is made, and otherwise behaves as the class does."""
    original = getattr(module, name)
    made: list = []

    class Recorded(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(note(self))

    monkeypatch.setattr(module, name, Recorded)
    return made
