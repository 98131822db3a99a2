"""check_plan: every problem of a plan against a model and a tp size, at once.

The checks here read module types, shapes and attributes, and a trace of the model on fake
tensors; none touches torch.distributed, so they work on a model on the meta device, of any
size. A plan they pass is then run once by tpplan/check/run.py. Start at `check_plan`; each
`_check_*` function adds one kind of Problem.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from torch import nn

from .._runtime.facts import describe_mismatch, fingerprint
from ..errors import Problem, TpplanError, did_you_mean
from ..plan.patterns import collapse, match_names, wildcard
from ..plan.schema import Plan, Rule
from .rules import check_inside_experts, check_rules, check_tied, match_rules
from .shared import closes_region, legal_sizes, opens_region, rule_label, traced_name

if TYPE_CHECKING:
    from ..trace import Trace

__all__ = ["check_plan", "splits_nothing"]


def check_plan(plan: Plan, model: nn.Module, *, tp_size: int) -> list[Problem]:
    """Every problem of `plan` for `model` at `tp_size`; an empty list when the plan is sound.

    Reported: patterns that match no module, modules matched by two rules, styles on module
    types they cannot apply to, split dims (features, heads, vocab) that tp_size does not
    divide, column-parallel regions no row-parallel module closes (and the reverse),
    attribute fixes that cannot be made, and a fingerprint that does not match the model.

    A plan with none of these is applied to a weightless copy of the model over `tp_size`
    fake ranks and run forward and backward (tpplan/check/run.py); a failure is one problem
    naming the rule, the module where torch raised and torch's error. Where no such run can
    be set up (inputs tpplan cannot make up, a model that does not run on meta tensors even
    unsharded, parameters that are already DTensors), the checks above stand alone.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive integer, got {tp_size!r}.")
    modules = dict(model.named_modules())
    names = [n for n in modules if n]
    matches = match_rules(plan, names)
    problems = check_rules(plan, matches, modules, tp_size)
    problems += check_inside_experts(plan, matches.owner)
    problems += check_tied(plan, matches.owner, model)
    flagged = {p.module for p in problems if p.kind == "divisibility" and p.module}
    problems.extend(_check_regions(plan, matches.by_rule, model, tp_size, flagged))
    problems.extend(_check_attributes(plan, names, modules, tp_size))
    problems.extend(_check_fingerprint(plan, model))
    if problems:
        return _merge_layers(problems, names)
    # Last, the proof: the plan applied to a meta copy runs a forward and a backward. Only
    # for a plan the checks above pass, so that one mistake is not told twice.
    from .run import run_plan

    return run_plan(plan, model, tp_size=tp_size)


def splits_nothing(plan: Plan) -> bool:
    """Whether applying the plan leaves every parameter and activation whole on every rank
    (no rules, or only replicate ones): sound, but each rank then runs the whole model."""
    return all(r.style in ("replicate", "replicate_grad_sum") for r in plan.rules)


def _merge_layers(problems: list[Problem], names: list[str]) -> list[Problem]:
    """One problem per rule and message, its modules collapsed over repeated layers."""
    groups: dict[tuple[str, str, str, str], list[Problem]] = {}
    for p in problems:
        groups.setdefault((p.kind, p.rule, p.message, p.fix), []).append(p)
    out = []
    for (kind, rule, message, fix), same in groups.items():
        mods = [p.module for p in same if p.module is not None]
        module = ", ".join(collapse(mods, names)) if mods else None
        out.append(Problem(kind, rule, module, message, fix))  # type: ignore[arg-type]
    return out


