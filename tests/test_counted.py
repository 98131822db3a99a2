"""`Counted` (tpplan/trace/counted.py): the numbers a traced forward computes from integer
attributes remember their formula, so a repeat by `self.n_head // self.n_kv` is told from a
repeat by `self.n_kv`, however their values compare."""

from __future__ import annotations

import copy
import pickle

import pytest

from tpplan.trace.counted import Counted, attributes_in, evaluate, render

pytestmark = pytest.mark.unit


def _read(attr: str, value: int) -> Counted:
    return Counted.read("attn", attr, value)


def test_an_attribute_as_read_is_itself() -> None:
    n_kv = _read("n_kv", 2)
    assert n_kv == 2 and isinstance(n_kv, int) and n_kv.direct() == ("attn", "n_kv")


def test_arithmetic_keeps_the_formula_on_either_side() -> None:
    n_head, n_kv = _read("n_head", 4), _read("n_kv", 2)
    g = n_head // n_kv
    assert g == 2 and isinstance(g, Counted) and g.direct() is None
    assert render(g.expr) == "n_head // n_kv"
    assert attributes_in(g.expr) == {("attn", "n_head"), ("attn", "n_kv")}
    width = 2 * n_head + 1  # a plain number on the left
    assert width == 9 and render(width.expr) == "(2 * n_head) + 1"
    mixed = (n_head - n_kv) % 3
    assert mixed == 2 and render(mixed.expr) == "(n_head - n_kv) % 3"


def test_a_formula_evaluates_with_the_values_the_plan_gives() -> None:
    g = _read("n_head", 8) // _read("n_kv", 2)
    assert evaluate(g.expr, {}) == 4  # as read
    assert evaluate(g.expr, {("attn", "n_head"): 2, ("attn", "n_kv"): 1}) == 2  # at tp 4
    assert evaluate(g.expr, {("attn", "n_kv"): 0}) is None  # no division by zero


def test_anything_else_sees_the_plain_number() -> None:
    n = _read("n_head", 4)
    assert n / 2 == 2.0 and isinstance(n / 2, float)  # true division: no formula
    assert not isinstance(n * 1.5, Counted)
    assert list(range(n)) == [0, 1, 2, 3] and [0, 1, 2, 3, 4][n] == 4
    assert repr(n) == "4" and f"{n}" == "4" and hash(n) == hash(4)
    assert type(copy.deepcopy(n)) is int and type(pickle.loads(pickle.dumps(n))) is int
