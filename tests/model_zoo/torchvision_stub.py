"""A stand-in for torchvision, for timm's models on CPU torch.

timm imports torchvision when it is imported (`import timm` reaches
`torchvision.transforms` and `torchvision.ops.misc.FrozenBatchNorm2d`), and PyPI's
torchvision wheel is a CUDA build that cannot load beside the CPU torch 2.13 the project
tests against: `import torchvision` raises "operator torchvision::nms does not exist". timm
uses torchvision only for data transforms and FrozenBatchNorm2d, which the zoo's ViT and Swin
never touch, so a stand-in lets `import timm` succeed without changing what they compute.

`use_if_broken()` installs it only when `import torchvision` fails; a torchvision that loads
is used as it is. The stand-in's modules hand out `_Absent` for every name (a class, so
`isinstance` checks and class attributes work at import time) and a real `InterpolationMode`
enum (timm builds tables from its members when imported); making an `_Absent` raises.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__all__ = ["use_if_broken"]

InterpolationMode = enum.Enum(
    "InterpolationMode", "NEAREST NEAREST_EXACT BILINEAR BICUBIC BOX HAMMING LANCZOS"
)


class _AbsentMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return cls


class _Absent(metaclass=_AbsentMeta):
    """Any torchvision name: usable at import time, unusable at run time."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "torchvision is replaced by tests/model_zoo/torchvision_stub.py: its wheel does not "
            "load beside this CPU torch"
        )


class _Module(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return InterpolationMode if name == "InterpolationMode" else _Absent


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds every `torchvision[.sub]` module, as an empty package of `_Absent` names."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        leaf = fullname.rsplit(".", 1)[-1]
        # a capitalized leaf is a class imported by name (`from torchvision.datasets import
        # CIFAR10`), which `_Module.__getattr__` answers; it is not a module to make
        if fullname.split(".")[0] == "torchvision" and not leaf[:1].isupper():
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Module(spec.name)
        module.__path__ = []
        module.__version__ = "0.0+stub"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def use_if_broken() -> None:
    """Install the stand-in where `import torchvision` fails (missing, or PyPI's CUDA wheel
    beside CPU torch); leave a working torchvision alone. Safe to call more than once."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    try:
        import torchvision  # noqa: F401
    except Exception:  # ImportError when absent, RuntimeError from the CUDA wheel
        # a failed import leaves some of its submodules registered; the stand-in replaces all
        for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
            del sys.modules[name]
        sys.meta_path.insert(0, _Finder())