def _check_regions(
    plan: Plan, matched: dict[int, list[str]], model: nn.Module, tp: int, flagged: set[str]
) -> list[Problem]:
    """A column-parallel output must reach row-parallel layers only (and the reverse), and
    split into whole heads as the model itself views them; the heads and fused pieces a
    rule states must be the model's; a vocab-parallel table must sum where its rows are.

    The model is traced (tpplan/trace/) to see where each layer's output goes; a model
    that cannot be traced (its inputs cannot be guessed) gets the structural check instead.
    Parts its forward does not call are traced on their own, as infer_plan splits them.
    """
    from ..trace import idle_roots, trace_model

    def having(keep: Any) -> list[tuple[int, str]]:
        return [(i, n) for i, r in enumerate(plan.rules) if keep(r) for n in matched[i]]

    names = [n for n, _ in model.named_modules() if n]

    checked = _Checked(
        openers=having(opens_region),
        closers=having(closes_region),
        tables=having(lambda r: r.style == "vocab_parallel"),
        # a colwise layer gathered right after is no opener, but its parts must still be right
        widths=having(lambda r: r.head_dim or r.parts or r.fused),
        divided=[
            (i, n) for i, a in enumerate(plan.attributes) for n in match_names(a.match, names)
        ],
    )
    if not any(checked):
        return []
    try:
        trace = trace_model(model)
    except TpplanError:
        return _check_regions_by_structure(plan, checked.openers, checked.closers, model)
    out = _check_traced(plan, checked, trace, tp, flagged)
    checked_names = (name for pairs in checked for _, name in pairs)
    for root in idle_roots(checked_names, trace.layers.ran, lambda n: traced_name(trace, n)):
        out += _check_part(plan, checked, model, root, tp, flagged)
    return out


class _Checked(NamedTuple):
    """The (rule index, module name) pairs each trace-based check looks at."""

    openers: list[tuple[int, str]]
    closers: list[tuple[int, str]]
    tables: list[tuple[int, str]]
    widths: list[tuple[int, str]]
    divided: list[tuple[int, str]]
    """(attribute rule index, module name): the rule indexes plan.attributes."""


def _check_traced(
    plan: Plan, checked: _Checked, trace: Trace, tp: int, flagged: set[str]
) -> list[Problem]:
    return (
        _check_regions_by_flow(plan, checked.openers, checked.closers, trace)
        + _check_heads(plan, checked.openers, trace, tp, flagged)
        + _check_widths(plan, checked.widths, trace)
        + _check_lookups(plan, checked.tables, trace)
        + _check_divided(plan, checked, trace)
    )


def _check_divided(plan: Plan, checked: _Checked, trace: Trace) -> list[Problem]:
    """An attribute a plan divides must be a count the model's views read to cut the split
    features, as the trace saw them (what infer divides); divided, any other size its
    forward reads (head_dim, a width) shrinks what every rank keeps whole. Judged only where
    the trace followed every split the plan opens to its end (a split it lost may have
    read counts it did not see); the dry run speaks for the rest."""
    if any(traced_name(trace, n) in trace.regions.broken for _, n in checked.openers):
        return []
    counts = [*trace.reads.counts.values(), *trace.experts.counts.values()]
    legal = {(m, a) for found in counts for m, a, _ in found}
    out: list[Problem] = []
    for i, name in checked.divided:
        rule, t = plan.attributes[i], traced_name(trace, name)
        for attr in rule.divide:
            if (t, attr) in legal or (t, attr) not in trace.reads.ints:
                continue
            read = sorted(a for m, a in legal if m == t)
            views = (
                f"its views read {', '.join(read)} for that"
                if read
                else "its views read no count for that (they size the split with -1 or off the tensor)"
            )
            out.append(
                Problem(
                    "attribute",
                    f"attributes[{i}] (match: {rule.match})",
                    name,
                    f"its forward reads {attr}, but not as a count of the split features' "
                    f"heads: {views}. Divided, {attr} would shrink a size every rank keeps whole.",
                    f"remove {attr} from divide (the attributes `tpplan infer` writes are the "
                    "ones to divide).",
                )
            )
    return out


