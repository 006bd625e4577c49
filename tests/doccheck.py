"""Checks the commands and Python snippets of README.md and docs/ against the code.

* Shell commands, in ``bash``/``sh``/``console`` blocks, in unlabelled blocks
  (lines that start with one of our programs) and in inline code spans: for
  ``p2ptrain ...``, ``python -m p2ptrain.X ...``, ``python -m benchmarks.X
  ...`` and ``python examples/X.py ...`` every subcommand and every ``--flag``
  must exist in that program's argparse parser (read from the program itself,
  not from a copy). Benchmarks run as modules: ``python benchmarks/X.py`` is
  reported.
* Python blocks: each must compile (top-level ``await`` allowed) and every
  import in it must resolve, names included. A *complete* snippet (no free
  names, no ``await``) is also run, in a child process.

:func:`check_markdown` returns the problems found as strings; tests assert
that the list is empty.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import importlib
import importlib.util
import io
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```", re.S | re.M)
_INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_SHELL = {"bash", "sh", "shell", "console"}
_OURS = re.compile(
    r"^(?:\$ )?(?:p2ptrain [a-z-]|python3? "
    r"(?:-m (?:p2ptrain|benchmarks)[\w.]*|(?:benchmarks|examples)/\S+\.py)\b)"
)


@dataclass(frozen=True)
class Snippet:
    """One piece of a markdown file: its kind ("shell", "python", "inline") and text."""

    kind: str
    text: str
    line: int


def snippets(markdown: str) -> Iterator[Snippet]:
    """The shell blocks, Python blocks and inline code spans of ``markdown``."""
    covered: list[tuple[int, int]] = []
    for match in _FENCE.finditer(markdown):
        covered.append(match.span())
        lang, body = match.group(1).lower(), match.group(2)
        line = markdown.count("\n", 0, match.start()) + 2
        if lang in _SHELL:
            yield Snippet("shell", body, line)
        elif lang == "python":
            yield Snippet("python", body, line)
        elif not lang:
            lines = re.sub(r"\\\n\s*", " ", body).splitlines()
            ours = [text for text in lines if _OURS.match(text.strip())]
            if ours:
                yield Snippet("shell", "\n".join(ours), line)
    for match in _INLINE.finditer(markdown):
        if any(start <= match.start() < end for start, end in covered):
            continue
        if _OURS.match(match.group(1).strip()):
            line = markdown.count("\n", 0, match.start()) + 1
            yield Snippet("inline", match.group(1), line)


def commands(text: str) -> Iterator[list[str]]:
    """The commands of a shell snippet as argv lists (prompts, comments, ``&&`` split off)."""
    joined = re.sub(r"\\\n\s*", " ", text)
    for raw in joined.splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.startswith("$ "):
            stripped = stripped[2:]
        elif text.lstrip().startswith("$ "):
            continue  # console output, not a command
        try:
            tokens = shlex.split(stripped, comments=True)
        except ValueError:
            tokens = stripped.split()
        current: list[str] = []
        for token in tokens:
            if token in ("&&", "||", ";", "|"):
                if current:
                    yield current
                current = []
            else:
                current.append(token)
        if current:
            yield current


# -- reading a program's parser --------------------------------------------------------------


class _Captured(Exception):  # noqa: N818 - a control-flow signal, not an error
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser captured")
        self.parser = parser


_PARSERS: dict[str, argparse.ArgumentParser | None] = {}


def program_parser(program: str) -> argparse.ArgumentParser | None:
    """The argparse parser of a module (``p2ptrain.app.cli``, ``benchmarks.bench_x``) or
    script (``examples/x.py``).

    The program runs until it parses its arguments, where it is stopped; None
    when it parses none (or the file or module does not exist).
    """
    if program in _PARSERS:
        return _PARSERS[program]
    original = argparse.ArgumentParser.parse_args

    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> object:
        raise _Captured(self)

    argparse.ArgumentParser.parse_args = capture  # type: ignore[assignment,method-assign]
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    parser = None
    try:
        sys.argv = [program]
        sys.path.insert(0, str(ROOT))  # the benchmarks package
        with (
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
            warnings.catch_warnings(),
        ):
            # runpy warns that the module is already imported (the tests imported it)
            warnings.simplefilter("ignore", RuntimeWarning)
            if program.endswith(".py"):
                path = ROOT / program
                if path.is_file():
                    runpy.run_path(str(path), run_name="__main__")
            else:
                runpy.run_module(program, run_name="__main__", alter_sys=True)
    except _Captured as captured:
        parser = captured.parser
    except (ImportError, SystemExit):
        parser = None
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
        sys.argv, sys.path[:] = saved_argv, saved_path
    _PARSERS[program] = parser
    return parser


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _choices_of_positionals(parser: argparse.ArgumentParser) -> list[object]:
    return [
        a.choices
        for a in parser._actions
        if not a.option_strings and a.choices and not isinstance(a, argparse._SubParsersAction)
    ]


def check_argv(argv: list[str]) -> list[str]:
    """Problems with one command line of ours (empty when it names only what exists)."""
    if argv and argv[0] == "p2ptrain":
        program, rest = "p2ptrain.app.cli", argv[1:]
    elif len(argv) >= 3 and argv[0] in ("python", "python3") and argv[1] == "-m":
        program, rest = argv[2], argv[3:]
        if not program.startswith(("p2ptrain", "benchmarks.")):
            return []
        if _placeholder(program.removeprefix("benchmarks.").removeprefix("bench_")):
            return []
    elif (
        len(argv) >= 2
        and argv[0] in ("python", "python3")
        and argv[1].startswith(("benchmarks/", "examples/"))
    ):
        program, rest = argv[1], argv[2:]
        if _placeholder(Path(program).stem.removeprefix("bench_")):
            return []
        if program.startswith("benchmarks/"):
            module = program.removesuffix(".py").replace("/", ".")
            return [f"{program}: run benchmarks as modules: python -m {module}"]
        if not (ROOT / program).is_file():
            return [f"{program}: no such file"]
    else:
        return []
    if program == "p2ptrain.app.cli":
        program = "p2ptrain.app.cli"
    elif not program.endswith(".py") and not _module_exists(program):
        return [f"python -m {program}: no such module"]
    parser = program_parser(program)
    if parser is None:
        return [] if rest == [] else [f"{program}: takes no arguments we could read"]
    return _check_tokens(program, parser, rest)


def _check_tokens(program: str, parser: argparse.ArgumentParser, rest: list[str]) -> list[str]:
    problems: list[str] = []
    name = program
    tokens = list(rest)
    while tokens:
        token = tokens.pop(0)
        if token.startswith("--"):
            flag = token.split("=", 1)[0]
            if flag == "--":
                break
            action = parser._option_string_actions.get(flag)
            if action is None:
                problems.append(f"{name}: no flag {flag}")
            elif action.nargs == argparse.REMAINDER:
                break
            continue
        if token.startswith("-") and len(token) > 1:
            if token not in parser._option_string_actions and not token[1:].isdigit():
                problems.append(f"{name}: no flag {token}")
            continue
        subcommands = _subcommands(parser)
        if subcommands:
            if token not in subcommands:
                if not _placeholder(token):
                    problems.append(f"{name}: no subcommand {token!r}")
                break
            name, parser = f"{name} {token}", subcommands[token]
            if program == "p2ptrain.app.cli" and token == "bench" and tokens:
                bench = tokens.pop(0)
                script = f"benchmarks.bench_{bench}"
                known = (_choices_of_positionals(parser) or [[]])[0]
                if bench not in known and not _placeholder(bench):  # type: ignore[operator]
                    problems.append(f"p2ptrain bench: no benchmark {bench!r}")
                    break
                inner = program_parser(script)
                if inner is not None:
                    problems += _check_tokens(f"p2ptrain bench {bench}", inner, tokens)
                break
    return problems


def _module_exists(module: str) -> bool:
    saved = sys.path[:]
    sys.path.insert(0, str(ROOT))  # the benchmarks package
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False
    finally:
        sys.path[:] = saved


def _placeholder(token: str) -> bool:
    return token.isupper() or token.startswith("<") or token in ("...", "X", "NAME")


# -- Python snippets --------------------------------------------------------------------------


def free_names(tree: ast.AST) -> set[str]:
    """Names a snippet reads that it never binds (nor builtins provide)."""
    bound: set[str] = set(dir(builtins))
    loaded: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return loaded - bound


def check_python(text: str, *, run: bool = True) -> list[str]:
    """Problems with one Python snippet: syntax, imports, and (when complete) running it."""
    try:
        tree = ast.parse(text)
        compile(text, "<snippet>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except SyntaxError as exc:
        return [f"does not compile: {exc.msg} (line {exc.lineno})"]
    problems: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                problems += _check_import(alias.name, None)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                problems += _check_import(node.module, alias.name)
    awaits = any(isinstance(n, ast.Await | ast.AsyncWith | ast.AsyncFor) for n in ast.walk(tree))
    if problems or not run or awaits or free_names(tree):
        return problems
    done = subprocess.run(
        [sys.executable, "-c", text],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        problems.append(f"fails when run: {done.stderr.strip().splitlines()[-1:]}")
    return problems


def _check_import(module: str, name: str | None) -> list[str]:
    try:
        imported = importlib.import_module(module)
    except ImportError as exc:
        return [f"import {module}: {exc}"]
    if name is None or name == "*" or hasattr(imported, name):
        return []
    try:
        importlib.import_module(f"{module}.{name}")
    except ImportError:
        return [f"from {module} import {name}: no such name"]
    return []


def check_markdown(markdown: str, *, run_python: bool = True) -> list[str]:
    """Every problem in one markdown text, as ``line N: problem``."""
    problems: list[str] = []
    for snippet in snippets(markdown):
        if snippet.kind == "python":
            found = check_python(snippet.text, run=run_python)
        else:
            found = [p for argv in commands(snippet.text) for p in check_argv(argv)]
        problems += [f"line {snippet.line}: {problem}" for problem in found]
    return problems


def documents() -> list[Path]:
    """README.md, every page of docs/, and the examples' READMEs."""
    return [
        ROOT / "README.md",
        ROOT / "examples" / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "p2ptrain").rglob("README.md")),
    ]
