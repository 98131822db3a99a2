"""Every private torch name tpplan uses, in this one module, so a torch upgrade fails here
first (tests/test_torch_compat.py names the one that moved) and is mended here only.

Nothing else in tpplan imports or reaches a torch name with a `_` part (a test reads the
package with `ast` to keep it so). Each name is ours under a public name, or its own, with
what tpplan uses it for and the torch it is known to hold since: "2.13" is the release the
project is tested against (and the only one where nothing older is known); "2.5+" names the
release torch's history shows it in, untested here.

Three kinds, by what they cost to import:
- names that `import torch` loads anyway: imported here at the top;
- DTensor's private pieces, which need `torch.distributed.tensor` (seconds, and nothing
  below compile/ imports it): resolved on first use, like tpplan's own top-level names
  (a module `__getattr__`; mypy reads them from the `TYPE_CHECKING` block);
- the heavy or optional ones (torch._dynamo, torch._inductor, torch.testing._internal, the
  comm-mode tracker): functions that import on call.

Start at the groups below; local.py and ranks.py show how the simulated ranks use them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch._C._distributed_c10d import (
    FakeProcessGroup,
    _register_process_group,
    _unregister_process_group,
)
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
    unset_fake_temporarily,
)
from torch.nn.modules.conv import _ConvNd
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

if TYPE_CHECKING:
    from torch.distributed._functional_collectives import (
        _resolve_group_name as resolve_group_name,
    )
    from torch.distributed._functional_collectives import all_gather_single as funcol_all_gather
    from torch.distributed._functional_collectives import all_reduce as funcol_all_reduce
    from torch.distributed._functional_collectives import wait_tensor as funcol_wait_tensor
    from torch.distributed._local_tensor import (
        LocalIntNode,
        LocalTensor,
        LocalTensorMode,
        local_tensor_mode,
        maybe_disable_local_tensor_mode,
    )
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import generate_redistribute_costs, normalize_dim
    from torch.distributed.tensor.placement_types import _StridedShard as StridedShard

# grouped by what they are for in the sections below
__all__ = [
    "ConvNd",
    "DTensorSpec",
    "DataDependentOutputException",
    "DisableTorchFunction",
    "DynamicOutputShapeException",
    "FakeTensor",
    "FakeTensorMode",
    "LocalIntNode",
    "LocalTensor",
    "LocalTensorMode",
    "OpSchema",
    "OpSpec",
    "RuntimeSchemaInfo",
    "StridedShard",
    "TorchDispatchMode",
    "UnsupportedOperatorException",
    "all_gather_op",
    "all_reduce_op",
    "canonical_mask",
    "comm_mode_module_tracker",
    "create_fake_backend",
    "decomposition",
    "disable_current_modes",
    "dtensor_rng_tracker",
    "fake_store",
    "funcol_all_gather",
    "funcol_all_reduce",
    "funcol_wait_tensor",
    "generate_redistribute_costs",
    "grouped_mm",
    "inductor_mode_options",
    "local_tensor_mode",
    "mark_static_address",
    "maybe_disable_local_tensor_mode",
    "mha_shape_check",
    "none_or_dtype",
    "normalize_dim",
    "reduce_scatter_op",
    "register_process_group",
    "resolve_group_name",
    "root_mesh_dims",
    "rowwise_prepare_output",
    "set_dtensor_rng_tracker",
    "sharding_propagator",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
    "unregister_process_group",
    "unset_fake_temporarily",
    "wait_tensor_op",
]

# ---- fake tensors and dispatch modes (loaded with torch) -----------------------------------
# FakeTensorMode / FakeTensor: the tracer, the dry run and the probes run models on fake
# tensors (shapes only); 2.0+. unset_fake_temporarily: shared_heads.py makes a real tensor
# inside a fake run; 2.1+. The three exceptions: what a fake run cannot answer (blame.py
# tells them from a plan's fault); 2.0+. (All imported above.)
# TorchDispatchMode: the tracer's, the probes' and plan_stats' op hooks subclass it; 2.0+.
# disable_current_modes: trace/whole.py runs an op for real under the tracer's mode; 2.0+.
disable_current_modes = _disable_current_modes
# DisableTorchFunction: infer/stream.py makes a plain view of a tensor the stream mode must
# not see; 2.0+.
DisableTorchFunction = torch._C.DisableTorchFunction

# ---- nested inputs and outputs (loaded with torch) ------------------------------------------
# tree_leaves / tree_map / tree_flatten / tree_unflatten: the tensors inside an op's or a
# module's arguments and outputs (imported above); 2.1+.

# ---- torch's own modules and ops (loaded with torch) ----------------------------------------
# ConvNd: the base of nn.Conv1d/2d/3d, for "is this a convolution" and its channel sizes; 1.0+.
ConvNd = _ConvNd
# mha_shape_check / canonical_mask / none_or_dtype: compile/attention.py runs
# nn.MultiheadAttention's forward on a rank's heads with torch's own input checks; 2.0+.
mha_shape_check = F._mha_shape_check  # type: ignore[attr-defined]
canonical_mask = F._canonical_mask
none_or_dtype = F._none_or_dtype
# grouped_mm: the grouped matmul of mixture-of-experts layers, whose meta kernel takes bf16
# only (trace/ops.py asks it in bf16); 2.8+.
grouped_mm = torch.ops.aten._grouped_mm.default

# decomposition(op): torch's own decomposition of an aten op into simpler ones (its Python
# reference, `torch._decomp.decomposition_table`), None where it has none: the tracer
# follows a split through an op it has no rule for by the ops it decomposes into; 2.0+.


def decomposition(op: Any) -> Any:
    """torch's decomposition of the aten op `op` into simpler aten ops, or None."""
    from torch._decomp import decomposition_table

    return decomposition_table.get(op)