def _check_part(
    plan: Plan, checked: _Checked, model: nn.Module, root: str, tp: int, flagged: set[str]
) -> list[Problem]:
    """The checks on a trace of one part alone, on the inputs infer_plan traces it on; a
    part that cannot run alone is tried child by child, as infer_plan does. What nothing can
    run stays unchecked by flow (infer_plan keeps it whole)."""
    from .._runtime.inputs import example_inputs, part_inputs
    from ..trace import trace_model

    part = model.get_submodule(root)
    try:
        guess = part_inputs(part)
        inputs = guess if guess is not None else example_inputs(part, batch=2, seq=16)
        trace = trace_model(_placed(part, root), example_inputs=inputs)
    except TpplanError:
        out: list[Problem] = []
        for child, _ in part.named_children():
            below = f"{root}.{child}"
            if any(n == below or n.startswith(below + ".") for pairs in checked for _, n in pairs):
                out += _check_part(plan, checked, model, below, tp, flagged)
        return out
    return _check_traced(plan, checked, trace, tp, flagged)


def _placed(part: nn.Module, root: str) -> nn.Module:
    """A module holding only `part`, at the same dotted path as in the model, whose forward
    is the part's: traced, the part's layers keep the names the plan's rules match (and
    layers outside it do not run, so the checks pass them by)."""

    class Placed(nn.Module):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return self.get_submodule(root)(*args, **kwargs)

    shell = Placed()
    here: nn.Module = shell
    *path, last = root.split(".")
    for name in path:
        here.add_module(name, nn.Module())
        here = here.get_submodule(name)
    here.add_module(last, part)
    return shell


def _model_head_dim(trace: Trace, t: str, *, closer: bool) -> tuple[int, str] | None:
    """(head size, how the model's views show it) of a traced opener or closer, read as
    infer reads it when it writes a rule's head_dim; None where the flow shows no heads."""
    if closer:
        s = trace.regions.closers.get(t)
        if s is None or s.inner <= 1:
            return None
        return s.inner, f"its {s.n * s.inner} input features arrive as {s.n} heads of {s.inner}"
    if t not in trace.regions.openers:
        return None
    features, parts = trace.regions.openers[t], trace.regions.parts.get(t)
    if parts is not None:
        # fused pieces are cut apart before any view: their head size shows where they meet
        # again, at the closers' input, merged from (heads, head_dim)
        links = [g for g in trace.regions.links if t in g]
        inners = {
            trace.regions.closers[c].inner for g in links for c in g if c in trace.regions.closers
        }
        if len(inners) != 1 or (inner := inners.pop()) <= 1 or any(p % inner for p in parts):
            return None
        pieces = " | ".join(map(str, parts))
        return (
            inner,
            f"its {features} output features are fused pieces ({pieces}), each made of heads "
            f"of {inner}",
        )
    heads = trace.regions.heads.get(t)
    if not heads or features % heads:
        return None
    return (
        features // heads,
        f"it views its {features} output features as {heads} heads of {features // heads}",
    )


def _check_widths(plan: Plan, modules: list[tuple[int, str]], trace: Trace) -> list[Problem]:
    """A rule's head_dim and fused parts must be the model's own, as its forward cuts the
    features. The rule's own checks only ask that the width be whole heads of the stated size
    and that the parts add up to it; but 32 heads of 64 are also 16 whole heads of 128, and
    768 | 768 | 768 add up like 512 | 1024 | 768: a plan written for another model would
    pass them. Wrong parts give each rank the wrong slices (wrong numbers); a wrong head_dim
    checks tp sizes against heads the model does not have."""
    out: list[Problem] = []
    for i, name in modules:
        rule, t = plan.rules[i], traced_name(trace, name)
        stated = [("parts", "", rule.parts, trace.regions.parts.get(t), "parts: {}")] + [
            (
                f"fused {p}",
                f" of {p} per expert",
                sizes,
                trace.regions.parts.get(f"{t}.{p}"),
                f"fused: {{{{{p}: {{}}}}}}",
            )
            for p, sizes in (rule.fused or {}).items()
        ]
        for field, of, sizes, pieces, setting in stated:
            # (sizes that do not add up to the width are reported by the rule's own check)
            if not sizes or not pieces or sum(sizes) != sum(pieces) or sizes == [*pieces]:
                continue
            out.append(
                Problem(
                    "parts",
                    rule_label(i, rule),
                    name,
                    f"the rule states {field} {sizes}, but the model cuts its "
                    f"{sum(pieces)} output features{of} into the pieces {[*pieces]}.",
                    f"set {setting.format([*pieces])} in the rule, or infer the plan again "
                    "for this model (`tpplan infer`).",
                )
            )
        if rule.head_dim is None:
            continue
        seen = _model_head_dim(trace, t, closer=closes_region(rule))
        if seen is None or seen[0] == rule.head_dim:
            continue
        head_dim, view = seen
        out.append(
            Problem(
                "head_dim",
                rule_label(i, rule),
                name,
                f"the rule states head_dim {rule.head_dim}, but the model's head_dim is "
                f"{head_dim} ({view}).",
                f"set head_dim: {head_dim} in the rule, or infer the plan again for this model "
                "(`tpplan infer`).",
            )
        )
    return out


