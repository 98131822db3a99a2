"""Transformer-like models written by hand from a `Spec`, for property tests of the tracer.

`build(spec)` makes a decoder whose every choice a transformer family makes differently is a
knob: grouped or multi-query attention, separate or fused q/k/v (q|k|v blocks or per-head
interleaved, GPT-NeoX style), plain or gated MLP (gate|up fused or not), pre- or post-norm with
LayerNorm or RMSNorm, sequential or parallel residual, tied or untied head, biases, per-head q/k
norms, and how the heads are reshaped (-1 for the head count, or a stored attribute). Plain
torch only, no transformers, and module names that say nothing about their role, so the tracer
has the data flow alone to go on.

tests/support/parity.py holds these models to the unsharded numbers (`assert_parity`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["HEAD_DIM", "ROLE_NAMES", "Spec", "build", "token_ids"]

HEAD_DIM = 8

# Attribute names per role: short and meaningless, so that names are no evidence.
ROLE_NAMES = {
    "q": "ra", "k": "rb", "v": "rc", "qkv": "rx", "o": "rd",
    "fc1": "ma", "fc2": "mb", "gate": "mc", "up": "md", "gate_up": "mx", "down": "mf",
    "q_norm": "qa", "k_norm": "qb",
}  # fmt: skip


@dataclass(frozen=True)
class Spec:
    """One model of the family; every field is a knob a real transformer family turns."""

    hidden: int = 32
    """32 or 64; heads are HEAD_DIM wide, so 4 or 8 query heads."""
    kv: str = "mha"
    """"mha" (kv heads = heads), "gqa" (half as many) or "mqa" (one kv head)."""
    repeat_kv: bool = True
    """GQA/MQA: repeat the kv heads by expand + reshape (Hugging Face style); False passes
    enable_gqa=True to scaled_dot_product_attention instead."""
    qkv: str = "separate"
    """"separate" q, k, v Linears; "fused" one Linear laid out q|k|v, cut at widths stored as
    attributes (nanoGPT, GPT-2); "interleaved" one Linear laid out per kv head as (its query
    heads, k, v), viewed as heads then split (GPT-NeoX)."""
    view: str = "minus1"
    """How heads are reshaped: "minus1" view(B, T, -1, hd) (Hugging Face); with a stored head
    count, "stored" view(B, T, self.n_head, hd) (Meta's Llama, nanoGPT), "stored_seq"
    view(B, -1, self.n_head, hd) (OPT), "stored_last" view(B, T, self.n_head, -1), or
    "stored_hd" view(B, T, self.n_head, t.size(-1) // self.n_head) (head size read off the
    tensor being viewed), "unflatten" t.unflatten(-1, (self.n_head, -1)); or with the count
    read off a config object rather than the module, "config_hd" view(B, T, cfg.n_head,
    t.size(-1) // cfg.n_head)."""
    mlp: str = "plain"
    """"plain" fc1 -> gelu -> fc2; "gated" silu(gate) * up -> down; "gated_fused" one gate|up
    Linear cut by chunk(2)."""
    norm: str = "layer"
    """"layer" (LayerNorm) or "rms" (RMSNorm) over the hidden features."""
    post_norm: bool = False
    """Norm after the residual add (original transformer / BERT) instead of before the branch."""
    parallel: bool = False
    """x + attn(n1(x)) + mlp(n2(x)) (GPT-J/NeoX) instead of one branch after the other."""
    tied: bool = False
    """The output head reuses the token embedding's weight."""
    bias: bool = True
    """Biases on the attention and MLP Linears (the head never has one)."""
    qk_norm: bool = False
    """RMSNorm over head_dim on queries and keys (Qwen3 style), one weight shared by all heads."""
    layers: int = 2
    """1 to 3 (stacks of up to 8 blocks are traced block by block)."""
    vocab: int = 64
    """64 or 128."""

    @property
    def heads(self) -> int:
        return self.hidden // HEAD_DIM

    @property
    def kv_heads(self) -> int:
        return {"mha": self.heads, "gqa": self.heads // 2, "mqa": 1}[self.kv]

    @property
    def inter(self) -> int:
        """MLP width: 2x hidden (plain) or 1.5x hidden (gated); divisible by 4 either way."""
        return 2 * self.hidden if self.mlp == "plain" else 3 * self.hidden // 2

    def label(self) -> str:
        """A short description of the knobs that differ from the defaults."""
        base = Spec()
        return ", ".join(
            f"{k}={getattr(self, k)}"
            for k in self.__dataclass_fields__
            if getattr(self, k) != getattr(base, k)
        )


def _norm(kind: str, dim: int) -> nn.Module:
    return nn.LayerNorm(dim) if kind == "layer" else nn.RMSNorm(dim)


class _Attention(nn.Module):
    def __init__(self, s: Spec) -> None:
        super().__init__()
        self.s = s
        self.head_dim = HEAD_DIM  # read by the views, as Hugging Face models do
        q_out, kv_out = s.heads * HEAD_DIM, s.kv_heads * HEAD_DIM
        # Stored head counts, only as many attributes as there are distinct counts: two int
        # attributes holding the same number would make a stored count ambiguous to anyone
        # reading it (nanoGPT stores just n_head).
        if s.view not in ("minus1", "config_hd"):
            self.n_head = s.heads
            if s.kv_heads != s.heads:
                self.n_kv_head = s.kv_heads
        if s.qkv == "separate":
            for role, out in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                setattr(self, ROLE_NAMES[role], nn.Linear(s.hidden, out, bias=s.bias))
        else:
            setattr(self, ROLE_NAMES["qkv"], nn.Linear(s.hidden, q_out + 2 * kv_out, bias=s.bias))
        if s.qkv == "fused":
            # The widths the fused output is cut at, stored the way nanoGPT (n_embd) and GPT-2
            # (split_size) store them: one attribute when the pieces are equal.
            self.q_width = q_out
            if kv_out != q_out:
                self.kv_width = kv_out
        setattr(self, ROLE_NAMES["o"], nn.Linear(q_out, s.hidden, bias=s.bias))
        if s.qk_norm:
            for role in ("q_norm", "k_norm"):
                norm = nn.RMSNorm(HEAD_DIM)
                with torch.no_grad():  # a weight far from ones, so its gradient matters
                    norm.weight.uniform_(0.5, 1.5)
                setattr(self, role, norm)

    def count(self, kind: str) -> int:
        """The head count a stored-count view reads: an attribute of this module, or of the
        config (the Spec) for "config_hd"."""
        if self.s.view == "config_hd":
            return self.s.heads if kind == "q" else self.s.kv_heads
        if kind == "q" or self.s.kv_heads == self.s.heads:
            return self.n_head
        return self.n_kv_head

    def heads_view(self, t: torch.Tensor, kind: str, width: int | None = None) -> torch.Tensor:
        """(B, T, features) -> (B, T, heads, width) the way `Spec.view` says."""
        width = self.head_dim if width is None else width
        b, n, f = t.shape
        view = self.s.view
        if view == "minus1":
            return t.view(b, n, -1, width)
        count = self.count(kind)
        if view == "stored":
            return t.view(b, n, count, width)
        if view == "stored_seq":
            return t.view(b, -1, count, width)
        if view == "stored_last":
            return t.view(b, n, count, -1)
        if view == "unflatten":
            return t.unflatten(-1, (count, -1))
        return t.view(b, n, count, f // count)  # stored_hd, config_hd

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as (B, T, heads, hd)."""
        s = self.s
        if s.qkv == "separate":
            q, k, v = (getattr(self, ROLE_NAMES[r])(x) for r in ("q", "k", "v"))
            return self.heads_view(q, "q"), self.heads_view(k, "kv"), self.heads_view(v, "kv")
        fused = getattr(self, ROLE_NAMES["qkv"])(x)
        group = s.heads // s.kv_heads
        if s.qkv == "fused":
            if s.kv_heads == s.heads:
                q, k, v = fused.split(self.q_width, dim=-1)
            else:
                q, k, v = fused.split([self.q_width, self.kv_width, self.kv_width], dim=-1)
            return self.heads_view(q, "q"), self.heads_view(k, "kv"), self.heads_view(v, "kv")
        # interleaved: per kv head, its `group` query heads then one k and one v head
        b, n, _ = x.shape
        per_kv = self.heads_view(fused, "kv", (group + 2) * HEAD_DIM)
        q, k, v = per_kv.split([group * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=-1)
        return q.reshape(b, n, -1, HEAD_DIM), k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.s
        b, n, _ = x.shape
        q, k, v = self.project(x)
        if s.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        extra = {}
        if s.kv_heads != s.heads:
            if s.repeat_kv:
                group = q.shape[1] // k.shape[1]  # local counts: the ratio holds on every rank
                k, v = (
                    t[:, :, None]
                    .expand(b, t.shape[1], group, n, self.head_dim)
                    .reshape(b, -1, n, self.head_dim)
                    for t in (k, v)
                )
            else:
                extra["enable_gqa"] = True
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, **extra)
        return getattr(self, ROLE_NAMES["o"])(a.transpose(1, 2).reshape(b, n, -1))


class _Mlp(nn.Module):
    def __init__(self, s: Spec) -> None:
        super().__init__()
        self.kind = s.mlp
        h, i, bias = s.hidden, s.inter, s.bias
        if s.mlp == "plain":
            parts = {"fc1": nn.Linear(h, i, bias=bias), "fc2": nn.Linear(i, h, bias=bias)}
        elif s.mlp == "gated":
            parts = {
                "gate": nn.Linear(h, i, bias=bias),
                "up": nn.Linear(h, i, bias=bias),
                "down": nn.Linear(i, h, bias=bias),
            }
        else:
            parts = {"gate_up": nn.Linear(h, 2 * i, bias=bias), "down": nn.Linear(i, h, bias=bias)}
        for role, module in parts.items():
            setattr(self, ROLE_NAMES[role], module)

    def part(self, role: str) -> nn.Module:
        return getattr(self, ROLE_NAMES[role])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "plain":
            return self.part("fc2")(F.gelu(self.part("fc1")(x)))
        if self.kind == "gated":
            gate, up = self.part("gate")(x), self.part("up")(x)
        else:
            gate, up = self.part("gate_up")(x).chunk(2, dim=-1)
        return self.part("down")(F.silu(gate) * up)


class _Block(nn.Module):
    def __init__(self, s: Spec) -> None:
        super().__init__()
        self.s = s
        self.n1 = _norm(s.norm, s.hidden)
        self.mix = _Attention(s)
        self.ff = _Mlp(s)
        if not (s.post_norm and s.parallel):  # parallel post-norm has one norm per block
            self.n2 = _norm(s.norm, s.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.s
        if s.parallel and s.post_norm:
            return self.n1(x + self.mix(x) + self.ff(x))
        if s.parallel:
            return x + self.mix(self.n1(x)) + self.ff(self.n2(x))
        if s.post_norm:
            x = self.n1(x + self.mix(x))
            return self.n2(x + self.ff(x))
        x = x + self.mix(self.n1(x))
        return x + self.ff(self.n2(x))


class _Model(nn.Module):
    def __init__(self, s: Spec) -> None:
        super().__init__()
        self.s = s
        self.tab = nn.Embedding(s.vocab, s.hidden)
        self.stack = nn.ModuleList(_Block(s) for _ in range(s.layers))
        if not s.post_norm:
            self.nf = _norm(s.norm, s.hidden)
        self.out = nn.Linear(s.hidden, s.vocab, bias=False)
        if s.tied:
            self.out.weight = self.tab.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tab(ids)
        for block in self.stack:
            x = block(x)
        if not self.s.post_norm:
            x = self.nf(x)
        return self.out(x)


def build(spec: Spec, seed: int = 0) -> nn.Module:
    """The model of `spec`, its weights drawn from `seed` without touching the global RNG."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = _Model(spec)
        with torch.no_grad():
            # Norm weights away from ones and embeddings of unit-ish rows, so that no
            # gradient is trivially equal on every rank; the embedding is scaled so tied
            # logits stay O(1) (keeps the absolute tolerance meaningful).
            for m in model.modules():
                if isinstance(m, (nn.LayerNorm, nn.RMSNorm)) and m.weight is not None:
                    m.weight.uniform_(0.5, 1.5)
            model.tab.weight.mul_(0.3)
    return model.eval()


def token_ids(vocab: int, *, batch: int = 2, seq: int = 8, seed: int = 0) -> torch.Tensor:
    """The same tokens on every rank: drawn from a generator of our own, not the global RNG."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)
