"""Metal Shading Language rules that Apple's compiler enforces and a C++ compiler does not.

metalsim compiles kernels as C++, which accepts code the Metal compiler rejects (a ``double``,
a ``new``, a pointer without an address space). :func:`check` runs over a kernel's header and
body (MLX headers expanded) before the rewrite and raises :class:`MSLRuleError` on the first
violation, naming the rule, the file and line, and the section of Apple's Metal Shading
Language Specification (version 3.2) that states it. Each rule is checked on tokens, so it
sees the code as written (macro bodies included), never the C++ metalsim makes of it.

Rules (section numbers of the MSL 3.2 specification):

* ``double``, ``long double``, ``long long`` types: §2.1 (Scalar Data Types).
* ``new``/``delete`` expressions and ``malloc``/``calloc``/``realloc``/``free`` calls: §1.5.4
  (no dynamic allocation).
* ``virtual`` functions, ``try``/``catch``/``throw``, ``goto``, ``dynamic_cast``, ``typeid``,
  ``thread_local`` and ``register`` storage: §1.5.4.
* a function named ``main``: §1.5.4.
* recursion (a function that calls itself by name and has no overload of that name): §1.5.4.
* a pointer type without an address space (``device``, ``constant``, ``threadgroup``,
  ``thread``) in a parameter or variable declaration: §1.5.4 and §4 (Address Spaces); Apple's
  compiler: "pointer type must have explicit address space qualifier".
* a ``threadgroup`` variable declared inside a function that is not a kernel: §4.4
  (threadgroup Address Space).
* compiling for Metal 3.0 (macOS 13): the native ``bfloat`` types (``bfloat``, ``bfloat4``,
  ``simdgroup_bfloat8x8``): §2.1, new in Metal 3.1. ``bfloat16_t`` (MLX's type) is fine.

Not checked (version-dependent or not decidable on tokens): lambdas (Metal 4's kernels in
MLX's headers use them), derived classes (allowed since Metal 2), the ``noexcept`` operator
(the ``noexcept`` specifier is allowed and appears in MLX's headers), indirect recursion.
"""

from __future__ import annotations

import re

from .rewrite import _Rewriter
from .tokenizer import Token, TokenizeError, split_shift, tokenize

__all__ = ["check", "MSLRuleError", "RULES"]

SPEC = "Metal Shading Language Specification 3.2"
# rule id -> (what is rejected, section)
RULES = {
    "double": ("the double / long double / long long types", "§2.1 Scalar Data Types"),
    "allocation": ("dynamic allocation (new, delete, malloc, free)", "§1.5.4 Metal Restrictions"),
    "virtual": ("virtual functions", "§1.5.4 Metal Restrictions"),
    "exceptions": ("exceptions (try, catch, throw)", "§1.5.4 Metal Restrictions"),
    "goto": ("goto", "§1.5.4 Metal Restrictions"),
    "rtti": ("dynamic_cast and typeid", "§1.5.4 Metal Restrictions"),
    "storage": ("thread_local and register storage", "§1.5.4 Metal Restrictions"),
    "main": ("a function named main", "§1.5.4 Metal Restrictions"),
    "recursion": ("recursive function calls", "§1.5.4 Metal Restrictions"),
    "address_space": ("a pointer type without an address space (device, constant, threadgroup, "
                      "thread)", "§1.5.4 Metal Restrictions, §4 Address Spaces"),
    "bfloat": ("the native bfloat type before Metal 3.1 (macOS 14); MLX's bfloat16_t is "
               "portable", "§2.1 Scalar Data Types"),
    "threadgroup_scope": ("a threadgroup variable outside a kernel function",
                          "§4.4 threadgroup Address Space"),
}

_SPACES = {"device", "constant", "threadgroup", "thread", "threadgroup_imageblock", "ray_data",
           "object_data"}
_KEYWORD_RULES = {"virtual": "virtual", "try": "exceptions", "catch": "exceptions",
                  "throw": "exceptions", "goto": "goto", "dynamic_cast": "rtti", "typeid": "rtti",
                  "thread_local": "storage", "register": "storage", "double": "double"}
