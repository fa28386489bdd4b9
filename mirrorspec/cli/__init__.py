"""The ``mirrorspec`` command line: the face of the project.

Bad values are reported as ``mirrorspec <command>: error: --flag: what is wrong and how to fix
it`` with exit status 2, never a traceback. One module per command (``generate``, ``serve``,
``deployment`` for scale/status/stop, ``demo``); ``parser`` holds the flags, ``flags`` the rules
several commands share.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from mirrorspec.cli.parser import FLAG_FOR_FIELD, build_parser
from mirrorspec.config import InvalidRequest


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["bench", "mirror"]:
        from benchmarks.mirror import main as mirror_main

        return _interruptible(lambda: mirror_main(argv[2:]))
    if argv[:2] == ["bench", "acceptance"]:
        from benchmarks.acceptance import main as acceptance_main

        return _interruptible(lambda: acceptance_main(argv[2:], prog="mirrorspec bench acceptance"))
    if argv[:1] == ["bench"]:
        from benchmarks.run import main as bench_main

        return bench_main(argv[1:], prog="mirrorspec bench")
    args = parse_command_line(argv)
    try:
        return args.handler(args)
    except InvalidRequest as err:
        flag = FLAG_FOR_FIELD.get(err.field or "")
        args.subparser.error(f"{flag}: {err}" if flag else str(err))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (e.g. `| head`): not an error of ours
        sys.stdout = open(os.devnull, "w")
        return 0


def _interruptible(run: Callable[[], int]) -> int:
    """Ctrl-C ends a benchmark with 130 and a line, as `bench` and `demo` do, not a traceback
    from wherever it fell (review 24 of stop 48); what it started stops on its way out."""
    try:
        return run()
    except KeyboardInterrupt:
        print("interrupted: nothing written", file=sys.stderr)
        return 130


def parse_command_line(argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` parsed, with ``given``: the flags the command line itself sets. A flag given its
    default value is given all the same: `generate --server ... --target demo-target` against a
    server running another target was ignored, as if never typed."""
    args = build_parser().parse_args(argv)
    bare = build_parser()  # the same flags with no defaults: what parses is what was typed
    for command in next(a for a in bare._actions if isinstance(a, argparse._SubParsersAction)).choices.values():
        for action in command._actions:
            action.default = argparse.SUPPRESS
    args.given = frozenset(vars(bare.parse_args(argv)))
    return args
