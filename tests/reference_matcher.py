"""A slow, plain reference matcher written from SPEC §2 (not from the Rust code): the oracle of the
property tests.

It expands braces into alternatives, then matches by backtracking over the whole FQN, one
pattern element at a time. Only well-formed patterns are handled; `re:` patterns use Python's
`re`, so tests give it only regexes both dialects read alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Element:
    kind: str  # lit, dot, star, any, class, range, globstar
    text: str = ""
    negated: bool = False
    lo: int = 0
    hi: int = 0


def _close(pattern: str, i: int, opener: str, closer: str) -> int:
    depth, k = 0, i
    while k < len(pattern):
        c = pattern[k]
        if c == "\\":
            k += 2
            continue
        if c == opener:
            depth += 1
        elif c == closer:
            depth -= 1
            if depth == 0:
                return k
        k += 1
    raise ValueError("unbalanced")


def _split_alternatives(body: str) -> list[str]:
    parts, depth, start, k = [], 0, 0, 0
    while k < len(body):
        c = body[k]
        if c == "\\":
            k += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif c == "[":
            k = body.index("]", k + 2 if body[k + 1 : k + 2] in ("]", "!") else k + 1)
        elif c == "," and depth == 0:
            parts.append(body[start:k])
            start = k + 1
        k += 1
    parts.append(body[start:])
    return parts


def expand_braces(pattern: str) -> list[str]:
    """Every brace-free spelling of the pattern."""
    k = 0
    while k < len(pattern):
        c = pattern[k]
        if c == "\\":
            k += 2
            continue
        if c == "[":
            k = pattern.index("]", k + 2 if pattern[k + 1 : k + 2] == "!" else k + 1) + 1
            continue
        if c == "{":
            end = _close(pattern, k, "{", "}")
            head, tail = pattern[:k], pattern[end + 1 :]
            return [
                out
                for alternative in _split_alternatives(pattern[k + 1 : end])
                for out in expand_braces(head + alternative + tail)
            ]
        k += 1
    return [pattern]


def elements(glob: str) -> list[Element]:
    out: list[Element] = []
    k = 0
    while k < len(glob):
        c = glob[k]
        if c == "\\":
            out.append(Element("lit", glob[k + 1]))
            k += 2
        elif glob.startswith("**", k):
            out.append(Element("globstar"))
            k += 2
        elif c == "*":
            out.append(Element("star"))
            k += 1
        elif c == "?":
            out.append(Element("any"))
            k += 1
        elif c == ".":
            out.append(Element("dot"))
            k += 1
        elif c == "[":
            negated = glob[k + 1] == "!"
            start = k + 2 if negated else k + 1
            end = start + 1
            while glob[end] != "]" or glob[end - 1] == "\\":
                end += 1
            out.append(Element("class", glob[start:end], negated=negated))
            k = end + 1
        elif c == "<":
            end = glob.index(">", k)
            lo, hi = glob[k + 1 : end].split("-")
            out.append(Element("range", lo=int(lo), hi=int(hi)))
            k = end + 1
        else:
            out.append(Element("lit", c))
            k += 1
    return out


def _in_class(body: str, c: str) -> bool:
    items, k = [], 0
    while k < len(body):
        ch = body[k]
        if ch == "\\":
            ch = body[k + 1]
            k += 1
        items.append(ch)
        k += 1
    k = 0
    while k < len(items):
        if k + 2 < len(items) and items[k + 1] == "-":
            if items[k] <= c <= items[k + 2]:
                return True
            k += 3
        else:
            if items[k] == c:
                return True
            k += 1
    return False


def _match(els: list[Element], i: int, name: str, j: int) -> bool:
    if i == len(els):
        return j == len(name)
    e = els[i]
    nxt = els[i + 1] if i + 1 < len(els) else None
    if e.kind == "globstar":
        if nxt is None:  # `**` at the end stands alone here (the `.**` form is handled at the dot)
            return True
        # `**.` : zero or more whole segments, each with its dot
        starts = [j] + [m + 1 for m in range(j, len(name)) if name[m] == "."]
        return any(_match(els, i + 2, name, s) for s in starts)
    if e.kind == "dot":
        if nxt is not None and nxt.kind == "globstar":
            # `.**`: zero segments (the dot goes too), or one or more `.segment`s
            if _match(els, i + 2, name, j):
                return True
            if j >= len(name) or name[j] != ".":
                return False
            ends = [m for m in range(j + 1, len(name) + 1) if m == len(name) or name[m] == "."]
            return any(_match(els, i + 2, name, m) for m in ends)
        return j < len(name) and name[j] == "." and _match(els, i + 1, name, j + 1)
    if e.kind == "lit":
        return j < len(name) and name[j] == e.text and _match(els, i + 1, name, j + 1)
    if e.kind == "any":
        return j < len(name) and name[j] != "." and _match(els, i + 1, name, j + 1)
    if e.kind == "class":
        return j < len(name) and name[j] != "." and _in_class(e.text, name[j]) != e.negated and _match(els, i + 1, name, j + 1)
    if e.kind == "star":
        m = j
        while True:
            if _match(els, i + 1, name, m):
                return True
            if m >= len(name) or name[m] == ".":
                return False
            m += 1
    if e.kind == "range":
        m = j
        while m < len(name) and name[m].isdigit() and name[m].isascii():
            m += 1
            numeral = name[j:m]
            canonical = numeral == "0" or not numeral.startswith("0")
            if canonical and e.lo <= int(numeral) <= e.hi and _match(els, i + 1, name, m):
                return True
        return False
    raise AssertionError(e.kind)


def reference_match(pattern: str, name: str) -> bool:
    """Whether `pattern` selects the FQN `name`, read straight from SPEC §2."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    if pattern == "":
        return name == ""
    spellings = [elements(s) for s in expand_braces(pattern)]
    if name == "":
        # The root: only `""`, `**` (whole-globstar patterns) and regexes select it.
        return any(els and all(e.kind in ("globstar", "dot") for e in els) for els in spellings)
    return any(_match(els, 0, name, 0) for els in spellings)