_NATIVE_BFLOAT = re.compile(r"^(packed_)?bfloat[234]?$|^simdgroup_bfloat8x8$")
_ALLOC_CALLS = {"malloc", "calloc", "realloc", "free", "aligned_alloc"}
_NOT_TYPES = {"return", "else", "case", "throw", "new", "delete", "sizeof", "co_return", "goto",
              "do", "if", "while", "for", "switch", "operator", "typedef", "using", "template",
              "typename", "struct", "class", "namespace", "public", "private", "protected",
              "static_assert", "decltype", "alignof", "not", "and", "or"}
_CONTROL = {"if", "for", "while", "switch", "catch"}


class MSLRuleError(ValueError):
    """Code Apple's Metal compiler rejects; `line` is 1-based in `file`."""

    def __init__(self, rule: str, msg: str, line: int):
        what, section = RULES[rule]
        super().__init__(f"{msg} ({what} is not Metal: {SPEC}, {section})")
        self.rule = rule
        self.line = line


def check(src: str, *, kernel_scope: bool, tokens: list[Token] | None = None,
          metal_version: int = 310) -> None:
    """Checks MSL source (a kernel header, or a body when `kernel_scope`: the body is the
    kernel function's own scope) for Metal `metal_version` (310 = 3.1). `tokens`:
    rewrite.lex(src) when already lexed (read only). Raises MSLRuleError at the first
    violation."""
    if tokens is None:
        try:
            tokens = split_shift(tokenize(src))
        except TokenizeError:
            return  # the rewriter reports it
    _Checker(tokens, kernel_scope, metal_version).run_rules()