# ---- collectives ----------------------------------------------------------------------------
# all_reduce_op / all_gather_op / wait_tensor_op: torch's functional collective ops
# themselves, which a decode step calls without funcol's per-call tensor subclass
# (compile/local_run.py); registered with torch; 2.13.
all_reduce_op = torch.ops._c10d_functional.all_reduce
all_gather_op = torch.ops._c10d_functional.all_gather_into_tensor
# reduce_scatter_op: a fused layer's working rows' gradient back to its Shard (own_rows.py)
reduce_scatter_op = torch.ops._c10d_functional.reduce_scatter_tensor
wait_tensor_op = torch.ops._c10d_functional.wait_tensor
# funcol_all_reduce / funcol_all_gather / funcol_wait_tensor: a gradient summed or averaged
# over the ranks, a tensor gathered for a guard (apply/, compile/); resolve_group_name: the
# name those ops know a mesh's process group by. Lazy (DTensor's import); 2.13.

# ---- fake process groups and simulated ranks ------------------------------------------------
# register_process_group / unregister_process_group: a fake group of tpplan's own beside the
# user's (_runtime/local.py's solo_fake_mesh); 2.13.
register_process_group = _register_process_group
unregister_process_group = _unregister_process_group
# create_fake_backend(rank, size): the fake backend of that group; 2.13.
create_fake_backend = FakeProcessGroup._create_internal
# LocalTensor / LocalTensorMode / local_tensor_mode / maybe_disable_local_tensor_mode: every
# rank in one process with real numbers (_runtime/local.py, ranks.py). LocalIntNode: an int
# of each simulated rank's own, a SymInt's node (compile/uneven_heads.py); the mesh's
# coordinate is one, `_local_ints` its values by global rank. Lazy; 2.13.


def fake_store() -> Any:
    """A store for a fake process group (`init_process_group("fake", store=...)`). Imported
    on call: torch.testing._internal needs the expecttest package; 2.1+."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


# ---- DTensor's sharding propagation and placements (lazy: DTensor's import) ----------------
# StridedShard: a fused weight (q|k|v) split piece by piece, each rank a slice of each
# piece; 2.5+. DTensorSpec / OpSchema / OpSpec / RuntimeSchemaInfo /
# generate_redistribute_costs / normalize_dim: compile/dtensor_ops.py adds sharding
# strategies beside torch's own (split and cat of such pieces); 2.13.


def sharding_propagator() -> Any:
    """DTensor's sharding propagator: its strategy table (`op_strategy_funcs`,
    `register_op_strategy`) and split-size adjusters (`op_to_scalar_shape_adjuster`),
    which compile/dtensor_ops.py extends; 2.13."""
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher.sharding_propagator


def rowwise_prepare_output(
    output_layouts: Any, use_local_output: bool, mod: torch.nn.Module, outputs: Any, mesh: Any
) -> Any:
    """RowwiseParallel's output step (its static `_prepare_output_fn`): compile/linear.py's
    rowwise layers with local shards end as torch's do; 2.13."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    return RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, mesh)


