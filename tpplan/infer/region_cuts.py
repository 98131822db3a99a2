"""Which of a module's split-and-gathered layers open a DTensor region and which close it,
read off one forward on fake tensors (step 1 of dtensor_regions.py).

Start at `cuts`: `_reads` follows which gathered layers' outputs reach which layers'
inputs, `_candidates` turns that into the ways to cut each module (`Cut`): openers,
closers, and layers kept whole.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .._runtime.fake import meta_copy
from .._runtime.torch_compat import FakeTensorMode, tree_flatten
from ..check.blame import MetaKernels
from ..compile.region_pieces import CUTS, cut_spans
from ..trace import quiet_fake_tensor_log

__all__ = ["Cut", "ParamDims", "call_fake", "cuts", "param_dims"]


def cuts(
    model: nn.Module,
    gathered: set[str],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    raw: set[str] = frozenset(),  # type: ignore[assignment]
    dims: dict[str, ParamDims] | None = None,
    bounds: dict[str, set[int]] | None = None,
) -> dict[str, list[Cut]] | None:
    """{module: the ways to make it a region, first first} for the modules holding
    `gathered` layers or the `raw` parameters (`module.param`, used by its own code in a
    matmul or einsum, where each use is a call of a layer); None when the fake forward
    fails. `dims` receives, for each raw parameter used, the dims it may be split on;
    `bounds`, for each gathered layer whose features the code cuts apart, where it cuts
    them (the bounds of its fused pieces)."""
    modules = dict(model.named_modules())
    holder = {n: _holder(n, modules) for n in gathered}
    holder.update({n: n.rpartition(".")[0] for n in raw})
    found = _reads(model, holder, args, kwargs, raw, {} if dims is None else dims)
    if found is None:
        return None
    calls, used, cut_at = found
    if bounds is not None:
        bounds.update(cut_at)
    return _candidates(holder, calls, used)


class ParamDims(NamedTuple):
    """The dims of a raw parameter that its matmul or einsum calls keep in their output (it
    opens a split there) and contract with the other operand (it closes one), in the order
    to try them."""

    opens: tuple[int, ...]
    closes: tuple[int, ...]


def param_dims(func: Any, args: tuple[Any, ...], param: torch.Tensor) -> ParamDims | None:
    """Where `func(*args)` lets `param` open or close a split: a matmul's operand (`x @ w`:
    w's columns open, its rows close), a linear's weight (rows open, columns close), an
    einsum's operand (letters only it and the output hold open, letters only it and the
    other operand hold close). None for any other use."""
    operands = [a for a in args if isinstance(a, torch.Tensor)]
    nd = param.dim()
    if func in _LINEARS:
        return ParamDims((0,), (1,)) if nd == 2 and operands[1:2] == [param] else None
    if func in _MATMULS and len(operands) == 2 and nd >= 2:
        right = operands[1] is param if func not in _RMATMULS else operands[0] is param
        return ParamDims((nd - 1,), (nd - 2,)) if right else ParamDims((nd - 2,), (nd - 1,))
    if func in _EINSUMS and args and isinstance(args[0], str):
        ops = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        return _einsum_dims(args[0], list(ops), param)
    return None


def _einsum_dims(eq: str, ops: list[Any], param: torch.Tensor) -> ParamDims | None:
    eq = eq.replace(" ", "")
    if "->" not in eq or "." in eq or len(ops) != 2:
        return None
    ins, out = eq.split("->")
    letters = ins.split(",")
    at = next((i for i, t in enumerate(ops) if t is param), None)
    if at is None or len(letters) != 2 or len(letters[at]) != param.dim():
        return None
    mine, other = letters[at], letters[1 - at]
    opens = tuple(i for i, c in enumerate(mine) if c in out and c not in other)
    closes = tuple(i for i, c in enumerate(mine) if c in other and c not in out)
    return ParamDims(opens, closes)


_LINEARS = frozenset((F.linear,))
_RMATMULS = frozenset((torch.Tensor.__rmatmul__,))
_MATMULS = (
    frozenset(
        (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm)
    )
    | _RMATMULS
)
_EINSUMS = frozenset((torch.einsum,))
_VIEWS = frozenset((torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.unflatten))
_UNBINDS = frozenset((torch.Tensor.unbind, torch.unbind, torch.Tensor.chunk, torch.chunk))


def call_fake(
    model: nn.Module, fake: FakeTensorMode, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """`model(*args, **kwargs)` with the tensors among them made fake tensors of `fake`."""

    def made(t: Any) -> Any:
        return fake.from_tensor(t) if isinstance(t, torch.Tensor) else t

    return model(*[made(a) for a in args], **{k: made(v) for k, v in kwargs.items()})


# ---- reads --------------------------------------------------------------------------------
class _Taint(TorchFunctionMode):
    """Which gathered layers' outputs each tensor was computed from."""

    def __init__(
        self, params: dict[int, str] | None = None, dims: dict[str, ParamDims] | None = None
    ) -> None:
        super().__init__()
        self.params = params or {}  # id of a raw parameter -> its name
        self.dims = {} if dims is None else dims
        self.calls: list[tuple[str, frozenset[str]]] = []
        self.of: dict[int, frozenset[str]] = {}
        self.keep: list[Any] = []  # tensors whose ids are keys: alive, so ids stay unique
        self.leaked: dict[int, tuple[str, frozenset[str]]] = {}  # id -> (holder, sources)
        self.used: dict[str, frozenset[str]] = {}  # holder -> what of it was used outside
        # a layer's output and the runs cut from its features: id -> (layer, first feature)
        self.runs: dict[int, tuple[str, int]] = {}
        # such a run viewed with its features as (k, ...): id -> (layer, first, width, dim, k)
        self.viewed: dict[int, tuple[str, int, int, int, int]] = {}
        self.bounds: dict[str, set[int]] = {}  # layer -> where the code cuts its features

    def output(self, name: str, out: Any) -> None:
        """A gathered layer's output: the code's cuts of its features are followed."""
        if isinstance(out, torch.Tensor) and out.dim() >= 1:
            self.runs[id(out)] = (name, 0)
            self.keep.append(out)

    def _follow(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Where `func` cuts a layer's features (or a run of them) apart: split, chunk, a
        slice or narrow of the last dim, or a view of it as (k, ...) unbound or chunked at
        its k: noted as bounds of the layer's fused pieces."""
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor):
            return
        at = self.runs.get(id(x))
        if at is not None and func in CUTS:
            spans = cut_spans(func, x, args[1:], kwargs)
            outs = [out] if isinstance(out, torch.Tensor) else list(out)
            if spans is None or len(spans) != len(outs):
                return
            layer, first = at
            for (a, b), t in zip(spans, outs, strict=True):
                self.bounds.setdefault(layer, set()).update((first + a, first + b))
                self.runs[id(t)] = (layer, first + a)
                self.keep.append(t)
            return
        if at is not None and func in _VIEWS and isinstance(out, torch.Tensor):
            d, width = x.dim() - 1, x.shape[-1]
            if (
                out.dim() > x.dim()
                and out.shape[:d] == x.shape[:d]
                and out.shape[d:].numel() == width
            ):
                self.viewed[id(out)] = (at[0], at[1], width, d, out.shape[d])
                self.keep.append(out)
            return
        seen = self.viewed.get(id(x))
        if seen is not None and func in _UNBINDS:
            layer, first, width, d, k = seen
            chunk = func in (torch.Tensor.chunk, torch.chunk)
            dim = kwargs.get("dim", ((args[2:3] if chunk else args[1:2]) or (0,))[0])
            count = len(out) if isinstance(out, (tuple, list)) else 0
            if isinstance(dim, int) and dim % x.dim() == d and count == k:
                self.bounds.setdefault(layer, set()).update(
                    first + i * width // k for i in range(k + 1)
                )

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
        used = self._param_calls(func, args, kwargs)
        out = func(*args, **kwargs)
        if used:  # what a raw weight's call makes is its own, as a layer's output is
            self.mark(out, used)
            return out
        found = self.sources((args, kwargs))
        if found:
            self.mark(out, found | self.sources(out))
        if self.runs:
            self._follow(func, args, kwargs, out)
        return out

    def _param_calls(self, func: Any, args: Any, kwargs: Any) -> frozenset[str]:
        """The raw parameters `func` takes as a layer takes its weight, each noted as a
        call reading what the other operands were computed from."""
        if not self.params:
            return frozenset()
        used = set()
        for t in tree_flatten((args, kwargs))[0]:
            name = self.params.get(id(t)) if isinstance(t, torch.Tensor) else None
            if name is None:
                continue
            dims = param_dims(func, tuple(args), t)
            if dims is None:
                continue
            known = self.dims.get(name)
            if known is not None and known != dims:
                dims = ParamDims(
                    tuple(d for d in known.opens if d in dims.opens),
                    tuple(d for d in known.closes if d in dims.closes),
                )
            self.dims[name] = dims
            self.calls.append((name, self.sources((args, kwargs))))
            used.add(name)
        return frozenset(used)


