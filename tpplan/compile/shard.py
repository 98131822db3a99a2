"""shard_model: a plan's styles and attribute fixes applied to a model, module by module.

What apply_plan does once the plan is checked, and what the dry run of `check` does on a
weightless copy; no check here. Start at `shard_model`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from .._runtime.facts import tied_groups
from ..errors import TpplanError
from ..plan.patterns import match_names, matches
from ..plan.schema import AttributeRule, Plan
from .adapters import fuse_adapters
from .local_regions import RegionNotes, run_locally
from .regions import hold_dtensors
from .rules import plan_to_torch
from .shared_heads import SharedHeadsColwise, head_replicas
from .uneven_heads import head_shares, own_share, own_value

__all__ = ["attribute_divisor", "own_attributes", "retie", "shard_model", "tied_holders"]


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: Plan,
    *,
    on_module: Callable[[str], None] | None = None,
    local_shards: bool = True,
    notes: dict[type, RegionNotes] | None = None,
    record: dict[type, RegionNotes] | None = None,
) -> None:
    """Apply a checked plan's styles, attribute fixes and DTensor regions to `model` in
    place, no check.

    `on_module` is told each module's name before its style is applied (the dry run names
    the module a failure came from). Styles are applied one module at a time, which is what
    parallelize_module does with a dict of full names. `local_shards`: as `plan_to_torch`.

    `notes` ({region module class: what its proof found}, check/run.py): with it, a region
    module whose class the proof found local runs on local shards (local_regions.py) and its
    opening layers hand on plain tensors; the others run on DTensors. Without it, regions
    run on DTensors. `record`: the proof run, which fills it in as its regions run.
    """
    names = [n for n, _ in model.named_modules()]
    regions = [n for region in plan.regions for n in match_names(region.match, names)]
    streams = {n for r in plan.regions if r.stream for n in match_names(r.match, names)}
    # at tp 1 a rank's shard is the whole tensor: a region's code runs as it is, unproven
    whole = mesh.size() == 1 and notes is not None
    local = [n for n in regions if whole or _local_notes(notes, model.get_submodule(n))]
    if local:
        plan = _opened_locally(plan, names, local)
    tied = tied_holders(model)
    styles = plan_to_torch(plan, model, local_shards=local_shards)
    _in_local_regions(styles, local)
    for name, style in styles.items():
        if on_module is not None:
            on_module(name)
        parallelize_module(model, mesh, {name: style})
    retie(tied)
    # after every style: a LoRA wrapper's forward folds its adapters into its base's collective
    fuse_adapters(model, mesh, styles, local_shards=local_shards)
    _divide_attributes(plan, model, mesh)
    for name in regions:
        module = model.get_submodule(name)
        found = _local_notes(notes, module)
        # what `tpplan stats` reports
        how = "local shards" if found or whole else f"DTensor: {_why_dtensor(notes, module)}"
        module.__dict__["_tpplan_region"] = how
        if whole:
            continue
        if found is not None:
            run_locally(module, found, mesh, name)
        elif record is not None:
            notes_ = record.setdefault(type(module), RegionNotes())
            hold_dtensors(module, notes=notes_, mesh=mesh, stream=name in streams)
        else:
            hold_dtensors(module, stream=name in streams)


def _local_notes(notes: dict[type, RegionNotes] | None, module: nn.Module) -> RegionNotes | None:
    """The proof's notes of `module`'s class where they let it run on local shards."""
    found = None if notes is None else notes.get(type(module))
    if found is None or not found.ran or found.refused is not None:
        return None
    return found


def _why_dtensor(notes: dict[type, RegionNotes] | None, module: nn.Module) -> str:
    """Why a region module runs on DTensors rather than local shards."""
    if notes is None:
        return "a DTensor region (regions on local shards were not asked for: local_shards=False)"
    found = notes.get(type(module))
    if found is None or not found.ran:
        return "a DTensor region: its proof on fake ranks could not run it"
    return f"a DTensor region, not run on local shards: {found.refused}"


def _in_local_regions(styles: dict[str, Any], local: list[str]) -> None:
    """Layers sharing whole heads inside regions on local shards hand on plain tensors where
    tp divides their heads (a plain colwise's local output), as `_opened_locally` makes the
    other layers there do."""
    inside = tuple(f"{n}." for n in local)
    for name, style in styles.items():
        if isinstance(style, SharedHeadsColwise) and name.startswith(inside):
            style.in_local_region = True


def _opened_locally(plan: Plan, names: list[str], local: list[str]) -> Plan:
    """The plan with `local_output: false` dropped from rules whose every module lies inside
    a region that runs on local shards: their outputs are the local tensors it computes on."""
    inside = tuple(f"{n}." for n in local)
    rules = []
    for rule in plan.rules:
        matched = match_names(rule.match, names)
        # a layer sharing whole heads keeps handing the code the whole width (its style
        # is told the region runs locally: `_in_local_regions`)
        if (
            rule.hands_dtensors()
            and not rule.shares_heads()
            and matched
            and all(m.startswith(inside) for m in matched)
        ):
            rule = rule.model_copy(update={"local_output": None})
        rules.append(rule)
    return plan.model_copy(update={"rules": rules})


def tied_holders(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, parameter name) that share one parameter (tied weights)."""
    return [[(model.get_submodule(m), p) for m, p in group] for group in tied_groups(model)]


def retie(tied: list[list[tuple[nn.Module, str]]]) -> None:
    """Each group of holders (`tied_holders`, taken before) shares one parameter again.

    parallelize_module distributes each module's parameters on its own, and `to_empty`
    makes a tensor per holder, so a tied weight comes out as one copy per holder; check_plan
    made sure they are split alike, so the first copy serves them all again."""
    for group in tied:
        now = [module._parameters[name] for module, name in group]
        # a holder no style touched (a module keeping a reference) takes the split copy
        shared = next((p for p in now if isinstance(p, DTensor)), now[0])
        for module, name in group:
            module.register_parameter(name, shared)


def _divide_attributes(plan: Plan, model: nn.Module, mesh: DeviceMesh) -> None:
    """Each rank now holds 1/tp of the heads, so reshapes by stored counts use the local count
    (with `by: replicas` or `shards`, counts of heads that tp/heads ranks share; with
    `uneven`, each rank's own count of heads split unevenly)."""
    modules = dict(model.named_modules())
    tp_size = mesh.size()
    for rule in plan.attributes:
        for name in match_names(rule.match, list(modules)):
            if rule.uneven is not None:
                for attr in rule.divide:
                    holder, own = _holder(modules[name], attr)
                    values = own_attributes(
                        plan, model, rule, name, attr, tp_size, getattr(holder, own)
                    )
                    _set_own(holder, own, own_value(mesh, values), f"{name}.{attr}")
                continue
            by = attribute_divisor(plan, model, rule, name, tp_size)
            for attr in rule.divide:
                holder, own = _holder(modules[name], attr)
                setattr(holder, own, getattr(holder, own) // by)


def _set_own(holder: Any, attr: str, value: Any, where: str) -> None:
    """Set a rank's own value; on simulated ranks (a SymInt of each rank's own) an object
    that takes only ints (a transformers config validating its fields) cannot hold it."""
    try:
        setattr(holder, attr, value)
    except Exception as e:  # a validating setter raises an error type of its own
        if isinstance(value, int):
            raise
        raise TpplanError(
            f"{where} takes each rank's own value of heads split unevenly, which one process "
            f"running every rank holds as a SymInt, and {type(holder).__name__} takes ints "
            "only. Run it on real ranks (torchrun; tpplan verify --processes)."
        ) from e


def own_attributes(
    plan: Plan, model: nn.Module, rule: AttributeRule, name: str, attr: str, tp: int, value: int
) -> list[int]:
    """Per rank, its own value of attribute `attr` (`value` on the whole model) of module `name`
    whose rule names the query layer of heads split unevenly (`uneven`): by tp its share
    of the query heads, by shards of the key/value heads, by replicas the query heads each
    of its key/value heads serves on it. A TpplanError where one is no whole number."""
    assert rule.uneven is not None
    layer = f"{name}.{rule.uneven}"
    found = next(
        (r for r in plan.rules if r.uneven_group() is not None and matches(r.match, layer)), None
    )
    try:
        module = model.get_submodule(layer)
    except AttributeError:
        module = None
    if found is None or module is None:
        raise TpplanError(
            f"an attribute rule takes its uneven heads from {layer}, which no colwise rule "
            "with uneven and head_dim splits; name the query projection in `uneven`."
        )
    head_dim, group = found.head_size(), found.uneven_group()
    assert head_dim is not None and group is not None
    weight = module._parameters["weight"]
    assert weight is not None
    features = int(weight.shape[1 if found.stored_transposed() else 0])
    heads = max(found.part_sizes() or [features]) // head_dim  # a fused layer's query piece
    out = []
    for s in head_shares(heads, group, tp):
        own, whole = own_share(s, rule.by or "tp", heads, group)
        if (value * own) % whole:
            raise TpplanError(
                f"{name}.{attr} = {value} has no "
                f"whole share for a rank of {own} of {whole} heads (uneven heads of {layer} at "
                f"tp {tp}); use a tp size that divides the heads, or keep the attention replicated."
            )
        out.append(value * own // whole)
    return out


def attribute_value(module: nn.Module, attr: str) -> Any:
    """`module`'s attribute `attr`, or the attribute of an object it holds for a dotted one
    (`cfg.n_head`: a config the layers share); None where there is none."""
    holder, _, own = attr.rpartition(".")
    found = getattr(module, holder, None) if holder else module
    return getattr(found, own, None)


def _holder(module: nn.Module, attr: str) -> tuple[Any, str]:
    """The object holding `attr` and its own name there. A dotted one (`cfg.n_head`) is on
    an object the module holds, which other modules may share (a config): the module gets a
    copy of its own first, so that dividing it leaves the others' as they are."""
    path, _, own = attr.rpartition(".")
    if not path:
        return module, own
    copied = module.__dict__.setdefault("_tpplan_own_copies", set())
    if path not in copied:
        setattr(module, path, copy.copy(getattr(module, path)))
        copied.add(path)
    return getattr(module, path), own


def attribute_divisor(
    plan: Plan, model: nn.Module, rule: AttributeRule, name: str, tp_size: int
) -> int:
    """What `rule` divides the attributes of module `name` by at `tp_size`: tp, or the
    replicas (tp/heads, at least 1) or shards (min(tp, heads)) of the heads of `rule.of`.
    With `uneven` (each rank its own value, `own_attributes`): tp, for what divides them."""
    if rule.of is None or rule.uneven is not None:
        return tp_size
    heads = shared_heads(plan, model, f"{name}.{rule.of}")
    replicas = head_replicas(heads, tp_size)
    return replicas if rule.by == "replicas" else tp_size // replicas


def shared_heads(plan: Plan, model: nn.Module, name: str) -> int:
    """The head count of the module `name`, split by a colwise rule with replicate_heads."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        module = None
    for rule in plan.rules:
        heads = rule.head_size() if rule.shares_heads() else None
        if module is not None and heads and matches(rule.match, name):
            parts = rule.part_sizes()
            if parts:
                return min(parts) // heads  # q|k|v fused: the key/value pieces' heads
            weight = module._parameters["weight"]
            assert weight is not None
            return int(weight.shape[0]) // heads
    raise TpplanError(
        f"an attribute rule divides by the heads of {name}, which no colwise rule with "
        "replicate_heads splits; name the key or value projection in `of`."
    )
