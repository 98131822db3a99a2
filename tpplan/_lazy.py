"""Names a package loads on first use, so that importing it stays cheap: `tpplan` itself
imports no torch until a name needs it, and `check`/`compile` load their drivers only when
asked, so that a module importing one small part of them does not pay for the rest."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package` that loads each name of `table` (name -> the
    module holding it, relative to `package`) on first use and keeps it in the package."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        if name in table:
            value = getattr(importlib.import_module(table[name], package), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
