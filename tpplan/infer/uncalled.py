"""Parts of the model its traced forward did not call (a vision tower given text only): the
trace says nothing of them, so they are decided another way, or kept whole with the reason.

Start at `infer_uncalled_parts`, which api.py calls after the decisions of the traced
forward. Two ways, tried in this order:
- `copy_from_alike`: a part beside an alike part that ran takes its decisions. Alike: of one
  structure (trace's `block_structure`: class, parameter shapes, submodules), so the same
  code on the same shapes.
- `infer_uncalled_parts`: a part is traced on its own, from inputs made for its own forward.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from torch import nn

from .._runtime.inputs import part_inputs
from ..errors import TpplanError
from ..trace import Trace, block_structure, idle_roots
from .decision import NOT_CALLED, Attributes, Decisions, reasoned
from .names import inside, tied_outside
from .spans import find_spans

__all__ = ["InferPart", "copy_from_alike", "infer_uncalled_parts"]

# infer_plan's decisions for a part of the model, traced on the given inputs as a model
InferPart = Callable[[nn.Module, Any], tuple[Decisions, Attributes]]


def _closed_inside(trace: Trace, spans: list[list[str]], root: str) -> bool:
    """Every span that touches `root` opens and closes inside it: its outputs are whole."""
    return not any(inside(o, root) for o in trace.spans.at_output) and all(
        all(inside(m, root) for m in members) or not any(inside(m, root) for m in members)
        for members in spans
    )


def copy_from_alike(
    model: nn.Module,
    decisions: Decisions,
    attributes: Attributes,
    trace: Trace,
    ran: set[str],
    shared: dict[str, list[str]],
) -> tuple[Decisions, Attributes]:
    """A part that did not run, called by a module that did, beside an alike part that ran:
    the same module types and parameter shapes (ERNIE 4.5 VL's vision experts beside its
    text experts, given text only). Same code on the same shapes, so the decisions of the
    one that ran hold for it, provided every span in that one opens and closes inside it
    (its outputs are then whole, whoever uses them) and none of the part's parameters was
    used directly or is shared with the rest. Returns the decisions and attributes with the
    copies."""
    decisions, attributes = dict(decisions), dict(attributes)
    modules = dict(model.named_modules())
    used = trace.params.outside | set(trace.params.in_span)
    spans = find_spans(trace)
    alike_that_ran: dict[Any, str] = {}
    for name in sorted(ran):
        if name and name in modules and next(modules[name].parameters(), None) is not None:
            alike_that_ran.setdefault(block_structure(modules[name]), name)
    for name, module in modules.items():
        if not name or name in ran or name.rpartition(".")[0] not in ran:
            continue
        if next(module.parameters(), None) is None or any(inside(p, name) for p in used):
            continue
        if tied_outside(shared, name):
            continue  # tied to the rest: apply keeps it with the copy that ran
        source = alike_that_ran.get(block_structure(module))
        if source is None or not _closed_inside(trace, spans, source):
            continue
        why = f"as {source}, which has the same structure and ran (the model's forward did not call this one)"
        for n, d in list(decisions.items()):
            target = name + n[len(source) :]
            if inside(n, source) and decisions.get(target, d).why in (d.why, NOT_CALLED):
                decisions[target] = reasoned(d, f"{d.why}; {why}")
        for n, a in list(attributes.items()):
            if inside(n, source):
                attributes.setdefault(name + n[len(source) :], a)
    return decisions, attributes


def _uncalled_roots(decisions: Decisions, ran: set[str]) -> list[str]:
    """The largest submodules that did not run in the traced forward and hold no layer that
    did (a multimodal model's vision tower, given text only): the model's own forward says
    nothing of them."""
    uncalled = {n for n, d in decisions.items() if d.why == NOT_CALLED}
    return idle_roots(uncalled, ran | (decisions.keys() - uncalled))


def infer_uncalled_parts(
    model: nn.Module,
    decisions: Decisions,
    attributes: Attributes,
    ran: set[str],
    shared: dict[str, list[str]],
    used: set[str],
    infer: InferPart,
) -> tuple[Decisions, Attributes]:
    """Each part of the model its forward did not call is traced on its own, from inputs
    made for its own forward signature and config (a vision tower's pixel values), and
    split by what that trace shows. Its outputs are then its own model outputs: whatever
    splits inside closes inside, so the rest of the model receives whole tensors. A part
    that cannot run alone is tried child by child (an image embedding that needs image
    sizes may hold a tower that needs pixels only). A part that shares a parameter with
    the rest, whose parameters the forward uses directly, or that nothing in it can run
    alone, stays whole with the reason. Returns the decisions and attributes with theirs."""
    decisions, attributes = dict(decisions), dict(attributes)

    def under(root: str) -> list[str]:
        return [n for n in decisions if inside(n, root)]

    def attempt(root: str) -> str | None:
        """Split what can be split under `root`; the reason its own trace failed, if it did."""
        part = model.get_submodule(root)
        prefix = root + "."
        if tied_outside(shared, root):
            return "it shares a parameter with the rest of the model, so it is not split alone"
        if any(inside(p, root) for p in used):
            # (Jamba's dt_proj: the mixer multiplies by its weight without calling it)
            return "the model's forward uses its parameters directly, so it is not split alone"
        try:
            mine, attrs = infer(part, part_inputs(part))
        except TpplanError as e:
            # the error's first clause, less its advice to pass inputs, which the caller
            # of infer_plan cannot do for a part
            said = re.split(r"[;.] [Pp]ass ", str(e))[0]
            for child, _ in part.named_children():
                if any(decisions[n].why == NOT_CALLED for n in under(prefix + child)):
                    attempt(prefix + child)
            return f"traced on its own, it failed: {said}"
        own = "traced on its own (the model's forward did not call it)"
        full = lambda n: prefix + n if n else root  # noqa: E731 (a lone layer is its own root)
        for name, d in mine.items():
            if decisions.get(full(name), d).why == NOT_CALLED:
                # what the part's own forward did not call says so already
                nested = d.why.startswith(NOT_CALLED)
                decisions[full(name)] = d if nested else reasoned(d, f"{d.why}; {own}")
        attributes.update({full(n): a for n, a in attrs.items()})
        return None

    for root in _uncalled_roots(decisions, ran):
        why = attempt(root)
        for name in under(root):
            if why is not None and decisions[name].why == NOT_CALLED:
                decisions[name] = reasoned(decisions[name], f"{NOT_CALLED}; {why}")
    return decisions, attributes
