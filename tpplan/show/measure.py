"""picture_of: the `Picture` of a plan on a model at a tp size, measured, not guessed.

Start at `picture_of`. Three runs on copies of the model with no storage, each one the
project's own: the plan applied on fake ranks gives each parameter's bytes per rank (as
`plan_stats` counts them); check's counted dry run (`collectives_inside`) gives the
collectives each module's forward ran; one unsharded forward on fake tensors gives the
order the modules run in. A model whose forward cannot run on fake tensors is drawn in
module order, with a note where its collectives could not be counted.

The boxes are the modules a rule matches, and the modules no rule matches that hold
parameters of their own outside a module whose rule treats it whole (an expert layer's
weights are its rule's). Blocks are the children of a numbered stack (`model.layers.3`);
blocks that come out alike once their index is replaced are one group.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from .._runtime.fake import meta_copy, quiet_fake_tensor_log
from .._runtime.local import fake_ranks, outside_simulation
from .._runtime.torch_compat import FakeTensorMode
from .._runtime.tree import local_bytes
from ..apply.api import apply_plan
from ..check.blame import MetaKernels
from ..check.run import collectives_inside, region_inputs
from ..check.shared import rules_by_module
from ..plan.patterns import match_names, wildcard
from ..plan.rule import Rule
from ..plan.schema import Plan
from ..plan.styles import PrepareRule, SequenceParallelRule
from .picture import OUTSIDE, Collective, Group, Layer, Picture, Region, kind_of

__all__ = ["picture_of"]

_NO_RULE = "no rule matches it: every rank holds it whole and runs it on the whole input"
# torch's functional collectives, in words
_WORDS = {
    "all_reduce": "all-reduce",
    "all_gather_into_tensor": "all-gather",
    "reduce_scatter_tensor": "reduce-scatter",
    "all_to_all_single": "all-to-all",
}


def picture_of(model: nn.Module, plan: Plan, *, tp_size: int) -> Picture:
    """The picture of `plan` on `model` at `tp_size`. The model is never touched: every run
    is on a copy without storage, so a model on the meta device of any size will do.

    Example::

        picture = picture_of(model, infer_plan(model, tp_size=2), tp_size=2)
        Path("plan.svg").write_text(render_svg(picture))
    """
    names = [n for n, _ in model.named_modules()]
    rules = {n: rule for n, (_, rule) in rules_by_module(plan, names)[0].items()}
    drawn = _drawn(model, rules)
    blocks = [b for b in dict.fromkeys(_block_of(model, n) for n in drawn) if b is not None]
    inputs = region_inputs(model, tp_size)
    order = _forward_order(model, inputs) if inputs is not None else {}
    per_rank, total = _param_bytes(model, plan, tp_size)
    counted = _collectives(plan, model, tp_size, inputs, [*drawn, *blocks, ""])
    # the forward's order, and module order for what it did not call
    key = {n: (order[n], 0) if n in order else (len(order), i) for i, n in enumerate(names)}
    sites = _Sites(model, rules, drawn, per_rank, total, counted or {}, plan, key)
    groups = sorted(_groups(sites, blocks), key=lambda g: min(key[n] for n in g[1]))
    note = None
    if counted is None:
        note = (
            "collectives not drawn: the plan's forward could not be run on fake ranks to "
            "count them (`tpplan check` says why)"
        )
    return Picture(
        model=type(model).__name__,
        tp_size=tp_size,
        groups=tuple(g for g, _ in groups),
        bytes_per_rank=sum(per_rank.values()),
        bytes_total=sum(total.values()),
        note=note,
    )


def _owns_inside(rule: Rule | None) -> bool:
    """A module so treated holds its submodules' parameters as its own (an experts rule,
    replicate); prepare and sequence_parallel only move activations."""
    return rule is not None and not isinstance(rule, (PrepareRule, SequenceParallelRule))


def _drawn(model: nn.Module, rules: dict[str, Rule | None]) -> list[str]:
    """The modules drawn as boxes, in module order (see the module docstring)."""
    owners = [n for n, r in rules.items() if _owns_inside(r)]
    out = []
    for name, module in model.named_modules():
        own = next(module.parameters(recurse=False), None) is not None
        inside = any(name.startswith(f"{o}.") for o in owners)
        if name in rules or (own and name and not inside):
            out.append(name)
    return out


def _block_of(model: nn.Module, name: str) -> str | None:
    """The block `name` lies in (`model.layers.3`): a child with children of its own
    under a numbered name; None outside every block."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            prefix = ".".join(parts[: i + 1])
            try:
                block = model.get_submodule(prefix)
            except AttributeError:  # a numbered parameter (a ParameterList's)
                return None
            return prefix if next(block.children(), None) is not None else None
    return None


def _param_bytes(model: nn.Module, plan: Plan, tp: int) -> tuple[dict[str, int], dict[str, int]]:
    """({parameter: bytes on one rank}, {parameter: bytes unsharded}), the plan applied to a
    meta copy on fake ranks, as `plan_stats` does."""
    meta = meta_copy(model)
    total = {n: local_bytes(p) for n, p in meta.named_parameters()}
    with fake_ranks(tp) as mesh:
        apply_plan(meta, mesh, plan)
        per_rank = {n: local_bytes(p) for n, p in meta.named_parameters()}
    return per_rank, total


def _collectives(
    plan: Plan, model: nn.Module, tp: int, inputs: dict[str, Any] | None, where: list[str]
) -> dict[str, dict[str, int]] | None:
    """{module: {collective: count}} of one forward, each module's own: without those of
    the modules of `where` inside it. None where the forward could not be run."""
    if inputs is None:
        return None
    # each module less the outermost of `where` inside it
    inside = {
        m: [
            n
            for n in where
            if _under(n, m) and not any(_under(n, o) and _under(o, m) for o in where)
        ]
        for m in where
    }
    found = collectives_inside(
        plan, model, tp_size=tp, args=(), kwargs=inputs, modules=dict(inside)
    )
    return None if found is None else {m: found[m].forward for m in found}