def _check_lookups(plan: Plan, tables: list[tuple[int, str]], trace: Trace) -> list[Problem]:
    """A vocab-parallel table whose own forward does what is not linear in the looked-up rows
    (a norm) must sum them at the lookup (`sum_at: lookup`); one that writes its own
    parameters over rows must name them (`written`) so each rank writes its share, or sum
    at the lookup. Both need its lookups made through nn.Embedding's forward."""
    out: list[Problem] = []
    for i, name in tables:
        rule, t = plan.rules[i], traced_name(trace, name)
        found = _lookup_problem(rule, t, trace)
        if found is not None:
            out.append(Problem("lookup", rule_label(i, rule), name, *found))
    return out


def _lookup_problem(rule: Rule, t: str, trace: Trace) -> tuple[str, str] | None:
    """(message, fix) for one vocab-parallel rule on the table traced as `t`, if wrong."""
    bent, slot = trace.lookups.not_linear.get(t), trace.lookups.at_lookup_place.get(t)
    traced = sorted(trace.lookups.written_rows.get(t, ()))
    named = sorted(rule.written or ())
    whole = "keep it whole (style: replicate)."
    if (rule.sum_at is not None or named) and slot is False:
        how = "sum_at: lookup sums" if rule.sum_at is not None else "written looks up"
        return (
            "it looks its rows up with an embedding of its own, not through nn.Embedding's "
            f"forward (`super().forward(ids)`), where {how} them.",
            whole,
        )
    if bent and rule.sum_at is None:
        return (
            f"its forward applies {bent} to the looked-up rows, which is not linear in "
            "them, but "
            + (
                "written sums the rows only as the forward returns"
                if named
                else "a vocab-parallel lookup's partial rows are summed only after the forward"
            )
            + ", so it would act on partial rows.",
            (
                "replace written with `sum_at: lookup`."
                if named
                else "add `sum_at: lookup` to the rule."
            )
            if slot
            else whole,
        )
    if rule.sum_at is not None or named == traced:
        if named and trace.written_elsewhere(t, named):
            return (
                f"its forward uses {', '.join(named)} otherwise than by writing it over "
                "looked-up rows, so it cannot be split as written asks.",
                "replace written with `sum_at: lookup`.",
            )
        return None
    listed = f"[{', '.join(traced)}]"
    if not traced:
        return (
            f"written names {', '.join(named)}, but its forward writes no parameter of its "
            "own over the looked-up rows.",
            "drop written from the rule.",
        )
    if not named:
        return (
            f"its forward writes {', '.join(traced)} over some of the looked-up rows, but a "
            "vocab-parallel lookup's rows are partial sums there, so each rank would write "
            "the whole of it and the sum would count it once per rank.",
            f"add `written: {listed}` to the rule (or `sum_at: lookup`).",
        )
    return (
        f"its forward writes {', '.join(traced)} over looked-up rows, but written names "
        f"{', '.join(named)}.",
        f"set `written: {listed}`.",
    )


