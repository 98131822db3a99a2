"""Regions run on DTensors: attention and MLPs split the Megatron way where the local shapes
of a split cannot be proven from attributes tpplan may divide.

Start at `try_dtensor_regions`, which infer_plan calls once a plan is made. A layer whose
split ended at a view the trace could not size per rank (a head size computed as
`C // self.n_head` from `x.size()`, a literal in `reshape(B, N, 3, heads, hd)`, a count
read from a config object every layer shares) was split and gathered right after: weights
shrink, work does not. Here such layers get a second chance:

1. roles: a forward on fake tensors follows which of them read what the others made, in
   the module that holds them: a layer reading none of their outputs opens a split, a
   layer reading an opener's output closes it (`_roles`);
2. candidate: in each module whose gathered layers all took a role, openers colwise with
   DTensor outputs (`local_output: false`; a fused one as its equal pieces), closers
   rowwise, and the module a DTensor region (`Plan.regions`);
3. proof: the plan applied to a meta copy on fake ranks, one forward and backward counted
   (`check.run.collectives_inside`): a region is kept only where no collective ran inside
   the module outside its layers' own calls, so the split ran through every view, rotary
   embedding and attention untouched, and DTensor's own sharding propagation computed
   every op (its numbers are the unsplit model's by construction). Anything else keeps
   the split-and-gather rules, with their reasons.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..check.rules import match_rules
from ..check.run import collectives_inside, meta_copy
from ..plan.patterns import collapse
from ..plan.schema import Plan, RegionRule, Rule
from ..trace import quiet_fake_tensor_log

__all__ = ["call_fake", "collapsed", "example_call", "per_module", "try_dtensor_regions"]

# how rest.py words a layer whose output could not stay split (split and gathered)
_GATHERED = "its output cannot stay split ("


def try_dtensor_regions(model: nn.Module, plan: Plan, tp: int, example_inputs: Any) -> Plan:
    """`plan` with every region it can prove turned into a DTensor region (see the module
    docstring); `plan` itself when there is none."""
    names = [n for n, _ in model.named_modules() if n]
    rules = per_module(plan, names)
    gathered = {
        n
        for n, r in rules.items()
        if r.style == "colwise" and r.output == "replicate" and r.why.startswith(_GATHERED)
    }
    if not gathered:
        return plan
    args, kwargs = example_call(model, example_inputs)
    modules = dict(model.named_modules())
    holder = {n: _holder(n, modules) for n in gathered}
    roles = _roles(model, holder, args, kwargs)
    if roles is None:
        return plan
    candidates = _candidates(holder, roles)
    if not candidates:
        return plan
    proven: dict[str, dict[str, Rule]] = {}
    for pieces in (1, 3, 2):
        trial = {m: c for m, c in candidates.items() if m not in proven}
        made: dict[str, dict[str, Rule]] = {}
        for m, (opens, closes) in trial.items():
            rewritten = _rewrite(model, rules, m, opens, closes, pieces, tp)
            if rewritten is not None:
                made[m] = rewritten
        if not made:
            continue
        found = collectives_inside(
            _with(plan, rules, made, names),
            model,
            tp_size=tp,
            args=args,
            kwargs=kwargs,
            modules={m: [*trial[m][0], *trial[m][1]] for m in made},
        )
        if found is None:
            continue
        for m in made:
            if found.get(m) == 0:
                proven[m] = made[m]
    if not proven:
        return plan
    return _with(plan, rules, proven, names)


def per_module(plan: Plan, names: list[str]) -> dict[str, Rule]:
    """{module: the rule that styles it} (the first that matches, as apply does)."""
    return {n: plan.rules[i] for n, i in match_rules(plan, names).owner.items()}


def call_fake(
    model: nn.Module, fake: FakeTensorMode, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """`model(*args, **kwargs)` with the tensors among them made fake tensors of `fake`."""

    def made(t: Any) -> Any:
        return fake.from_tensor(t) if isinstance(t, torch.Tensor) else t

    return model(*[made(a) for a in args], **{k: made(v) for k, v in kwargs.items()})


def collapsed(per: dict[str, Rule], names: list[str]) -> list[Rule]:
    """Rules from per-module ones: modules with equal rules under compact patterns, in
    module order (`names`)."""
    groups: dict[str, tuple[Rule, list[str]]] = {}
    for n in names:
        if n in per:
            key = per[n].model_copy(update={"match": "_"}).model_dump_json()
            groups.setdefault(key, (per[n], []))[1].append(n)
    return [
        r.model_copy(update={"match": p})
        for r, members in groups.values()
        for p in collapse(members, names)
    ]


def example_call(model: nn.Module, example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The (args, kwargs) the tracer calls the model with, as meta tensors."""
    from torch.utils._pytree import tree_map

    from ..trace.run import _example_inputs

    found = _example_inputs(model, example_inputs, torch.device("meta"))
    return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, found)


