"""Rules for flags that several commands share: what was typed, what is refused together, and
the checks of waits, amounts and addresses (also the front door's own ``python -m orchestrator``).
"""

from __future__ import annotations

import argparse
import math
import re

from mirrorspec.config import InvalidRequest, MAX_WAIT_S


def is_set(args: argparse.Namespace, dest: str) -> bool:
    """Whether the command line gave this flag (``parse_command_line``), whatever its value."""
    return dest in args.given


# what sets speculation up, in generate and serve: refused where speculation is off, not ignored
SPECULATION_SETTINGS = ("k", "adaptive", "mirror", "no_runner_up", "windows_on_target", "speculation_off_above",
                        "hint_layer")


def refuse_speculation_settings(args: argparse.Namespace, off: str, also: tuple[str, ...] = ()) -> None:
    """``off`` (a flag) decodes target-only: a flag that sets speculation up would be ignored."""
    for dest in (*SPECULATION_SETTINGS, *also):
        if hasattr(args, dest) and is_set(args, dest):
            raise InvalidRequest(f"sets speculation, which {off} turns off: drop one of the two", field=field_of(dest))


def field_of(dest: str) -> str:
    """The field an error names for a flag's dest: ``--no-runner-up`` is the field runner_up."""
    return "runner_up" if dest == "no_runner_up" else dest


# how a draft model drafts: an n-gram drafter has no model, and would ignore them (its proposals
# have no runner-up to offer either)
DRAFT_MODEL_SETTINGS = ("prompt_lookup", "draft_confidence", "proposal_top_k", "draft_quantize", "no_runner_up")


def refuse_draft_model_settings_without_a_model(args: argparse.Namespace, draft: str) -> None:
    why = {"ngram": "--draft ngram has none (it proposes what followed the context's last tokens where they "
                    "occurred before)",
           "none": "--draft none has none (it decodes with the target alone)"}.get(draft)
    if why is not None:
        refuse_draft_model_settings(args, why)


def refuse_draft_model_settings(args: argparse.Namespace, why: str) -> None:
    """A setting of how a draft model drafts, where ``why`` none drafts: it would be ignored."""
    for dest in DRAFT_MODEL_SETTINGS:
        if hasattr(args, dest) and is_set(args, dest):
            raise InvalidRequest(f"sets how a draft model drafts, and {why}: drop one of the two", field=field_of(dest))


def check_finite_amount(value: float | None, field: str) -> None:
    """A count, resource share or wait that must be a finite number >= 0 (``nan`` passes ``< 0``
    and ``inf`` overflows Ray's and threading's arithmetic, both as tracebacks)."""
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise InvalidRequest(f"must be a finite number >= 0, got {value}", field=field)


def ray_address(text: str) -> str:
    """``--address``: an empty one (an unset ``"$HEAD"``) was a cluster's to some checks and a local
    Ray's to others (a review's find): `serve --address ""` started a local Ray, skipping the checks
    of one, and waited out --start-timeout for a GPU it would never have."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give the Ray cluster's head (HOST:6379, or 'auto' for the one on "
                                         "this machine), or leave --address out")
    return text.strip()


def deployment_name(text: str) -> str:
    """``--name``: it names Ray actors and placement groups, and a file beside the cache for a local
    Ray; "a/b" became a path under that folder, and "" a deployment called "-controller"."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a deployment name: use 1 to 64 letters, digits, '-', '_' "
                                         f"or '.', starting with a letter or digit")
    return text


def check_wait(seconds: float | None, field: str) -> None:
    """A finite wait of at most ``MAX_WAIT_S``: threading's waits and gRPC's deadlines overflow a
    little past 9.2e9 s, and a stop given ``--shutdown-grace 1e10`` raised inside its replicas,
    leaving the deployment half stopped (a review's find)."""
    check_finite_amount(seconds, field)
    if seconds is not None and seconds > MAX_WAIT_S:
        raise InvalidRequest(f"must be at most {MAX_WAIT_S:g} seconds (about four months), got {seconds:g}",
                             field=field)


def is_draft_model(draft: str) -> bool:
    """A resolved ``--draft`` that names a model (not prompt lookup alone, not none)."""
    return draft not in ("ngram", "none")


def resolve_draft(draft: str, target: str) -> str:
    """``auto``: the trained demo draft for the demo target, prompt lookup for any other target."""
    from mirrorspec.models import DEMO_DRAFT, DEMO_TARGET

    if draft != "auto":
        return draft
    return DEMO_DRAFT if target == DEMO_TARGET else "ngram"
