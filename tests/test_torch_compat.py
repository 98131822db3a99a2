"""torch's private names, as tpplan uses them (tpplan/_runtime/torch_compat.py).

One test per name torch_compat exposes, each checking what tpplan relies on (the class, the
parameters it passes, the context manager it enters), so that a torch which renames or
changes one fails here, naming it, before any pipeline test fails somewhere downstream.
`nox -s torch_next` runs this file first against the newest torch release. And one test
that reads tpplan/ with `ast`: no module but torch_compat.py reaches a private torch name.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from tpplan._runtime import torch_compat as tc

PACKAGE = Path(__file__).resolve().parents[1] / "tpplan"
COMPAT = PACKAGE / "_runtime" / "torch_compat.py"


# ---- nothing else reaches a private torch name ----------------------------------------------
def _private(path: str) -> bool:
    return any(p.startswith("_") and not p.endswith("__") for p in path.split("."))


def _torch_bindings(tree: ast.Module) -> dict[str, str]:
    """Local name -> what it stands for: torch (or a torch module or name) imported anywhere
    in the file, lazy imports included, and names taken from torch_compat (a private
    attribute reached through one of ours is still torch's)."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    bound[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.module:
            if not node.level and node.module.split(".")[0] == "torch":
                for a in node.names:
                    bound[a.asname or a.name] = f"{node.module}.{a.name}"
            elif node.module.endswith("torch_compat"):
                for a in node.names:
                    bound[a.asname or a.name] = f"torch_compat.{a.name}"
    return bound


def private_torch_names(path: Path) -> list[str]:
    """'line: name' for each import of, or attribute chain reaching, a torch name with a
    `_` part (not a dunder)."""
    tree = ast.parse(path.read_text())
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: {a.name}" for a in node.names if _private(a.name)]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
            found += [
                f"{node.lineno}: {n}" for n in names if n.startswith("torch.") and _private(n)
            ]
    bound = _torch_bindings(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain: list[str] = []
        cur: ast.expr = node
        while isinstance(cur, ast.Attribute):
            chain.append(cur.attr)
            cur = cur.value
        if isinstance(cur, ast.Name) and cur.id in bound and not _private(bound[cur.id]):
            full = ".".join([bound[cur.id], *reversed(chain)])
            if _private(full):
                found.append(f"{node.lineno}: {full}")
    return sorted(set(found))


@pytest.mark.unit
def test_the_search_finds_each_kind_of_private_name(tmp_path: Path) -> None:
    """The search itself, on one line of each kind it must catch and of each it lets by."""
    caught = [
        "from torch.utils import _pytree",
        "from torch.distributed.tensor.placement_types import _StridedShard",
        "import torch.distributed._functional_collectives as funcol",
        "import torch.nn.functional as F\nF._canonical_mask",
        "from torch import nn\nnn.modules.conv._ConvNd",
        "import torch\ntorch.ops._c10d_functional.wait_tensor",
        "from torch.distributed.tensor import DTensor\nDTensor._op_dispatcher",
        "def f():\n    from torch._dynamo import mark_static_address",
        "from .._runtime.torch_compat import create_fake_backend\ncreate_fake_backend._x",
    ]
    let_by = [
        "import torch\ntorch.__version__",
        "from torch import nn\nnn.Linear",
        "from .local_run import _rank",
        "def f(self):\n    self._prepare_output_fn",
        "from .._runtime.torch_compat import StridedShard\nStridedShard(0, split_factor=2)",
    ]
    for i, code in enumerate(caught + let_by):
        path = tmp_path / f"m{i}.py"
        path.write_text(code + "\n")
        assert bool(private_torch_names(path)) == (code in caught), code


@pytest.mark.unit
def test_only_torch_compat_reaches_private_torch_names() -> None:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 20 and COMPAT in modules
    wrong = [
        f"{path.relative_to(PACKAGE.parent)}:{hit}"
        for path in modules
        if path != COMPAT
        for hit in private_torch_names(path)
    ]
    assert not wrong, (
        "take these from tpplan/_runtime/torch_compat.py (add them there, with a test here):\n"
        + "\n".join(wrong)
    )


def test_importing_torch_compat_leaves_the_heavy_parts_unloaded() -> None:
    """As cheap as `import torch`: DTensor, the simulated ranks, dynamo, inductor and
    torch.testing load on first use, so _runtime/ and trace/ stay as light as before. The
    one test here outside the unit tier: it imports torch afresh in a new interpreter (3 s)."""
    heavy = [
        "torch.distributed.tensor",
        "torch.distributed._local_tensor",
        "torch._dynamo",
        "torch._inductor",
        "torch.testing._internal.distributed.fake_pg",
    ]
    code = (
        "import sys; import tpplan._runtime.torch_compat; "
        f"print([m for m in {heavy!r} if m in sys.modules])"
    )
    # run from the checkout, whose tpplan then comes first on the path (`-c` puts cwd there)
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=PACKAGE.parent
    ).stdout
    assert out.strip() == "[]", out


# ---- one check per name ---------------------------------------------------------------------
CHECKS: dict[str, Callable[[], None]] = {}


def holds(*names: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Register `check` as what tpplan relies on of each of `names`."""

    def register(check: Callable[[], None]) -> Callable[[], None]:
        for name in names:
            CHECKS[name] = check
        return check

    return register


def _parameters(f: Callable[..., object]) -> list[str]:
    return list(inspect.signature(f).parameters)


@pytest.mark.unit
def test_every_name_has_a_check() -> None:
    assert sorted(CHECKS) == sorted(tc.__all__)


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(tc.__all__))
def test_name_holds(name: str) -> None:
    """The name resolves (a lazy one imports), and holds what tpplan relies on."""
    assert getattr(tc, name) is not None
    CHECKS[name]()


# fake tensors and dispatch modes
@holds("FakeTensorMode", "FakeTensor")
def _fake_tensors() -> None:
    assert isinstance(tc.FakeTensorMode, type) and isinstance(tc.FakeTensor, type)
    with tc.FakeTensorMode(allow_non_fake_inputs=True) as fake:
        t = fake.from_tensor(torch.ones(2, 3))
        assert isinstance(t, tc.FakeTensor) and (t @ torch.ones(3, 4)).shape == (2, 4)


@holds("unset_fake_temporarily")
def _unset_fake() -> None:
    with tc.FakeTensorMode():
        with tc.unset_fake_temporarily():
            real = torch.ones(2)
        assert not isinstance(real, tc.FakeTensor)


@holds("DataDependentOutputException", "DynamicOutputShapeException")
def _fake_limits() -> None:
    # check/blame.py and trace/run.py tell these from a plan's fault, also as a __cause__
    for kind in (tc.DataDependentOutputException, tc.DynamicOutputShapeException):
        assert issubclass(kind, Exception)
    with tc.FakeTensorMode(), pytest.raises(tc.DynamicOutputShapeException):
        torch.ones(3).nonzero()


@holds("UnsupportedOperatorException")
def _unsupported() -> None:
    assert issubclass(tc.UnsupportedOperatorException, Exception)


@holds("TorchDispatchMode")
def _dispatch_mode() -> None:
    class Seen(tc.TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Seen() as seen:
        _ = torch.ones(2) + 1
    assert "add" in seen.ops


@holds("disable_current_modes")
def _disable_modes() -> None:
    class Failing(tc.TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            raise AssertionError("the mode saw an op run under disable_current_modes")

    with Failing(), tc.disable_current_modes():
        _ = torch.ones(2) + 1


@holds("DisableTorchFunction")
def _disable_torch_function() -> None:
    class Seen(TorchFunctionMode):
        calls = 0

        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            Seen.calls += 1
            return func(*args, **(kwargs or {}))

    t = torch.ones(2)
    with Seen():
        with tc.DisableTorchFunction():
            t.view_as(t)  # infer/stream.py: a plain view the stream mode does not see
        assert Seen.calls == 0
        t.view_as(t)
    assert Seen.calls == 1


# nested inputs and outputs
@holds("decomposition")
def _decomposition() -> None:
    glu = tc.decomposition(torch.ops.aten.glu.default)
    x = torch.randn(2, 6)
    assert torch.allclose(glu(x, -1), torch.nn.functional.glu(x, -1))
    assert tc.decomposition(torch.ops.aten.topk.default) is None  # none for topk


@holds("tree_leaves")
def _tree_leaves() -> None:
    a, b = torch.ones(1), torch.ones(2)
    assert tc.tree_leaves(((a, [b]), {"k": 3})) == [a, b, 3]


@holds("tree_map")
def _tree_map() -> None:
    assert tc.tree_map(lambda x: x * 2, ((1, [2]), {"k": 3})) == ((2, [4]), {"k": 6})


@holds("tree_flatten", "tree_unflatten")
def _tree_flatten() -> None:
    tree = ((1, [2]), {"k": 3})
    leaves, spec = tc.tree_flatten(tree)
    assert leaves == [1, 2, 3] and tc.tree_unflatten(leaves, spec) == tree


# torch's own modules and ops
@holds("ConvNd")
def _conv() -> None:
    for kind in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
        assert issubclass(kind, tc.ConvNd)
    conv = nn.Conv1d(2, 4, 1)
    # what check/sizes.py, _runtime/facts.py and inputs.py read of one
    assert (conv.in_channels, conv.out_channels, conv.groups) == (2, 4, 1)
    assert conv.kernel_size == (1,) and conv.stride == (1,) and conv.padding == (0,)
    assert callable(type(conv)._conv_forward)  # facts.channel_conv compares it


@holds("mha_shape_check")
def _mha_shape_check() -> None:
    assert _parameters(tc.mha_shape_check) == [
        "query",
        "key",
        "value",
        "key_padding_mask",
        "attn_mask",
        "num_heads",
    ]
    x = torch.ones(3, 2, 4)  # (L, N, E)
    assert tc.mha_shape_check(x, x, x, None, None, 2) is True


@holds("canonical_mask")
def _canonical_mask() -> None:
    assert {"mask", "mask_name", "other_type", "other_name", "target_type", "check_other"} <= set(
        _parameters(tc.canonical_mask)
    )
    mask = tc.canonical_mask(
        mask=torch.tensor([True, False]),
        mask_name="key_padding_mask",
        other_type=None,
        other_name="",
        target_type=torch.float32,
        check_other=False,
    )
    assert mask is not None and mask.dtype == torch.float32


@holds("none_or_dtype")
def _none_or_dtype() -> None:
    assert tc.none_or_dtype(None) is None
    assert tc.none_or_dtype(torch.ones(1, dtype=torch.bfloat16)) == torch.bfloat16


@holds("grouped_mm")
def _grouped_mm() -> None:
    # trace/trackers/experts.py knows the op by this name
    assert tc.grouped_mm.overloadpacket.__name__ == "_grouped_mm"
    assert [a.name for a in tc.grouped_mm._schema.arguments][:2] == ["self", "mat2"]


# collectives
def _arguments(packet: Any) -> list[str]:
    return [a.name for a in packet.default._schema.arguments]


@holds("all_reduce_op")
def _all_reduce_op() -> None:
    assert _arguments(tc.all_reduce_op) == ["input", "reduce_op", "group_name"]
    # diagnose/stats.py counts collectives by this namespace
    assert tc.all_reduce_op.default.namespace == "_c10d_functional"


@holds("all_gather_op")
def _all_gather_op() -> None:
    assert _arguments(tc.all_gather_op) == ["input", "group_size", "group_name"]


@holds("reduce_scatter_op")
def _reduce_scatter_op() -> None:
    # compile/own_rows.py: a fused layer's working rows' gradient back to its Shard
    assert _arguments(tc.reduce_scatter_op) == ["input", "reduce_op", "group_size", "group_name"]


@holds("wait_tensor_op")
def _wait_tensor_op() -> None:
    assert _arguments(tc.wait_tensor_op) == ["tensor"]


@holds("funcol_all_reduce")
def _funcol_all_reduce() -> None:
    assert _parameters(tc.funcol_all_reduce)[:3] == ["self", "reduceOp", "group"]


@holds("funcol_all_gather")
def _funcol_all_gather() -> None:
    assert _parameters(tc.funcol_all_gather)[:3] == ["self", "gather_dim", "group"]


@holds("funcol_wait_tensor")
def _funcol_wait_tensor() -> None:
    assert len(_parameters(tc.funcol_wait_tensor)) == 1


@holds("resolve_group_name")
def _resolve_group_name() -> None:
    assert _parameters(tc.resolve_group_name)[0] == "group"


# fake process groups and simulated ranks
@holds("create_fake_backend", "register_process_group", "unregister_process_group")
def _fake_group() -> None:
    """What _runtime/local.py's solo_fake_mesh does: a fake backend of (rank, size) on a
    ProcessGroup of our own, registered by name and unregistered."""
    backend = tc.create_fake_backend(0, 2)
    group = dist.ProcessGroup(dist.HashStore(), 0, 2)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, backend)
    name = "tpplan-test-torch-compat"
    tc.unregister_process_group(name)  # unregistering an unknown name is allowed
    tc.register_process_group(name, group)
    tc.unregister_process_group(name)


@holds("fake_store")
def _fake_store() -> None:
    assert isinstance(tc.fake_store(), dist.Store)


@holds("LocalTensorMode", "local_tensor_mode")
def _local_tensor_mode() -> None:
    assert tc.local_tensor_mode() is None
    with tc.LocalTensorMode(2) as mode:
        assert tc.local_tensor_mode() is mode
        with mode.disable():  # _runtime/ranks.py's each_rank
            pass
    assert tc.local_tensor_mode() is None


@holds("LocalIntNode")
def _local_int_node() -> None:
    # compile/uneven_heads.py: an int of each simulated rank's own, which shapes follow, and
    # the mesh coordinate's node holding each rank's value by global rank
    n = torch.SymInt(tc.LocalIntNode({0: 4, 1: 3}))
    with tc.LocalTensorMode(2) as mode:
        x = mode.rank_map(lambda r: torch.zeros(4 - r, 2))
        assert x.shape[0].node._local_ints == n.node._local_ints == {0: 4, 1: 3}
        assert x.reshape(n, 2).shape[0].node._local_ints == {0: 4, 1: 3}


@holds("LocalTensor")
def _local_tensor() -> None:
    t = tc.LocalTensor({0: torch.zeros(2), 1: torch.ones(2)})
    assert isinstance(t, torch.Tensor)
    assert sorted(t._local_tensors) == [0, 1]  # _runtime/local.py reads each rank's value


@holds("maybe_disable_local_tensor_mode")
def _maybe_disable() -> None:
    with tc.maybe_disable_local_tensor_mode():  # a no-op outside the mode
        pass
    with tc.LocalTensorMode(2), tc.maybe_disable_local_tensor_mode():
        pass


# DTensor's sharding propagation and placements
@holds("StridedShard")
def _strided_shard() -> None:
    from torch.distributed.tensor import Placement

    p = tc.StridedShard(1, split_factor=3)
    assert isinstance(p, Placement) and (p.dim, p.split_factor) == (1, 3)
    assert p == tc.StridedShard(1, split_factor=3) != tc.StridedShard(1, split_factor=2)


@holds("DTensorSpec")
def _dtensor_spec() -> None:
    assert _parameters(tc.DTensorSpec)[:3] == ["mesh", "placements", "tensor_meta"]


@holds("OpSchema")
def _op_schema() -> None:
    assert _parameters(tc.OpSchema)[:4] == ["op", "args_schema", "kwargs_schema", "schema_info"]


@holds("OpSpec")
def _op_spec() -> None:
    assert _parameters(tc.OpSpec)[:3] == ["output_specs", "input_specs", "redistribute_cost"]


@holds("RuntimeSchemaInfo")
def _runtime_schema_info() -> None:
    assert tc.RuntimeSchemaInfo(1).static_argnum == 1
    assert tc.RuntimeSchemaInfo(1, needs_pytree=True).needs_pytree


@holds("generate_redistribute_costs")
def _redistribute_costs() -> None:
    assert _parameters(tc.generate_redistribute_costs) == ["src_strategy", "dst_spec"]


@holds("normalize_dim")
def _normalize_dim() -> None:
    assert tc.normalize_dim(-1, 3) == 2 and tc.normalize_dim(1, 3) == 1


@holds("sharding_propagator")
def _sharding_propagator() -> None:
    aten = torch.ops.aten
    found = tc.sharding_propagator()
    for op in (aten.split.Tensor, aten.split_with_sizes.default, aten.cat.default):
        assert callable(found.op_strategy_funcs[op])
    assert isinstance(found.op_to_scalar_shape_adjuster, dict)
    assert _parameters(found.register_op_strategy)[:3] == [
        "op_overload",
        "strategy_func",
        "schema_info",
    ]


@holds("rowwise_prepare_output")
def _rowwise_prepare_output() -> None:
    from torch.distributed.tensor.parallel import RowwiseParallel

    assert _parameters(RowwiseParallel._prepare_output_fn) == [
        "output_layouts",
        "use_local_output",
        "mod",
        "outputs",
        "device_mesh",
    ]


@holds("dtensor_rng_tracker", "set_dtensor_rng_tracker")
def _rng_tracker() -> None:
    saved = tc.dtensor_rng_tracker()
    marker = object()
    try:
        tc.set_dtensor_rng_tracker(marker)
        assert tc.dtensor_rng_tracker() is marker
    finally:
        tc.set_dtensor_rng_tracker(saved)


# debugging and compiling
@holds("comm_mode_module_tracker")
def _comm_mode_tracker() -> None:
    from torch.distributed.tensor.debug import CommDebugMode

    tracker = tc.comm_mode_module_tracker()
    assert isinstance(tracker, type)
    # what check/run.py's subclass overrides and reads
    assert callable(tracker._fw_pre_hook) and callable(tracker._get_mod_name)
    assert isinstance(tracker().register_forward_hook_handles, dict)
    assert isinstance(CommDebugMode().advanced_module_tracker, tracker)


@holds("root_mesh_dims")
def _root_mesh_dims() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from tpplan._runtime.local import fake_ranks

    with fake_ranks(4) as flat:
        assert tc.root_mesh_dims(flat) == 1
        grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        assert tc.root_mesh_dims(grid["tp"]) == 2  # compile/own_rows.py: FSDP2 beside tp


@holds("mark_static_address")
def _mark_static_address() -> None:
    t = torch.ones(2)
    tc.mark_static_address(t)
    # compile/local_run.py marks a local weight once: it looks for this attribute
    assert hasattr(t, "_dynamo_static_input_type")


@holds("inductor_mode_options")
def _inductor_mode_options() -> None:
    assert tc.inductor_mode_options("reduce-overhead", None) == {"triton.cudagraphs": True}
    assert tc.inductor_mode_options("max-autotune", None)["max_autotune"] is True