# ---- 1. roles --------------------------------------------------------------------------------
class _Taint(TorchFunctionMode):
    """Which gathered layers' outputs each tensor was computed from."""

    def __init__(self) -> None:
        super().__init__()
        self.of: dict[int, frozenset[str]] = {}
        self.keep: list[Any] = []  # tensors whose ids are keys: alive, so ids stay unique
        self.leaked: dict[int, tuple[str, frozenset[str]]] = {}  # id -> (holder, sources)
        self.used: dict[str, frozenset[str]] = {}  # holder -> what of it was used outside

    def note_use(self, tree: Any) -> None:
        """A tensor a holder handed out with split features in it, used after all."""
        for t in tree_flatten(tree)[0]:
            if isinstance(t, torch.Tensor) and id(t) in self.leaked:
                holder, found = self.leaked[id(t)]
                self.used[holder] = self.used.get(holder, frozenset()) | found

    def sources(self, tree: Any) -> frozenset[str]:
        leaves, _ = tree_flatten(tree)
        found: frozenset[str] = frozenset()
        for t in leaves:
            if isinstance(t, torch.Tensor):
                found |= self.of.get(id(t), frozenset())
        return found

    def mark(self, tree: Any, sources: frozenset[str]) -> None:
        leaves, _ = tree_flatten(tree)
        for t in leaves:
            if isinstance(t, torch.Tensor):
                self.of[id(t)] = sources
                self.keep.append(t)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.note_use((args, kwargs))
        out = func(*args, **kwargs)
        found = self.sources((args, kwargs))
        if found:
            self.mark(out, found | self.sources(out))
        return out


