"""The checks of each rule on the modules it matches, read from module types and shapes
alone: a pattern that matches nothing, a module two rules match, a style the module cannot
take, parameters an experts or split_params rule names that the module lacks, sizes tp does
not divide (sizes.py), and, across rules, a module split inside an experts module and a
tied parameter split two ways. Start at `match_rules` and `check_rules`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from torch import Tensor, nn

from .._runtime.facts import channel_conv, tied_groups, weight_split
from .._runtime.torch_compat import ConvNd
from ..errors import Problem, did_you_mean
from ..plan.patterns import collapse, match_names
from ..plan.rule import Rule
from ..plan.schema import Plan
from ..plan.styles import (
    ColwiseRule,
    ExpertsRule,
    HeadsRule,
    ReplicateGradSumRule,
    ReplicateRule,
    RowwiseRule,
    SequenceParallelRule,
    SplitParamsRule,
    VocabParallelRule,
)
from .shared import rule_label
from .sizes import check_size, check_uneven_heads, sharded_dim, split_dims

__all__ = ["Matches", "check_inside_experts", "check_rules", "check_tied", "match_rules"]

# Module types each style can be applied to (a style not named: any module).
_FITS: dict[type[Rule], tuple[type[nn.Module], ...]] = {
    ColwiseRule: (nn.Linear, nn.Embedding),
    RowwiseRule: (nn.Linear, nn.Embedding),
    VocabParallelRule: (nn.Embedding,),
    HeadsRule: (nn.MultiheadAttention,),
}


class Matches(NamedTuple):
    """Which modules each rule matches, and which rule styles each module."""

    by_rule: dict[int, list[str]]
    """Rule index -> the modules its pattern matches."""
    owner: dict[str, int]
    """Module -> index of the rule that styles it (the first to match it)."""


def match_rules(plan: Plan, names: list[str]) -> Matches:
    """Which modules each rule's pattern matches, and which rule styles each module: the
    first that matches it (a module takes one style; a later match is an overlap)."""
    by_rule = {i: match_names(rule.match, names) for i, rule in enumerate(plan.rules)}
    owner: dict[str, int] = {}
    for i, hits in by_rule.items():
        for name in hits:
            owner.setdefault(name, i)
    return Matches(by_rule, owner)


def check_rules(
    plan: Plan, matches: Matches, modules: dict[str, nn.Module], tp: int
) -> list[Problem]:
    """Rule by rule, in the plan's order: a pattern that matches nothing, then for each
    module it matches, another rule's match of it or the rule's own problems there."""
    names = [n for n in modules if n]
    out: list[Problem] = []
    for i, rule in enumerate(plan.rules):
        if not matches.by_rule[i]:
            out.append(_no_match(i, rule, names))
        for name in matches.by_rule[i]:
            j = matches.owner[name]
            if j != i:
                out.append(_overlap(i, rule, name, j, plan.rules[j]))
            else:
                out.extend(_check_module(i, rule, name, modules[name], tp))
    return out


def _no_match(i: int, rule: Rule, names: list[str]) -> Problem:
    depth = rule.match.count(".")
    candidates = [c for c in collapse(names, names) if c.count(".") == depth]
    hint = did_you_mean(rule.match, candidates) or did_you_mean(rule.match, collapse(names, names))
    return Problem(
        "no_match",
        rule_label(i, rule),
        None,
        f"the pattern matches no module of the model.{hint}",
        "correct the pattern (segments are matched one by one, `*` never crosses a dot) "
        "or delete the rule.",
    )


def _overlap(i: int, rule: Rule, name: str, j: int, first: Rule) -> Problem:
    return Problem(
        "overlap",
        rule_label(i, rule),
        name,
        f"the module is also matched by rules[{j}] (match: {first.match}); "
        "a module takes one style.",
        "narrow one of the two patterns.",
    )


def _check_module(i: int, rule: Rule, name: str, module: nn.Module, tp: int) -> list[Problem]:
    """The problems of one rule on a module it styles, by its style's own check (by default:
    a style that does not fit the module, then the sizes it splits)."""
    return _MODULE_CHECKS.get(type(rule), _check_layer)(i, rule, name, module, tp)


def _check_layer(i: int, rule: Rule, name: str, module: nn.Module, tp: int) -> list[Problem]:
    misfit = _misfit(i, rule, name, module)
    if misfit is not None:
        return [misfit]  # no size of a module the style cannot take means anything
    return _check_split(i, rule, name, module, tp)


def _check_grad_sum(i: int, rule: Rule, name: str, module: nn.Module, tp: int) -> list[Problem]:
    if any(True for _ in module.parameters(False)):
        return _check_layer(i, rule, name, module, tp)
    return [
        Problem(
            "module_type",
            rule_label(i, rule),
            name,
            "style 'replicate_grad_sum' needs a module with parameters of its own.",
            "match the module that holds the parameters.",
        )
    ]


def _check_experts(
    i: int, rule: ExpertsRule, name: str, module: nn.Module, tp: int
) -> list[Problem]:
    return _check_own_params(i, rule, name, module, tp) + _check_added_whole(i, rule, name, module)


def _conv_misfit(i: int, rule: Rule, name: str, module: nn.Module) -> Problem | None:
    """colwise and rowwise split a convolution only where it is a Linear over its channels,
    and such a weight is never stored transposed (fused `parts` split as a Linear's)."""
    if not isinstance(module, ConvNd):
        return None
    if not channel_conv(module):
        return Problem(
            "module_type",
            rule_label(i, rule),
            name,
            f"style '{rule.style}' splits a convolution only where it is a Linear over its "
            f"channels (one group: every output channel reads every input channel); this "
            f"{type(module).__name__} has groups {module.groups}, each output channel "
            f"reading {module.in_channels // module.groups} of {module.in_channels}.",
            "keep this module replicated (style: replicate).",
        )
    if rule.stored_transposed():
        return Problem(
            "module_type",
            rule_label(i, rule),
            name,
            "a convolution takes no `transposed`: its weight is stored (out, in, kernel...).",
            "drop `transposed` from the rule.",
        )
    return None


def _heads_misfit(i: int, rule: Rule, name: str, module: nn.Module) -> Problem | None:
    if (
        isinstance(module, nn.MultiheadAttention)
        and type(module).forward is not nn.MultiheadAttention.forward
    ):
        return Problem(
            "module_type",
            rule_label(i, rule),
            name,
            f"style 'heads' runs nn.MultiheadAttention's own computation split by heads; "
            f"{type(module).__name__} has a forward of its own.",
            "keep this module replicated (style: replicate).",
        )
    return None


def _embedding_misfit(i: int, rule: Rule, name: str, module: nn.Module) -> Problem | None:
    if isinstance(module, nn.Embedding):
        return Problem(
            "module_type",
            rule_label(i, rule),
            name,
            "style 'sequence_parallel' takes a module's input as this rank's share of the "
            "sequence, but an nn.Embedding's input is the token ids, which every rank "
            "holds whole: its rows would be read as 1/tp of a sequence tp times as long.",
            "use vocab_parallel (`output: shard(1)` starts a sequence-parallel region, "
            "as `tpplan infer --sequence-parallel` writes it) or replicate.",
        )
    return None


def _misfit(i: int, rule: Rule, name: str, module: nn.Module) -> Problem | None:
    """The problem of a style the module cannot take at all, if it cannot: its style's own
    misfit first (a convolution that is no Linear over its channels, ...), then the module
    types it applies to."""
    own = _MISFITS.get(type(rule))
    found = own(i, rule, name, module) if own is not None else None
    if found is not None or (isinstance(module, ConvNd) and own is _conv_misfit):
        return found
    types = _FITS.get(type(rule))
    if rule.stored_transposed():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
            return Problem(
                "module_type",
                rule_label(i, rule),
                name,
                f"transposed: true needs a module with a 2-D weight stored (in, out); "
                f"{type(module).__name__} has none.",
                "remove transposed, or match the layer that holds the weight.",
            )
    elif types is not None and not isinstance(module, types):
        ok = " or ".join(f"nn.{t.__name__}" for t in types)
        return Problem(
            "module_type",
            rule_label(i, rule),
            name,
            f"style '{rule.style}' applies to {ok}, not to {type(module).__name__}.",
            "match the layers inside this module instead, or use another style.",
        )
    return None


# each style's own misfit, checked before the module types it applies to
_MISFITS: dict[type[Rule], Callable[[int, Any, str, nn.Module], Problem | None]] = {
    ColwiseRule: _conv_misfit,
    RowwiseRule: _conv_misfit,
    HeadsRule: _heads_misfit,
    SequenceParallelRule: _embedding_misfit,
}


def _check_split(i: int, rule: Rule, name: str, module: nn.Module, tp: int) -> list[Problem]:
    """The dim the style splits: fused parts that add up to it, each of them (or the whole
    dim) a size tp divides, and the parameters `written` names as wide as the rows."""
    whole, parts = sharded_dim(rule, module), rule.part_sizes()
    if parts and whole is not None and sum(parts) != whole[1]:
        return [
            Problem(
                "parts",
                rule_label(i, rule),
                name,
                f"parts {parts} add up to {sum(parts)}, but the {whole[0]} is {whole[1]}.",
                "list the sizes of the fused pieces (e.g. q, k, v) in order; they must add up "
                "to the whole.",
            )
        ]
    out: list[Problem] = []
    if rule.uneven_group() is not None:
        out += check_uneven_heads(i, rule, name, [size for _, size in split_dims(rule, module)], tp)
    if not rule.splits_unevenly():
        also = (
            ", or set uneven: true (each rank then holds DTensor's share, the last ones less)"
            if rule.may_split_unevenly()
            else ""
        )
        for what, size in split_dims(rule, module):
            out.extend(check_size(i, rule, name, what, size, tp, also=also))
    if isinstance(rule, VocabParallelRule):
        out += _check_written(i, rule, name, module, tp)
    return out


def _check_own_params(
    i: int, rule: ExpertsRule | SplitParamsRule, name: str, module: nn.Module, tp: int
) -> list[Problem]:
    """Every parameter an experts or split_params rule names exists, and each split dim
    divides by tp."""
    # experts may name a child's parameters (`input_linear.weight`) too
    experts = isinstance(rule, ExpertsRule)
    own: dict[str, Tensor] = dict(module.named_parameters(recurse=experts))
    if not experts:  # split_params also splits buffers (a BatchNorm's running statistics)
        own.update(module.named_buffers(recurse=False))
    after = rule.after_sum if isinstance(rule, ExpertsRule) else None
    named = [*(rule.shard or {}), *(after or ())]
    missing = [p for p in named if p not in own]
    if missing:
        have = ", ".join(f"{n} {tuple(p.shape)}" for n, p in own.items()) or "none"
        return [
            Problem(
                "module_type",
                rule_label(i, rule),
                name,
                f"{rule.style} names {', '.join(missing)}, which {type(module).__name__} does "
                f"not hold (its parameters: {have}).",
                "name the module's own parameters (a child's by its dotted name) in shard "
                "and after_sum."
                if experts
                else "name the module's own parameters (not its children's) in shard.",
            )
        ]
    out: list[Problem] = []
    for pname, dim in (rule.shard or {}).items():
        out.extend(_check_param_dim(i, rule, name, pname, dim, tuple(own[pname].shape), tp))
    return out


def _check_param_dim(
    i: int,
    rule: ExpertsRule | SplitParamsRule,
    name: str,
    pname: str,
    dim: int,
    shape: tuple[int, ...],
    tp: int,
) -> list[Problem]:
    """One `shard: {pname: dim}` entry: a dim the parameter has, fused pieces that add up to
    it, and sizes tp divides."""
    if dim >= len(shape):
        return [
            Problem(
                "module_type",
                rule_label(i, rule),
                name,
                f"shard: {pname}: {dim}, but {pname} has {len(shape)} dims {shape}.",
                "give a dim of the parameter"
                + (" (0 is the experts)." if isinstance(rule, ExpertsRule) else "."),
            )
        ]
    pieces = rule.fused_sizes().get(pname)
    experts = isinstance(rule, ExpertsRule) and dim == 0
    what = f"{pname} dim {dim}" + (" (the number of experts)" if experts else "")
    if pieces is not None and sum(pieces) != shape[dim]:
        return [
            Problem(
                "parts",
                rule_label(i, rule),
                name,
                f"fused {pname} {pieces} add up to {sum(pieces)}, but {what} is {shape[dim]}.",
                f"list the sizes of the fused pieces ({'gate, up' if isinstance(rule, ExpertsRule) else 'q, k, v'}) "
                "in order; they must add up to the whole.",
            )
        ]
    out: list[Problem] = []
    for size in pieces or [shape[dim]]:
        out.extend(check_size(i, rule, name, what, size, tp))
    return out


def _check_added_whole(i: int, rule: ExpertsRule, name: str, module: nn.Module) -> list[Problem]:
    """Every submodule an experts rule scales by 1/tp exists under the matched module."""
    have = {n for n, _ in module.named_modules() if n}
    missing = [c for c in rule.added_whole or () if c not in have]
    if not missing:
        return []
    return [
        Problem(
            "module_type",
            rule_label(i, rule),
            name,
            f"added_whole names {', '.join(missing)}, which {type(module).__name__} does not "
            f"hold (its submodules: {', '.join(sorted(have)) or 'none'}).",
            "name submodules of the matched module by their dotted names under it.",
        )
    ]


def _check_written(
    i: int, rule: VocabParallelRule, name: str, module: nn.Module, tp: int
) -> list[Problem]:
    """Each parameter `written` names is the embedding's own and as wide as its rows, a width
    that divides by tp."""
    if not rule.written or not isinstance(module, nn.Embedding):
        return []
    own = dict(module.named_parameters(recurse=False))
    wrong = [
        p
        for p in rule.written
        if p == "weight" or p not in own or own[p].shape[-1:] != (module.embedding_dim,)
    ]
    if wrong:
        have = ", ".join(f"{n} {tuple(q.shape)}" for n, q in own.items())
        return [
            Problem(
                "module_type",
                rule_label(i, rule),
                name,
                f"written names {', '.join(wrong)}, not a parameter of "
                f"{type(module).__name__} as wide as its rows ({module.embedding_dim}); its "
                f"parameters: {have}.",
                "name the parameters its forward writes over looked-up rows.",
            )
        ]
    what = f"embedding_dim (the width of {', '.join(rule.written)})"
    return check_size(i, rule, name, what, module.embedding_dim, tp)


def check_inside_experts(plan: Plan, owner: dict[str, int]) -> list[Problem]:
    """An experts module runs its forward on each rank's local tensors with every parameter
    but its expert weights whole, so a module inside it takes no split of its own; nor does
    one inside an nn.MultiheadAttention split by heads, which splits its out_proj itself."""
    holders = [n for n, i in owner.items() if plan.rules[i].inside is not None]
    out: list[Problem] = []
    for name, i in owner.items():
        rule = plan.rules[i]
        outer = next((e for e in holders if name.startswith(f"{e}.")), None)
        if outer is None or isinstance(rule, ReplicateRule):
            continue
        holder = plan.rules[owner[outer]]
        out.append(
            Problem(
                "overlap",
                rule_label(i, rule),
                name,
                f"it is inside {outer}, matched by rules[{owner[outer]}] (style {holder.style}), "
                f"{holder.inside}.",
                "drop this rule, or keep the module whole (style: replicate).",
            )
        )
    return out


def check_tied(plan: Plan, owner: dict[str, int], model: nn.Module) -> list[Problem]:
    """Modules sharing one parameter (tied embeddings) must split it alike, or it would be
    two different tensors after sharding: no longer tied, and wrong after one step. A
    holder no rule matches (T5's `shared` embedding, which forward never calls; BERT's
    prediction head, which keeps a reference to its decoder's bias) follows the split copy
    when apply re-ties them; were it to compute with it, DTensor would refuse the mix of a
    plain input and a split weight loudly."""
    modules = dict(model.named_modules())
    out = []
    for group in tied_groups(model):
        splits = {
            (mod, name): weight_split(
                plan.rules[owner[mod]] if mod in owner else None, modules[mod], name
            )
            for mod, name in group
            if mod in owner
        }
        if len(set(splits.values())) > 1:
            (mod, _), *_ = [k for k, v in splits.items() if v != "whole"] or list(splits)
            i = owner[mod]
            said = ", ".join(f"{m}.{n}: {v}" for (m, n), v in splits.items())
            out.append(
                Problem(
                    "tied",
                    rule_label(i, plan.rules[i]),
                    mod,
                    f"it shares a parameter with other modules (tied), which the plan splits "
                    f"differently ({said}); sharded, they would stop being one tensor.",
                    "give every module holding the tied parameter a style that splits it the "
                    "same way (vocab_parallel input embedding with a colwise head), or keep them "
                    "all replicated.",
                )
            )
    return out


# each style's own check of a module it styles (a style not named: `_check_layer`)
_MODULE_CHECKS: dict[type[Rule], Callable[[int, Any, str, nn.Module, int], list[Problem]]] = {
    ExpertsRule: _check_experts,
    SplitParamsRule: _check_own_params,
    ReplicateGradSumRule: _check_grad_sum,
}
