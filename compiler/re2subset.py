"""RE2 patterns (ONNX's RegexFullMatch) as Python ``re`` patterns, where both read them alike.

ONNX's RegexFullMatch takes RE2 syntax; the host stage (:mod:`compiler.hoststage`) runs it with
Python's ``re``. :func:`translate_re2` takes the subset the two engines agree on, with the few
rewrites that make them agree (ASCII classes, ``$`` only at the end of the text, ``\\s`` without
``\\v``), and refuses every other construct with a ValueError naming it: a refusal at compile time
rather than a different answer. ``tests/compiler/test_hoststage.py`` compares patterns with
onnxruntime, whose kernel is RE2 itself. Standard library only.
"""

from __future__ import annotations

import re

__all__ = ["translate_re2"]

_ESCAPES_OUT = {"d": r"\d", "D": r"\D", "w": r"\w", "W": r"\W", "b": r"\b", "B": r"\B",
                "s": r"[\t\n\f\r ]", "S": r"[^\t\n\f\r ]", "n": r"\n", "t": r"\t", "r": r"\r", "f": r"\f",
                "v": r"\v"}
_ESCAPES_IN = {"d": r"\d", "D": r"\D", "w": r"\w", "W": r"\W", "s": r"\t\n\f\r ", "n": r"\n", "t": r"\t",
               "r": r"\r", "f": r"\f", "v": r"\v"}
_REPEAT = re.compile(r"\{(\d+)(,(\d*))?\}")
_MAX_REPEAT = 1000  # RE2's limit


def translate_re2(pattern: str) -> str:
    """``pattern`` (RE2 syntax) as a Python ``re`` pattern (compiled with ``re.ASCII``) that matches
    the same strings, or ValueError naming the construct outside the subset both read alike.

    Taken: literals, ``.``, escaped punctuation, ``\\d \\D \\w \\W \\s \\S \\b \\B \\n \\t \\r \\f
    \\v \\xHH``, classes ``[...]`` (ranges, negation, the class escapes but ``\\S``...), groups
    ``(...)`` and ``(?:...)``, ``|``, ``* + ? {m} {m,} {m,n}`` (n <= 1000) and their lazy ``?``
    forms, ``^`` and ``$`` (end of text only, as in RE2; Python's also matches before a final
    newline). Refused: look-around, back-references, named groups, flags, ``\\A \\z \\Z \\p \\Q``,
    POSIX classes, octal escapes, possessive repeats, and an open-ended repeat of a group that holds
    a repeat or an alternation (``(a*)*``, ``(a|ab)+``: exponential backtracking in Python, a request
    could stall the node; RE2 is linear)."""
    out: list[str] = []
    i, n = 0, len(pattern)
    groups: list[bool] = []  # per open group: whether it holds a repeat or an alternation
    repeatable = False  # whether a quantifier may follow (an atom precedes it)
    risky = False  # the atom just read is a group holding a repeat or an alternation

    def refuse(what: str) -> ValueError:
        return ValueError(f"{what} at offset {i} of the pattern")

    while i < n:
        c = pattern[i]
        after_risky, risky = risky, False
        if c == "\\":
            if i + 1 >= n:
                raise refuse("a trailing backslash")
            e = pattern[i + 1]
            if e in _ESCAPES_OUT:
                out.append(_ESCAPES_OUT[e])
                repeatable = e not in "bB"
                i += 2
                continue
            if e == "x" and re.fullmatch(r"[0-9a-fA-F]{2}", pattern[i + 2:i + 4]):
                out.append(pattern[i:i + 4])
                repeatable, i = True, i + 4
                continue
            if e.isascii() and not e.isalnum():
                out.append("\\" + e)
                repeatable, i = True, i + 2
                continue
            raise refuse(f"the escape \\{e} (RE2 and Python read it differently, or one lacks it)")
        if c == "[":
            j, body = _class(pattern, i)
            out.append(body)
            repeatable, i = True, j
            continue
        if c == "(":
            if pattern.startswith("(?:", i):
                out.append("(?:")
                i += 3
            elif pattern.startswith("(?", i):
                raise refuse("a (? group (look-around, named group or flags)")
            else:
                out.append("(")
                i += 1
            groups.append(False)
            repeatable = False
            continue
        if c == ")":
            if not groups:
                raise refuse("an unbalanced )")
            risky = groups.pop()
            if groups and risky:
                groups[-1] = True
            out.append(")")
            repeatable, i = True, i + 1
            continue
        if c in "*+?{":
            if c == "{":
                m = _REPEAT.match(pattern, i)
                if m is None:
                    raise refuse("a { that is not a repeat {m}, {m,} or {m,n}")
                hi = m.group(3)
                if int(m.group(1)) > _MAX_REPEAT or (hi and int(hi) > _MAX_REPEAT) or \
                        (hi and int(hi) < int(m.group(1))):
                    raise refuse(f"the repeat {m.group(0)} (RE2 takes m <= n <= {_MAX_REPEAT})")
                tok, j = m.group(0), m.end()
            else:
                tok, j = c, i + 1
            if not repeatable:
                raise refuse(f"a repeat {tok} with nothing to repeat")
            if j < n and pattern[j] == "?":
                tok, j = tok + "?", j + 1
            if j < n and pattern[j] in "*+?{":
                raise refuse("a repeat of a repeat")
            bounded = tok in ("?", "??") or (c == "{" and "," not in tok)  # at most one / exactly m copies
            if after_risky and not bounded:
                raise refuse(f"the repeat {tok} of a group holding a repeat or an alternation (Python's "
                             "backtracking can take exponential time on it where RE2 takes linear time)")
            if groups:
                groups[-1] = True
            out.append(tok)
            repeatable, i = False, j
            continue
        if c == "$":
            out.append(r"\Z")
            repeatable, i = False, i + 1
            continue
        if c in "^|":
            if c == "|" and groups:
                groups[-1] = True
            out.append(c)
            repeatable, i = False, i + 1
            continue
        if c == "]" or c == "}":
            raise refuse(f"an unescaped {c}")
        out.append(re.escape(c) if c != "." else ".")
        repeatable, i = True, i + 1
    if groups:
        raise refuse("an unclosed (")
    return "".join(out)


def _class(pattern: str, start: int) -> tuple[int, str]:
    """The class starting at ``pattern[start] == "["``: (index after it, its Python form)."""
    i, n = start + 1, len(pattern)
    out = ["["]
    if i < n and pattern[i] == "^":
        out.append("^")
        i += 1
    if i < n and pattern[i] == "]":
        raise ValueError(f"a ] first in a class at offset {i} of the pattern")
    while i < n and pattern[i] != "]":
        c = pattern[i]
        if c == "[" or pattern.startswith(("--", "&&", "~~", "||"), i):
            raise ValueError(f"{pattern[i:i + 2]!r} in a class (POSIX classes or set operations) at "
                             f"offset {i} of the pattern")
        if c == "\\":
            e = pattern[i + 1] if i + 1 < n else ""
            if e in _ESCAPES_IN:
                out.append(_ESCAPES_IN[e])
            elif e == "x" and re.fullmatch(r"[0-9a-fA-F]{2}", pattern[i + 2:i + 4]):
                out.append(pattern[i:i + 4])
                i += 2
            elif e and e.isascii() and not e.isalnum():
                out.append("\\" + e)
            else:
                raise ValueError(f"the escape \\{e} in a class at offset {i} of the pattern")
            i += 2
            continue
        out.append(c if c != "^" else r"\^")
        i += 1
    if i >= n:
        raise ValueError("an unclosed [ in the pattern")
    out.append("]")
    return i + 1, "".join(out)