def _holder(name: str, modules: dict[str, nn.Module]) -> str:
    """The module a layer is a region member of: its parent, or the first ancestor that is
    not a container (diffusers' `attn.to_out.0` belongs to `attn`)."""
    parent = name.rpartition(".")[0]
    while parent and isinstance(modules[parent], (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        parent = parent.rpartition(".")[0]
    return parent


def _roles(
    model: nn.Module, holder: dict[str, str], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, tuple[str, frozenset[str]]] | None:
    """{gathered layer: ("open", {}) or ("close", the openers it read)}, and for each
    module holding them ("leaks", the gathered layers whose outputs reach its output). A
    layer reads only what gathered layers of its own holder made: a modulation computed
    elsewhere (a timestep's scale on the attention's input) opens or closes nothing here."""
    gathered = set(holder)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    copy_ = meta_copy(model, fake=fake).eval()
    modules = dict(copy_.named_modules())
    taint = _Taint()
    roles: dict[str, tuple[str, frozenset[str]]] = {}
    holders = set(holder.values())

    def pre(name: str) -> Any:
        def hook(m: nn.Module, a: Any, kw: Any) -> None:
            read = frozenset(s for s in taint.sources((a, kw)) if holder[s] == holder[name])
            role = ("close", read) if read else ("open", frozenset())
            if roles.setdefault(name, role)[0] != role[0]:
                roles[name] = ("mixed", frozenset())

        return hook

    def post(name: str) -> Any:
        def hook(m: nn.Module, a: Any, kw: Any, out: Any) -> None:
            opened = roles.get(name, ("", frozenset()))[0] == "open"
            taint.mark(out, frozenset({name}) if opened else frozenset())

        return hook

    def leaving(name: str) -> Any:
        def hook(m: nn.Module, a: Any, out: Any) -> None:
            # what leaves it split is a leak only if something uses it (SD3's last block
            # hands back its context's attention output, which its caller drops)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    found = frozenset(s for s in taint.sources(t) if holder[s] == name)
                    if found:
                        taint.leaked[id(t)] = (name, found)

        return hook

    handles = []
    for n in gathered:
        handles.append(modules[n].register_forward_pre_hook(pre(n), with_kwargs=True))
        handles.append(modules[n].register_forward_hook(post(n), with_kwargs=True))
    for h in holders:
        handles.append(modules[h].register_forward_hook(leaving(h)))
    try:
        with quiet_fake_tensor_log(), fake, taint, torch.no_grad():
            taint.note_use(call_fake(copy_, fake, args, kwargs))  # the output is a use
    except Exception:
        return None
    finally:
        for handle in handles:
            handle.remove()
    for h, found in taint.used.items():
        roles[f"{h}>"] = ("leaks", found)
    return roles


def _candidates(
    holder: dict[str, str], roles: dict[str, tuple[str, frozenset[str]]]
) -> dict[str, tuple[list[str], list[str]]]:
    """{module: (openers, closers)} where every gathered layer the module holds took one
    role, each closer read only this module's openers, every opener was read by a closer,
    and nothing the openers made leaves the module unclosed."""
    by_holder: dict[str, list[str]] = {}
    for n in sorted(holder):
        by_holder.setdefault(holder[n], []).append(n)
    out = {}
    for held, layers in by_holder.items():
        if not held or f"{held}>" in roles:
            continue
        if any(roles.get(n, ("", frozenset()))[0] not in ("open", "close") for n in layers):
            continue
        opens = [n for n in layers if roles[n][0] == "open"]
        closes = [n for n in layers if roles[n][0] == "close"]
        read = frozenset().union(*(roles[c][1] for c in closes)) if closes else frozenset()
        if opens and closes and read == set(opens):
            out[held] = (opens, closes)
    return out


# ---- 2. candidates as rules ----------------------------------------------------------------
def _rewrite(
    model: nn.Module,
    rules: dict[str, Rule],
    holder: str,
    opens: list[str],
    closes: list[str],
    pieces: int,
    tp: int,
) -> dict[str, Rule] | None:
    """The region's rules: openers colwise handing DTensors on (cut into `pieces` equal
    fused pieces when more than 1), closers rowwise; None when the pieces do not fit."""
    out = {}
    by = ", ".join(n[len(holder) + 1 :] for n in opens)
    to = ", ".join(n[len(holder) + 1 :] for n in closes)
    for o in opens:
        given = rules[o].parts
        features = sum(given) if given else _out_features(model, o)
        if features is None:
            return None
        parts = None
        if pieces > 1:
            if features % (pieces * tp):
                return None
            parts = [features // pieces] * pieces
        split = (
            f"as {pieces} fused pieces of {features // pieces}, each rank its slice of every piece, "
            if parts
            else ""
        )
        out[o] = Rule(
            match=o,
            style="colwise",
            parts=parts,
            transposed=rules[o].transposed,
            local_output=False,
            why=(
                f"its {features} output features are split {split}and stay a DTensor through "
                f"the module's own code (a DTensor region) to {to}, which contracts them "
                "(rowwise)"
            ),
        )
    for c in closes:
        out[c] = Rule(
            match=c,
            style="rowwise",
            transposed=rules[c].transposed,
            why=(
                f"contracts the features split by {by}, which reach it as a DTensor; its "
                "output is a partial sum, one all-reduce"
            ),
        )
    return out


def _out_features(model: nn.Module, name: str) -> int | None:
    m = model.get_submodule(name)
    n = getattr(m, "out_features", None)
    if isinstance(n, int):
        return n
    w = getattr(m, "weight", None)
    return int(w.shape[0]) if isinstance(w, torch.Tensor) and w.dim() == 2 else None


def _with(
    plan: Plan, rules: dict[str, Rule], regions: dict[str, dict[str, Rule]], names: list[str]
) -> Plan:
    """The plan with each region's rules in place of its layers' old ones, and the regions
    listed; rules are collapsed to patterns again, in module order."""
    per = dict(rules)
    for new in regions.values():
        per.update(new)
    new_rules = collapsed(per, names)
    kinds: dict[str, list[str]] = {}
    for m, made in regions.items():
        opens = [n for n, r in made.items() if r.style == "colwise"]
        closes = [n for n, r in made.items() if r.style == "rowwise"]
        why = (
            f"runs on DTensors from {', '.join(o[len(m) + 1 :] for o in opens)} to "
            f"{', '.join(c[len(m) + 1 :] for c in closes)}: its code sizes the split "
            "features by what no attribute a plan may divide holds, so it sees global shapes "
            "and DTensor carries the split; proven on fake ranks with no collective inside "
            "it but the closers' sums"
        )
        kinds.setdefault(why, []).append(m)
    region_rules = [
        RegionRule(match=p, why=why) for why, ms in kinds.items() for p in collapse(ms, names)
    ]
    return plan.model_copy(update={"rules": new_rules, "regions": region_rules, "tpplan": 8})
