import faulthandler
import os
import sys

import pytest
import torch

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One torch thread per test process: tests that start servers run several torch processes on two cores.
torch.set_num_threads(1)

import support  # noqa: E402
from mirrorspec.models.demo_target import CHECKPOINT_NAME, cache_root  # noqa: E402

# Finished builds in the user's cache that tests may share: keyed by content, never rewritten.
_SHAREABLE = {CHECKPOINT_NAME: "CONVERTED_OK", "demo-draft-": "ASSEMBLED_OK"}


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """Tests build into a cache of their own (``MIRRORSPEC_CACHE``, inherited by the servers,
    CLIs and Ray workers they start), so tuned lenses fitted to temporary tiny models, toy
    teacher shards and rebuilt drafts do not pile up in the user's ``~/.cache/mirrorspec``.
    Finished demo-target and demo-draft builds found there are linked in, not redone: converting
    the target from GGUF costs every run tens of seconds."""
    user_cache = cache_root()
    cache = tmp_path_factory.mktemp("mirrorspec-cache")
    for entry in user_cache.iterdir() if user_cache.is_dir() else ():
        marker = next((m for prefix, m in _SHAREABLE.items() if entry.name.startswith(prefix)), None)
        if marker and (entry / marker).is_file():
            (cache / entry.name).symlink_to(entry)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MIRRORSPEC_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Target and two different drafts, vocab 8, saved and reloaded with from_pretrained."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        "target": support.save_tiny_llama(root / "target", seed=0, logit_scale=1.5),
        "draft": support.save_tiny_llama(root / "draft", seed=1, logit_scale=2.0),
        "target16": support.save_tiny_llama(root / "target16", seed=2, vocab=16, layers=2),
        "draft16": support.save_tiny_llama(root / "draft16", seed=3, vocab=16),
    }


@pytest.fixture(scope="session")
def padded_pair(tmp_path_factory):
    """One 12-word tokenizer, padded to two table sizes (as Qwen2.5's is: 151,936 rows for 0.5B,
    152,064 for 7B): a 16-row target, whose random head samples its padding ids 12-15 often, and a
    12-row draft; plus a 12-row draft with another tokenizer of the same size."""
    root = tmp_path_factory.mktemp("padded")
    pair = {"target": support.save_tiny_llama(root / "target", seed=2, vocab=16, layers=2),
            "draft": support.save_tiny_llama(root / "draft", seed=5, vocab=12, logit_scale=2.0),
            "stranger": support.save_tiny_llama(root / "stranger", seed=5, vocab=12, logit_scale=2.0)}
    for name in ("target", "draft"):
        support.save_word_tokenizer(pair[name], 12)
    support.save_word_tokenizer(pair["stranger"], 12, prefix="x")
    return pair


@pytest.fixture(scope="session")
def tiny_target(tiny_dir):
    return support.load(tiny_dir["target"])


@pytest.fixture(scope="session")
def tiny_draft(tiny_dir):
    return support.load(tiny_dir["draft"])


@pytest.fixture(scope="session")
def near_draft(tiny_dir):
    """The tiny target with seeded noise on every weight: it agrees with the target at about a third
    of greedy positions (the tiny random draft agrees at none, which would test nothing)."""
    return support.noisy_copy(support.load(tiny_dir["target"]))


@pytest.fixture(scope="session")
def near_draft16(tiny_dir):
    """``near_draft`` for the 2-layer vocab-16 target, which has a layer to read early-exit hints off."""
    return support.noisy_copy(support.load(tiny_dir["target16"]))


@pytest.fixture(scope="session")
def near_draft16_dir(near_draft16, tmp_path_factory):
    """``near_draft16`` saved, for a drafter server to load with ``from_pretrained``."""
    path = tmp_path_factory.mktemp("near") / "near16"
    near_draft16.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def demo_target():
    """The real SmolLM2-135M-Instruct demo target (converted from GGUF once, then cached)."""
    from mirrorspec.models import load_causal_lm

    return load_causal_lm("demo-target")


@pytest.fixture
def not_a_front_door():
    """A real gRPC server on loopback that serves the health service only, as a drafter or target
    server would answer a client pointed at it by mistake."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    server = grpc.server(ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


_SESSION = pytest.StashKey[pytest.Session]()
# pytest prints these after unconfigure (a misspelled path, a bad -k; an internal error's traceback):
# the normal teardown lets it
_REPORTED_AFTER_UNCONFIGURE = (pytest.ExitCode.USAGE_ERROR, pytest.ExitCode.INTERNAL_ERROR)


def pytest_sessionstart(session):
    session.config.stash[_SESSION] = session


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Ends the test process once pytest has reported, without tearing down its native libraries.

    This one process hosts hundreds of in-process gRPC servers and channels, a Ray driver (joined to
    three clusters in turn) and forked children; Ray keeps some C++ threads of its own after
    ``ray.shutdown`` (its GCS client's IO thread). Twice, CI's run passed every test and then died
    with SIGSEGV after the summary (exit 139: on 508e903, and on 23d965a), with no Python stack even
    though a faulthandler was on: so after Python had finalised, in C++ static destructors racing
    those threads (Ray's own workers end with ``os._exit`` for the same reason, ray-project/ray#18899).
    pytest's result is printed by now, and its exit status final (``session.exitstatus``, which the
    terminal reporter's ``--max-warnings`` may have changed after any plugin's sessionfinish). So:
    run the ``atexit`` handlers (Ray's shutdown, multiprocessing's reaping of daemon children,
    logging's flush; a handler that hangs for 2 minutes dumps every stack and exits), print the
    threads still alive (so a leak shows in CI's log), and leave with ``os._exit``. Where pytest
    still has something to print (a usage error, an internal error) the teardown is the normal one.
    ``MIRRORSPEC_TEST_FULL_TEARDOWN=1`` keeps the normal teardown, to hunt such a crash; a
    faulthandler stays on through it either way, so a crash inside Python's part prints stacks."""
    faulthandler.enable(file=sys.__stderr__, all_threads=True)
    session = config.stash.get(_SESSION, None)
    if (os.environ.get("MIRRORSPEC_TEST_FULL_TEARDOWN") == "1" or session is None
            or session.exitstatus in _REPORTED_AFTER_UNCONFIGURE):
        return
    _run_atexit_handlers(timeout_s=120)
    try:
        print(f"threads alive at exit: {support.live_threads()}", file=sys.__stderr__)
    except Exception as err:  # noqa: BLE001 - a census that fails must not keep the process from leaving
        print(f"threads alive at exit: not counted ({err!r})", file=sys.__stderr__)
    for stream in (sys.stdout, sys.__stdout__, sys.stderr, sys.__stderr__):
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):
            pass
    os._exit(int(session.exitstatus))


def _run_atexit_handlers(timeout_s: float) -> None:
    import atexit

    faulthandler.dump_traceback_later(timeout_s, exit=True, file=sys.__stderr__)
    try:
        atexit._run_exitfuncs()
    finally:
        faulthandler.cancel_dump_traceback_later()
