"""The ``glm5serve`` command: argparse sub-commands, one module each.

Every module in :data:`COMMAND_MODULES` exposes ``add_parser(subparsers)``, which registers its sub-command and sets
``func`` (``args -> exit code``). A module that is not there (a command still being written, or left out of a
build) is skipped. Bad input -- any :class:`~glm5serve.errors.GGUFModelError`, or an ``OSError`` such as an output
path that cannot be written -- is printed as one line on stderr with exit status 2, never as a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import sys
import threading

from glm5serve import __version__
from glm5serve.errors import GGUFModelError, one_line

#: sub-command -> the module that registers it; only the named command's module is imported (torch and
#: transformers cost seconds, ``inspect`` needs neither), all of them for ``--help`` or an unknown command
COMMAND_MODULES = {"make-checkpoint": "glm5serve.checkpoint", "inspect": "glm5serve.inspect_cmd",
                   "verify": "glm5serve.verify", "generate": "glm5serve.generate",
                   "serve": "glm5serve.vllm_plugin.serve", "synthetic-gguf": "glm5serve.synthetic",
                   "bench": "glm5serve.bench"}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``glm5serve`` parser with ``command`` registered, or every available sub-command when ``command`` is
    None or not one of :data:`COMMAND_MODULES`."""
    parser = argparse.ArgumentParser(prog="glm5serve", description="Serve GLM-5 from GGUF files and prove the "
                                                                   "output is right.")
    parser.add_argument("--version", action="version", version=f"glm5serve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    names = [COMMAND_MODULES[command]] if command in COMMAND_MODULES else COMMAND_MODULES.values()
    for name in names:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue  # command not available in this build
            raise
        add = getattr(module, "add_parser", None)
        if add is not None:
            add(sub)
    for p in sub.choices.values():  # descriptions come from docstrings: no reST markup in --help
        p.description = p.description and re.sub(r"(:\w+:)?``?([^`]+)``?", r"\2", p.description)
    return parser


def _terminate(signum, frame):
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``glm5serve`` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(next((a for a in argv if not a.startswith("-")), None)).parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):  # a latin-1 or ASCII terminal: escape what it cannot show, no traceback
        sys.stdout.reconfigure(errors="backslashreplace")
    if threading.current_thread() is threading.main_thread():
        # SIGTERM (timeout, docker stop, systemd) unwinds like Ctrl-C: `finally` blocks remove partial output
        signal.signal(signal.SIGTERM, _terminate)
    try:
        return int(args.func(args) or 0)
    except GGUFModelError as e:
        print(f"glm5serve {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into e.g. `head`: stop quietly (Python docs, "Note on SIGPIPE")
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:  # an output path that cannot be written, a file that vanished: one line too
        where = f"{one_line(str(e.filename))}: " if e.filename else ""
        print(f"glm5serve {args.command}: {where}{e.strerror or e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
