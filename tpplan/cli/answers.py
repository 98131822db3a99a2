"""The command line's answer cache: `tpplan check` asked the same question twice answers the
second time without importing torch.

An answer (the text a command printed on stdout and its exit code) is stored under a key
that hashes everything it depends on: the plan file's bytes, the MODEL spec and its config
file's bytes, every `--set`, the tp size, tpplan's own source files, and the installed
versions of torch, transformers and the packages that read plans. A MODEL that names the
user's own code (`package.module:callable`) cannot be hashed cheaply and safely, so its
answers are never stored. Start at `answer_key`.

The folder is `$TPPLAN_CACHE_DIR`, else `$XDG_CACHE_HOME/tpplan`, else `~/.cache/tpplan`. A
cache that cannot be read or written is never an error: the answer is computed instead.
Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from .._runtime.models import hub_cache, hub_folder
from ..plan.shipped import shipped_plan

__all__ = ["Answer", "answer_key", "cache_dir", "load_answer", "save_answer"]

_FORMAT = "tpplan-answer-1"  # bump when what an answer holds changes
# what decides an answer besides tpplan itself: models and their configs, plan parsing
_PACKAGES = ("torch", "transformers", "huggingface_hub", "pydantic", "PyYAML")


@dataclass(frozen=True)
class Answer:
    """What a command printed on stdout, and its exit code."""

    code: int
    out: str


def cache_dir() -> Path:
    """Where answers are kept, read from the environment now."""
    if os.environ.get("TPPLAN_CACHE_DIR"):
        return Path(os.environ["TPPLAN_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(base).expanduser() / "tpplan"


def answer_key(
    command: str, plan: str, model: str, overrides: Sequence[str], tp: int
) -> str | None:
    """The key of a command's answer, or None where it must not be cached: a MODEL of the
    user's own code, or a plan or config that cannot be read (computing says why)."""
    digest = hashlib.sha256()

    def add(*parts: str | bytes) -> None:
        for part in parts:
            data = part if isinstance(part, bytes) else part.encode("utf-8", "surrogateescape")
            digest.update(len(data).to_bytes(8, "little") + data)  # no two lists hash alike

    plan_bytes = _plan_bytes(plan)
    model_bytes = _model_bytes(model)
    if plan_bytes is None or model_bytes is None:
        return None
    add(_FORMAT, command, plan, plan_bytes, model, *model_bytes, str(tp), str(len(overrides)))
    add(*overrides)
    add(_source_hash(), sys.version, *(_version(p) for p in _PACKAGES))
    return digest.hexdigest()


def _plan_bytes(plan: str) -> bytes | None:
    """The bytes of the plan file load_plan would read (a shipped plan by its name)."""
    path = Path(plan)
    if len(path.parts) == 1 and not path.suffix and not path.exists():
        path = shipped_plan(plan) or path
    try:
        return path.read_bytes()
    except OSError:
        return None


def _model_bytes(spec: str) -> list[bytes] | None:
    """What the model a spec names is built from, besides the installed packages: a local
    config file's bytes; for a model type or id, the state of its folder in the local
    Hugging Face cache (which snapshot `main` names, and its config). None for user code."""
    path = Path(spec)
    try:
        if path.is_file():
            return [b"file", path.read_bytes()]
        if path.is_dir():
            return [b"folder", (path / "config.json").read_bytes()]
        if ":" in spec:
            return None  # package.module:callable: the user's code, imported from anywhere
        folder = hub_folder(spec)
        if not folder.is_dir():
            return [b"absent", str(hub_cache()).encode()]
        commit = (folder / "refs" / "main").read_text().strip()
        return [b"hub", str(folder).encode(), commit.encode(), _snapshot_config(folder, commit)]
    except (OSError, ValueError):
        return None


def _snapshot_config(folder: Path, commit: str) -> bytes:
    config = folder / "snapshots" / commit / "config.json"
    return config.read_bytes() if config.is_file() else b"no config"


def _source_hash() -> str:
    """A hash of tpplan's own source files: an edited tpplan answers anew."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parents[1]  # tpplan/
    for file in sorted(package.rglob("*.py")):
        digest.update(str(file.relative_to(package)).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def _version(package: str) -> str:
    try:
        return f"{package}=={metadata.version(package)}"
    except metadata.PackageNotFoundError:
        return f"{package} absent"


def _file(key: str) -> Path:
    return cache_dir() / "answers" / f"{key}.json"


def load_answer(key: str) -> Answer | None:
    """The stored answer of `key`; None when there is none or it cannot be read whole."""
    try:
        data = json.loads(_file(key).read_text(encoding="utf-8"))
        if data["key"] != key or not isinstance(data["out"], str):
            return None
        code = data["code"]
        return Answer(code, data["out"]) if isinstance(code, int) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_answer(key: str, answer: Answer) -> None:
    """Store an answer; a folder that cannot be written leaves it unstored, silently. The
    file is written whole under another name first, so a reader never sees half of one."""
    file = _file(key)
    temp = file.with_name(f"{file.name}.{os.getpid()}.tmp")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        temp.write_text(json.dumps({"key": key, "code": answer.code, "out": answer.out}))
        os.replace(temp, file)
    except OSError:
        with contextlib.suppress(OSError):
            temp.unlink(missing_ok=True)
