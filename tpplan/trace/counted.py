"""`Counted`, an integer attribute as a traced forward reads it, and the numbers computed
from such reads: each remembers the expression it came from.

Start at `Counted`. The plan divides integer attributes (head counts); a number an op is
given must shrink with them. A number that merely equals an attribute (`g = self.n_head //
self.n_kv` is 2, and so is `self.n_kv`) says nothing of where it came from; a `Counted`
does. The read hooks (hooks.py) hand the forward a `Counted` for every integer attribute it
reads; arithmetic on it (`+ - * // %`, either side) gives another, whose `expr` is the
formula over the attributes read. The attention mode sees them where Python code hands them
to an op (a repeat's count), and infer evaluates `expr` with the counts the plan divides
(`evaluate`). Anything else that touches one treats it as the plain int it equals.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "Counted",
    "Expr",
    "attributes_in",
    "evaluate",
    "kept_by_dividing",
    "linear_terms",
    "product_terms",
    "render",
    "scaled_reads",
    "shrinks_with_width",
    "values_read",
]

# ("attr", module, attribute, value as read) | ("const", value) | (operator, left, right)
Expr = tuple[Any, ...]

_OPS: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "//": operator.floordiv,
    "%": operator.mod,
}


def _expr(x: Any) -> Expr:
    return x.expr if isinstance(x, Counted) else ("const", int(x))


def _binary(symbol: str, *, reflected: bool = False) -> Callable[[Counted, Any], Any]:
    fn = _OPS[symbol]

    def op(self: Counted, other: Any) -> Any:
        if type(other) is not int and not isinstance(other, Counted):
            return NotImplemented  # floats, tensors: their own arithmetic, no formula
        left, right = (other, self) if reflected else (self, other)
        value = fn(int(left), int(right))
        return Counted(value, (symbol, _expr(left), _expr(right)))

    return op


class Counted(int):
    """An int that remembers the formula over integer attributes it was computed from."""

    expr: Expr

    def __new__(cls, value: int, expr: Expr) -> Counted:
        out = super().__new__(cls, value)
        out.expr = expr
        return out

    @classmethod
    def read(cls, module: str, attr: str, value: int) -> Counted:
        """Attribute `attr` of the module named `module`, as its forward read it."""
        return cls(value, ("attr", module, attr, value))

    def direct(self) -> tuple[str, str] | None:
        """(module, attribute) when this is one attribute as read, not computed from it."""
        return (self.expr[1], self.expr[2]) if self.expr[0] == "attr" else None

    __add__ = _binary("+")
    __radd__ = _binary("+", reflected=True)
    __sub__ = _binary("-")
    __rsub__ = _binary("-", reflected=True)
    __mul__ = _binary("*")
    __rmul__ = _binary("*", reflected=True)
    __floordiv__ = _binary("//")
    __rfloordiv__ = _binary("//", reflected=True)
    __mod__ = _binary("%")
    __rmod__ = _binary("%", reflected=True)

    def __repr__(self) -> str:
        return int.__repr__(self)

    def __reduce__(self) -> Any:  # copies and pickles are the plain number
        return (int, (int(self),))


def values_read(expr: Expr) -> dict[tuple[str, str], int]:
    """(module, attribute) -> its value as read, for every attribute the formula reads."""
    if expr[0] == "attr":
        return {(expr[1], expr[2]): expr[3]}
    if expr[0] == "const":
        return {}
    return {**values_read(expr[1]), **values_read(expr[2])}


def scaled_reads(expr: Expr) -> list[tuple[str, str, int]] | None:
    """(module, attribute, value) of each attribute of a formula that is a sum of attributes,
    each maybe times a positive constant (`self.q_size + 2 * self.kv_size`): dividing every
    one of them by tp divides the whole by tp. None for any other formula (a product of two
    attributes, a constant added), which no division of its attributes shrinks so: the
    `product_terms` of one factor each."""
    terms = product_terms(expr)
    if terms is None or any(len(t) != 1 for t in terms):
        return None
    return [t[0] for t in terms]


def linear_terms(expr: Expr) -> tuple[list[tuple[tuple[str, str, int], int]], int] | None:
    """The attribute terms and the constant of a formula that is a sum of attributes, each
    maybe times a positive constant, plus a constant (`self.num_heads + 2`: the query heads,
    and a key and a value head beside them; `self.n_head + 2 * self.n_kv`): ((module,
    attribute, value), its factor) of each term, and the constant (0 if none). None for any
    other formula (a product of attributes, a difference)."""
    kind = expr[0]
    if kind == "const":
        return ([], expr[1]) if expr[1] >= 0 else None
    if kind == "attr":
        return [((expr[1], expr[2], expr[3]), 1)], 0
    if kind == "*":
        for const, other in ((expr[1], expr[2]), (expr[2], expr[1])):
            if const[0] == "const" and const[1] > 0 and other[0] == "attr":
                return [((other[1], other[2], other[3]), const[1])], 0
        return None
    if kind == "+":
        left, right = linear_terms(expr[1]), linear_terms(expr[2])
        if left is None or right is None:
            return None
        return left[0] + right[0], left[1] + right[1]
    return None


def product_terms(expr: Expr) -> list[tuple[tuple[str, str, int], ...]] | None:
    """The attributes of each term of a formula that is a sum of products of attributes, each
    maybe times a positive constant (`self.n_head * self.head_dim + 2 * self.n_kv *
    self.head_dim`), one tuple of (module, attribute, value) per term; None for any other
    formula. Dividing one factor of every term by tp (the head count) divides the whole."""
    kind = expr[0]
    if kind == "attr":
        return [((expr[1], expr[2], expr[3]),)]
    if kind == "+":
        left, right = product_terms(expr[1]), product_terms(expr[2])
        return None if left is None or right is None else left + right
    if kind == "*":
        for const, other in ((expr[1], expr[2]), (expr[2], expr[1])):
            if const[0] == "const" and const[1] > 0:
                return product_terms(other)
        left, right = product_terms(expr[1]), product_terms(expr[2])
        if left is None or right is None:
            return None
        # ((n_head + n_kv) * head_dim): each term of one side times each of the other
        return [a + b for a in left for b in right]
    return None


def shrinks_with_width(expr: Expr, width: int, want: int) -> bool:
    """Whether a formula holding the split features' width as read off their tensor
    (`qkv.shape[-1] // (self.groups + 2)`, the width a constant equal to `width`) gives
    `want` / tp on a shard, whose width is `width` / tp, at each tp up to 8 that divides
    both, with its attributes as read (there must be one such tp)."""
    tps = [tp for tp in range(2, 9) if width % tp == 0 and want % tp == 0]
    return bool(tps) and all(
        evaluate(expr, {}, width=(width, width // tp)) == want // tp for tp in tps
    )


def kept_by_dividing(expr: Expr) -> bool:
    """Whether a formula of two or more attributes keeps its value when every attribute it
    reads is divided by tp, at each tp up to 8 that divides them all (there must be one):
    a ratio of head counts (`self.num_heads // self.num_kv_heads + 2`, Falcon's q heads per
    key/value head and its k and v) is the same on every rank once both counts are."""
    reads = values_read(expr)
    if len(reads) < 2 or expr[0] == "attr":
        return False
    want = evaluate(expr, {})
    tps = [tp for tp in range(2, 9) if all(v % tp == 0 for v in reads.values())]
    return bool(tps) and all(
        evaluate(expr, {read: v // tp for read, v in reads.items()}) == want for tp in tps
    )


def attributes_in(expr: Expr) -> set[tuple[str, str]]:
    """(module, attribute) of every attribute the formula reads."""
    return set(values_read(expr))


def evaluate(
    expr: Expr,
    values: Mapping[tuple[str, str], int],
    *,
    width: tuple[int, int] | None = None,
) -> int | None:
    """The formula with these values of (module, attribute) (the others as read); None where
    it divides by zero. `width`: (the split features' width as read off their tensor, a
    rank's), for a formula holding that width (a constant equal to it), read as the rank's."""
    kind = expr[0]
    if kind == "const":
        return width[1] if width is not None and expr[1] == width[0] else int(expr[1])
    if kind == "attr":
        return values.get((expr[1], expr[2]), expr[3])
    left = evaluate(expr[1], values, width=width)
    right = evaluate(expr[2], values, width=width)
    if left is None or right is None or (kind in ("//", "%") and right == 0):
        return None
    return _OPS[kind](left, right)


def render(expr: Expr) -> str:
    """The formula as the model's code might write it (`n_head // n_kv`)."""
    kind = expr[0]
    if kind == "const":
        return str(expr[1])
    if kind == "attr":
        return str(expr[2])
    return f"{_inner(expr[1])} {kind} {_inner(expr[2])}"


def _inner(expr: Expr) -> str:
    text = render(expr)
    return f"({text})" if expr[0] not in ("attr", "const") else text
