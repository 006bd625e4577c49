"""Rebuild ``kjv.txt.xz`` from Debian's ``bible-kjv`` packages (run once, by hand).

The shipped file was made with this script; it is kept so that anyone can check
the provenance (see ``PROVENANCE.md``). Nothing here runs at training time.

Steps, as root on a Debian bookworm machine::

    apt-get download bible-kjv-text bible-kjv
    for deb in bible-kjv*.deb; do dpkg-deb -x "$deb" kjv; done
    python p2ptrain/examples/charlm/corpus/make_kjv.py kjv/usr/bin/bible kjv/usr/lib \
        p2ptrain/examples/charlm/corpus/kjv.txt.xz

The ``bible`` program decodes its own compressed database; with ``-f`` it prints
one verse a line as ``<abbreviation><chapter>:<verse> <text>``, and without it
a heading ``<Book name> <chapter>`` before every chapter, from which the full
book names are taken. The output is one block per book::

    Genesis

    1:1 In the beginning God created the heaven and the earth.
    1:2 ...

with runs of spaces collapsed, no trailing spaces, and one final newline.
"""

from __future__ import annotations

import argparse
import hashlib
import lzma
import re
import subprocess
from pathlib import Path

WHOLE_BIBLE = "Gen1:1-Rev22:21"
BOOKS = 66
VERSES = 31102

_VERSE = re.compile(r"^(?P<book>\S+?)(?P<chapter>\d+):(?P<verse>\d+) (?P<text>.*)$")
_HEADING = re.compile(r"^(?P<book>\S.*?) (?P<chapter>\d+)$", re.MULTILINE)


def _run_bible(program: Path, data_dir: Path, *flags: str) -> str:
    result = subprocess.run(
        [str(program), *flags, "-p", str(data_dir), WHOLE_BIBLE],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        check=True,
    )
    return result.stdout.decode("ascii")


def _book_names(pretty: str) -> list[str]:
    names: list[str] = []
    for match in _HEADING.finditer(pretty):
        if not names or names[-1] != match["book"]:
            names.append(match["book"])
    return names


def build_text(program: Path, data_dir: Path) -> str:
    """Return the normalised text of the whole King James Bible.

    Args:
        program: The ``bible`` executable from the ``bible-kjv`` package.
        data_dir: The folder holding ``bible.data`` (``/usr/lib`` in the package).

    Returns:
        The text in the layout described in the module docstring.

    Raises:
        ValueError: The program's output does not have 66 books and 31,102 verses.
    """
    names = _book_names(_run_bible(program, data_dir))
    if len(names) != BOOKS:
        raise ValueError(f"expected {BOOKS} book headings, found {len(names)}")
    blocks: list[list[str]] = []
    abbreviations: list[str] = []
    verses = 0
    for line in _run_bible(program, data_dir, "-f").splitlines():
        match = _VERSE.match(line)
        if match is None:
            raise ValueError(f"unexpected line: {line!r}")
        if not abbreviations or abbreviations[-1] != match["book"]:
            abbreviations.append(match["book"])
            blocks.append([names[len(blocks)], ""])
        text = " ".join(match["text"].split())
        blocks[-1].append(f"{match['chapter']}:{match['verse']} {text}")
        verses += 1
    if len(blocks) != BOOKS or verses != VERSES:
        raise ValueError(f"expected {BOOKS} books and {VERSES} verses, got {len(blocks)}, {verses}")
    return "\n\n".join("\n".join(block) for block in blocks) + "\n"


def main() -> None:
    """Write the compressed text and print its size and sha256."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("program", type=Path, help="path to the bible executable")
    parser.add_argument("data_dir", type=Path, help="folder holding bible.data")
    parser.add_argument("output", type=Path, help="where to write the .xz file")
    args = parser.parse_args()
    raw = build_text(args.program, args.data_dir).encode("ascii")
    args.output.write_bytes(lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME))
    print(f"{len(raw)} bytes, sha256 {hashlib.sha256(raw).hexdigest()}")
    print(f"{args.output}: {args.output.stat().st_size} bytes")


if __name__ == "__main__":
    main()
