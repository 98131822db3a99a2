"""The hand-written modules check_plan's tests run on (tests/test_check_messages.py,
tests/test_check_complete.py), built on the meta device: `Tiny` (embedding, attention, MLP,
a tied head) and its sound plan `SOUND`, `Untraceable`, `TwoInputs` (layers inside wrappers,
and a forward of two inputs), and `problems_said`, what check_plan says."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpplan import Plan, Rule, check_plan

__all__ = [
    "SOUND",
    "Attention",
    "Mlp",
    "Tiny",
    "TwoInputs",
    "Untraceable",
    "Wrapped",
    "WrappedMlp",
    "make_rule",
    "on_meta",
    "problems_said",
]


class Attention(nn.Module):
    """q, k, v and o over 4 heads of 4, viewed with -1 heads (so local shards run)."""

    def __init__(self) -> None:
        super().__init__()
        self.head_dim = 4
        self.heads = 4  # read by no forward, so only its value is checked
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            m(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (b, heads, t, head_dim)
            for m in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))  # (b, t, 16)


class Mlp(nn.Module):
    """A fused gate|up layer (24 | 24), cut apart by chunk, and the layer it feeds."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Linear(16, 48)
        self.down = nn.Linear(24, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, -1)  # (b, t, 24) each
        return self.down(F.silu(gate) * up)


class Tiny(nn.Module):
    """Embedding -> attention -> norm -> MLP -> a head tied to the embedding."""

    def __init__(self, vocab: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.attn = Attention()
        self.norm = nn.LayerNorm(16)
        self.act = nn.ReLU()
        self.mlp = Mlp()
        self.head = nn.Linear(16, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        x = x + self.attn(x)
        x = x + self.mlp(self.act(self.norm(x)))
        return self.head(x)


class Untraceable(nn.Module):
    """up -> down, with a forward that takes no input tpplan can make up: checked by
    module structure, not by data flow."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 24)
        self.down = nn.Linear(24, 16)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x))) * scale  # two inputs: none can be made up


class Wrapped(nn.Module):
    """A layer inside a wrapper of its own (`q.linear`), as some vision towers write them."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim_in, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class WrappedMlp(nn.Module):
    """up -> relu -> down, each Linear inside a Wrapped."""

    def __init__(self) -> None:
        super().__init__()
        self.up = Wrapped(8, 16)
        self.down = Wrapped(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class TwoInputs(nn.Module):
    """WrappedMlp scaled by a second input: a forward tpplan cannot make inputs up for
    (test_check; test_cli gives them with `--input`)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = WrappedMlp()

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.mlp(x) * scale  # two inputs: none can be made up, so no trace


def on_meta(cls: type[nn.Module], **kwargs: object) -> nn.Module:
    with torch.device("meta"):
        return cls(**kwargs)


def make_rule(match: str, style: str, **fields: object) -> Rule:
    return Rule(match=match, style=style, why="a test", **fields)


# The sound plan of Tiny: the embedding split over the vocab, heads of 4, the fused
# gate|up as 24 | 24, and the tied head gathered right after.
SOUND = [
    make_rule("embed", "vocab_parallel"),
    make_rule("attn.[qkv]", "colwise", head_dim=4),
    make_rule("attn.o", "rowwise", head_dim=4),
    make_rule("mlp.gate_up", "colwise", parts=[24, 24]),
    make_rule("mlp.down", "rowwise"),
    make_rule("head", "colwise", output="replicate"),
]


def problems_said(plan: Plan, model: nn.Module, tp: int = 2) -> list[tuple[str, str]]:
    return [(p.kind, str(p)) for p in check_plan(plan, model, tp_size=tp)]
