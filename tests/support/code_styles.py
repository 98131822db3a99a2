"""Tiny attention and MLP blocks written many ways, for issue 35's generator of code styles.

A `Spec` is a set of independent choices a model's author makes (Linear or raw parameters,
fused q|k|v and how it is cut, how heads are reshaped, where sizes come from, ...). `source`
writes the Python source of a residual model (embedding, then norm -> attention ->
add and norm -> MLP -> add per layer, a final norm and a vocabulary head) from those choices,
and `build` runs that source, so a failing case can print its own code. `megatron_exists`
says whether a Megatron split of the blocks exists at all (`why_not` says why not), the
ground truth the tracer is measured against. `measure_case` infers a plan for one case,
holds it to parity and decides whether each block was split the Megatron way.

Start at `Spec`, then `source`. tests/test_code_styles.py holds every case to parity;
benchmarks/code_styles.py reports, per choice, parity and the Megatron share.
"""

from __future__ import annotations

import copy
import importlib.util
import linecache
import time
import typing
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Literal

import torch
from model_zoo.measure import measure
from torch import nn
from torch.distributed.tensor import DTensor

import tpplan
from tpplan._runtime.local import rank_values, simulated_ranks
from tpplan.plan import Plan
from tpplan.plan.styles import ColwiseRule, ReplicateRule

from .blocks import token_ids
from .parity import assert_parity
from .plans import expand_rules

__all__ = [
    "AXES",
    "BLOCKS",
    "EINOPS",
    "SAMPLE",
    "VOCAB",
    "Outcome",
    "Spec",
    "build",
    "inputs",
    "measure_case",
    "megatron_exists",
    "source",
    "why_not",
]

EINOPS = importlib.util.find_spec("einops") is not None
"""einops forms are written only where einops is installed (it is no test dependency)."""

# Sizes: a width of 32, 4 heads of 8 (or 4 of 16 with a wider inner width, or 1 head), kv
# heads 2 (GQA) or 1 (MQA); tp 2 and 4 divide every width a Megatron split cuts.
VOCAB, WIDTH, MLP_WIDTH, LAYERS = 64, 32, 64, 1
EXPERTS, TOP_K, EXPERT_WIDTH = 4, 2, 32

BLOCKS = {"attention": r"layers\.\d+\.attn", "mlp": r"layers\.\d+\.mlp"}
"""{kind: module path regex} of the blocks measured, as tests/model_zoo's `Entry.blocks`."""