def _under(name: str, outer: str) -> bool:
    return name != outer and (outer == "" or name.startswith(f"{outer}."))


def _forward_order(model: nn.Module, inputs: dict[str, Any]) -> dict[str, int]:
    """{module: its place in the order the unsharded forward first calls the modules},
    from a run on fake tensors; a forward that fails there leaves what ran before."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    copy_ = meta_copy(model, fake=fake).eval()
    order: dict[str, int] = {}

    def note(name: str) -> Any:
        def called(module: nn.Module, args: Any) -> None:
            order.setdefault(name, len(order))

        return called

    for name, module in copy_.named_modules():
        module.register_forward_pre_hook(note(name))
    with outside_simulation(), quiet_fake_tensor_log(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            given = {
                k: fake.from_tensor(v) if isinstance(v, torch.Tensor) else v
                for k, v in inputs.items()
            }
            # routing by `torch.where(chosen == e)` runs too, every expert given every token
            with fake, torch.no_grad(), MetaKernels(bounded_nonzero=True):
                copy_(**given)
        except Exception:  # a model fake tensors cannot run: module order for the rest
            pass
    return order


@dataclass
class _Sites:
    """What a group is made from: the model, its rules, the boxes, the measurements."""

    model: nn.Module
    rules: dict[str, Rule | None]
    drawn: list[str]
    per_rank: dict[str, int]
    total: dict[str, int]
    counted: dict[str, dict[str, int]]
    plan: Plan
    key: dict[str, tuple[int, int]]
    """{module: where it comes in the drawing}."""

    def owner(self, param: str) -> str | None:
        """The innermost drawn module that holds a parameter."""
        parts = param.split(".")[:-1]
        while parts:
            if ".".join(parts) in self.drawn:
                return ".".join(parts)
            parts.pop()
        return None

    def layer(self, relative: str, members: list[str]) -> Layer:
        rule = self.rules.get(members[0])
        params = [p for p in self.per_rank if self.owner(p) in members]
        return Layer(
            name=relative,
            kind=kind_of(rule),
            rule=rule.match if rule is not None else None,
            reason=rule.why if rule is not None else _NO_RULE,
            collectives=_summed(self.counted.get(m, {}) for m in members),
            bytes_per_rank=sum(self.per_rank[p] for p in params),
            bytes_total=sum(self.total[p] for p in params),
            copies=len(members),
        )


def _summed(counts: Iterable[dict[str, int]]) -> tuple[Collective, ...]:
    out: dict[str, int] = {}
    for per in counts:
        for op, n in per.items():
            word = _WORDS.get(op, op.replace("_", "-"))
            out[word] = out.get(word, 0) + n
    return tuple(Collective(k, n) for k, n in sorted(out.items()) if n > 0)


def _instance(sites: _Sites, prefix: str | None, names: list[str]) -> tuple[Group, list[str]]:
    """The group of one block (prefix None: the outside modules), and its module names."""
    cut = len(prefix) + 1 if prefix else 0
    by_name: dict[tuple[str, str | None], list[str]] = {}
    for n in names:
        relative = wildcard(n[cut:]) if prefix else n
        rule = sites.rules.get(n)
        by_name.setdefault((relative, rule.match if rule else None), []).append(n)
    runs = sorted(by_name.items(), key=lambda kv: min(sites.key[m] for m in kv[1]))
    layers = tuple(sites.layer(rel or "(the block)", ms) for (rel, _), ms in runs)
    regions = tuple(
        Region(wildcard(n[cut:]) if prefix else n, r.why)
        for r in sites.plan.regions
        for n in match_names(r.match, [n for n, _ in sites.model.named_modules()])
        if (prefix is None and _block_of(sites.model, n) is None)
        or (prefix is not None and n.startswith(f"{prefix}."))
    )
    inside = [p for p in sites.total if _block_of(sites.model, p) == prefix]
    group = Group(
        name=wildcard(prefix) if prefix else OUTSIDE,
        indices=(int(prefix.rsplit(".", 1)[1]),) if prefix else (),
        stack_size=1,
        layers=layers,
        regions=regions,
        own_collectives=_summed([sites.counted.get(prefix or "", {})]),
        bytes_per_rank=sum(sites.per_rank[p] for p in inside),
        bytes_total=sum(sites.total[p] for p in inside),
    )
    return group, names


def _groups(sites: _Sites, blocks: list[str]) -> list[tuple[Group, list[str]]]:
    """Each distinct block once, standing for every block of its stack alike; the outside
    modules as one group. Paired with the module names of the first block it stands for."""
    members: dict[str | None, list[str]] = {}
    for n in sites.drawn:
        members.setdefault(_block_of(sites.model, n), []).append(n)
    found: dict[tuple[Any, ...], tuple[Group, list[str]]] = {}
    stack_sizes: dict[str, int] = {}
    for prefix in [None, *blocks]:
        if prefix is None and not members.get(None):
            continue
        group, names = _instance(sites, prefix, members.get(prefix, []))
        stack_sizes[group.name] = stack_sizes.get(group.name, 0) + 1
        alike = (group.name, group.layers, group.regions, group.own_collectives)
        if alike in found:
            first, first_names = found[alike]
            group = _with(first, indices=first.indices + group.indices)
            names = first_names
        found[alike] = (group, names)
    return [(_with(g, stack_size=stack_sizes[g.name]), n) for g, n in found.values()]


def _with(group: Group, **changes: Any) -> Group:
    return replace(group, **changes)
