"""Forward hooks and class swaps on the traced copy: where module calls reach the trackers.

Start at `hook_layer`. Dispatch sees ops, not modules; these hooks tell the trackers when a
Linear or Embedding is called (`hook_layer`), when a module holding expert weights runs
(`hook_experts`), which integer attributes each forward reads (`watch_reads`,
`track_frames`), and whether a table's lookups run in nn.Embedding.forward's place
(`watch_lookup_places`). Each hook only hands what it sees to its tracker.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .._runtime.lookup import put_in_lookup_place
from .counted import Counted
from .split import Split
from .trackers import Trackers

__all__ = [
    "hook_attention",
    "hook_experts",
    "hook_layer",
    "track_frames",
    "under",
    "watch_lookup_places",
    "watch_reads",
]


def under(name: str, prefixes: Iterable[str]) -> bool:
    """`name` is a submodule of one of `prefixes`."""
    return any(name.startswith(f"{p}.") for p in prefixes)


# ---- nn.MultiheadAttention calls ------------------------------------------------------------
def hook_attention(st: Trackers, name: str, module: nn.MultiheadAttention) -> None:
    """torch's nn.MultiheadAttention, one step of the data flow like a Linear: its forward
    (F.multi_head_attention_forward) is torch's fixed computation, which the `heads` style
    runs split by heads with its output whole; ops inside it are not followed (`quiet`), so
    its parameters count as used by its own call, not "directly" by the model."""
    trace = st.trace

    def before(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        trace.layers.attention[name] = module.num_heads
        for x in (*args, *kwargs.values()):
            s = st.splits.split_of(x) if isinstance(x, torch.Tensor) else None
            if s is not None:
                trace.spans.break_(s.sources, "nn.MultiheadAttention takes its inputs whole")
        st.quiet += 1

    def after(mod: nn.Module, args: Any, out: Any) -> None:
        st.quiet -= 1
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                st.origins.computed(t)  # computed from the module's weights

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after)


# ---- Linear and Embedding calls -----------------------------------------------------------
def hook_layer(st: Trackers, name: str, module: nn.Module) -> None:
    """A Linear (or linear-like module) or an Embedding: its call opens or closes a split.
    Ops inside it are not followed (`quiet`): the layer is one step of the data flow."""
    trace = st.trace
    arrived: list[Split | None] = []  # the split of each call's input, until the call returns
    table = module if isinstance(module, nn.Embedding) else None

    def before(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        trace.layers.called.add(name)
        x = args[0] if args else next(iter(kwargs.values()), None)
        if table is not None:
            st.lookups.enter(name)
            st.splits.arrive_at_lookup(x)
        else:
            p = st.experts.partial_of(x)
            if p:
                trace.spans.break_(p, "a Linear takes the experts' partial sums")
            st.splits.arrive(name, x, contracted=1 if name in trace.layers.channels else -1)
        st.quiet += 1
        arrived.append(st.splits.split_of(x))

    def after(mod: nn.Module, args: Any, out: Any) -> None:
        st.quiet -= 1
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            st.origins.computed(out)  # computed from the module's weight
        if table is not None:
            st.lookups.leave(name, out)
        unsplit = arrived.pop() is None
        if name in trace.layers.linears and unsplit and isinstance(out, torch.Tensor):
            at = 1 if name in trace.layers.channels else -1
            st.splits.open_linear(name, out, trace.layers.linears[name][1], at=at)
        elif (
            table is not None
            and trace.lookups.token_ids.get(name) is False
            and isinstance(out, torch.Tensor)
            and out.shape[-1] == table.embedding_dim
        ):
            # A table looked up at computed positions (T5's relative position bias, one
            # column per head) may be split by its columns like a Linear's outputs.
            st.splits.open(name, out, table.embedding_dim, "embedding")

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after)


# ---- modules holding expert weights -------------------------------------------------------
def hook_experts(
    st: Trackers, name: str, module: nn.Module, *, sums: bool = True, holders: Iterable[str] = ()
) -> None:
    """Watch a module holding 3-D expert weights: what comes in (routing, for expert
    parallel), whether what goes out is the sum of partial sums, which attribute holds its
    number of experts. With `sums` false its parent, holding more expert weights in other
    children, is the one whose output sums the partial sums; for that parent, `holders`
    are those children."""
    # its own parameters, and those of children holding expert weights for it
    own = {f"{name}.{p}" if name else p for p, _ in module.named_parameters()}
    experts = {p.shape[0] for p in module.parameters() if p.dim() == 3}

    def before(mod: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        st.experts.enter(name, args, kwargs, experts=experts)

    def after(mod: nn.Module, args: Any, out: Any) -> None:
        # before `track_frames` pops this forward's frame: hooks run in registration order
        frame = st.reads.frames[-1] if st.reads.frames else []
        st.experts.leave(name, out, frame, experts=experts, own=own, sums=sums)

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after)
    for child, m in module.named_modules():
        full = f"{name}.{child}" if name else child
        # (one inside a child holding expert weights is that child's)
        if child and next(m.parameters(), None) is None and not under(full, holders):
            _hook_whole_output(st, full, name, m)


def _hook_whole_output(st: Trackers, name: str, owner: str, module: nn.Module) -> None:
    """Watch a parameter-free submodule of an experts module: an output it makes whole (not
    split, not a partial sum) is the same on every rank, and if it is added to the experts'
    partial sums, the plan scales it by 1/tp (`ExpertFacts.added_whole`)."""

    def after(mod: nn.Module, args: Any, kwargs: dict[str, Any], out: Any) -> Any:
        if st.experts.partial_of(out) is not None:
            return None
        return st.whole_outputs.note_output(name, owner, args, kwargs, out)

    module.register_forward_hook(after, with_kwargs=True)


# ---- integer attributes read in forward ---------------------------------------------------
_READS = "_tpplan_reads"
_WATCHING: dict[type, type] = {}


def _watched(cls: type) -> type:
    """A subclass of `cls` that logs reads of integer attributes (see `watch_reads`)."""
    sub = _WATCHING.get(cls)
    if sub is None:

        def __getattribute__(self: Any, attr: str) -> Any:
            value = super(sub, self).__getattribute__(attr)  # type: ignore[arg-type]
            if type(value) is int:
                log = object.__getattribute__(self, "__dict__").get(_READS)
                if log is not None:
                    log[0].read(log[1], attr, value)
                    # the forward gets a number that remembers it is this attribute
                    return Counted.read(log[1], attr, value)
            elif not isinstance(value, (torch.Tensor, nn.Module)):
                log = object.__getattribute__(self, "__dict__").get(_READS)
                if log is not None and id(value) in log[2]:
                    return _shared_view(value, log[0], log[1], attr)
            return value

        sub = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__})
        sub.__qualname__ = cls.__qualname__
        sub.__module__ = cls.__module__
        _WATCHING[cls] = sub
    return sub


_PLAIN = (int, float, str, bytes, bool, torch.Tensor, nn.Module, type, list, tuple, dict, set)


def _shared_object(value: Any) -> bool:
    """An object of attributes (a config), not a number, tensor, module, container or
    function."""
    return (
        value is not None
        and not isinstance(value, _PLAIN)
        and not callable(value)
        and type(value).__module__ != "builtins"
        and isinstance(getattr(value, "__dict__", None), dict)
    )


def _shared_view(value: Any, reads: Any, module: str, attr: str) -> Any:
    """`value`, an object of attributes several modules hold (a config every layer shares),
    seen through `module.attr`: an instance of a subclass of its class over the same
    attributes, whose integer attributes read as `attr.name` of `module` (`cfg.n_head`), so
    that a size computed from one is traced to it and the plan can divide it on that
    module's own copy. Anything that will not take it is handed on as it is."""
    cls = type(value)
    key = (cls, module, attr)
    # one subclass per trace (the reads it logs to), module and name
    views: dict[tuple[type, str, str], type] = reads.__dict__.setdefault("_tpplan_views", {})
    sub = views.get(key)
    if sub is None:

        def __getattribute__(self: Any, name: str) -> Any:
            got = super(sub, self).__getattribute__(name)  # type: ignore[arg-type]
            if type(got) is int and not name.startswith("_"):
                reads.read(module, f"{attr}.{name}", got)
                return Counted.read(module, f"{attr}.{name}", got)
            return got

        sub = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__})
        sub.__qualname__, sub.__module__ = cls.__qualname__, cls.__module__
        views[key] = sub
    try:
        view: Any = object.__new__(sub)
        object.__setattr__(view, "__dict__", value.__dict__)
    except (TypeError, AttributeError):
        return value
    return view


