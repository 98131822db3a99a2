"""A fused q|k|v of unequal pieces inside a DTensor region (issue 35 a with b, d, e): grouped
key/value heads in one Linear, cut at literal sizes no attribute holds, so the attention is a
region. DTensor has no layout for rank r's slice of each of pieces of several sizes; the
layer hands on its own rows held in pieces (compile/region_pieces.py), which the code's cut
turns into one honest DTensor per piece. Before, the layer was split then gathered.

Written by hand in five ways of cutting the pieces apart, with and without a norm over every
head's features (which keeps the region on DTensors; without it the region runs on local
shards).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from support.models import seeded, token_batch
from support.parity import assert_parity, forward_collectives
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import tpplan
from tpplan._runtime.local import simulated_ranks
from tpplan.errors import TpplanError

WIDTH, HEADS, KV, HEAD_DIM = 32, 8, 4, 8
QW, KW = HEADS * HEAD_DIM, KV * HEAD_DIM
CUTS = ["split3", "split2-chunk", "slices", "narrow", "view-unbind"]


class _Fused(nn.Module):
    """q|k|v in one Linear (8 query heads, 4 key/value heads), cut `cut`'s way at literal
    sizes; `norm`: an RMSNorm over all query heads' features (OLMo-2's), `reads`: the fused
    output scaled before it is cut (a use that is no cut)."""

    def __init__(self, cut: str, norm: bool = False, reads: bool = False) -> None:
        super().__init__()
        self.cut, self.norm, self.reads = cut, norm, reads
        self.qkv = nn.Linear(WIDTH, QW + 2 * KW)
        self.o_proj = nn.Linear(QW, WIDTH)
        self.q_norm = nn.RMSNorm(QW) if norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x)
        if self.reads:
            qkv = qkv * 0.5
        if self.cut == "split3":
            q, k, v = qkv.split([64, 32, 32], dim=-1)
        elif self.cut == "split2-chunk":
            q, kv = qkv.split([64, 64], dim=-1)
            k, v = kv.chunk(2, dim=-1)
        elif self.cut == "slices":
            q, k, v = qkv[..., :64], qkv[..., 64:96], qkv[..., 96:]
        elif self.cut == "narrow":
            q, k, v = qkv.narrow(-1, 0, 64), qkv.narrow(-1, 64, 32), qkv.narrow(-1, 96, 32)
        else:
            q, kv = qkv.split([64, 64], dim=-1)
            k, v = kv.view(b, t, 2, 4, 8).unbind(2)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = q.view(b, t, 8, 8).transpose(1, 2)
        k, v = (z.reshape(b, t, 4, 8).transpose(1, 2) for z in (k, v))
        k, v = (z.repeat_interleave(2, dim=1) for z in (k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(a.transpose(1, 2).reshape(b, t, 64))


class _Model(nn.Module):
    def __init__(self, cut: str, norm: bool = False, reads: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, WIDTH)
        self.attn = _Fused(cut, norm, reads)
        self.head = nn.Linear(WIDTH, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.head(x + self.attn(x))


def _applied(model: nn.Module, plan: tpplan.Plan, tp: int, x: torch.Tensor) -> tuple[dict, str]:
    """The attention's forward collectives (a second call's) and how its region ran, on
    simulated ranks."""
    with simulated_ranks(tp) as mesh:
        sharded = copy.deepcopy(model)
        tpplan.apply_plan(sharded, mesh, plan)
        sharded(x)  # the first call gathers the fused layer's own rows once (own_rows.py)
        with CommDebugMode() as comms:
            sharded(x)
        how = sharded.attn.__dict__["_tpplan_region"]
        weight = sharded.state_dict()["attn.qkv.weight"]
        assert isinstance(weight, DTensor)
        assert torch.equal(weight.full_tensor(), model.attn.qkv.weight)  # the original
        return forward_collectives(comms, "_Model.attn"), how


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm-over-heads"])
@pytest.mark.parametrize("cut", CUTS)
def test_unequal_fused_pieces_stay_split_in_a_region(cut: str, norm: bool, tp: int) -> None:
    """The fused layer opens the region in its pieces [64, 32, 32], the output layer
    closes it; check passes; no all-gather in the attention's forward, on local shards
    (plain) or on DTensors (a norm over every head sums its statistics); parity forward and
    backward on both paths; the state dict holds the original weight."""
    model = seeded(_Model, cut=cut, norm=norm)
    x = token_batch(64)
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x)
    rules = {r.match: r for r in plan.rules}
    assert [r.match for r in plan.regions] == ["attn"], plan.to_yaml()
    qkv = rules["attn.qkv"]
    assert (qkv.style, qkv.parts, qkv.local_output) == ("colwise", [64, 32, 32], False)
    assert "the pieces its code cuts them into, [64, 32, 32]" in qkv.why
    assert rules["attn.o_proj"].style == "rowwise"
    assert tpplan.check_plan(plan, model, tp_size=tp) == []
    assert_parity(model, plan, tp, x)
    found, how = _applied(model, plan, tp, x)
    assert not any(k.startswith("all_gather") for k in found), found
    assert found["all_reduce"] == (2 if norm else 1), found
    assert how == "local shards" if not norm else how.startswith("DTensor"), how


def test_a_fused_output_read_before_its_cut_is_gathered() -> None:
    """The fused output scaled before the cut: held in pieces it may only be cut, so the
    proof refuses the region and the layer stays split then gathered, with parity."""
    model = seeded(_Model, cut="split3", reads=True)
    x = token_batch(64)
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=x)
    rules = {r.match: r for r in plan.rules}
    assert plan.regions == [], plan.to_yaml()
    assert rules["attn.qkv"].output == "replicate", plan.to_yaml()
    assert_parity(model, plan, 2, x)


def test_a_cut_inside_a_piece_is_refused_by_name() -> None:
    """A cut whose bound falls inside a piece, a use other than a cut, and a region handing
    the held output back uncut each raise one message naming the pieces and the fix."""
    from tpplan.compile.region_pieces import mark_pieces, pieces_call, refuse_held

    with simulated_ranks(2) as mesh:
        held = mark_pieces(torch.zeros(2, 3, 64), mesh, [64, 32, 32], (2, 3, 128))
        with pytest.raises(TpplanError, match=r"\[0, 40\).*\[64, 32, 32\].*Fix: keep"):
            pieces_call(torch.Tensor.split, (held, [40, 88]), {"dim": -1})
        with pytest.raises(TpplanError, match=r"mul on a fused output .* \[64, 32, 32\].*Fix"):
            pieces_call(torch.Tensor.mul, (held, 2.0), {})
        with pytest.raises(TpplanError, match=r"returns a fused output held .* uncut.*Fix"):
            refuse_held((held, None))
        q, k, v = pieces_call(torch.Tensor.split, (held, [64, 32, 32]), {"dim": -1})
        assert [tuple(t.shape) for t in (q, k, v)] == [(2, 3, 64), (2, 3, 32), (2, 3, 32)]
        assert [tuple(t.to_local().shape) for t in (q, k, v)] == [
            (2, 3, 32),
            (2, 3, 16),
            (2, 3, 16),
        ]


def test_verify_passes_a_region_of_unequal_fused_pieces() -> None:
    """`tpplan verify`'s check against the unsharded model, forward and backward."""
    from tpplan.diagnose.verify import verify_plan

    model = seeded(_Model, cut="slices", norm=True)
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=token_batch(64))
    assert verify_plan(model, plan, tp_size=2, backward=True, tol=1e-4).ok
