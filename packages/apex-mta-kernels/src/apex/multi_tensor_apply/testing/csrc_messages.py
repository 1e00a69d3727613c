"""Where a package's C++/CUDA sources format a message through an ostream.

On the GPU machine's toolchain (nvcc 13.0, torch 2.11), ostream number formatting crashed the
process inside these libraries (SIGSEGV in num_put): apex-mta-kernels' error messages first
(checks.h), apex-norm's APEX_NORM_TUNE notes on 2026-12-05 (faulthandler put the crash in the
call that built them with ``c10::str``). Messages are built by concatenation instead (each
package's ``fmt``). ostream formatting hides in ``c10::str`` and in the macros that call it, so
this reads the sources for:

- ``c10::str(``, ``TORCH_WARN*(``, ``AT_ERROR(``, ``STD_TORCH_CHECK*(`` (it streams
  ``__LINE__``), the comparison checks that stream their operands (``TORCH_CHECK_EQ`` and the
  like, ``TORCH_DCHECK*``), glog-style ``LOG(`` / ``VLOG(``, string and file streams,
  ``std::cout`` / ``cerr`` / ``clog``, ``using namespace std`` and ``using c10::str`` (which
  would hide the names above), and a ``#define`` that names one of these macros without calling
  it (an alias would hide its uses);
- a ``TORCH_CHECK*``, ``TORCH_INTERNAL_ASSERT*`` or ``AT_ASSERT*`` whose message is anything but
  one string literal (adjacent literals included) or one ``fmt(...)`` call (for
  ``TORCH_CHECK_WITH*`` the message follows the error type and the condition).

By design a few messages are flagged that would not reach an ostream (a ``std::string``
variable or a ``+`` of strings as the message, a single literal given to ``TORCH_WARN``): one
rule is easier to keep than the cases where ``c10::str`` passes its argument through.

Comments, string, raw string and character literals are blanked before matching (digit
separators, ``1'000``, are not character literals).
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["SUFFIXES", "findings", "findings_in", "sources"]

SUFFIXES = (".cu", ".cuh", ".cpp", ".cc", ".h", ".hpp")
_FORBIDDEN = re.compile(
    r"\bc10::str\s*\("
    r"|\b(?:TORCH_WARN\w*|AT_ERROR|STD_TORCH_CHECK\w*|TORCH_DCHECK\w*"
    r"|TORCH_CHECK_(?:EQ|NE|LE|LT|GE|GT)|LOG|VLOG|LOG_IF|VLOG_IF)\s*\("
    r"|\b(?:std::)?(?:w?[io]?stringstream|basic_[io]?stringstream|w?[io]?fstream)\b"
    r"|\bstd::(?:w?cout|w?cerr|w?clog)\b"
    r"|\busing\s+(?:namespace\s+std\b|c10::str\b)"
)
# (TORCH_CHECK_EQ and the like are forbidden outright above, not read here.)
_CHECK = re.compile(
    r"\b(TORCH_CHECK(?!_(?:EQ|NE|LE|LT|GE|GT)\s*\()\w*|TORCH_INTERNAL_ASSERT\w*|AT_ASSERT\w*)\s*\("
)
_LITERALS = re.compile(r'^(?:\s*(?:u8|[uUL])?"(?:[^"\\]|\\.)*")+\s*$', re.S)
_FMT_CALL = re.compile(r"^\s*(?:::)?(?:\w+::)*fmt\s*\(", re.S)
# A #define whose body names a formatting macro without calling it (an alias, CHECK_ for
# TORCH_CHECK), which the rules above would then not see at its uses.
_ALIAS = re.compile(
    r"^[ \t]*#[ \t]*define[ \t]+\w+(?:\([^)]*\))?[^\n]*?"
    r"\b(TORCH_CHECK\w*|TORCH_WARN\w*|TORCH_INTERNAL_ASSERT\w*|AT_ERROR|AT_ASSERT\w*|c10::str)\b"
    r"(?![ \t]*\()",
    re.M,
)
_RAW_OPEN = re.compile(r'(?:u8|[uUL])?R"([^()\\\s]{0,16})\(')


def _word_before(text: str, i: int) -> str:
    """The identifier or number characters right before ``text[i]``."""
    j = i
    while j > 0 and (text[j - 1].isalnum() or text[j - 1] == "_"):
        j -= 1
    return text[j:i]


def _blank(text: str) -> tuple[str, str]:
    """(code, code with literals): comments blanked in both, string and character literals'
    contents also blanked in the first (newlines kept, so offsets and lines agree)."""
    code, kept = [], []
    i, n = 0, len(text)

    def both(piece: str, literal: str | None = None) -> None:
        blank = re.sub(r"[^\n]", " ", piece)
        code.append(blank if literal is None else literal)
        kept.append(blank if literal is None else piece)

    while i < n:
        c = text[i]
        raw = _RAW_OPEN.match(text, i) if c in "uULR" and not _word_before(text, i) else None
        if raw:
            close = text.find(")" + raw.group(1) + '"', raw.end())
            j = n if close < 0 else close + len(raw.group(1)) + 2
            piece = text[i:j]
            both(piece, '"' + re.sub(r"[^\n]", " ", piece[1:-1]) + '"' if len(piece) > 1 else piece)
            i = j
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            both(text[i:j])
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            both(text[i:j])
            i = j
        elif c == "'" and _word_before(text, i) not in ("", "u", "U", "L", "u8"):
            code.append(c)  # a digit separator (1'000), not a character literal
            kept.append(c)
            i += 1
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" and j + 1 < n and text[j + 1] != "\n" else 1
            closed = j < n and text[j] == c
            j = j + 1 if closed else j  # an unclosed literal ends before its line's newline
            inner = re.sub(r"[^\n]", " ", text[i + 1 : j - 1 if closed else j])
            code.append(c + inner + (c if closed else ""))
            kept.append(text[i:j])
            i = j
        else:
            code.append(c)
            kept.append(c)
            i += 1
    return "".join(code), "".join(kept)


def _arguments(code: str, kept: str, start: int) -> list[str] | None:
    """The top-level arguments of the call whose '(' is at ``start`` (text from ``kept``); None
    where the call does not close before its statement ends (a ';' among its arguments)."""
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
        elif ch == ";" and depth == 1:
            return None
    return None


def findings_in(text: str, name: str = "<text>") -> list[str]:
    """``name:line: what`` for each place in ``text`` that formats a message via an ostream."""
    code, kept = _blank(text)
    out = []

    def line(pos: int) -> int:
        return code.count("\n", 0, pos) + 1

    for m in _FORBIDDEN.finditer(code):
        what = " ".join(m.group(0).rstrip("(").split())
        out.append((m.start(), f"{name}:{line(m.start())}: {what}"))
    for m in _ALIAS.finditer(code):
        out.append((m.start(), f"{name}:{line(m.start())}: {m.group(1)} named in a #define"))
    for m in _CHECK.finditer(code):
        macro = m.group(1)
        args = _arguments(code, kept, m.end() - 1)
        if args is None:
            continue  # not a call (a macro's name in a #define body, say)
        message = args[2:] if macro.startswith("TORCH_CHECK_WITH") else args[1:]
        fine = not message or (
            len(message) == 1 and (_LITERALS.match(message[0]) or _FMT_CALL.match(message[0]))
        )
        if not fine:
            out.append(
                (m.start(), f"{name}:{line(m.start())}: {macro} message formatted by c10::str")
            )
    return [f for _, f in sorted(out)]


def sources(root: Path) -> list[Path]:
    """The C++/CUDA source files under ``root`` (files only, sorted)."""
    return sorted(p for p in Path(root).rglob("*") if p.suffix in SUFFIXES and p.is_file())


def findings(root: Path) -> list[str]:
    """findings_in over every C++/CUDA source under ``root``."""
    out = []
    for path in sources(root):
        out += findings_in(path.read_text(errors="replace"), str(path))
    return out
