"""A small C/C++/MSL lexer for metalsim's source rewriter.

The lexer keeps *every* character of the input: whitespace and comments are
tokens too, so joining the tokens' texts gives back the source exactly. This
lets the rewriter edit a few tokens and keep line numbers (compile errors are
reported on the kernel's own lines).

Token kinds:
    ident    identifiers and keywords
    number   pp-numbers (``1``, ``1.5f``, ``0x1p-3``, ``2.0h``)
    string   string literals
    char     character literals
    punct    operators and punctuation (``>>`` is one token; see split_shift)
    pp       a whole preprocessor line other than #define (with continuations)
    define   the head of a ``#define NAME`` / ``#define NAME(args)`` line; the
             macro body follows as ordinary tokens up to a ``ppend`` token
    ppend    the (empty) end of a #define body
    ws       whitespace (may contain newlines)
    comment  ``//`` and ``/* */`` comments
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["Token", "tokenize", "TokenizeError", "match_bracket", "significant"]


class TokenizeError(ValueError):
    """Raised for unterminated comments/literals; carries a 1-based line."""

    def __init__(self, msg: str, line: int):
        super().__init__(msg)
        self.line = line


@dataclass
class Token:
    kind: str
    text: str
    line: int  # 1-based line of the token's first character
    # Output text; the rewriter edits this and leaves `text` untouched.
    out: str = field(default=None)  # type: ignore[assignment]

    def __post_init__(self):
        if self.out is None:
            self.out = self.text

    def is_(self, kind: str, text: str | None = None) -> bool:
        return self.kind == kind and (text is None or self.text == text)

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"Token({self.kind}, {self.text!r}, line={self.line})"


_PUNCTS = sorted(
    """
    >>= <<= ... ->* :: -> ++ -- << >> <= >= == != && || += -= *= /= %= &= |= ^= ##
    { } [ ] ( ) ; : , . ? ~ ! + - * / % ^ & | = < > #
    """.split(),
    key=len,
    reverse=True,
)
_PUNCT_RE = re.compile("|".join(re.escape(p) for p in _PUNCTS))
_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")
_NUMBER_RE = re.compile(r"\.?[0-9](?:[eEpP][+-]|[A-Za-z0-9_.']|)*")
_WS_RE = re.compile(r"(?:[ \t\r\f\v\n]|\\\n)+")


def tokenize(src: str) -> list[Token]:
    """Splits `src` into tokens covering all of its characters."""
    toks: list[Token] = []
    i, n, line = 0, len(src), 1
    at_line_start = True  # only whitespace since the last newline
    in_define = False  # inside a #define body

    def add(kind: str, text: str) -> None:
        nonlocal line
        toks.append(Token(kind, text, line))
        line += text.count("\n")

    while i < n:
        c = src[i]
        # End of a #define body: a newline not escaped by a backslash.
        if in_define and c == "\n":
            toks.append(Token("ppend", "", line))
            in_define = False
        m = _WS_RE.match(src, i)
        if m:
            text = m.group()
            if in_define and "\n" in text.replace("\\\n", ""):
                # Split so the ppend lands before the first bare newline.
                k = _first_bare_newline(text)
                if k > 0:
                    add("ws", text[:k])
                toks.append(Token("ppend", "", line))
                in_define = False
                text = text[k:]
            add("ws", text)
            if "\n" in text.replace("\\\n", ""):
                at_line_start = True
            i = m.end()
            continue
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            add("comment", src[i:j])
            i = j
            continue
        if src.startswith("/*", i):
            j = src.find("*/", i + 2)
            if j < 0:
                raise TokenizeError("unterminated /* comment", line)
            add("comment", src[i : j + 2])
            i = j + 2
            continue
        if c == "#" and at_line_start and not in_define:
            j = _end_of_pp_line(src, i)
            text = src[i:j]
            m2 = re.match(r"#\s*define\s+[A-Za-z_][A-Za-z_0-9]*(\([^)]*\))?", text)
            if m2:
                add("define", m2.group())
                i += m2.end()
                in_define = True
            else:
                add("pp", text)
                i = j
            at_line_start = False
            continue
        at_line_start = False
        if c == '"' or c == "'":
            j = _end_of_literal(src, i, c, line)
            add("string" if c == '"' else "char", src[i:j])
            i = j
            continue
        if c.isdigit() or (c == "." and i + 1 < n and src[i + 1].isdigit()):
            m = _NUMBER_RE.match(src, i)
            add("number", m.group())
            i = m.end()
            continue
        m = _IDENT_RE.match(src, i)
        if m:
            # String literal prefixes (u8"...", L'x') belong to the literal.
            if m.end() < n and src[m.end()] in "\"'" and m.group() in ("u8", "u", "U", "L", "R"):
                j = _end_of_literal(src, m.end(), src[m.end()], line)
                add("string", src[i:j])
                i = j
                continue
            add("ident", m.group())
            i = m.end()
            continue
        m = _PUNCT_RE.match(src, i)
        if m:
            add("punct", m.group())
            i = m.end()
            continue
        raise TokenizeError(f"unexpected character {c!r}", line)
    if in_define:
        toks.append(Token("ppend", "", line))
    return toks


def _first_bare_newline(text: str) -> int:
    k = 0
    while True:
        k = text.find("\n", k)
        if k <= 0 or text[k - 1] != "\\":
            return k
        k += 1


def _end_of_pp_line(src: str, i: int) -> int:
    n = len(src)
    while i < n:
        if src[i] == "\\" and i + 1 < n and src[i + 1] == "\n":
            i += 2
            continue
        if src[i] == "\n":
            return i
        if src.startswith("/*", i):  # a comment may span lines inside a directive
            j = src.find("*/", i + 2)
            i = n if j < 0 else j + 2
            continue
        if src.startswith("//", i):
            j = src.find("\n", i)
            return n if j < 0 else j
        i += 1
    return n


def _end_of_literal(src: str, i: int, q: str, line: int) -> int:
    j = i + 1
    n = len(src)
    while j < n:
        if src[j] == "\\":
            j += 2
            continue
        if src[j] == q:
            return j + 1
        if src[j] == "\n":
            break
        j += 1
    raise TokenizeError("unterminated literal", line)


def significant(toks: list[Token]) -> list[int]:
    """Indices of the tokens that are neither whitespace nor comments."""
    return [i for i, t in enumerate(toks) if t.kind not in ("ws", "comment")]


_OPEN = {"(": ")", "[": "]", "{": "}"}


def match_bracket(toks: list[Token], sig: list[int], k: int) -> int:
    """Position in `sig` of the bracket closing the one at sig[k] (or -1).

    Handles (), [] and {}; for ``<`` it matches template angle brackets,
    counting ``>>`` as two closers and giving up at ``;``, ``{`` or ``}``.
    """
    open_t = toks[sig[k]].text
    if open_t == "<":
        depth = 0
        paren = 0
        for j in range(k, len(sig)):
            t = toks[sig[j]]
            if t.kind != "punct":
                continue
            if t.text in "([":
                paren += 1
            elif t.text in ")]":
                paren -= 1
                if paren < 0:
                    return -1
            elif paren == 0:
                if t.text == "<":
                    depth += 1
                elif t.text == ">":
                    depth -= 1
                elif t.text == ">>":
                    depth -= 2
                    if depth < 0:
                        return -1  # `>>` closing both: caller must split
                elif t.text in (";", "{", "}"):
                    return -1
                if depth == 0:
                    return j
        return -1
    close_t = _OPEN[open_t]
    depth = 0
    for j in range(k, len(sig)):
        t = toks[sig[j]]
        if t.kind != "punct":
            continue
        if t.text in _OPEN:
            depth += 1
        elif t.text in (")", "]", "}"):
            depth -= 1
            if depth == 0:
                return j if t.text == close_t else -1
    return -1


def split_shift(toks: list[Token]) -> list[Token]:
    """Splits ``>>`` into two ``>`` tokens (for nested template arguments)."""
    out: list[Token] = []
    for t in toks:
        if t.kind == "punct" and t.text == ">>":
            out.append(Token("punct", ">", t.line))
            out.append(Token("punct", ">", t.line))
        else:
            out.append(t)
    return out