@dataclass(frozen=True)
class Spec:
    """One case: each field is one choice, independent of the others."""

    proj: Literal["linear", "matmul", "einsum", "conv"] = "linear"
    """Attention projections: nn.Linear; raw 2-D parameters used as `x @ w`; raw per-head
    3-D parameters in einsum (W_Q [heads, width, head_dim], W_O [heads, head_dim, width]; a
    fused q|k|v weight stays 2-D); or 1x1 nn.Conv1d over channels."""
    qkv: Literal["separate", "split", "slices", "chunk", "unbind"] = "separate"
    """Separate q, k, v projections, or one fused q|k|v cut by `split` (one size, or a list
    when kv is narrower), slices, `chunk` or a view then `unbind` (the narrower k|v part
    cut apart after q is split off)."""
    reshape: Literal["view", "reshape", "unflatten", "einops"] = "view"
    """How features become heads and back: view, reshape, unflatten/flatten, einops."""
    sizes: Literal["attr", "config", "shape", "literal"] = "attr"
    """Where forward reads head counts and widths: module attributes, a config object every
    layer shares, the tensors' shapes (-1, shape[-1] // 3) beside a head_dim attribute, or
    numbers written in the code."""
    layout: Literal["heads", "batch"] = "heads"
    """Attention on (B, heads, T, D), or with the heads moved into the batch dim (B*heads, T, D)."""
    attend: Literal["sdpa", "softmax", "talking"] = "sdpa"
    """scaled_dot_product_attention; an explicit softmax; or talking heads (the scores of
    all heads mixed by a heads x heads weight before the softmax)."""
    norm: Literal["none", "per_head", "over_heads"] = "none"
    """q/k RMSNorm: none, over head_dim (one weight for all heads), or over all heads'
    features at once (OLMo-2)."""
    reduce: Literal["none", "unused", "used"] = "none"
    """Attention weights averaged over heads: not computed, returned and dropped by the
    caller, or returned and added into the residual stream."""
    kv: Literal["mha", "gqa", "mqa"] = "mha"
    """Key/value heads: as many as query heads, half as many, or one."""
    heads: Literal["many", "one"] = "many"
    """4 heads, or a single head (then 1 kv head whatever `kv` says)."""
    inner: Literal["model", "wider"] = "model"
    """heads x head_dim equal to the model width (32), or set apart from it (64)."""
    mlp: Literal["plain", "gated", "gated_fused", "moe"] = "plain"
    """fc1 -> gelu -> fc2; silu(gate) * up -> down; gate|up fused and cut by chunk; or a
    mixture of 4 experts (top 2, 3-D expert weights, a loop over experts) after a router."""
    mlp_proj: Literal["linear", "param", "conv", "conv3"] = "linear"
    """MLP weights (not the experts'): nn.Linear, raw parameters in einsum, 1x1 nn.Conv1d, or
    3-wide nn.Conv1d over the tokens with an nn.GroupNorm of 4 groups on the first
    projection's channels (a resnet's pair; gated_fused takes no norm)."""

    @property
    def n_head(self) -> int:
        return 4 if self.heads == "many" else 1

    @property
    def n_kv(self) -> int:
        return {"mha": self.n_head, "gqa": max(1, self.n_head // 2), "mqa": 1}[self.kv]

    @property
    def head_dim(self) -> int:
        return (WIDTH if self.inner == "model" else 2 * WIDTH) // self.n_head

    @classmethod
    def of(cls, choices: Mapping[str, str]) -> Spec:
        """The spec of {choice: value}, the rest at the common form, from text (JSON, a
        command line); a choice or value not in `AXES` is refused, naming the choices."""
        for axis, value in choices.items():
            if value not in AXES.get(axis, ()):
                known = ", ".join(f"{a}={'|'.join(v)}" for a, v in AXES.items())
                raise ValueError(f"{axis}={value} is not a choice; the choices: {known}")
        return cls(**choices)  # type: ignore[arg-type]

    def label(self) -> str:
        """The choices that differ from the defaults, "default" for none."""
        base = Spec()
        diff = [f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) != getattr(base, f.name)]  # fmt: skip
        return ", ".join(diff) or "default"


AXES: dict[str, tuple[str, ...]] = {
    name: tuple(v for v in typing.get_args(hint) if v != "einops" or EINOPS)
    for name, hint in typing.get_type_hints(Spec).items()
}
"""{choice: its values}; einops forms only where einops is installed."""


def why_not(spec: Spec) -> str | None:
    """Why no Megatron split of the blocks exists (None when one does): one line."""
    if spec.n_head == 1:
        return "a single head: heads cannot be dealt out, and cutting head_dim splits q.k (an all-reduce of the scores inside attention)"
    if spec.attend == "talking":
        return "talking heads: every head's scores are mixed with the others' before the softmax, so each rank needs all heads"
    return None


def megatron_exists(spec: Spec) -> bool:
    """Whether the attention and MLP blocks can be split with no all-gather inside them and
    about 1/tp of their split weights per rank (kv heads fewer than tp shared whole)."""
    return why_not(spec) is None


# ---- the source ---------------------------------------------------------------------------
class _Say:
    """The expressions forward reads its sizes by, for `Spec.sizes`."""

    def __init__(self, s: Spec) -> None:
        self.s = s
        at = {"attr": "self.", "config": "cfg."}.get(s.sizes)
        self.unequal = s.n_kv != s.n_head
        if at is not None:
            kv = "n_kv" if self.unequal or s.sizes == "config" else "n_head"
            self.h, self.kvh, self.d = at + "n_head", at + kv, at + "head_dim"
            self.merged = f"{self.h} * {self.d}"
            self.groups = f"{self.h} // {self.kvh}"
            self.bh = f"b * {self.h}"
        elif s.sizes == "shape":
            self.h = self.kvh = self.merged = self.bh = "-1"
            self.d = "self.head_dim"
            self.groups = "q.shape[2] // k.shape[2]"
        else:
            self.h, self.kvh, self.d = str(s.n_head), str(s.n_kv), str(s.head_dim)
            self.merged = str(s.n_head * s.head_dim)
            self.groups = str(s.n_head // s.n_kv)
            self.bh = f"b * {s.n_head}"
        q_w, kv_w = s.n_head * s.head_dim, s.n_kv * s.head_dim
        self.q, self.kv = {
            "attr": ("self.q_size", "self.kv_size" if self.unequal else "self.q_size"),
            "config": ("cfg.n_head * cfg.head_dim", "cfg.n_kv * cfg.head_dim"),
            "shape": ("q_size", "kv_size"),
            "literal": (str(q_w), str(kv_w)),
        }[s.sizes]

    def heads(self, z: str, h: str, parts: int = 0) -> str:
        """(B, T, [parts *] h * D) -> (B, T, [parts,] h, D) in the form of `Spec.reshape`."""
        lead, dims = (
            (f"{parts}, ", f"({parts}, {h}, {self.d})") if parts else ("", f"({h}, {self.d})")
        )
        form = self.s.reshape
        if form == "unflatten":
            return f"{z}.unflatten(-1, {dims})"
        if form == "einops":
            pattern = "(s h d) -> b t s h d" if parts else "(h d) -> b t h d"
            more = f"s={parts}, " if parts else ""
            return f'rearrange({z}, "b t {pattern}", {more}d={self.d})'
        return f"{z}.{form}(b, t, {lead}{h}, {self.d})"

    def merge(self, z: str) -> str:
        """(B, T, H, D) -> (B, T, H * D)."""
        return {
            "view": f"{z}.contiguous().view(b, t, {self.merged})",
            "reshape": f"{z}.reshape(b, t, {self.merged})",
            "unflatten": f"{z}.flatten(2)",
            "einops": f'rearrange({z}, "b t h d -> b t (h d)")',
        }[self.s.reshape]


# output features of each projection, as __init__ writes them (from the config)
_WIDTHS = {
    "q": "cfg.n_head * cfg.head_dim",
    "k": "cfg.n_kv * cfg.head_dim",
    "v": "cfg.n_kv * cfg.head_dim",
    "qkv": "(cfg.n_head + 2 * cfg.n_kv) * cfg.head_dim",
}


def _attention_init(s: Spec) -> list[str]:
    w = _WIDTHS
    roles = ["qkv"] if s.qkv != "separate" else ["q", "k", "v"]
    out = []
    for r in roles:
        if s.proj == "linear":
            out.append(f"self.{r}_proj = nn.Linear(cfg.width, {w[r]})")
        elif s.proj == "conv":
            out.append(f"self.{r}_proj = nn.Conv1d(cfg.width, {w[r]}, 1)")
        elif s.proj == "einsum" and r != "qkv":
            h = "cfg.n_head" if r == "q" else "cfg.n_kv"
            out.append(f"self.w_{r} = nn.Parameter(torch.randn({h}, cfg.width, cfg.head_dim) * cfg.width**-0.5)")  # fmt: skip
        else:
            out.append(f"self.w_{r} = nn.Parameter(torch.randn(cfg.width, {w[r]}) * cfg.width**-0.5)")  # fmt: skip
    if s.proj == "linear":
        out.append(f"self.o_proj = nn.Linear({w['q']}, cfg.width)")
    elif s.proj == "conv":
        out.append(f"self.o_proj = nn.Conv1d({w['q']}, cfg.width, 1)")
    elif s.proj == "einsum":
        out.append("self.w_o = nn.Parameter(torch.randn(cfg.n_head, cfg.head_dim, cfg.width) * cfg.width**-0.5)")  # fmt: skip
    else:
        out.append(f"self.w_o = nn.Parameter(torch.randn({w['q']}, cfg.width) * cfg.width**-0.5)")
    if s.norm == "per_head":
        out += ["self.q_norm = nn.RMSNorm(cfg.head_dim)", "self.k_norm = nn.RMSNorm(cfg.head_dim)"]
    elif s.norm == "over_heads":
        out += [f"self.q_norm = nn.RMSNorm({w['q']})", f"self.k_norm = nn.RMSNorm({w['k']})"]
    if s.attend == "talking":
        out.append("self.talk = nn.Parameter(torch.eye(cfg.n_head) + 0.3 * torch.randn(cfg.n_head, cfg.n_head))")  # fmt: skip
    unequal = s.n_kv != s.n_head
    if s.sizes == "attr":
        out += ["self.n_head = cfg.n_head", "self.head_dim = cfg.head_dim"]
        out += ["self.n_kv = cfg.n_kv"] if unequal else []
        if s.qkv in ("split", "slices") or (s.qkv != "separate" and unequal):
            out.append("self.q_size = cfg.n_head * cfg.head_dim")
            out += ["self.kv_size = cfg.n_kv * cfg.head_dim"] if unequal else []
    elif s.sizes == "config":
        out.append("self.cfg = cfg  # the one config object every layer holds")
    elif s.sizes == "shape":
        out.append("self.head_dim = cfg.head_dim")
        out += ["self.groups = cfg.n_head // cfg.n_kv"] if unequal and s.qkv != "separate" else []
    return out


def _project(s: Spec, say: _Say) -> tuple[list[str], set[str]]:
    """Lines making q, k, v; and which of them come out as heads (B, T, h, D)."""

    def apply(r: str, z: str = "x") -> str:
        return {
            "linear": f"self.{r}_proj({z})",
            "conv": f"self.{r}_proj({z}.transpose(1, 2)).transpose(1, 2)",
            "matmul": f"{z} @ self.w_{r}",
            "einsum": f'torch.einsum("btc,cf->btf", {z}, self.w_{r})'
            if r == "qkv"
            else f'torch.einsum("btc,hcd->bthd", {z}, self.w_{r})',
        }[s.proj]

    if s.qkv == "separate":
        shape = "(B, T, h, D)" if s.proj == "einsum" else "(B, T, h * D)"
        lines = [f"{r} = {apply(r)}  # {shape}" for r in "qkv"]
        return lines, ({"q", "k", "v"} if s.proj == "einsum" else set())
    lines = [f"qkv = {apply('qkv')}  # (B, T, (H + 2 * KV) * D), laid out q|k|v"]
    q_w, kv_w = say.q, say.kv  # the widths of q and of k (and v) as forward reads them
    if s.sizes == "shape" and (s.qkv in ("split", "slices") or say.unequal):
        lines += (
            ["kv_size = qkv.shape[-1] // (self.groups + 2)", "q_size = qkv.shape[-1] - 2 * kv_size"]
            if say.unequal
            else ["q_size = kv_size = qkv.shape[-1] // 3"]
        )
    if s.qkv == "split":
        cut = q_w if not say.unequal else f"[{q_w}, {kv_w}, {kv_w}]"
        return [*lines, f"q, k, v = qkv.split({cut}, dim=-1)"], set()
    if s.qkv == "slices":
        lines += [
            f"q = qkv[..., :{q_w}]",
            f"k = qkv[..., {q_w} : {q_w} + {kv_w}]",
            f"v = qkv[..., {q_w} + {kv_w} :]",
        ]
        return lines, set()
    if not say.unequal:
        if s.qkv == "chunk":
            return [*lines, "q, k, v = qkv.chunk(3, dim=-1)"], set()
        lines.append(f"q, k, v = {say.heads('qkv', say.h, parts=3)}.unbind(2)  # (B, T, H, D) each")
        return lines, {"q", "k", "v"}
    lines.append(f"q, kv = qkv.split([{q_w}, 2 * {kv_w}], dim=-1)")
    if s.qkv == "chunk":
        return [*lines, "k, v = kv.chunk(2, dim=-1)"], set()
    lines.append(f"k, v = {say.heads('kv', say.kvh, parts=2)}.unbind(2)  # (B, T, KV, D) each")
    return lines, {"k", "v"}


def _attend(s: Spec) -> list[str]:
    """q, k, v in the layout of `Spec.layout` -> a, and p (the weights) where needed."""
    scores = [
        "keep = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()  # (T, T), causal",
        f"s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5  # {'(B, H, T, T)' if s.layout == 'heads' else '(B*H, T, T)'}",
    ]
    if s.attend == "talking":
        scores.append('s = torch.einsum("bhqk,gh->bgqk", s.view(b, -1, t, t), self.talk).reshape(s.shape)')  # fmt: skip
    scores += ['s = s.masked_fill(~keep, float("-inf"))', "p = s.softmax(dim=-1)"]
    if s.attend == "sdpa":
        out = ["a = F.scaled_dot_product_attention(q, k, v, is_causal=True)"]
        return out + (scores if s.reduce != "none" else [])
    return [*scores, "a = p @ v"]


def _attention_forward(s: Spec) -> list[str]:
    say = _Say(s)
    lines = ["b, t, _ = x.shape  # (B, T, C)"]
    lines += ["cfg = self.cfg"] if s.sizes == "config" else []
    made, as_heads = _project(s, say)
    lines += made
    names = {"q": say.h, "k": say.kvh, "v": say.kvh}
    if s.norm == "over_heads":
        for r in "qk":
            flat = f"{r}.flatten(2)" if r in as_heads else r
            back = f".view_as({r})" if r in as_heads else ""
            lines.append(f"{r} = self.{r}_norm({flat}){back}  # over every head's features")
    for r in "qkv":
        if r not in as_heads:
            lines.append(f"{r} = {say.heads(r, names[r])}  # (B, T, h, D)")
    if s.norm == "per_head":
        lines.append("q, k = self.q_norm(q), self.k_norm(k)  # over head_dim")
    if s.n_kv != s.n_head:
        lines.append(f"g = {say.groups}  # query heads per kv head")
        lines.append("k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)  # (B, T, H, D)")  # fmt: skip
    if s.layout == "heads":
        lines.append("q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # (B, H, T, D)")
    elif s.reshape == "einops":
        lines.append('q, k, v = (rearrange(z, "b t h d -> (b h) t d") for z in (q, k, v))  # (B*H, T, D)')  # fmt: skip
    else:
        lines.append(f"q, k, v = (z.transpose(1, 2).reshape({say.bh}, t, {say.d}) for z in (q, k, v))  # (B*H, T, D)")  # fmt: skip
    lines += _attend(s)
    if s.reduce != "none":
        lines.append("w = p.view(b, -1, t, t).mean(dim=1)  # (B, T, T), the weights averaged over heads")  # fmt: skip
    if s.layout == "heads":
        lines.append("a = a.transpose(1, 2)  # (B, T, H, D)")
    elif s.reshape == "einops":
        lines.append('a = rearrange(a, "(b h) t d -> b t h d", b=b)')
    else:
        lines.append(f"a = a.view(b, {say.h}, t, {say.d}).transpose(1, 2)  # (B, T, H, D)")
    if s.proj == "einsum":
        out = 'torch.einsum("bthd,hdc->btc", a, self.w_o)'
    else:
        merged = say.merge("a")
        out = {
            "linear": f"self.o_proj({merged})",
            "conv": f"self.o_proj({merged}.transpose(1, 2)).transpose(1, 2)",
            "matmul": f"{merged} @ self.w_o",
        }[s.proj]
    return [*lines, f"return {out}" + (", w" if s.reduce != "none" else "")]


def _mlp(s: Spec) -> tuple[list[str], list[str]]:
    """__init__ and forward lines of the MLP."""
    if s.mlp == "moe":
        init = [
            "self.n_expert, self.top_k = cfg.n_expert, cfg.top_k",
            "self.router = nn.Linear(cfg.width, cfg.n_expert, bias=False)",
            "self.w_gate_up = nn.Parameter(torch.randn(cfg.n_expert, cfg.width, 2 * cfg.expert_width) * cfg.width**-0.5)",
            "self.w_down = nn.Parameter(torch.randn(cfg.n_expert, cfg.expert_width, cfg.width) * cfg.expert_width**-0.5)",
        ]  # fmt: skip
        forward = [
            "b, t, c = x.shape",
            "weights, chosen = self.router(x).softmax(dim=-1).topk(self.top_k, dim=-1)  # (B, T, K)",
            "flat, weights, chosen = x.reshape(-1, c), weights.reshape(-1, self.top_k), chosen.reshape(-1, self.top_k)",
            "out = torch.zeros_like(flat)",
            "for e in range(self.n_expert):",
            "    token, slot = torch.where(chosen == e)",
            "    gate, up = (flat[token] @ self.w_gate_up[e]).chunk(2, dim=-1)",
            "    out = out.index_add(0, token, (F.silu(gate) * up) @ self.w_down[e] * weights[token, slot, None])",
            "return out.view(b, t, c)",
        ]  # fmt: skip
        return init, forward
    parts = {"plain": ["fc1", "fc2"], "gated": ["gate", "up", "down"], "gated_fused": ["gate_up", "down"]}[s.mlp]  # fmt: skip
    init, calls = [], {}
    for name in parts:
        closes = name in ("fc2", "down")
        n_in, n_out = ("cfg.mlp_width", "cfg.width") if closes else ("cfg.width", "cfg.mlp_width")
        n_out = "2 * cfg.mlp_width" if name == "gate_up" else n_out
        if s.mlp_proj == "param":
            init.append(
                f"self.w_{name} = nn.Parameter(torch.randn({n_in}, {n_out}) * {n_in}**-0.5)"
            )
            init.append(f"self.b_{name} = nn.Parameter(torch.zeros({n_out}))")
            calls[name] = lambda z, n=name: f'(torch.einsum("btc,cm->btm", {z}, self.w_{n}) + self.b_{n})'  # fmt: skip
        else:
            cls = "nn.Linear" if s.mlp_proj == "linear" else "nn.Conv1d"
            kernel = {"conv": ", 1", "conv3": ", 3, padding=1"}.get(s.mlp_proj, "")
            init.append(f"self.{name} = {cls}({n_in}, {n_out}{kernel})")
            calls[name] = lambda z, n=name: f"self.{n}({z})"
    convs = s.mlp_proj in ("conv", "conv3")
    z = "x.transpose(1, 2)" if convs else "x"
    dim = 1 if convs else -1
    normed = (lambda t: f"self.norm({t})") if s.mlp_proj == "conv3" else (lambda t: t)
    if s.mlp_proj == "conv3" and s.mlp != "gated_fused":
        init.append("self.norm = nn.GroupNorm(4, cfg.mlp_width)")
    if s.mlp == "plain":
        h = f"F.gelu({normed(calls['fc1'](z))})"
        out = calls["fc2"]("h")
    elif s.mlp == "gated":
        h = f"F.silu({normed(calls['gate'](z))}) * {calls['up'](z)}"
        out = calls["down"]("h")
    else:
        h = "F.silu(gate) * up"
        out = calls["down"]("h")
    forward = [f"gate, up = {calls['gate_up'](z)}.chunk(2, dim={dim})"] if s.mlp == "gated_fused" else []  # fmt: skip
    forward += [f"h = {h}", f"return {out}" + (".transpose(1, 2)" if convs else "")]
    return init, forward


_MODEL = '''

class Config:
    """The sizes every layer reads."""

    vocab, width, n_layer = {vocab}, {width}, {layers}
    n_head, n_kv, head_dim = {n_head}, {n_kv}, {head_dim}
    mlp_width, n_expert, top_k, expert_width = {mlp_width}, {experts}, {top_k}, {expert_width}


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn_norm, self.attn = nn.LayerNorm(cfg.width), Attention(cfg)
        self.mlp_norm, self.mlp = nn.LayerNorm(cfg.width), Mlp(cfg)

    def forward(self, x):
        {attend}
        x = x + self.mlp(self.mlp_norm(x))
        return x


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        cfg = Config()
        self.embed = nn.Embedding(cfg.vocab, cfg.width)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm, self.head = nn.LayerNorm(cfg.width), nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)  # (B, T, C)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))
'''

_ATTEND = {
    "none": "x = x + self.attn(self.attn_norm(x))",
    "unused": "a, _ = self.attn(self.attn_norm(x))  # the weights are dropped\n        x = x + a",
    "used": "a, w = self.attn(self.attn_norm(x))\n        x = x + a + w.amax(dim=-1, keepdim=True)  # (B, T, 1)",
}


def _class(name: str, init: list[str], forward: list[str]) -> str:
    def body(lines: list[str]) -> str:
        return "\n".join(f"        {ln}" for ln in lines)

    return (
        f"class {name}(nn.Module):\n    def __init__(self, cfg):\n        super().__init__()\n"
        f"{body(init)}\n\n    def forward(self, x):\n{body(forward)}\n"
    )


def source(spec: Spec) -> str:
    """The Python source of the case's model: `Model()` takes token ids (B, T)."""
    mlp_init, mlp_forward = _mlp(spec)
    head = [
        f"# code style: {spec.label()}",
        "import torch",
        "import torch.nn.functional as F",
        "from torch import nn",
    ]
    head += ["from einops import rearrange"] if spec.reshape == "einops" else []
    model = _MODEL.format(
        vocab=VOCAB, width=WIDTH, layers=LAYERS, n_head=spec.n_head, n_kv=spec.n_kv,
        head_dim=spec.head_dim, mlp_width=MLP_WIDTH, experts=EXPERTS, top_k=TOP_K,
        expert_width=EXPERT_WIDTH, attend=_ATTEND[spec.reduce],
    )  # fmt: skip
    return "\n".join(head) + "\n\n\n" + "\n\n".join([
        _class("Attention", _attention_init(spec), _attention_forward(spec)),
        _class("Mlp", mlp_init, mlp_forward),
    ]) + model  # fmt: skip


def build(spec: Spec, seed: int = 0) -> nn.Module:
    """The case's model, its weights drawn from `seed` without touching the global RNG. The
    source is registered with linecache, so tracebacks and `inspect` show its lines."""
    text = source(spec)
    filename = f"<code_styles {spec.label()}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    scope: dict[str, object] = {"__name__": "code_styles_case"}
    exec(compile(text, filename, "exec"), scope)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model: nn.Module = scope["Model"]()  # type: ignore[operator]
        with torch.no_grad():
            # norm weights away from ones, so that no gradient is trivially the same on
            # every rank; the embedding scaled so the stream stays O(1)
            for m in model.modules():
                if isinstance(m, (nn.LayerNorm, nn.RMSNorm)) and m.weight is not None:
                    m.weight.uniform_(0.5, 1.5)
                elif isinstance(m, nn.Embedding):
                    m.weight.mul_(0.5)
    return model.eval()


def inputs(seed: int = 0) -> torch.Tensor:
    """The token ids (2, 8) every case runs on, the same on every rank."""
    return token_ids(VOCAB, batch=2, seq=8, seed=seed)


# ---- measuring a case ---------------------------------------------------------------------
# Where each parameter of a block goes in a Megatron split, by its name in the block: cut
# over tp ("split"), kv heads (cut over at most kv_heads ranks, each shared whole by the
# rest), the fused q|k|v (its q part split, its k|v part as kv), or whole on every rank.
_ROLES = {
    "q_proj": "split", "w_q": "split", "k_proj": "kv", "w_k": "kv", "v_proj": "kv", "w_v": "kv",
    "qkv_proj": "qkv", "w_qkv": "qkv", "o_proj.weight": "split", "w_o": "split",
    "o_proj.bias": "whole", "talk": "whole", "router": "whole",
    "fc2.bias": "whole", "down.bias": "whole", "b_fc2": "whole", "b_down": "whole",
}  # fmt: skip


def _role(spec: Spec, name: str) -> str:
    """The role of parameter `name` ("attn.q_proj.weight") of a block (see _ROLES)."""
    _, _, rest = name.partition(".")
    if rest.startswith(("q_norm", "k_norm")):
        return "whole" if spec.norm == "per_head" else ("split" if rest[0] == "q" else "kv")
    for key, role in _ROLES.items():
        if rest == key or rest.startswith(key + "."):
            return role
    return "split"  # the MLP's and the experts' other weights and biases


def _megatron_numel(spec: Spec, name: str, numel: int, tp: int) -> float:
    """The elements of a block parameter a rank holds in a Megatron split."""
    role, kv_ranks = _role(spec, name), min(tp, spec.n_kv)
    q, kv = spec.n_head * spec.head_dim, spec.n_kv * spec.head_dim
    share = {
        "split": 1 / tp,
        "kv": 1 / kv_ranks,
        "qkv": (q / tp + 2 * kv / kv_ranks) / (q + 2 * kv),
        "whole": 1.0,
    }[role]
    return numel * share


# a rank may hold a few more elements than Megatron's (a q/k norm kept whole): 10% slack
_SLACK = 1.1


@dataclass
class Outcome:
    """One case at one tp size, measured."""

    spec: Spec
    tp: int
    parity: Literal["ok", "wrong", "error"] = "ok"
    """"wrong": assert_parity failed (a wrong answer); "error": something raised."""
    detail: str = ""
    """What went wrong, for a parity failure."""
    megatron: dict[str, bool] = field(default_factory=dict)
    """{block: split the Megatron way} over the blocks of `BLOCKS`."""
    fraction: dict[str, float] = field(default_factory=dict)
    """{block: elements the most loaded rank holds, over a Megatron split's}."""
    gathers: dict[str, int] = field(default_factory=dict)
    """{block: all-gathers in its forward} (every call's: counted on a second call)."""
    weight_gathers: dict[str, int] = field(default_factory=dict)
    """{block: all-gathers of weight rows its first call made once} (a fused layer of
    unequal pieces, compile/own_rows.py; again after each change of the weight)."""
    whys: list[str] = field(default_factory=list)
    """"module (style): why" of the blocks' modules kept whole or gathered."""
    seconds: float = 0.0

    @property
    def exists(self) -> bool:
        return megatron_exists(self.spec)

    @property
    def got(self) -> bool:
        """Every block split the Megatron way (with parity)."""
        return self.parity == "ok" and bool(self.megatron) and all(self.megatron.values())

    def as_json(self) -> dict[str, object]:
        out = {k: v for k, v in asdict(self).items() if k != "spec"}
        return {**out, "spec": asdict(self.spec), "exists": self.exists, "got": self.got}


def _per_rank(model: nn.Module, plan: Plan, tp: int) -> dict[str, int]:
    """{parameter: elements the most loaded simulated rank holds} with `plan` applied."""
    with simulated_ranks(tp) as mesh:
        sharded = copy.deepcopy(model)
        tpplan.apply_plan(sharded, mesh, plan)
        return {
            n: max(v.numel() for v in rank_values(p.to_local() if isinstance(p, DTensor) else p))
            for n, p in sharded.named_parameters()
        }


def _whys(model: nn.Module, plan: Plan, blocks: list[str]) -> list[str]:
    """ "module (style): why" for each module of the blocks kept whole or gathered, and the
    modules holding weights of their own (parameters of 2 dims or more) with no rule (a norm
    with no rule is whole beside a whole attention: no news)."""
    rules = expand_rules(plan, model)
    out = []
    for block in blocks:
        for name, module in model.get_submodule(block).named_modules(prefix=block):
            rule = rules.get(name)
            weights = any(p.dim() >= 2 for p in module.parameters(recurse=False))
            short = name.split(".", 2)[-1]
            if rule is None:
                out += [f"{short}: no rule"] if weights else []
            elif isinstance(rule, ReplicateRule) or (
                isinstance(rule, ColwiseRule) and rule.output_layout() == "replicate"
            ):
                out.append(f"{short} ({rule.style}): {rule.why}")
    return list(dict.fromkeys(out))


def measure_case(spec: Spec, tp: int) -> Outcome:
    """Infer a plan for the case at `tp`, hold it to parity (tests/support/parity.py), and
    decide each block: split the Megatron way when its forward runs no all-gather
    (tests/model_zoo/measure.py counts them) and its most loaded rank holds at most a
    Megatron split's elements (10% slack) and fewer than the whole block's."""
    t0 = time.perf_counter()
    got = Outcome(spec, tp)
    try:
        model, ids = build(spec), inputs()
        plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=ids)
        try:
            assert_parity(model, plan, tp, ids)
        except AssertionError as e:
            got.parity, got.detail = "wrong", str(e).splitlines()[0]
        counted = measure(model, plan, tp, ids, BLOCKS)
        held = _per_rank(model, plan, tp)
    except Exception as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        got.parity, got.detail = "error", f"{type(e).__name__}: {' '.join(lines)}"[:1000]
        got.seconds = time.perf_counter() - t0
        return got
    params = dict(model.named_parameters())
    for block in counted.blocks:
        inside = [n for n in params if n.startswith(block + ".")]
        whole = sum(params[n].numel() for n in inside)
        mine = sum(held[n] for n in inside)
        megatron = sum(_megatron_numel(spec, n.split(".", 2)[-1], params[n].numel(), tp) for n in inside)  # fmt: skip
        gathers = sum(
            n for k, n in counted.collectives[block].items() if k.startswith("all_gather")
        )
        got.gathers[block], got.fraction[block] = gathers, round(mine / megatron, 3)
        got.weight_gathers[block] = counted.weight_gathers[block]
        got.megatron[block] = gathers == 0 and mine <= _SLACK * megatron and mine < whole
    not_split = [b for b, ok in got.megatron.items() if not ok]
    got.whys = _whys(model, plan, not_split)
    got.seconds = time.perf_counter() - t0
    return got


def _sample() -> list[Spec]:
    """12 hand-picked cases (13 with einops) covering every value of every choice."""
    cases = [
        Spec(),
        Spec(proj="matmul", qkv="split", kv="gqa", sizes="config", mlp="gated"),
        Spec(proj="einsum", qkv="separate", sizes="shape", layout="batch", mlp_proj="param"),
        Spec(proj="conv", qkv="chunk", reshape="reshape", mlp_proj="conv", norm="per_head"),
        Spec(
            qkv="slices",
            kv="mqa",
            sizes="literal",
            attend="softmax",
            reduce="unused",
            mlp_proj="conv3",
        ),
        Spec(qkv="unbind", reshape="unflatten", kv="gqa", norm="over_heads", mlp="moe"),
        Spec(qkv="split", sizes="shape", kv="gqa", reduce="used", inner="wider"),
        Spec(attend="talking", layout="batch", reshape="reshape", mlp="gated_fused"),
        Spec(heads="one", qkv="split", sizes="config", attend="softmax"),
        Spec(
            proj="einsum",
            qkv="unbind",
            sizes="literal",
            kv="mqa",
            mlp="gated_fused",
            mlp_proj="param",
        ),
        Spec(proj="matmul", qkv="chunk", sizes="shape", layout="batch", norm="over_heads"),
        Spec(proj="conv", qkv="slices", reshape="unflatten", sizes="config", kv="gqa", mlp="moe"),
    ]
    if EINOPS:
        cases.append(Spec(reshape="einops", layout="batch", qkv="unbind", kv="gqa"))
    return cases


SAMPLE = _sample()
"""The fixed sample of the slow tier: every value of every choice at least once."""
