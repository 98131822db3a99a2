"""What fake tensors cannot run, whatever the plan (an op that reads values, one whose output
shape depends on them, a kernel with no fake implementation), stops check's dry run with a
note, "could not dry-run <module>: <op>", and never with a problem on a rule (issue 33)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from support.fake_limits import (
    FUSED_PLAN,
    PLAN,
    Sandwich,
    fused,
    no_fake_kernel,
    nonzero,
    value_read,
)
from torch._subclasses.fake_tensor import DataDependentOutputException

from tpplan import check_plan
from tpplan.check.blame import fake_limit
from tpplan.errors import DryRunSkipped

pytestmark = pytest.mark.unit

CASES: dict[str, tuple[Callable[[], Sandwich], str]] = {
    "value_read": (
        value_read,
        "could not dry-run mid (_ReadsValue): aten._local_scalar_dense.default reads a "
        "tensor's values, which fake tensors do not have.",
    ),
    "nonzero": (
        nonzero,
        "could not dry-run mid (_Nonzero): aten.nonzero.default makes a tensor whose shape "
        "depends on the values.",
    ),
    "no_fake_kernel": (
        no_fake_kernel,
        "could not dry-run mid (_NoFakeKernel): RuntimeError: There was no fake impl "
        "registered for <CustomOpDef(tpplan_tests::scaled)> (no kernel for fake tensors).",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_what_fake_tensors_cannot_run_even_unsharded_is_left_to_the_static_checks(
    case: str,
) -> None:
    """A model that does not run on fake tensors even unsharded: no dry run can judge the
    plan, so the static checks stand alone, with no note (every apply of a model routing by
    values would carry one). The limit is still found (`fake_limit`, below)."""
    build, _ = CASES[case]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert check_plan(PLAN, build(), tp_size=2) == []
    assert not [w for w in caught if issubclass(w.category, DryRunSkipped)]


def test_a_fused_layer_gathered_after_it_dry_runs_to_the_end() -> None:
    """DiffLlama's v_proj and Mamba's in_proj: two equal pieces, output replicate. torch's
    own gather of such pieces reads values on fake tensors (torch 2.13); tpplan gathers them
    by a fixed permutation instead (compile/strided.py), so the dry run goes through."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert check_plan(FUSED_PLAN, fused(), tp_size=2) == []
    assert not [w for w in caught if issubclass(w.category, DryRunSkipped)]


def test_a_fake_tensor_limit_is_found_behind_the_error_it_caused() -> None:
    op = torch.ops.aten._local_scalar_dense.default
    try:
        try:
            raise DataDependentOutputException(op)
        except DataDependentOutputException as e:
            raise RuntimeError("the model's own wrapper") from e
    except RuntimeError as outer:
        found = fake_limit(outer)
    assert found == f"{op} reads a tensor's values, which fake tensors do not have"


def test_an_op_dtensor_cannot_shard_is_still_the_plan_s_problem() -> None:
    """DTensor's NotImplementedError is about the layout the plan gave, not fake tensors."""
    error = NotImplementedError(
        "Operator aten.cumsum.default does not have a sharding strategy registered."
    )
    assert fake_limit(error) is None


def test_routing_by_torch_where_runs_bounded_where_only_shapes_matter() -> None:
    """Runs that count collectives or follow which layer reads what (the DTensor regions'
    proof) give `nonzero` as many indices as the mask has entries, the most it could; the
    dry run's verdict keeps torch's refusal above."""
    from tpplan._runtime.torch_compat import DynamicOutputShapeException, FakeTensorMode
    from tpplan.check.blame import MetaKernels

    with FakeTensorMode() as fake:
        chosen = fake.from_tensor(torch.zeros(6, 2, dtype=torch.long))
        with MetaKernels(bounded_nonzero=True):
            token, slot = torch.where(chosen == 1)
        assert token.shape == slot.shape == (12,) and token.dtype == torch.long
        with pytest.raises(DynamicOutputShapeException), MetaKernels():
            torch.where(chosen == 1)