def _holder(name: str, modules: dict[str, nn.Module]) -> str:
    """The module a layer is a region member of: its parent, or the first ancestor that is
    not a container (diffusers' `attn.to_out.0` belongs to `attn`)."""
    parent = name.rpartition(".")[0]
    while parent and isinstance(modules[parent], (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        parent = parent.rpartition(".")[0]
    return parent


def _reads(
    model: nn.Module,
    holder: dict[str, str],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    raw: set[str],
    dims: dict[str, ParamDims],
) -> tuple[list[tuple[str, frozenset[str]]], dict[str, frozenset[str]], dict[str, set[int]]] | None:
    """The calls of the gathered layers (and uses of the raw parameters), in order, each
    with the gathered layers whose outputs reached its inputs; {holder: the layers in it
    (or in holders inside it) whose outputs reach what it hands back and its caller uses};
    and {gathered layer: where the code cuts its features}. None when the fake forward
    fails."""
    gathered = set(holder) - raw
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    copy_ = meta_copy(model, fake=fake).eval()
    modules = dict(copy_.named_modules())
    params = {id(copy_.get_parameter(n)): n for n in raw}
    taint = _Taint(params, dims)
    calls = taint.calls

    def pre(name: str) -> Any:
        def hook(m: nn.Module, a: Any, kw: Any) -> None:
            calls.append((name, taint.sources((a, kw))))

        return hook

    def post(name: str) -> Any:
        def hook(m: nn.Module, a: Any, kw: Any, out: Any) -> None:
            taint.mark(out, frozenset({name}))
            taint.output(name, out)

        return hook

    def leaving(name: str) -> Any:
        def hook(m: nn.Module, a: Any, out: Any) -> None:
            # what leaves it split is a leak only if something uses it (SD3's last block
            # hands back its context's attention output, which its caller drops)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    found = frozenset(s for s in taint.sources(t) if _inside(holder[s], name))
                    if found:
                        taint.leaked[id(t)] = (name, found)

        return hook

    handles = []
    for n in gathered:
        handles.append(modules[n].register_forward_pre_hook(pre(n), with_kwargs=True))
        handles.append(modules[n].register_forward_hook(post(n), with_kwargs=True))
    for h in set(holder.values()):
        handles.append(modules[h].register_forward_hook(leaving(h)))
    try:
        # MetaKernels: the ops as the tracer runs them (experts' grouped matmul in fp32),
        # routing by `torch.where` on fake tensors as every token to every expert
        with (
            quiet_fake_tensor_log(),
            fake,
            taint,
            torch.no_grad(),
            MetaKernels(bounded_nonzero=True),
        ):
            taint.note_use(call_fake(copy_, fake, args, kwargs))  # the output is a use
    except Exception:
        return None
    finally:
        for handle in handles:
            handle.remove()
    return calls, taint.used, taint.bounds


class Cut(NamedTuple):
    """One way to make a module a region: its layers that open the split (colwise), close
    it (rowwise), and stay whole."""

    opens: list[str]
    closes: list[str]
    kept: list[str]
    readers: dict[str, list[str]]
    """{kept layer: the openers that read what it made}."""
    leaky: bool = False
    """What an opener made leaves the module unclosed and is used (attention weights
    averaged over the heads): the proof must find it summed over the ranks at the exit,
    never gathered."""
    shared: bool = False
    """The kept layers are openers narrower than the others, whose output every split head
    shares whole (multi-query attention's one key/value head, or fewer key/value heads than
    ranks), not layers an opener reads."""
    chained: tuple[str, ...] = ()
    """Closers whose output another closer reads (the split closed, then cut again inside
    the module): talking heads' mix of every head's scores before the softmax."""


def _candidates(
    holder: dict[str, str],
    calls: list[tuple[str, frozenset[str]]],
    leaks: dict[str, frozenset[str]],
) -> dict[str, list[Cut]]:
    """{module: the ways to try, first first} for each module holding gathered layers.

    A layer reads only what gathered layers of its own holder made: a modulation computed
    elsewhere (a timestep's scale on the attention's input) opens or closes nothing here.
    First, as the calls came: a layer that read none of the module's gathered layers
    opens, one that did closes, the closers' reads of openers are all the openers, and
    nothing an opener made leaves the module unclosed. Second, where a closer's
    output is itself read by a closer (DeepSeek's `wkv_a` -> norm -> `wkv_b` -> attention ->
    `wo`): the openers such a middle layer read stay whole, shared by every head, and the
    middle layer opens instead. A module inside another whose outputs only the outer one's
    closers read (Flux's single-stream attention, whose heads its block's `proj_out`
    contracts with the MLP's features) is part of the outer one's region (`_joined`)."""
    holder = _joined(holder, calls, leaks)
    roles, reads = _roles(holder, calls)
    by_holder: dict[str, list[str]] = {}
    for n in sorted(holder):
        by_holder.setdefault(holder[n], []).append(n)
    out: dict[str, list[Cut]] = {}
    for held, layers in by_holder.items():
        if not held or any(roles.get(n) not in ("open", "close") for n in layers):
            continue
        opens = [n for n in layers if roles[n] == "open"]
        closes = [n for n in layers if roles[n] == "close"]
        middle = [c for c in closes if any(c in reads[d] for d in closes)]
        cuts = [Cut(opens, closes, [], {}, chained=tuple(middle))]
        if middle:
            kept = sorted(frozenset().union(*(reads[m] for m in middle)))
            cuts.append(
                Cut(
                    sorted((set(opens) - set(kept)) | set(middle)),
                    [c for c in closes if c not in middle],
                    kept,
                    {k: [m for m in middle if k in reads[m]] for k in kept},
                )
            )
        leaked = leaks.get(held, frozenset())
        out[held] = [
            c._replace(leaky=bool(leaked & set(c.opens))) for c in cuts if _closed(c, reads, roles)
        ]
    return {m: cuts for m, cuts in out.items() if cuts}


def _inside(module: str, outer: str) -> bool:
    return module == outer or module.startswith(f"{outer}.")


def _roles(
    holder: dict[str, str], calls: list[tuple[str, frozenset[str]]]
) -> tuple[dict[str, str], dict[str, frozenset[str]]]:
    """{layer: "open", "close" or "mixed" (both, in different calls)} as the calls came,
    and {layer: the layers of its own holder it read}."""
    roles: dict[str, str] = {}
    reads: dict[str, frozenset[str]] = {}
    for n, found in calls:
        read = frozenset(s for s in found if holder[s] == holder[n])
        # a layer reading any of its holder's gathered layers closes (it may be a closer
        # whose output another closer reads: `_candidates` makes such middles open)
        role = "close" if read else "open"
        if roles.setdefault(n, role) != role:
            roles[n] = "mixed"
        reads[n] = reads.get(n, frozenset()) | read
    return roles, reads


def _joined(
    holder: dict[str, str],
    calls: list[tuple[str, frozenset[str]]],
    leaks: dict[str, frozenset[str]],
) -> dict[str, str]:
    """`holder` with each module whose openers' outputs leave it for the closers of the
    module around it (and for nothing else there) made part of that one: its layers all
    open there, and those closers are read by no closer, as a region's last layers are."""
    out = dict(holder)
    holders = set(holder.values())
    for h in sorted(holders, key=len, reverse=True):
        if not leaks.get(h):
            continue
        outer = max((p for p in holders if p != h and _inside(h, p)), key=len, default=None)
        if outer is None:
            continue
        mine = {n for n in out if out[n] == h}
        readers = {n for n, found in calls if found & mine and out[n] != h}
        trial = {n: outer if out[n] == h else out[n] for n in out}
        roles, reads = _roles(trial, calls)
        closes = {n for n in trial if trial[n] == outer and roles.get(n) == "close"}
        if (
            readers
            and all(trial[n] == outer for n in readers)
            and all(roles.get(n) == "open" for n in mine)
            and readers <= closes
            and not any(r in reads[c] for r in readers for c in closes)
        ):
            out = trial
    return out


def _closed(cut: Cut, reads: dict[str, frozenset[str]], roles: dict[str, str]) -> bool:
    """Every closer reads only openers (and layers kept whole), every opener is read by a
    closer, and kept layers are openers as called."""
    if not cut.opens or not cut.closes:
        return False
    if any(roles[k] != "open" for k in cut.kept):
        return False
    counted = set(cut.opens) | {n for n, r in roles.items() if r == "open"}
    read = frozenset().union(*((reads[c] - set(cut.kept)) & counted for c in cut.closes))
    return read == set(cut.opens)