def dtensor_rng_tracker() -> Any:
    """DTensor's one random-number tracker of the process (None until a random op made
    one); check/run.py keeps it across a dry run on a fake mesh; 2.13."""
    from torch.distributed.tensor import _random

    return _random._rng_tracker


def set_dtensor_rng_tracker(tracker: Any) -> None:
    """Put back the tracker `dtensor_rng_tracker` returned; 2.13."""
    from torch.distributed.tensor import _random

    _random._rng_tracker = tracker


# ---- debugging and compiling (heavy: imported on call) -------------------------------------
def comm_mode_module_tracker() -> type[Any]:
    """CommDebugMode's module tracker class, which check/run.py subclasses to mend a module
    called twice in one forward (its `_fw_pre_hook`, `_get_mod_name` and
    `register_forward_hook_handles`). Imports torch._dynamo; 2.13."""
    from torch.distributed.tensor.debug._comm_mode import _CommModeModuleTracker

    return _CommModeModuleTracker


def root_mesh_dims(mesh: Any) -> int:
    """The dims of the mesh `mesh` was cut from (itself when it is no sub-mesh): a tp axis of
    a (dp, tp) mesh says 2 (compile/own_rows.py); 2.13."""
    return int(mesh._get_root_mesh().ndim)


def mark_static_address(t: torch.Tensor) -> None:
    """Tell torch.compile a local weight keeps its address (compile/local_run.py), unguarded;
    2.1+."""
    import torch._dynamo

    torch._dynamo.mark_static_address(t)


def inductor_mode_options(mode: str | None, dynamic: bool | None) -> dict[str, Any]:
    """The options torch.compile's `mode` stands for (apply/compiled.py passes them with a
    guard filter, which torch.compile takes only in `options`); 2.0+."""
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode, dynamic))


# name -> (module, attribute): the DTensor names above, imported on first use
_LAZY: dict[str, tuple[str, str]] = {
    "funcol_all_gather": ("torch.distributed._functional_collectives", "all_gather_single"),
    "funcol_all_reduce": ("torch.distributed._functional_collectives", "all_reduce"),
    "funcol_wait_tensor": ("torch.distributed._functional_collectives", "wait_tensor"),
    "resolve_group_name": ("torch.distributed._functional_collectives", "_resolve_group_name"),
    "LocalIntNode": ("torch.distributed._local_tensor", "LocalIntNode"),
    "LocalTensor": ("torch.distributed._local_tensor", "LocalTensor"),
    "LocalTensorMode": ("torch.distributed._local_tensor", "LocalTensorMode"),
    "local_tensor_mode": ("torch.distributed._local_tensor", "local_tensor_mode"),
    "maybe_disable_local_tensor_mode": (
        "torch.distributed._local_tensor",
        "maybe_disable_local_tensor_mode",
    ),
    "StridedShard": ("torch.distributed.tensor.placement_types", "_StridedShard"),
    "DTensorSpec": ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
    "OpSchema": ("torch.distributed.tensor._op_schema", "OpSchema"),
    "OpSpec": ("torch.distributed.tensor._op_schema", "OpSpec"),
    "RuntimeSchemaInfo": ("torch.distributed.tensor._op_schema", "RuntimeSchemaInfo"),
    "generate_redistribute_costs": (
        "torch.distributed.tensor._ops.utils",
        "generate_redistribute_costs",
    ),
    "normalize_dim": ("torch.distributed.tensor._ops.utils", "normalize_dim"),
}

if not TYPE_CHECKING:  # mypy reads the names from the TYPE_CHECKING imports above

    def __getattr__(name: str) -> Any:
        if name not in _LAZY:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value  # the next lookup finds it without coming here
        return value
