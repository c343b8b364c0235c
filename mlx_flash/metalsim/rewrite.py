"""Source rewriter: Metal Shading Language body/header -> C++ for metalsim.

Works on the token stream of :mod:`tokenizer` (never on raw text) and edits
token output texts in place, so line numbers are preserved. Rewrites:

* unsuffixed floating literals get an ``f`` (MSL literals are float, not
  double); ``1.5h`` becomes ``((half)1.5f)``;
* address-space qualifiers ``device``/``constant``/``thread``/``threadgroup``
  are dropped (``constant`` becomes ``const``); in bounds-check mode device,
  constant and threadgroup pointers become ``msim::dptr<T>`` checked pointers
  and pointer casts become ``msim::ptr_cast<T>(...)``;
* ``threadgroup T name[N]...;`` declarations become references into the
  threadgroup's shared memory (one allocation per declaration per
  threadgroup, shared by all of its threads);
* vector constructors and casts (``float4(a.xy, b, c)``, ``float4(h4)``,
  ``(float4)x``, ``static_cast<float4>(x)``, ``float4 v(1, 2, 3, 4)``) become
  ``msim::vctor<float4>(...)``;
* ``#include <metal_*>`` and ``#pragma METAL`` lines are dropped.

* kernel and parameter attributes (``[[kernel]]``, ``[[buffer(0)]]``, ...) are
  dropped; ``constant T x [[function_constant(i)]];`` becomes a constexpr with
  the given value; overloads by address space collapse to the ``thread`` one.

Unsupported MSL (textures, samplers, imageblocks, raster order groups, other
Metal ``[[attributes]]``, matrix types) raise
:class:`UnsupportedError` naming the line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .tokenizer import Token, TokenizeError, match_bracket, split_shift, tokenize

__all__ = ["rewrite", "RewriteResult", "UnsupportedError", "VECTOR_TYPES"]


class UnsupportedError(ValueError):
    """An MSL construct metalsim does not support; `line` is 1-based."""

    def __init__(self, msg: str, line: int):
        super().__init__(msg)
        self.msg = msg
        self.line = line


_BASES = ["float", "half", "bfloat", "int", "uint", "short", "ushort", "char", "uchar",
          "long", "ulong", "bool"]
VECTOR_TYPES = frozenset(
    [f"{b}{n}" for b in _BASES for n in (2, 3, 4)]
    + [f"packed_{b}{n}" for b in _BASES for n in (2, 4)]
)

_UNSUPPORTED = {
    "sampler": "samplers",
    "imageblock": "imageblocks",
    "imageblock_data": "imageblocks",
    "raster_order_group": "raster order groups",
    "function_constant": "function constants",
    "visible_function_table": "visible function tables",
    "intersection_function_table": "intersection function tables",
    "acceleration_structure": "ray tracing",
    "primitive_acceleration_structure": "ray tracing",
    "instance_acceleration_structure": "ray tracing",
    "intersector": "ray tracing",
    "indirect_command_buffer": "indirect command buffers",
    "render_pipeline_state": "indirect command buffers",
    "compute_pipeline_state": "indirect command buffers",
    "simdgroup_event": "simdgroup async copies",
    "simdgroup_async_copy": "simdgroup async copies",
    "mesh_grid_properties": "mesh shaders",
    "object_data": "mesh shaders",
    "patch_control_point": "tessellation",
}
_TEXTURE_RE = re.compile(r"^(texture(1d|2d|3d|cube|_buffer)\w*|depth(2d|cube)\w*)$")
_MATRIX_RE = re.compile(r"^(float|half|bfloat)[234]x[234]$")
_PACKED3_RE = re.compile(r"^packed_\w+3$")
_STD_ATTRS = {"maybe_unused", "likely", "unlikely", "fallthrough", "nodiscard", "noreturn",
              "deprecated", "carries_dependency"}
# Attributes of kernel functions and their parameters that metalsim drops: the
# generated signature (signature.py) or the caller supplies what they describe.
_METAL_ATTRS = {"kernel", "buffer", "host_name", "function_constant",
                "max_total_threads_per_threadgroup", "threadgroup",
                "thread_position_in_grid", "thread_position_in_threadgroup",
                "threadgroup_position_in_grid", "threads_per_grid", "threads_per_threadgroup",
                "threadgroups_per_grid", "thread_index_in_threadgroup",
                "thread_index_in_simdgroup", "thread_index_in_quadgroup",
                "simdgroup_index_in_threadgroup", "quadgroup_index_in_threadgroup",
                "simdgroups_per_threadgroup", "quadgroups_per_threadgroup",
                "threads_per_simdgroup", "thread_execution_width", "grid_origin", "grid_size",
                "dispatch_threads_per_threadgroup", "dispatch_simdgroups_per_threadgroup",
                "dispatch_quadgroups_per_threadgroup"}
_ACCESS = {"public", "private", "protected"}
_FUNCTION_ATTRS = {"kernel", "host_name", "max_total_threads_per_threadgroup"}
_ADDRESS_SPACES = {"device", "constant", "thread", "threadgroup"}
_CHECKED_SPACES = {"device", "constant", "threadgroup"}
_FUNDAMENTAL = {"unsigned", "signed", "long", "short", "int", "char", "float", "double", "bool",
                "void"}
_KEYWORDS_BEFORE_EXPR = {"return", "case", "else", "do", "co_return", "throw"}


@dataclass
class RewriteResult:
    text: str
    tg_sites: list[str] = field(default_factory=list)  # names, indexed by site id
    function_constants: list[str] = field(default_factory=list)  # names bound to a value


def rewrite(src: str, *, check: bool = False, site_base: int = 0,
            function_constants: dict | None = None,
            tokens: list[Token] | None = None) -> RewriteResult:
    """Rewrites MSL source (a kernel body or header) into metalsim C++.

    `site_base` numbers the threadgroup declarations (body and header share
    one numbering). `tokens`: `lex(src)` when already lexed. `function_constants` gives the values of program-scope
    ``constant T name [[function_constant(i)]];`` declarations, by name.
    Raises UnsupportedError for unsupported constructs.
    """
    toks = tokens if tokens is not None else lex(src)
    rw = _Rewriter(toks, check, site_base, function_constants or {})
    rw.run()
    return RewriteResult("".join(t.out for t in toks), rw.tg_sites, rw.fc_bound)


def lex(src: str) -> list[Token]:
    """The token list `rewrite` works on (pass it as `tokens` to lex once for the MSL rules
    and the rewrite)."""
    try:
        return split_shift(tokenize(src))
    except TokenizeError as e:
        raise UnsupportedError(f"cannot tokenize: {e}", e.line) from None


class _Rewriter:
    def __init__(self, toks: list[Token], check: bool, site_base: int,
                 function_constants: dict):
        self.function_constants = function_constants
        self.fc_bound: list[str] = []
        self.toks = toks
        self.sig = [i for i, t in enumerate(toks) if t.kind not in ("ws", "comment")]
        self.check = check
        self.site_base = site_base
        self.tg_sites: list[str] = []

    # -- helpers -------------------------------------------------------------
    def t(self, k: int) -> Token | None:
        return self.toks[self.sig[k]] if 0 <= k < len(self.sig) else None

    def is_p(self, k: int, text: str) -> bool:
        t = self.t(k)
        return t is not None and t.kind == "punct" and t.text == text

    def is_id(self, k: int, text: str | None = None) -> bool:
        t = self.t(k)
        return t is not None and t.kind == "ident" and (text is None or t.text == text)

    def match(self, k: int) -> int:
        return match_bracket(self.toks, self.sig, k)

    def outs(self, a: int, b: int) -> str:
        """Output text of significant tokens [a, b), spaced as in the source
        (comments and newlines become single spaces)."""
        if a >= b:
            return ""
        parts = []
        for i in range(self.sig[a], self.sig[b - 1] + 1):
            t = self.toks[i]
            if t.kind in ("ws", "comment"):
                if parts and parts[-1] != " ":
                    parts.append(" ")
            elif t.out:
                parts.append(t.out)
        return "".join(parts).strip()

    def blank(self, a: int, b: int) -> None:
        for k in range(a, b):
            self.t(k).out = ""

    def stmt_start(self, k: int) -> bool:
        p = self.t(k - 1)
        if p is None:
            return True
        if p.kind in ("pp", "ppend", "define"):
            return True
        return p.kind == "punct" and p.text in (";", "{", "}", ":")

    def parse_type(self, k: int) -> int:
        """End (exclusive) of a type starting at k: qualifiers, (qualified)
        names, template arguments. Stops before the declarator."""
        j = k
        seen_name = False
        fundamental_only = True
        while j < len(self.sig):
            t = self.t(j)
            if t.kind == "ident" and t.text in ("const", "volatile"):
                j += 1
                continue
            if t.kind == "ident" and t.text in _FUNDAMENTAL and (not seen_name or fundamental_only):
                seen_name = True
                j += 1
                continue
            if t.kind == "ident" and t.text in ("typename", "struct", "class"):
                j += 1
                continue
            if (t.kind == "ident" and not seen_name) or (t.kind == "punct" and t.text == "::" and j == k):
                seen_name = True
                fundamental_only = False
                j += 1
                while True:
                    if self.is_p(j, "<"):
                        m = self.match(j)
                        if m < 0:
                            return j
                        j = m + 1
                    if self.is_p(j, "::") and self.is_id(j + 1):
                        j += 2
                        continue
                    break
                continue
            break
        return j

    def operand_end(self, k: int) -> int:
        """End (exclusive) of the unary-expression operand starting at k."""
        j = k
        while self.t(j) is not None and self.t(j).kind == "punct" and self.t(j).text in ("-", "+", "!", "~", "*", "&", "++", "--"):
            j += 1
        t = self.t(j)
        if t is None:
            return -1
        if self.is_p(j, "("):
            m = self.match(j)
            if m < 0:
                return -1
            j = m + 1
        elif t.kind in ("ident", "number", "string", "char"):
            j += 1
            while self.is_p(j, "::") and self.is_id(j + 1):
                j += 2
            if self.is_p(j, "<") and self.t(j - 1).text in ("as_type", "static_cast", "reinterpret_cast"):
                m = self.match(j)
                if m > 0:
                    j = m + 1
        else:
            return -1
        # postfix: calls, subscripts, member access
        while True:
            if self.is_p(j, "(") or self.is_p(j, "["):
                m = self.match(j)
                if m < 0:
                    return -1
                j = m + 1
            elif (self.is_p(j, ".") or self.is_p(j, "->")) and self.is_id(j + 1):
                j += 2
            elif self.is_p(j, "++") or self.is_p(j, "--"):
                j += 1
            else:
                return j

    def vec_type_end(self, k: int) -> int:
        """If a vector type starts at k, its end (exclusive), else -1."""
        t = self.t(k)
        if t is None or t.kind != "ident":
            return -1
        if t.text in VECTOR_TYPES:
            return k + 1
        if t.text == "vec" and self.is_p(k + 1, "<"):
            m = self.match(k + 1)
            return m + 1 if m > 0 else -1
        return -1

    # -- passes --------------------------------------------------------------
    def run(self) -> None:
        self.strip_metal_attributes()
        self.drop_address_space_overloads()
        self.drop_address_space_functions()
        self.drop_address_space_specializations()
        self.check_unsupported()
        self.fix_literals()
        self.fix_preprocessor()
        self.fix_vectors()
        self.fix_address_spaces()

    def check_unsupported(self) -> None:
        for k in range(len(self.sig)):
            t = self.t(k)
            if t.kind == "ident":
                what = _UNSUPPORTED.get(t.text)
                if what is None and _TEXTURE_RE.match(t.text):
                    what = "textures"
                if what is None and _MATRIX_RE.match(t.text):
                    what = "matrix types (floatNxM); use simdgroup_matrix or arrays"
                if what is None and _PACKED3_RE.match(t.text):
                    what = "packed 3-element vectors"
                if what is not None:
                    raise UnsupportedError(f"'{t.text}': {what} are not supported in metalsim", t.line)
            elif t.kind == "punct" and t.text == "[" and self.is_p(k + 1, "[") and t.out:
                a = self.t(k + 2)
                name = a.text if a is not None else ""
                if name in _UNSUPPORTED:
                    raise UnsupportedError(
                        f"[[{name}]]: {_UNSUPPORTED[name]} are not supported in metalsim", t.line)
                if a is None or a.kind != "ident" or not (name in _STD_ATTRS or self.is_p(k + 3, "::")):
                    raise UnsupportedError(
                        f"attribute [[{name}...]] is not supported in metalsim (Metal attributes "
                        "belong to the generated kernel signature)", t.line)

    def strip_metal_attributes(self) -> None:
        """Drops the Metal attributes of kernel functions and their parameters
        (``[[kernel]]``, ``[[buffer(0)]]``, ``[[thread_position_in_grid]]``,
        ``[[host_name("x")]]``, ...): metalsim calls kernel templates as plain
        functions. ``constant T name [[function_constant(i)]];`` becomes
        ``constexpr T name = value;`` with the value from `function_constants`."""
        k = 0
        while k < len(self.sig):
            if not (self.is_p(k, "[") and self.is_p(k + 1, "[")):
                k += 1
                continue
            m = self.match(k)
            if m < 0 or not self.is_p(m - 1, "]"):
                k += 1
                continue
            names = self._attribute_names(k + 2, m - 1)
            if not names or not all(n in _METAL_ATTRS for n in names):
                k = m + 1
                continue
            if names == ["function_constant"] and self.is_p(m + 1, ";") and self.is_id(k - 1):
                self._function_constant(k, m)
            elif not (all(n in _FUNCTION_ATTRS for n in names)
                      or self.is_p(m + 1, ",") or self.is_p(m + 1, ")")):
                k = m + 1  # a parameter attribute outside a parameter list
                continue
            self.remove(k, m + 1)

    def remove(self, a: int, b: int) -> None:
        """Deletes significant tokens [a, b) from the output and from later passes."""
        self.blank(a, b)
        del self.sig[a:b]

    def match_back(self, k: int) -> int:
        """Position of the bracket opening the one closing at k (or -1)."""
        close = {")": "(", "]": "[", "}": "{"}
        depth = 0
        for j in range(k, -1, -1):
            t = self.t(j)
            if t.kind != "punct":
                continue
            if t.text in close:
                depth += 1
            elif t.text in ("(", "[", "{"):
                depth -= 1
                if depth == 0:
                    return j
        return -1

    def drop_address_space_overloads(self) -> None:
        """Member functions qualified `device`, `threadgroup` or `constant`
        (``complex_t() threadgroup : ...``) overload the `thread` one by the
        object's address space; metalsim has one address space, so only the
        `thread` (or unqualified) member is kept and these are deleted."""
        k = 0
        while k < len(self.sig):
            t = self.t(k)
            if not (t.kind == "ident" and t.text in ("device", "threadgroup", "constant")):
                k += 1
                continue
            close = k - 2 if self.is_id(k - 1, "const") else k - 1
            if not self.is_p(close, ")"):
                k += 1
                continue
            open_ = self.match_back(close)
            start = open_ - 1
            depth = 0
            while start >= 0:
                u = self.t(start)
                if u.kind == "punct" and u.text in (")", "]"):
                    depth += 1
                elif u.kind == "punct" and u.text in ("(", "["):
                    depth -= 1
                elif depth == 0 and u.kind == "punct" and (
                        u.text in (";", "{", "}") or (u.text == ":" and self.is_id(start - 1) and
                                                      self.t(start - 1).text in _ACCESS)):
                    break
                start -= 1
            end = k + 1
            while end < len(self.sig) and not (self.is_p(end, "{") or self.is_p(end, ";")):
                if self.is_p(end, "("):
                    end = self.match(end)
                end += 1
            if self.is_p(end, "{"):
                end = self.match(end)
            if self.is_p(end + 1, ";"):
                end += 1
            if open_ < 0 or end < 0:
                k += 1
                continue
            self.remove(start + 1, end + 1)
            k = start + 1

    def drop_address_space_functions(self) -> None:
        """Functions returning a `device`, `threadgroup` or `constant`
        reference (``threadgroup complex_t<T>& operator+=(threadgroup
        complex_t<T>& a, ...)``) overload one returning a `thread` reference
        of the same name; with one address space they would be redefinitions,
        so the `thread` one is kept and these are deleted."""
        def ref_return(k: int) -> tuple[int, str] | None:
            # `q TYPE & name (` at k: (index of the name, name)
            te = self.parse_type(k + 1)
            if te == k + 1 or not self.is_p(te, "&"):
                return None
            j = te + 1
            if self.is_id(j, "operator"):
                j += 1
                while j < len(self.sig) and not self.is_p(j, "("):
                    j += 1
                return (te + 1, self.outs(te + 1, j)) if self.is_p(j, "(") else None
            if self.is_id(j) and self.is_p(j + 1, "("):
                return j, self.t(j).text
            return None

        thread_names = set()
        for k in range(len(self.sig)):
            if self.is_id(k, "thread"):
                r = ref_return(k)
                if r:
                    thread_names.add(r[1])
        if not thread_names:
            return
        k = 0
        while k < len(self.sig):
            r = None
            if self.t(k).kind == "ident" and self.t(k).text in ("device", "threadgroup", "constant"):
                r = ref_return(k)
            if r is None or r[1] not in thread_names:
                k += 1
                continue
            start = k - 1
            depth = 0
            while start >= 0:
                u = self.t(start)
                if u.kind == "punct" and u.text in (")", "]", ">"):
                    depth += 1
                elif u.kind == "punct" and u.text in ("(", "[", "<"):
                    depth -= 1
                elif depth == 0 and u.kind == "punct" and u.text in (";", "{", "}"):
                    break
                start -= 1
            j = r[0]
            while j < len(self.sig) and not self.is_p(j, "("):
                j += 1
            end = self.match(j) + 1
            while end < len(self.sig) and not (self.is_p(end, "{") or self.is_p(end, ";")):
                end += 1
            if self.is_p(end, "{"):
                end = self.match(end)
            if end < 0:
                k += 1
                continue
            self.remove(start + 1, end + 1)
            k = start + 1

    def drop_address_space_specializations(self) -> None:
        """Class template specializations on address-space-qualified pointers
        (``struct pointer_element<device T*>``) duplicate the `thread` one
        once address spaces are gone; they are deleted."""
        k = 0
        while k < len(self.sig):
            if not (self.is_id(k) and self.t(k).text in ("struct", "class") and self.is_id(k + 1)
                    and self.is_p(k + 2, "<") and self.is_id(k - 1) is False):
                k += 1
                continue
            m = self.match(k + 2)
            if m < 0 or not any(self.t(j).kind == "ident" and self.t(j).text in
                                ("device", "threadgroup", "constant") for j in range(k + 3, m)):
                k += 1
                continue
            start = k
            if self.is_p(k - 1, ">"):
                start = self.match_back_angle(k - 1)
                if start > 0 and self.is_id(start - 1, "template"):
                    start -= 1
            end = m + 1
            while end < len(self.sig) and not (self.is_p(end, "{") or self.is_p(end, ";")):
                end += 1
            if self.is_p(end, "{"):
                end = self.match(end)
                if self.is_p(end + 1, ";"):
                    end += 1
            self.remove(start, end + 1)
            k = start

    def match_back_angle(self, k: int) -> int:
        depth = 0
        for j in range(k, -1, -1):
            if self.is_p(j, ">"):
                depth += 1
            elif self.is_p(j, "<"):
                depth -= 1
                if depth == 0:
                    return j
        return -1

    def _attribute_names(self, a: int, b: int) -> list[str]:
        """Names of the comma-separated attributes in tokens [a, b)."""
        names: list[str] = []
        j = a
        while j < b:
            if not self.is_id(j):
                return []
            names.append(self.t(j).text)
            j += 1
            if self.is_p(j, "("):
                j = self.match(j) + 1
                if j <= 0:
                    return []
            if self.is_p(j, ","):
                j += 1
            elif j != b:
                return []
        return names

    def _function_constant(self, k: int, m: int) -> None:
        name_tok = self.t(k - 1)
        name = name_tok.text
        j = k - 2
        while j >= 0 and not (self.t(j).kind == "ident" and self.t(j).text == "constant"):
            if self.is_p(j, ";") or self.is_p(j, "}") or self.is_p(j, "{"):
                raise UnsupportedError(
                    f"function constant '{name}' must be declared `constant T {name} "
                    "[[function_constant(i)]];` at program scope", name_tok.line)
            j -= 1
        if name not in self.function_constants:
            raise UnsupportedError(
                f"function constant '{name}' has no value: pass function_constants="
                f"{{'{name}': ...}} to metalsim.metal_kernel", name_tok.line)
        v = self.function_constants[name]
        if isinstance(v, bool):
            text = "true" if v else "false"
        elif isinstance(v, int):
            text = str(v)
        elif isinstance(v, float):
            text = repr(v) + "f"
        else:
            raise UnsupportedError(f"function constant '{name}': value {v!r} is not a "
                                   "bool, int or float", name_tok.line)
        kw = self.t(j)
        kw.text = kw.out = "constexpr"
        self.fc_bound.append(name)
        name_tok.out = f"{name} = {text}"

    def fix_literals(self) -> None:
        for k in range(len(self.sig)):
            t = self.t(k)
            if t.kind != "number":
                continue
            s = t.text.replace("'", "")
            low = s.lower()
            if low.startswith("0x"):
                is_float = "p" in low
            elif low.startswith("0b"):
                is_float = False
            else:
                is_float = "." in s or "e" in low
            if not is_float:
                continue
            if low.endswith("h"):
                t.out = f"((half){s[:-1]}f)"
            elif low.endswith("f") and not low.startswith("0x"):
                pass
            elif low.endswith("f") and "p" in low:  # hex float with f suffix
                pass
            elif low.endswith("l"):
                t.out = s[:-1] + "f"
            else:
                t.out = s + "f"

    def fix_preprocessor(self) -> None:
        for k in range(len(self.sig)):
            t = self.t(k)
            if t.kind == "pp":
                body = t.text.lstrip("#").strip()
                if re.match(r"include\s*<metal_\w*>", body) or re.match(r"pragma\s+METAL\b", body):
                    t.out = "\n" * t.text.count("\n")

    def fix_vectors(self) -> None:
        k = 0
        n = len(self.sig)
        while k < n:
            t = self.t(k)
            # static_cast<float4>(x) -> msim::vctor<float4>(x)
            if t.kind == "ident" and t.text == "static_cast" and self.is_p(k + 1, "<"):
                e = self.vec_type_end(k + 2)
                if e > 0 and self.is_p(e, ">") and self.is_p(e + 1, "("):
                    t.out = "msim::vctor"
            e = self.vec_type_end(k)
            if e < 0:
                k += 1
                continue
            type_text = self.outs(k, e)
            prev = self.t(k - 1)
            # C-style cast: (float4)x
            if (self.is_p(k - 1, "(") and self.is_p(e, ")")
                    and not (self.t(k - 2) is not None and self.t(k - 2).kind == "ident"
                             and self.t(k - 2).text not in _KEYWORDS_BEFORE_EXPR)
                    and not self.is_p(k - 2, ")") and not self.is_p(k - 2, "]")):
                oe = self.operand_end(e + 1)
                if oe > 0:
                    self.t(k - 1).out = f"msim::vctor<{type_text}>("
                    self.blank(k, e + 1)
                    last = self.t(oe - 1)
                    last.out = last.out + ")"
                    k = e + 1
                    continue
            if self.is_p(e, "(") and not (prev is not None and prev.kind == "ident" and prev.text == "operator"):
                # functional construction float4(...)
                self.t(k).out = "msim::vctor<" + self.t(k).out
                self.t(e - 1).out = self.t(e - 1).out + ">"
                k = e
                continue
            if self.is_p(e, "{"):
                m = self.match(e)
                if m > 0:
                    self.t(k).out = "msim::vctor<" + self.t(k).out
                    self.t(e - 1).out = self.t(e - 1).out + ">"
                    self.t(e).out = "("
                    self.t(m).out = ")"
                k = e
                continue
            # declarations with direct or brace initialisation:
            # float4 a = x, v(1, 2, 3, 4), w{a.xy, b};
            if self.is_id(e):
                self._vector_declarators(e, type_text)
            k = e

    def _vector_declarators(self, j: int, type_text: str) -> None:
        while self.is_id(j):
            if self.is_p(j + 1, "(") or self.is_p(j + 1, "{"):
                m = self.match(j + 1)
                if m < 0 or not (self.is_p(m + 1, ";") or self.is_p(m + 1, ",")):
                    return
                if m > j + 2 and not (self.t(j + 1).text == "(" and self._looks_like_params(j + 2, m)):
                    self.t(j + 1).out = f" = msim::vctor<{type_text}>("
                    self.t(m).out = ")"
                j = m + 1
            elif self.is_p(j + 1, "="):
                j = self._skip_initializer(j + 2)
            elif self.is_p(j + 1, "["):
                m = self.match(j + 1)
                if m < 0:
                    return
                j = m + 1
                if self.is_p(j, "="):
                    j = self._skip_initializer(j + 1)
            else:
                j += 1
            if not self.is_p(j, ","):
                return
            j += 1

    def _skip_initializer(self, j: int) -> int:
        """Position of the `,` or `;` ending the initializer starting at j."""
        depth = 0
        while j < len(self.sig):
            t = self.t(j)
            if t.kind == "punct":
                if t.text in ("(", "[", "{"):
                    depth += 1
                elif t.text in (")", "]", "}"):
                    depth -= 1
                    if depth < 0:
                        return j
                elif depth == 0 and t.text in (",", ";"):
                    return j
            j += 1
        return j

    def _looks_like_params(self, a: int, b: int) -> bool:
        """Whether tokens [a, b) look like a parameter list (a prototype)."""
        te = self.parse_type(a)
        return te > a and te < b and self.is_id(te) and (te + 1 == b or self.is_p(te + 1, ","))

    def fix_address_spaces(self) -> None:
        k = 0
        while k < len(self.sig):
            t = self.t(k)
            if t.kind != "ident" or t.text not in _ADDRESS_SPACES:
                k += 1
                continue
            q = t.text
            if q == "threadgroup" and self.stmt_start(k) and self._tg_declaration(k):
                k = self.k_after
                continue
            # [const] q TYPE (* | &) ...
            const_before = self.is_id(k - 1, "const")
            a = k - 1 if const_before else k
            te = self.parse_type(k + 1)
            type_text = self.outs(k + 1, te)
            has_const = const_before or any(self.t(j).text == "const" for j in range(k + 1, te))
            is_ptr = self.is_p(te, "*")
            if not is_ptr:
                near_constexpr = self.is_id(k + 1, "constexpr") or self.is_id(k - 1, "constexpr")
                if q != "constant" or self.is_p(k - 1, ")") or (
                        self.is_id(k - 1, "const") and self.is_p(k - 2, ")")):
                    t.out = ""  # other spaces; `constant` as a member function qualifier
                elif (self.is_p(te, "&") or not self.is_id(te) or self.is_p(a - 1, "(")
                      or self.is_p(a - 1, ",")):  # references, parameters
                    t.out = "" if (has_const or near_constexpr) else "const"
                else:
                    # A `constant` object holds compile-time data: `static const constant
                    # float x = ...;` in a class needs constexpr in C++.
                    t.out = "" if near_constexpr else "constexpr"
                k += 1
                continue
            ctype = ("const " if const_before else "") + type_text
            if q == "constant" and not has_const:
                ctype = "const " + ctype
            # reinterpret_cast<device T*>(x) / static_cast / const_cast
            if (self.is_p(a - 1, "<") and self.is_id(a - 2)
                    and self.t(a - 2).text in ("reinterpret_cast", "static_cast", "const_cast")
                    and self.is_p(te + 1, ">")):
                if self.check and q in _CHECKED_SPACES:
                    self.t(a - 2).out = f"msim::ptr_cast<{ctype}>"
                    self.blank(a - 1, te + 2)
                else:
                    t.out = "const" if (q == "constant" and not has_const) else ""
                k = te + 2
                continue
            # C-style cast: (device T*)x
            if self.is_p(a - 1, "(") and self.is_p(te + 1, ")"):
                oe = self.operand_end(te + 2)
                if oe > 0 and self.check and q in _CHECKED_SPACES:
                    self.t(a - 1).out = f"msim::ptr_cast<{ctype}>("
                    self.blank(a, te + 2)
                    self.t(oe - 1).out += ")"
                    k = te + 2
                    continue
                t.out = "const" if (q == "constant" and not has_const) else ""
                k = te + 1
                continue
            if self.check and q in _CHECKED_SPACES:
                # Pointer declaration (variable, parameter, member).
                self.t(a).out = f"msim::dptr<{ctype}>"
                self.blank(a + 1, te + 1)
                k = te + 1
                continue
            t.out = "const" if (q == "constant" and not has_const) else ""
            k += 1

    def _tg_declaration(self, k: int) -> bool:
        """Rewrites `threadgroup T a[N], b;` at sig index k. Returns False if
        this is not a declaration of threadgroup variables (e.g. a pointer)."""
        te = self.parse_type(k + 1)
        if te == k + 1:
            return False
        if not self.is_id(te) or self.is_p(te + 1, "("):
            return False  # pointer/reference declarations or a function
        type_text = self.outs(k + 1, te)
        decls: list[str] = []
        j = te
        line = self.t(k).line
        while True:
            if not self.is_id(j):
                return False
            name = self.t(j).text
            j += 1
            dims = ""
            while self.is_p(j, "["):
                m = self.match(j)
                if m < 0:
                    return False
                dims += "[" + self.outs(j + 1, m) + "]"
                j = m + 1
            if self.is_p(j, "="):
                raise UnsupportedError(
                    f"threadgroup variable '{name}' cannot have an initializer (as in Metal)", line)
            site = self.site_base + len(self.tg_sites)
            self.tg_sites.append(name)
            full = f"{type_text}{dims}"
            alloc = f"msim::tg_alloc({site}, sizeof({full}), alignof({full}))"
            if dims and self.check:
                decls.append(f'auto {name} = msim::tg_check<{full}>({alloc}, "{name}")')
            else:
                decls.append(f"auto& {name} = msim::tg_ref<{full}>({alloc})")
            if self.is_p(j, ","):
                j += 1
                continue
            if self.is_p(j, ";"):
                break
            return False
        self.blank(k, j)
        self.t(k).out = "; ".join(decls)
        self.k_after = j
        return True
