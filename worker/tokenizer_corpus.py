"""Offline training text for the tokenizers of generated checkpoints.

Every fresh machine with Python already has its standard library on disk, so that is the corpus:
a fixed list of prose-heavy modules (docstrings, comments), read in a fixed order and cut at a
character budget. The same interpreter therefore always yields the same text, and the same text
yields the same tokenizer.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

# Modules with plenty of English docstrings as well as code; present in Python 3.11 and 3.12.
CORPUS_MODULES: tuple[str, ...] = (
    "textwrap.py",
    "difflib.py",
    "argparse.py",
    "string.py",
    "dataclasses.py",
    "functools.py",
    "shutil.py",
    "calendar.py",
    "fractions.py",
    "statistics.py",
    "heapq.py",
    "bisect.py",
    "csv.py",
    "glob.py",
    "fnmatch.py",
    "random.py",
)

# A few lines outside ASCII, so common multi-byte sequences get merges of their own.
EXTRA_TEXT = (
    "Grüße aus Köln — naïve café, crème brûlée. Ελληνικά κείμενα. Русский текст. "
    "日本語のテキスト。中文文本。한국어 텍스트. emoji 🙂🚀 ✓ € £ ¥ °C\n"
)


def stdlib_dir() -> Path:
    """The directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files() -> list[Path]:
    """The corpus files in reading order: the fixed list, else every top-level module sorted."""
    root = stdlib_dir()
    chosen = [root / name for name in CORPUS_MODULES if (root / name).is_file()]
    if len(chosen) < len(CORPUS_MODULES) // 2:
        chosen = sorted(root.glob("*.py"))
    return chosen


def iter_corpus(max_chars: int) -> Iterator[str]:
    """Yield corpus chunks (roughly one per file) until ``max_chars`` characters in total."""
    remaining = max_chars
    yield EXTRA_TEXT
    remaining -= len(EXTRA_TEXT)
    for path in corpus_files():
        if remaining <= 0:
            return
        text = path.read_text(encoding="utf-8", errors="replace")[:remaining]
        remaining -= len(text)
        yield text