def _check_heads(
    plan: Plan, openers: list[tuple[int, str]], trace: Trace, tp: int, flagged: set[str]
) -> list[Problem]:
    """Each split output must give every rank whole heads as the model's own views cut them
    (the trace's units), whatever head_dim the plan states: a plan whose head_dim is too
    small (or missing) would pass the rule's own check and cut heads in half mid-forward."""
    out: list[Problem] = []
    for i, name in openers:
        t = traced_name(trace, name)
        units = trace.regions.units.get(t)
        if name in flagged or t not in trace.regions.openers or units is None or units % tp == 0:
            continue
        features, heads = trace.regions.openers[t], trace.regions.heads.get(t)
        size = features // heads if heads and features % heads == 0 else None
        what = f"{heads} heads of {size}" if size else f"{features} features"
        if heads != units:
            what += f", which must stay together in {units} groups"
        # a head_dim that disagrees with the model's is a problem of its own (_check_head_dims)
        out.append(
            Problem(
                "divisibility",
                rule_label(i, plan.rules[i]),
                name,
                f"the model views its {features} output features as {what}: tp size {tp} "
                "would cut them.",
                f"use a tp size among {legal_sizes(units)}, or keep this module replicated.",
            )
        )
    return out


def _check_regions_by_flow(
    plan: Plan, openers: list[tuple[int, str]], closers: list[tuple[int, str]], trace: Trace
) -> list[Problem]:
    def traced(name: str) -> str:
        return traced_name(trace, name)

    open_t = {traced(n) for _, n in openers}
    close_t = {traced(n) for _, n in closers}

    def partners(t: str, role: dict[str, Any]) -> set[str]:
        return {m for g in trace.regions.links if t in g for m in g if m in role and m != t}

    out: list[Problem] = []
    for i, name in openers:
        rule, t = plan.rules[i], traced(name)
        if t in trace.lookups.token_ids and t not in trace.regions.openers:
            out.append(_split_rows(i, rule, name))
        if t not in trace.regions.openers:
            continue  # not a Linear called on a whole input; the type check speaks for it
        missing = sorted(wildcard(c) for c in partners(t, trace.regions.closers) - close_t)
        if missing:
            out.append(
                Problem(
                    "unclosed_region",
                    rule_label(i, rule),
                    name,
                    f"its output is contracted by {', '.join(missing)}, which the plan does not make "
                    "rowwise, so that layer would read a shard as if it were the whole tensor.",
                    "make those layers rowwise, or gather this output with `output: replicate`.",
                )
            )
        elif (
            t in trace.regions.at_output
            and not partners(t, trace.regions.closers)
            and not plan.options.loss_parallel
        ):
            out.append(
                Problem(
                    "unclosed_region",
                    rule_label(i, rule),
                    name,
                    f"its output stays sharded ({rule.output or 'shard(-1)'}) up to the model's output.",
                    "gather it with `output: replicate`, or set options.loss_parallel and compute "
                    "the loss under torch.distributed.tensor.parallel.loss_parallel().",
                )
            )
    for i, name in closers:
        rule, t = plan.rules[i], traced(name)
        if t not in trace.regions.closers:
            # The trace saw no split arrive (or its split went through a reshape by stored
            # head counts, which the plan's attributes fix): nothing to pair it with.
            continue
        missing = sorted(wildcard(o) for o in partners(t, trace.regions.openers) - open_t)
        if missing:
            out.append(
                Problem(
                    "unopened_region",
                    rule_label(i, rule),
                    name,
                    f"its input comes from {', '.join(missing)}, which the plan does not make colwise.",
                    "make those layers colwise too, or declare `input: replicate`.",
                )
            )
    return out


def _split_rows(i: int, rule: Rule, name: str) -> Problem:
    """colwise on a table whose rows are looked up (not one looked up at computed positions
    to open a split, as T5's relative position bias is) and whose output stays split."""
    return Problem(
        "unclosed_region",
        rule_label(i, rule),
        name,
        "colwise on an nn.Embedding gives each rank a slice of every looked-up row's "
        f"features and leaves its output split ({rule.output or 'shard(-1)'}), but the "
        "layers after a lookup take whole rows.",
        "colwise on an Embedding: use vocab_parallel (each rank holds a share of the vocab; "
        "one all-reduce) or replicate, or gather its rows with `output: replicate`.",
    )


