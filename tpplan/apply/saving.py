"""`save_pretrained` of a sharded model writes the unsharded model's files.

transformers' and peft's `save_pretrained` write the state dict they are handed, or the
model's own; a sharded model's holds DTensors, which safetensors cannot write (it fails
deep inside, "invalid python storage", after rank 0 has written the config). apply_plan
calls `gather_on_save`: each model in the tree whose class's `save_pretrained` takes a
`state_dict` gets one of its own that gathers the tensors the save writes, whole, hands
them to the class's method, and lets rank 0 alone write. Call it on every rank, as
transformers asks of a distributed save: each split tensor is one collective, and every rank
returns once the files are written (or raises when any rank failed).

A peft model saves its adapters only, so only the tensors peft picks for the adapter file
are gathered (peft itself is asked which, on the sharded state dict), never the frozen
base. A `state_dict=` the caller passes (Hugging Face's Trainer passes the model's own) is
gathered the same way, its plain tensors kept as they are.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .._runtime.gather import gather_named
from .._runtime.ranks import agree_on_failure, rank

__all__ = ["gather_on_save"]


def gather_on_save(model: nn.Module) -> None:
    """Give every module of `model` with a Hugging Face style `save_pretrained` (a PeftModel,
    a transformers model, the base model inside a PeftModel) the gathering one below."""
    for module in model.modules():
        if _takes_state_dict(module):
            module.save_pretrained = save_pretrained.__get__(module)


def save_pretrained(self: nn.Module, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
    """The class's own `save_pretrained`, writing the unsharded model's tensors: the state
    dict it saves has every DTensor gathered whole, and only rank 0 writes."""
    own = type(self).save_pretrained  # type: ignore[attr-defined]
    call = inspect.signature(own).bind(self, save_directory, *args, **kwargs)
    given = _argument(call, "state_dict")
    state = given if given is not None else self.state_dict(keep_vars=True)
    names = _saved_names(self, call, state) if _is_peft_model(self) else list(state)
    first = rank() == 0
    # rank 0 alone writes, so it alone keeps what was gathered; the others hand the save
    # the plain tensors only, which it reads but does not write
    tensors = [n for n in names if isinstance(state[n], torch.Tensor)]
    whole = gather_named(state, tensors, rank0_only=True)
    if not first:
        whole = {n: state[n].detach() for n in tensors if not isinstance(state[n], DTensor)}
    whole.update({n: state[n] for n in names if n not in tensors})  # (peft keeps some strings)
    _set_argument(call, "state_dict", whole)
    _set_argument(call, "is_main_process", first and _argument(call, "is_main_process", True))
    failure: BaseException | None = None
    try:
        out = own(*call.args, **call.kwargs)
    except Exception as e:  # a full disk on rank 0 must not leave the others waiting
        failure = e
    # every rank returns once rank 0 has written (a rank that reads the folder next finds
    # it whole), and every rank raises when one failed
    failure = agree_on_failure(failure)
    if failure is not None:
        raise failure
    return out


def _takes_state_dict(module: nn.Module) -> bool:
    """Whether the module's class saves through a `save_pretrained` that takes `state_dict`
    (transformers' names it, peft's reads it from its keyword arguments)."""
    own = getattr(type(module), "save_pretrained", None)
    if not callable(own):
        return False
    if _is_peft_model(module):
        return True
    try:
        return "state_dict" in inspect.signature(own).parameters
    except (TypeError, ValueError):  # a signature Python cannot read
        return False


def _is_peft_model(module: nn.Module) -> bool:
    peft = sys.modules.get("peft")  # a PeftModel exists only where its code was imported
    return peft is not None and isinstance(module, peft.PeftModel)


def _saved_names(
    model: nn.Module, call: inspect.BoundArguments, state: Mapping[str, Any]
) -> list[str]:
    """The names of `state` whose tensors peft writes to the adapter file, asked of peft's
    own selection for each adapter the save covers. Where peft hands back a tensor that is
    not one of `state`'s (a tuner that computes what it saves), every name, to be safe."""
    from peft.utils import get_peft_model_state_dict

    configs: dict[str, Any] = getattr(model, "peft_config", {})
    adapters = _argument(call, "selected_adapters") or list(configs)
    embeddings = _argument(call, "save_embedding_layers", "auto")
    picked: dict[int, Any] = {}
    for adapter in adapters:
        chosen = get_peft_model_state_dict(
            model, state_dict=dict(state), adapter_name=adapter, save_embedding_layers=embeddings
        )
        picked.update({id(v): v for v in chosen.values() if isinstance(v, torch.Tensor)})
    names = [n for n, t in state.items() if id(t) in picked]
    if len({id(state[n]) for n in names}) < len(picked):
        return list(state)
    return names


def _argument(call: inspect.BoundArguments, name: str, default: Any = None) -> Any:
    """An argument by name, whether the signature names it or takes it as **kwargs."""
    if name in call.signature.parameters:
        return call.arguments.get(name, default)
    return _extra(call).get(name, default)


def _set_argument(call: inspect.BoundArguments, name: str, value: Any) -> None:
    if name in call.signature.parameters:
        call.arguments[name] = value
    else:
        _extra(call)[name] = value


def _extra(call: inspect.BoundArguments) -> dict[str, Any]:
    """The **kwargs dict of the call (created empty when none were given)."""
    for p in call.signature.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            extra: dict[str, Any] = call.arguments.setdefault(p.name, {})
            return extra
    return {}
