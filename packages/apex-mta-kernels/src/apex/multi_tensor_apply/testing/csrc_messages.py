"""Where a package's C++/CUDA sources format a message through an ostream.

On the GPU machine's toolchain (nvcc 13.0, torch 2.11), ``c10::str``'s ostream formatting of a
number crashed the process inside these libraries (SIGSEGV): apex-mta-kernels' error messages
first (checks.h), apex-norm's APEX_NORM_TUNE notes on 2026-12-05 (faulthandler put the crash in
the call that built them). Messages are built by concatenation instead (each package's
``fmt``). ``c10::str`` hides in ``TORCH_CHECK``'s message arguments and in ``TORCH_WARN``, so
this reads the sources for:

- ``c10::str(``, ``TORCH_WARN*(``, string streams, ``std::cout`` / ``cerr`` / ``clog``;
- a ``TORCH_CHECK*`` or ``TORCH_INTERNAL_ASSERT*`` whose message is anything but one string
  literal (adjacent literals included) or one ``fmt(...)`` call.

Comments, string and character literals are blanked before matching.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["SUFFIXES", "findings", "findings_in"]

SUFFIXES = (".cu", ".cuh", ".cpp", ".cc", ".h", ".hpp")
_FORBIDDEN = re.compile(
    r"\bc10::str\s*\(|\bTORCH_WARN\w*\s*\(|\bstd::(?:o|i)?stringstream\b|\bstd::(?:cout|cerr|clog)\b"
)
_CHECK = re.compile(r"\b(?:TORCH_CHECK\w*|TORCH_INTERNAL_ASSERT\w*)\s*\(")
_LITERALS = re.compile(r'^(?:\s*"(?:[^"\\]|\\.)*")+\s*$', re.S)
_FMT_CALL = re.compile(r"^\s*(?:::)?(?:\w+::)*fmt\s*\(", re.S)


def _blank(text: str) -> tuple[str, str]:
    """(code, code with literals): comments blanked in both, string and character literals'
    contents also blanked in the first (newlines kept, so offsets and lines agree)."""
    code, kept = [], []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            code.append(" " * (j - i))
            kept.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            blank = re.sub(r"[^\n]", " ", text[i:j])
            code.append(blank)
            kept.append(blank)
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            code.append(c + " " * (j - i - 2) + c if j - i >= 2 else text[i:j])
            kept.append(text[i:j])
            i = j
        else:
            code.append(c)
            kept.append(c)
            i += 1
    return "".join(code), "".join(kept)


def _arguments(code: str, kept: str, start: int) -> list[str]:
    """The top-level arguments of the call whose '(' is at ``start`` (text from ``kept``)."""
    depth, args, begin = 0, [], start + 1
    for i in range(start, len(code)):
        ch = code[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                args.append(kept[begin:i])
                return [a for a in args if a.strip()]
        elif ch == "," and depth == 1:
            args.append(kept[begin:i])
            begin = i + 1
    return []  # unbalanced: not a call this reads


def findings_in(text: str, name: str = "<text>") -> list[str]:
    """``name:line: what`` for each place in ``text`` that formats a message via an ostream."""
    code, kept = _blank(text)
    out = []

    def line(pos: int) -> int:
        return code.count("\n", 0, pos) + 1

    for m in _FORBIDDEN.finditer(code):
        out.append((m.start(), f"{name}:{line(m.start())}: {m.group(0).rstrip('(').strip()}"))
    for m in _CHECK.finditer(code):
        message = _arguments(code, kept, m.end() - 1)[1:]
        fine = not message or (
            len(message) == 1 and (_LITERALS.match(message[0]) or _FMT_CALL.match(message[0]))
        )
        if not fine:
            macro = m.group(0).rstrip("(").strip()
            out.append(
                (m.start(), f"{name}:{line(m.start())}: {macro} message formatted by c10::str")
            )
    return [f for _, f in sorted(out)]


def findings(root: Path) -> list[str]:
    """findings_in over every C++/CUDA source under ``root``."""
    out = []
    for path in sorted(p for p in Path(root).rglob("*") if p.suffix in SUFFIXES):
        out += findings_in(path.read_text(errors="replace"), str(path))
    return out
