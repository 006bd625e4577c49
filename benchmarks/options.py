"""The command-line flags that several benchmarks take, each defined once.

``bench_all`` drives the benchmarks through some of them (``--png``,
``--no-hivemind``, ``--hivemind-python``), as :mod:`benchmarks.registry`
declares; the rest are the same switch in every benchmark that has it
(``--json-only``, ``--uvloop``, the hidden ``--role`` of child processes).
"""

from __future__ import annotations

import argparse

from benchmarks.harness import find_hivemind, uvloop_available

__all__ = [
    "add_hivemind_arguments",
    "add_json_only_argument",
    "add_plot_argument",
    "add_role_argument",
    "add_uvloop_argument",
    "hivemind_of",
]

_Container = argparse.ArgumentParser | argparse._ArgumentGroup
"""A parser or one of its argument groups: where a flag is added."""


def add_hivemind_arguments(parser: _Container, *, part: str = "") -> None:
    """``--no-hivemind`` and ``--hivemind-python PATH``, read by :func:`hivemind_of`.

    Args:
        parser: Where the flags go.
        part: The part of the benchmark that runs hivemind, appended to the
            help (e.g. ``" of --wan"``); empty for the whole benchmark.
    """
    parser.add_argument(
        "--hivemind-python",
        metavar="PATH",
        help="interpreter that can import hivemind, e.g. a separate venv's "
        "(default: this one, if it can)",
    )
    parser.add_argument("--no-hivemind", action="store_true", help=f"leave hivemind out{part}")


def hivemind_of(args: argparse.Namespace) -> tuple[str | None, str]:
    """The interpreter to run hivemind with (None: leave it out), and a line saying why."""
    if args.no_hivemind:
        return None, "hivemind skipped (--no-hivemind)"
    return find_hivemind(args.hivemind_python)


def add_plot_argument(parser: _Container, what: str, *, default: str | None = None) -> None:
    """``--png PATH``: where the benchmark draws ``what`` (``bench_all`` asks for it)."""
    shown = "none" if default is None else default
    parser.add_argument(
        "--png", default=default, help=f"write {what} to this PNG file (default: {shown})"
    )


def add_json_only_argument(parser: _Container) -> None:
    """``--json-only``: no table, no progress, only the last line."""
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")


def add_uvloop_argument(parser: _Container) -> None:
    """``--uvloop`` / ``--no-uvloop``: the event loop the benchmark runs on."""
    parser.add_argument(
        "--uvloop",
        action=argparse.BooleanOptionalAction,
        default=uvloop_available(),
        help="run the event loop of every process on uvloop (default: when installed)",
    )


def add_role_argument(parser: _Container, *roles: str) -> None:
    """The hidden ``--role``: ``bench`` (the default, what a user runs) or the role
    of a child process the benchmark starts as this same module."""
    parser.add_argument(
        "--role", choices=["bench", *roles], default="bench", help=argparse.SUPPRESS
    )