class _Checker(_Rewriter):
    def __init__(self, toks, kernel_scope: bool, metal_version: int = 310):
        super().__init__(toks, False, 0, {})
        self.kernel_scope = kernel_scope
        self.metal_version = metal_version
        self.body_ranges: list[tuple[int, int]] = []
        self._enclosing: list[int] | None = None
        self._paren_memo: dict[int, bool] = {}

    def fail(self, rule: str, k: int, msg: str) -> None:
        raise MSLRuleError(rule, msg, self.t(k).line)

    def run_rules(self) -> None:
        self.keywords()
        self.functions()
        self.pointers()

    # -- keywords ----------------------------------------------------------------
    def keywords(self) -> None:
        for k in range(len(self.sig)):
            t = self.t(k)
            if t.kind != "ident":
                continue
            w = t.text
            if self.metal_version < 310 and _NATIVE_BFLOAT.match(w):
                v = self.metal_version
                self.fail("bfloat", k, f"'{w}' (compiling for Metal {v // 100}.{v % 100 // 10})")
            if w in _KEYWORD_RULES:
                self.fail(_KEYWORD_RULES[w], k, f"'{w}'")
            if w == "long" and (self.is_id(k + 1, "long") or self.is_id(k + 1, "double")):
                self.fail("double", k, f"'long {self.t(k + 1).text}'")
            if w == "new" and not self.is_id(k - 1, "operator"):
                self.fail("allocation", k, "'new'")
            if w == "delete" and not self.is_p(k - 1, "=") and not self.is_id(k - 1, "operator"):
                self.fail("allocation", k, "'delete'")
            if w in ("new", "delete") and self.is_id(k - 1, "operator"):
                self.fail("allocation", k, f"'operator {w}'")
            if w in _ALLOC_CALLS and self.is_p(k + 1, "(") and not self.is_p(k - 1, ".") \
                    and not self.is_p(k - 1, "->"):
                self.fail("allocation", k, f"'{w}()'")

    # -- functions: main, recursion, threadgroup scope ---------------------------
    def _function_head(self, brace: int) -> tuple[int, str, bool] | None:
        """If the `{` at `brace` opens a function body: (index of the name, name, is_kernel)."""
        j = brace - 1
        # skip trailing qualifiers / ctor initializers back to the parameter list's `)`
        while j >= 0 and (self.is_id(j) and self.t(j).text in
                          ("const", "thread", "device", "threadgroup", "constant", "noexcept",
                           "override", "final", "mutable")):
            j -= 1
        if not self.is_p(j, ")"):
            # constructor initializer list `) : a(x), b(y) {`
            d = j
            while d >= 0 and not any(self.is_p(d, c) for c in (";", "{", "}")):
                if self.is_p(d, ":") and self.is_p(d - 1, ")"):
                    j = d - 1
                    break
                d -= 1
            if not self.is_p(j, ")"):
                return None
        o = self.match_back(j)
        if o <= 0:
            return None
        n = o - 1
        if self.is_p(n, ">"):  # explicit template arguments f<T>(
            n = self.match_back_angle(n) - 1
        if not self.is_id(n) or self.t(n).text in _CONTROL or self.t(n).text in _NOT_TYPES:
            if self.is_id(n) and self.t(n).text == "operator":
                return n, "operator", False
            if not (self.is_p(n, ")") or self.is_p(n, "]") or self.is_id(n)):
                return None
            if self.is_id(n) and self.t(n).text in _CONTROL:
                return None
            if not self.is_id(n):
                return None
        # is it a kernel? look back for [[kernel ...]] in this declaration
        is_kernel = False
        d = n - 1
        while d >= 0 and not (self.is_p(d, ";") or self.is_p(d, "}") or self.is_p(d, "{")):
            if self.is_id(d, "kernel") and self.is_p(d - 1, "[") and self.is_p(d - 2, "["):
                is_kernel = True
            d -= 1
        return n, self.t(n).text, is_kernel

    def functions(self) -> None:
        stack: list[tuple[str, str, bool]] = []  # (kind, name, is_kernel) per open brace
        defs: dict[str, int] = {}
        bodies: list[tuple[str, int, int]] = []
        for k in range(len(self.sig)):
            if self.is_p(k, "{"):
                head = self._function_head(k) if not any(s[0] == "function" for s in stack) \
                    else None
                if head is not None:
                    n, name, is_kernel = head
                    if name == "main":
                        self.fail("main", n, "function 'main'")
                    defs[name] = defs.get(name, 0) + 1
                    bodies.append((name, k, self.match(k)))
                    stack.append(("function", name, is_kernel))
                else:
                    stack.append(("block", "", False))
            elif self.is_p(k, "}"):
                if stack:
                    stack.pop()
            elif self.is_id(k, "threadgroup") and self.stmt_start(k):
                te = self.parse_type(k + 1)
                if te > k + 1 and self.is_id(te) and not self.is_p(te + 1, "("):
                    fn = [s for s in stack if s[0] == "function"]
                    if fn and not fn[0][2]:
                        self.fail("threadgroup_scope", k,
                                  f"threadgroup variable '{self.t(te).text}' in function "
                                  f"'{fn[0][1]}', which is not a kernel")
                    if not fn and not self.kernel_scope and stack:
                        pass  # inside a class or namespace: not a function scope
        self.body_ranges = [(a, b) for _, a, b in bodies]
        # Direct recursion, where the name is not overloaded (an overload calling another
        # overload of its name is ordinary code, e.g. MLX's simd_shuffle_up(bool)).
        for name, a, b in bodies:
            if name == "operator" or defs.get(name, 0) != 1 or b < 0:
                continue
            for j in range(a + 1, b):
                if (self.is_id(j, name) and self.is_p(j + 1, "(") and not self.is_p(j - 1, ".")
                        and not self.is_p(j - 1, "->") and not self.is_p(j - 1, "::")):
                    self.fail("recursion", j, f"function '{name}' calls itself")

    # -- pointers without an address space ----------------------------------------
    def _decl_context(self, k: int) -> bool:
        """Whether a declaration may start at sig index k (after `;`, `{`, `}`, `(`, `,` of a
        parameter list, or a label)."""
        p = self.t(k - 1)
        if p is None or p.kind in ("pp", "ppend", "define"):
            return True
        if p.kind != "punct":
            return False
        if p.text in (";", "{", "}"):
            return True
        if p.text == ":":
            return self.is_id(k - 2) and self.t(k - 2).text in ("public", "private", "protected")
        if p.text in ("(", ","):
            return self._in_declaration_parens(k - 1)
        return False

    def _open_of(self) -> list[int]:
        """For each significant token, the innermost `(`/`[` enclosing it within the current
        statement (-1 if none, or if a `;` inside that bracket precedes the token)."""
        if self._enclosing is None:
            enc = [-1] * len(self.sig)
            stack: list[list[int]] = []  # [open index, seen `;`]
            for k in range(len(self.sig)):
                t = self.t(k)
                if stack and not stack[-1][1]:
                    enc[k] = stack[-1][0]
                if t.kind != "punct":
                    continue
                if t.text in ("(", "["):
                    stack.append([k, False])
                elif t.text in (")", "]"):
                    if stack:
                        stack.pop()
                elif t.text == ";" and stack:
                    stack[-1][1] = True
                elif t.text in ("{", "}"):
                    stack.clear()
            self._enclosing = enc
        return self._enclosing

    def _in_declaration_parens(self, k: int) -> bool:
        """Whether the `(` or `,` at k belongs to a function declarator's parameter list (or a
        for-statement's init), not a call."""
        j = k if self.is_p(k, "(") else self._open_of()[k]
        if j not in self._paren_memo:
            self._paren_memo[j] = self._declaration_paren(j)
        return self._paren_memo[j]

    def _declaration_paren(self, j: int) -> bool:
        if j < 0 or not self.is_p(j, "("):
            return False
        if self.is_id(j - 1, "for"):
            return True
        m = self.match(j)
        if (m > 0 and (self.is_p(m + 1, ";") or self.is_p(m + 1, ","))
                and (self.kernel_scope or self._in_body(j))):
            return False  # `short2 v(a * b, c);` in a function body: a variable, not a prototype
        n = j - 1
        if self.is_p(n, ">"):
            n = self.match_back_angle(n) - 1
        if not self.is_id(n) or self.t(n).text in _NOT_TYPES or self.t(n).text in _CONTROL:
            return False
        # a declarator: the name follows a type (an identifier, `>`, `*`, `&`, `::~`)
        prev = self.t(n - 1)
        if prev is None:
            return False
        if prev.kind == "ident" and prev.text not in _NOT_TYPES:
            return True
        if prev.kind == "punct" and prev.text in (">", "*", "&"):
            return True
        if self.is_id(n - 1, "operator") or (prev.kind == "punct" and prev.text == "~"):
            return True
        # constructors: `Name(` at the start of a member declaration
        return self._decl_context(n) and self.is_p(self.match(j) + 1, "{") if self.match(j) > 0 \
            else False

    def _in_body(self, k: int) -> bool:
        return any(a < k < b for a, b in self.body_ranges)

    def pointers(self) -> None:
        k = 0
        while k < len(self.sig):
            t = self.t(k)
            if not (t.kind == "ident" or self.is_p(k, "::")) or not self._decl_context(k):
                k += 1
                continue
            start = k
            spaces = False
            j = k
            while self.is_id(j) and self.t(j).text in (_SPACES | {"const", "volatile", "static",
                                                                  "inline", "constexpr",
                                                                  "METAL_FUNC"}):
                spaces |= self.t(j).text in _SPACES
                j += 1
            if self.is_id(j) and self.t(j).text in _NOT_TYPES | {"auto"}:
                k += 1
                continue
            te = self.parse_type(j)
            if te == j:
                k += 1
                continue
            spaces |= any(self.is_id(i) and self.t(i).text in _SPACES for i in range(j, te))
            q = te
            while self.is_id(q) and self.t(q).text in _SPACES | {"const", "volatile"}:
                spaces |= self.t(q).text in _SPACES
                q += 1
            if self.is_p(q, "*") and self.is_id(q + 1) and not spaces:
                nxt = self.t(q + 2)
                if nxt is not None and nxt.kind == "punct" and nxt.text in ("=", ",", ")", ";",
                                                                              "["):
                    self.fail("address_space", q,
                              f"pointer '{self.t(q + 1).text}' of type '{self.outs(start, q)}*'")
            k = max(te, k + 1)