def _check_regions_by_structure(
    plan: Plan, openers: list[tuple[int, str]], closers: list[tuple[int, str]], model: nn.Module
) -> list[Problem]:
    """Without a trace: the closing layer must sit under the same parent module as the
    opening one (q_proj and o_proj under one attention module). A parent that holds the
    layer and nothing else (`q_proj.linear` inside a `q_proj` wrapper) is no parent of
    its own: the one above it is."""
    owned = {n: {id(p) for p in m.parameters()} for n, m in model.named_modules()}

    def parent(name: str) -> str:
        up = name.rpartition(".")[0]
        while up and owned.get(up) == owned.get(name):
            name, up = up, up.rpartition(".")[0]
        return up

    def under(root: str, name: str) -> bool:
        # At the top level only a top-level sibling counts: an output head is not closed by
        # the rowwise layers deep inside the blocks it follows.
        return "." not in name if root == "" else name.startswith(root + ".")

    out: list[Problem] = []
    for i, name in openers:
        p = parent(name)
        if plan.options.loss_parallel and p == "":
            continue  # a top-level head kept sharded for loss_parallel: the loss closes it
        if not any(under(p, c) for _, c in closers):
            rule = plan.rules[i]
            out.append(
                Problem(
                    "unclosed_region",
                    rule_label(i, rule),
                    name,
                    f"its output stays sharded ({rule.output or 'shard(-1)'}) but no rowwise "
                    f"module under {wildcard(p) or 'the model (top level)'} takes it back to a full tensor.",
                    "add a rowwise rule for the layer that consumes it, or gather the output "
                    "with `output: replicate`.",
                )
            )
    for i, name in closers:
        p = parent(name)
        if not any(under(p, o) for _, o in openers):
            rule = plan.rules[i]
            out.append(
                Problem(
                    "unopened_region",
                    rule_label(i, rule),
                    name,
                    f"it expects a sharded input ({rule.input or 'shard(-1)'}) but no colwise module "
                    f"under {wildcard(p) or 'the model (top level)'} produces one.",
                    "add colwise rules for the layers that feed it, or declare `input: replicate`.",
                )
            )
    return out


def _check_attributes(
    plan: Plan, names: list[str], modules: dict[str, nn.Module], tp: int
) -> list[Problem]:
    out: list[Problem] = []
    for i, rule in enumerate(plan.attributes):
        where = f"attributes[{i}] (match: {rule.match})"
        hits = match_names(rule.match, names)
        if not hits:
            out.append(
                Problem(
                    "no_match",
                    where,
                    None,
                    f"the pattern matches no module of the model.{did_you_mean(rule.match, collapse(names, names))}",
                    "correct the pattern or delete the entry.",
                )
            )
        for name in hits:
            for attr in rule.divide:
                value = getattr(modules[name], attr, None)
                if isinstance(value, bool) or not isinstance(value, int):
                    out.append(
                        Problem(
                            "attribute",
                            where,
                            name,
                            f"the module has no integer attribute '{attr}' (found {value!r}).",
                            "name an integer attribute the module's forward reads.",
                        )
                    )
                elif value % tp:
                    out.append(
                        Problem(
                            "divisibility",
                            where,
                            name,
                            f"{attr} = {value} does not divide by tp size {tp}.",
                            f"use a tp size among {legal_sizes(value)}.",
                        )
                    )
    return out


def _check_fingerprint(plan: Plan, model: nn.Module) -> list[Problem]:
    info = plan.model
    if info is None or info.fingerprint is None:
        return []
    now = fingerprint(model)
    if now == info.fingerprint and info.class_ == type(model).__name__:
        return []
    cls = (
        f" It was written for {info.class_}, this is {type(model).__name__}."
        if info.class_ != type(model).__name__
        else ""
    )
    return [
        Problem(
            "fingerprint",
            "model",
            None,
            f"the plan was written for another model (fingerprint {info.fingerprint}, this model "
            f"has {now}).{cls} What differs: {describe_mismatch(info.parameters, model)}.",
            "regenerate the plan with `tpplan infer`, or delete model.fingerprint to use the "
            "plan for any model whose module names match.",
        )
    ]