def watch_reads(model: nn.Module, st: Trackers) -> None:
    """Make the modules of the traced copy log every integer attribute their forward reads
    (`AttributeReads.read`), so that a number given to an op can be traced to the attribute
    it came from (`view(B, T, self.n_head, hd)`, `split(self.split_size)`), and a number that
    only happens to equal some attribute is not mistaken for it. An object of attributes a
    module holds (a config, which the layers often share) logs its integer attributes as
    `name.attribute` of the module reading it through `name` (`_shared_view`)."""
    for name, m in model.named_modules():
        shared = frozenset(id(v) for v in m.__dict__.values() if _shared_object(v))
        m.__dict__[_READS] = (st.reads, name, shared)
        m.__class__ = _watched(type(m))


def track_frames(st: Trackers, name: str, module: nn.Module) -> None:
    """Give each running forward its own frame of attribute reads, and note that it ran and
    which tensor it was first given (`LayerFacts.entries`)."""

    def enter(mod: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        st.reads.enter()
        st.trace.layers.ran.add(name)
        st.trace.layers.positional.setdefault(name, len(args))
        if name not in st.trace.layers.entries:
            # where its first tensor input came in, and which tensor it was
            found: list[tuple[int | str, torch.Tensor]]
            found = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            found += [(k, a) for k, a in kwargs.items() if isinstance(a, torch.Tensor)]
            if found:
                where, tensor = found[0]
                st.trace.layers.entries[name] = (where, id(tensor))
                st.origins.held.append(tensor)

    def leave(mod: nn.Module, args: Any, out: Any) -> None:
        st.reads.leave()

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(leave, always_call=True)


# ---- lookups in nn.Embedding.forward's place ----------------------------------------------
class _LookupPlace(nn.Embedding):
    """nn.Embedding's place in a traced table's class order: says when a lookup runs there."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        places, name = self.__dict__["_tpplan_place"]
        places.append(name)
        try:
            return nn.Embedding.forward(self, input)
        finally:
            places.pop()


def watch_lookup_places(model: nn.Module, st: Trackers) -> None:
    """Give each Embedding subclass with a forward of its own (in the traced copy) a class
    with `_LookupPlace` where nn.Embedding was: the place `SumAtLookup` takes when applied,
    so the trace sees whether every lookup goes there (a `super().forward(ids)`) or around
    it (an `F.embedding` of its own)."""
    for name, m in model.named_modules():
        if isinstance(m, nn.Embedding) and type(m).forward is not nn.Embedding.forward:
            put_in_lookup_place(m, _LookupPlace)
            m.__dict__["_tpplan_place"] = (st.lookups.places, name)
            st.lookups.own_forward.add(name)
