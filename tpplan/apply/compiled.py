"""torch.compile of an applied model, without the guards its local-shard layers do not need.

torch.compile re-checks, before every call of the compiled model, what the graph was traced
under (its guards). For each DTensor parameter that includes a Python check of the
parameter's layout (its DTensorSpec), a few microseconds each, and one that its mesh is the
other parameters' mesh: over the 30 parameters of a small 4-layer model, 4% of a CPU
decode step, and more where a CUDA graph makes the step itself short. A layer that runs on
its local shards (compile/local_run.py) reads only the parameter's local tensor, whose own
guards (shape, dtype, device, strides) stay; its code never reads the layout or the mesh,
so those checks are dropped, and only those. Layers on
DTensors (regions) keep every guard. Start at `compile`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .._runtime.torch_compat import inductor_mode_options
from ..compile.local_run import runs_locally

__all__ = ["compile_model", "layout_guard_filter"]


def layout_guard_filter(model: nn.Module) -> Any:
    """A `guard_filter_fn` for torch.compile that drops the layout guards of the DTensor
    parameters of `model`'s layers that run on local shards, keeping every other guard."""
    suffixes = tuple(
        "".join(f"._modules['{part}']" for part in name.split(".") if name)
        + f"._parameters['{p_name}'].{layout}"
        for name, module in model.named_modules()
        if runs_locally(module)
        for p_name, p in module.named_parameters(recurse=False)
        if isinstance(p, DTensor)
        for layout in ("_spec", "device_mesh")
    )

    def keep(entries: list[Any]) -> list[bool]:
        return [not str(e.name).endswith(suffixes) for e in entries]

    return keep


def compile_model(
    model: nn.Module,
    *,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """`torch.compile(model, ...)` for a model `apply_plan` sharded: the same arguments,
    and the layout guards its local-shard layers do not need left out (`layout_guard_filter`).

    A `guard_filter_fn` of your own in `options` still applies (a guard is kept when both
    keep it). `mode` ("reduce-overhead" for CUDA graphs, "max-autotune", ...) is passed as
    the options it stands for, since torch.compile takes a guard filter only in `options`.

    Example::
        >>> model = tpplan.compile_model(tpplan.apply_plan(model, mesh), mode="reduce-overhead")
    """
    options = dict(options or {})
    if mode is not None:
        options = {**inductor_mode_options(mode, kwargs.get("dynamic")), **options}
    theirs = options.get("guard_filter_fn")
    ours = layout_guard_filter(model)

    def both(entries: list[Any]) -> list[bool]:
        mine = ours(entries)
        return (
            mine
            if theirs is None
            else [a and b for a, b in zip(mine, theirs(entries), strict=True)]
        )

    options["guard_filter_fn"] = both
    return torch.compile(model, options=options, **kwargs)
