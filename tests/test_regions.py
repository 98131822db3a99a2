"""DTensor regions: modules whose forward runs on DTensor activations (`Plan.regions`).

What each piece does on its own (simulated ranks, real numbers), then infer_plan choosing a
region only where its proof run saw no collective inside the module, and the plan file
and `check` around it.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.placement_types import _StridedShard

import tpplan
from tpplan import Plan
from tpplan._runtime.local import rank_values, simulated_ranks
from tpplan.compile.dtensor_ops import teach_dtensor
from tpplan.compile.regions import hold_dtensors
from tpplan.compile.strided import split_parts
from tpplan.errors import PlanFileError

sys.path.insert(0, str(Path(__file__).parent))
from model_zoo.nanogpt import VOCAB, NanoGpt
from support.models import seeded, token_batch
from support.parity import assert_parity


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert (a - b).abs().max().item() < 1e-5


# ---- DTensor strategies ----------------------------------------------------------------------
@pytest.mark.unit
def test_cpu_sdpa_runs_on_heads_split_alike_with_no_collective() -> None:
    """DTensor has no strategy for SDPA's CPU kernel; the one registered shards q, k, v and
    the output alike on the heads dim, forward and backward, exactly."""
    teach_dtensor()
    q, k, v = (_randn(2, 4, 6, 8, seed=s).requires_grad_() for s in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    want.square().sum().backward()
    with simulated_ranks(2) as mesh:
        qd, kd, vd = (
            distribute_tensor(t.detach(), mesh, [Shard(1)]).requires_grad_() for t in (q, k, v)
        )
        with CommDebugMode() as comms:
            got = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qd, kd, vd, 0.0, True)[
                0
            ]
            assert got.placements == (Shard(1),)
            got.square().sum().backward()
        assert comms.get_total_counts() == 0
        whole = rank_values(got.full_tensor())[0]
        grads = [rank_values(t.grad.full_tensor())[0] for t in (qd, kd, vd)]
    _close(whole, want)
    for g, t in zip(grads, (q, k, v), strict=True):
        _close(g, t.grad)


@pytest.mark.unit
def test_a_strided_output_splits_into_its_pieces_with_no_collective() -> None:
    """A fused output (q|k|v, each rank its slice of each piece) cut into its pieces gives
    each piece as a plain Shard; the backward's cat gives the strided layout back."""
    teach_dtensor()
    weight = _randn(24, 16)
    x = _randn(3, 16)
    w_ref = weight.clone().requires_grad_()
    want = F.linear(x, w_ref).split(8, dim=-1)
    (want[0] * 1 + want[1] * 2 + want[2] * 3).sum().backward()
    with simulated_ranks(2) as mesh:
        w = split_parts(weight, mesh, 0, [8, 8, 8], None).requires_grad_()
        xd = distribute_tensor(x, mesh, [Replicate()])
        with CommDebugMode() as comms:
            pieces = F.linear(xd, w).split(8, dim=-1)
            assert [p.placements for p in pieces] == [(Shard(1),)] * 3
            joined = torch.cat([pieces[0] * 1, pieces[1] * 2, pieces[2] * 3], dim=-1)
            assert joined.placements == (_StridedShard(1, split_factor=3),)
        assert comms.get_total_counts() == 0
        joined.to_local().sum().backward()  # each rank's share of the sum
        got = [rank_values(p.full_tensor())[0] for p in pieces]
        grad = rank_values(w.grad.full_tensor())[0]
    for g, p in zip(got, want, strict=True):
        _close(g, p.detach())
    _close(grad, w_ref.grad)


@pytest.mark.unit
def test_a_strided_output_viewed_whole_then_unbound_trains_with_no_collective() -> None:
    """q|k|v viewed whole as (3, heads, head_dim) and unbound: the backward stacks the
    pieces and views them back, which torch's view strategy labels in a shard order of its
    own; the weight's gradient then met it in a matmul that gathered both (on fake tensors:
    a failure). Relabelled alike, it stays each rank's slice of each piece."""
    teach_dtensor()
    weight, x = _randn(48, 16), _randn(2, 3, 16, seed=1)
    w_ref, x_ref = weight.clone().requires_grad_(), x.clone().requires_grad_()

    def attend(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = F.linear(x, w).unflatten(-1, (3, -1, 4)).unbind(2)  # (B, T, heads, 4)
        return (q * k).sum(-1, keepdim=True) * v

    want = attend(w_ref, x_ref)
    want.square().sum().backward()
    with simulated_ranks(2) as mesh:
        w = split_parts(weight, mesh, 0, [16, 16, 16], None).requires_grad_()
        xd = distribute_tensor(x, mesh, [Replicate()]).requires_grad_()  # a layer's before
        with CommDebugMode() as comms:
            got = attend(w, xd)
            assert got.placements == (Shard(2),)
            got.to_local().square().sum().backward()  # each rank's heads' share of the sum
        assert comms.get_total_counts() == 0  # the input's gradient stays a partial sum
        assert w.grad.placements == (_StridedShard(0, split_factor=3),)
        whole = rank_values(got.full_tensor())[0]
        grad = rank_values(w.grad.full_tensor())[0]
        grad_x = rank_values(xd.grad.full_tensor())[0]
    # sums of squares of cubes: large numbers, compared relatively
    for g, r in ((whole, want.detach()), (grad, w_ref.grad), (grad_x, x_ref.grad)):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


# ---- hold_dtensors ---------------------------------------------------------------------------
class _Rotated(nn.Module):
    """Heads rotated by a plain table the module builds in forward, then merged back."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        b, t, c = h.shape
        h = h.view(b, t, 4, c // 4)  # sized from the global shape
        angle = torch.arange(t, dtype=h.dtype).view(1, t, 1, 1)  # plain, whole on every rank
        h = h * angle.cos() + h.flip(-1) * angle.sin()
        return self.down(h.reshape(b, t, c))


def _rotated_plan(*, region: bool) -> Plan:
    """`_Rotated` wrapped in a Sequential (rules style submodules, so the region is the
    wrapped module): up opens with DTensor outputs, down closes; with or without the region."""
    return Plan.model_validate(
        {
            "tpplan": 8,
            "rules": [
                {"match": "0.up", "style": "colwise", "local_output": False, "why": "opens"},
                {"match": "0.down", "style": "rowwise", "why": "closes"},
            ],
            "regions": [{"match": "0", "why": "runs on DTensors"}] if region else [],
        }
    )


def test_a_region_mixes_whole_plain_tensors_forward_and_backward() -> None:
    assert_parity(nn.Sequential(_Rotated()), _rotated_plan(region=True), 2, _randn(2, 5, 8))


@pytest.mark.unit
def test_without_the_region_the_same_plan_fails_loudly() -> None:
    outer = nn.Sequential(_Rotated())
    plan = _rotated_plan(region=False)
    with simulated_ranks(2) as mesh:
        model = tpplan.apply_plan(copy.deepcopy(outer), mesh, plan)
        with pytest.raises(RuntimeError, match=r"mixed torch\.Tensor and DTensor"):
            model(_randn(2, 5, 8))


@pytest.mark.unit
def test_hold_dtensors_is_idempotent() -> None:
    m = _Rotated()
    hold_dtensors(m)
    hold_dtensors(m)
    assert len(m._forward_pre_hooks) == 1 and len(m._forward_hooks) == 1


# ---- the plan file ---------------------------------------------------------------------------
@pytest.mark.unit
def test_regions_need_schema_8() -> None:
    with pytest.raises(PlanFileError, match="regions need schema version 8"):
        Plan.from_yaml("tpplan: 7\nregions:\n  - match: a\n    why: b\n")


@pytest.mark.unit
def test_a_version_7_file_still_loads() -> None:
    plan = Plan.from_yaml("tpplan: 7\nrules:\n  - match: a\n    style: colwise\n    why: b\n")
    assert plan.tpplan == 7 and plan.regions == []


@pytest.mark.unit
def test_regions_round_trip_with_their_reason_as_a_comment() -> None:
    plan = Plan.model_validate(
        {"tpplan": 8, "regions": [{"match": "h.*.attn", "why": "runs on DTensors"}]}
    )
    text = plan.to_yaml()
    assert "# runs on DTensors\n  - match: h.*.attn" in text
    assert Plan.from_yaml(text) == plan


# ---- infer_plan ------------------------------------------------------------------------------
def _one_forward(model: nn.Module, plan: Plan, tp: int, x: torch.Tensor) -> tuple[Any, Any]:
    """The collectives of one forward of `model` sharded by `plan` on `tp` simulated ranks,
    and rank 0's full proj_out weight of its first block where it has one."""
    with simulated_ranks(tp) as mesh:
        sharded = copy.deepcopy(model)
        tpplan.apply_plan(sharded, mesh, plan)
        with CommDebugMode() as comms:
            sharded(x)
        first = getattr(sharded, "blocks", [None])[0]
        out = getattr(first, "proj_out", None)
        weight = rank_values(out.weight.full_tensor())[0] if out is not None else None
    return comms, weight


@pytest.mark.parametrize("tp", [2, 4])
def test_nanogpt_attention_becomes_a_megatron_region(tp: int) -> None:
    """nanoGPT sizes its heads by `C // self.n_head` from `x.size()` and cuts its fused
    c_attn with `.split(self.n_embd, dim=2)`: no attribute division can make that per-rank.
    As a DTensor region, its attention runs each rank's heads and costs one all-reduce in
    forward, with the unsharded model's numbers."""
    model = seeded(NanoGpt)
    x = token_batch(VOCAB)
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x)
    assert [r.match for r in plan.regions] == ["transformer.h.*.attn"]
    rules = {r.match: r for r in plan.rules}
    opener = rules["transformer.h.*.attn.c_attn"]
    assert (opener.style, opener.local_output, opener.parts) == ("colwise", False, [32, 32, 32])
    assert rules["transformer.h.*.attn.c_proj"].style == "rowwise"
    assert not plan.attributes
    assert_parity(model, plan, tp, x)
    comms, _ = _one_forward(model, plan, tp, x)
    attn = comms.comm_module_counts["NanoGpt.transformer.h.0.attn"]["forward"]
    assert {str(op): n for op, n in attn.items()} == {"c10d_functional.all_reduce": 1}


# ---- check -----------------------------------------------------------------------------------
def test_check_names_a_region_pattern_that_matches_nothing() -> None:
    model = seeded(NanoGpt)
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=token_batch(VOCAB))
    wrong = plan.model_copy(
        update={"regions": [plan.regions[0].model_copy(update={"match": "transformer.h.*.atn"})]}
    )
    (problem,) = tpplan.check_plan(wrong, model, tp_size=2)
    assert str(problem) == (
        "regions[0] (match: transformer.h.*.atn): the region pattern 'transformer.h.*.atn' "
        "matches no module of the model. Fix: correct the pattern (module names as "
        "model.named_modules() prints them) or delete the region."
    )


def test_check_passes_an_inferred_region_and_refuses_one_that_gathers() -> None:
    """The inferred region is proven collective-free; the same region over a plan whose
    fused layer is cut contiguously (no `parts`) gathers its heads inside the region, and
    check refuses it, naming the region's module."""
    model = seeded(NanoGpt)
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=token_batch(VOCAB))
    assert tpplan.check_plan(plan, model, tp_size=2) == []
    rules = [
        r.model_copy(update={"parts": None}) if r.match.endswith("c_attn") else r
        for r in plan.rules
    ]
    gathers = plan.model_copy(update={"rules": rules})
    (problem,) = tpplan.check_plan(gathers, model, tp_size=2)
    assert problem.module is not None and problem.module.startswith("transformer.h.0.attn")


class _JointAttention(nn.Module):
    """As diffusers' SD3 processors do: the head size from the keys' width over the head
    count (which no plan attribute can make right on a shard), the output Linear inside a
    ModuleList with a dropout, and the raw attention output handed back as well."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Dropout(0.0)])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = x.shape[0]
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        hd = k.shape[-1] // self.heads
        q, k, v = (t.view(b, -1, self.heads, hd).transpose(1, 2) for t in (q, k, v))
        raw = (
            F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, hd * self.heads)
        )
        return self.to_out[1](self.to_out[0](raw)), raw


class _ModulatedBlock(nn.Module):
    """The attention's input scaled by a modulation a sibling Linear computes from a
    conditioning vector (kept whole, so split and gathered); the raw output dropped."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.attn = _JointAttention(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale, shift = self.mod(x.mean(1)).unsqueeze(1).chunk(2, dim=-1)
        out, _ = self.attn(x * (1 + scale) + shift)
        return x + out


@pytest.mark.parametrize("tp", [2, 4])
def test_a_modulated_attention_with_a_nested_closer_becomes_a_region(tp: int) -> None:
    """A modulation made outside the attention opens or closes nothing in it, the closer
    inside a ModuleList belongs to the attention, and an output the caller drops is not a
    leak: the attention is a region, at parity."""
    model = _ModulatedBlock()
    x = _randn(2, 6, 32)
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x)
    assert [r.match for r in plan.regions] == ["attn"]
    assert "from to_k, to_q, to_v to to_out.0" in plan.regions[0].why
    styles = {r.match: (r.style, r.local_output) for r in plan.rules}
    assert styles["attn.to_out.0"] == ("rowwise", None)
    assert all(styles[f"attn.{n}"] == ("colwise", False) for n in ("to_q", "to_k", "to_v"))
    assert_parity(model, plan, tp, x)


@pytest.mark.unit
def test_a_kv_cache_started_empty_takes_the_region_s_dtensors() -> None:
    """transformers' DynamicCache starts each layer's keys as `torch.tensor([])` and joins
    the first keys to it with `cat`: in a region those keys are DTensors split by heads, and
    the empty placeholder is left out of the join, as torch itself would skip it."""
    with simulated_ranks(2) as mesh:
        keys = distribute_tensor(_randn(2, 4, 3, 8), mesh, [Shard(1)])
        holder = nn.Module()
        hold_dtensors(holder)
        holder.forward = lambda k: torch.cat([torch.tensor([]), k], dim=-2)  # type: ignore[method-assign]
        joined = holder(keys)
        assert isinstance(joined, type(keys)) and joined.placements == (Shard(1),)
        assert torch.equal(joined.full_tensor(), keys.full_tensor())


# ---- pieces joined by cat, and layers kept whole ---------------------------------------------
@pytest.mark.unit
def test_a_cat_of_pieces_split_alike_is_each_rank_s_slice_of_every_piece() -> None:
    """Heads (one piece of 8) and MLP features (4 pieces of 8, each rank its slice of
    each) joined along the split dim: rank r's local join is its slice of every piece, a
    `_StridedShard` of 5, with no collective, forward and backward; pieces of different
    sizes are left to DTensor (which gathers them)."""
    a, b = _randn(2, 3, 8, seed=1), _randn(2, 3, 32, seed=2)
    g = _randn(2, 3, 40, seed=3)
    with simulated_ranks(2) as mesh:
        ad = distribute_tensor(a, mesh, [Shard(2)]).requires_grad_()
        bd = split_parts(b, mesh, 2, [8] * 4, None).requires_grad_()
        holder = nn.Module()
        hold_dtensors(holder)
        holder.forward = lambda x, y: torch.cat([x, y * 2], dim=-1)  # type: ignore[method-assign]
        gd = split_parts(g, mesh, 2, [8] * 5, None)
        with CommDebugMode() as comms:
            joined = holder(ad, bd)
            assert joined.placements == (_StridedShard(2, split_factor=5),)
            (joined * gd).sum().backward()
        assert comms.get_total_counts() == 0
        whole = rank_values(joined.full_tensor())[0]
        grads = [rank_values(t.grad.full_tensor())[0] for t in (ad, bd)]
        odd = holder(ad, distribute_tensor(_randn(2, 3, 12), mesh, [Shard(2)]))
        # DTensor's own gather (8 and 12 differ): whole, so the region hands it back plain
        assert not isinstance(odd, DTensor) and odd.shape == (2, 3, 20)
    _close(whole, torch.cat([a, b * 2], dim=-1))
    _close(grads[0], g[..., :8])
    _close(grads[1], 2 * g[..., 8:])


class _SingleStream(nn.Module):
    """Flux's single-stream block as diffusers writes it: attention (heads sized from the
    keys' width) and an MLP side by side on one normed input, joined by `cat` before one
    projection over both; the attention's module has no output layer of its own."""

    def __init__(self, dim: int = 32, heads: int = 4, hidden: int = 64) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = _HeadsOnly(dim, heads)
        self.proj_mlp = nn.Linear(dim, hidden)
        self.proj_out = nn.Linear(dim + hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        both = torch.cat([self.attn(h), F.gelu(self.proj_mlp(h))], dim=2)
        return x + self.proj_out(both)


class _Stack(nn.Module):
    """Two blocks in a ModuleList (a region is a module a plan names by pattern), each
    added to the stream when `residual`."""

    def __init__(self, make: type[nn.Module], *, residual: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([make(), make()])
        self.residual = residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x) if self.residual else block(x)
        return x


class _HeadsOnly(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        hd = k.shape[-1] // self.heads
        q, k, v = (t.view(b, -1, self.heads, hd).transpose(1, 2) for t in (q, k, v))
        return (
            F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, hd * self.heads)
        )


@pytest.mark.parametrize("tp", [2, 4])
def test_attention_and_mlp_joined_before_one_projection_become_one_region(tp: int) -> None:
    """The block is the region: the attention's heads (32 features) and the MLP (64, as 2
    pieces of 32) stay DTensors, the join is each rank's slice of 3 pieces, and proj_out
    contracts them rowwise with those `parts`: one all-reduce in forward, at parity."""
    model = _Stack(_SingleStream)
    x = _randn(2, 6, 32)
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x)
    assert [r.match for r in plan.regions] == ["blocks.*"]
    rules = {r.match: r for r in plan.rules}
    assert (rules["blocks.*.proj_mlp"].style, rules["blocks.*.proj_mlp"].parts) == (
        "colwise",
        [32, 32],
    )
    out = rules["blocks.*.proj_out"]
    assert (out.style, out.parts) == ("rowwise", [32, 32, 32])
    assert "joined as 3 pieces of 32" in out.why
    assert tpplan.check_plan(plan, model, tp_size=tp) == []
    assert Plan.from_yaml(plan.to_yaml()) == plan
    assert_parity(model, plan, tp, x)
    comms, weight = _one_forward(model, plan, tp, x)
    assert {str(op): n for op, n in comms.get_comm_counts().items()} == {
        "c10d_functional.all_reduce": 2
    }
    assert torch.equal(weight, model.blocks[0].proj_out.weight)


class _LatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention as torchtitan writes it: keys and values from
    a latent projection (normed) shared by every head, and a rotary key part every head
    shares, expanded to the heads; head counts read off the module, sizes computed."""

    def __init__(self, dim: int = 32, heads: int = 4, rank: int = 8, rope: int = 4) -> None:
        super().__init__()
        self.heads, self.rank, self.rope, self.nope = heads, rank, rope, 8
        self.wq = nn.Linear(dim, heads * (self.nope + rope))
        self.wkv_a = nn.Linear(dim, rank + rope)
        self.kv_norm = nn.RMSNorm(rank)
        self.wkv_b = nn.Linear(rank, heads * (self.nope + 8))
        self.wo = nn.Linear(heads * 8, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.nope + self.rope)
        kv, k_pe = self.wkv_a(x).split([self.rank, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv)).view(b, s, -1, self.nope + 8)
        k_nope, v = kv.split([self.nope, 8], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(-1, -1, self.heads, -1)], dim=-1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        )
        return self.wo(out.transpose(1, 2).flatten(2))


@pytest.mark.parametrize("tp", [2, 4])
def test_latent_attention_keeps_its_shared_projection_whole(tp: int) -> None:
    """wkv_a's output reaches wkv_b through a norm over all its features, and its rotary
    part reaches every head: it stays whole (with its reason), wkv_b and wq open the
    split, wo closes it. Forward: one all-reduce; the backward gathers the rotary part's
    gradient from the heads; numbers at parity."""
    model = _Stack(_LatentAttention, residual=True)
    x = _randn(2, 6, 32)
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x)
    rules = {r.match.removeprefix("blocks.*."): r for r in plan.rules}
    assert rules["wkv_a"].style == "replicate" and "wkv_b, which opens" in rules["wkv_a"].why
    assert {n: rules[n].style for n in ("wq", "wkv_b", "wo")} == {
        "wq": "colwise", "wkv_b": "colwise", "wo": "rowwise",
    }  # fmt: skip
    assert [r.match for r in plan.regions] == ["blocks.*"]
    assert "gather of the gradient of what wkv_a" in plan.regions[0].why
    assert tpplan.check_plan(plan, model, tp_size=tp) == []
    assert_parity(model, plan, tp, x)
    comms, _ = _one_forward(model, plan, tp, x)
    assert {str(op): n for op, n in comms.get_comm_counts().items()} == {
        "c10d_functional.all_reduce": 2
    }


_DEEPSEEK = {
    "num_hidden_layers": 2, "first_k_dense_replace": 1, "hidden_size": 64, "intermediate_size": 128,
    "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "vocab_size": 128,
}  # fmt: skip


@pytest.mark.parametrize("tp", [2, 4])
def test_transformers_deepseek_v3_latent_attention_is_a_region(tp: int) -> None:
    """transformers' DeepSeek-V3 (a dense layer, then a mixture-of-experts one, whose
    grouped matmul the region's fake runs ask in bf16 as the tracer does) has latent
    projections for queries as well as keys, and builds its keys with `new_empty` and
    `copy_` into slices: both latent projections stay whole, the keys are made split like
    the heads written into them, and the attention is a region with one all-reduce in
    forward, at parity."""
    from tpplan._runtime.models import build_model

    torch.manual_seed(0)
    model = build_model("deepseek_v3", _DEEPSEEK, device="cpu")
    x = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs={"input_ids": x})
    rules = {r.match.removeprefix("model.layers.*.self_attn."): r for r in plan.rules}
    assert [r.match for r in plan.regions] == ["model.layers.*.self_attn"]
    assert rules["q_a_proj"].why.startswith("kept whole: q_b_proj, which opens")
    assert rules["kv_a_proj_with_mqa"].why.startswith("kept whole: kv_b_proj, which opens")
    assert {n: rules[n].style for n in ("q_b_proj", "kv_b_proj", "o_proj")} == {
        "q_b_proj": "colwise", "kv_b_proj": "colwise", "o_proj": "rowwise",
    }  # fmt: skip
    assert tpplan.check_plan(plan, model, tp_size=tp) == []
    assert_parity(model, plan, tp, {"input_ids": x})


@pytest.mark.parametrize("tp", [2, 4])
def test_phi3_fused_projection_sliced_at_config_products_splits_on_local_shards(tp: int) -> None:
    """transformers' Phi-3 cuts q, k and v out of its fused qkv_proj by slices at positions
    computed from the config every layer shares (`qkv[..., : self.config.num_attention_heads
    * self.head_dim]`). The head count of that product is divided on the attention's own copy
    of the config (head_dim, which its views keep whole, stays): the layers run on local
    shards, no region, no gather, one all-reduce at o_proj, at parity."""
    from tpplan._runtime.models import build_model

    torch.manual_seed(0)
    config = {
        "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 128,
        "pad_token_id": 0, "eos_token_id": 0,
    }  # fmt: skip
    model = build_model("phi3", config, device="cpu")
    x = {"input_ids": torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))}
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x)
    assert plan.regions == []
    rules = {r.match.removeprefix("model.layers.*.self_attn."): r for r in plan.rules}
    assert (rules["qkv_proj"].style, rules["qkv_proj"].output_layout()) == ("colwise", "shard(-1)")
    assert rules["o_proj"].style == "rowwise"
    divided = {a for attr in plan.attributes for a in attr.divide}
    assert "config.num_attention_heads" in divided and "head_dim" not in divided
    assert tpplan.check_plan(plan, model, tp_size=tp) == []
    assert_parity(model, plan, tp, x)
    sharded_config = model.model.layers[0].self_attn.config
    assert sharded_config.num_attention_heads == 4  # the model itself is left as it was


class _LiteralSlices(nn.Module):
    """q|k|v in one Linear of three equal pieces, cut by slices at bounds written as numbers
    and viewed with a literal head count: no attribute a plan may divide holds them."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(64, 192)
        self.o = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x)
        q, k, v = (
            z.view(b, t, 4, 16).transpose(1, 2)
            for z in (qkv[..., :64], qkv[..., 64:128], qkv[..., 128:])
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, t, 64))


@pytest.mark.parametrize("tp", [2, 4])
def test_fused_projection_sliced_at_literal_bounds_is_a_region(tp: int) -> None:
    """Slices at literal bounds of three equal pieces: as a DTensor region the fused output
    is each rank's slice of the three pieces, and a slice on the pieces' bounds is the rank's
    own slice of them: no gather, one all-reduce at o, at parity."""
    torch.manual_seed(0)
    model = nn.Sequential(_LiteralSlices())
    x = torch.randn(2, 8, 64)
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x)
    assert [r.match for r in plan.regions] == ["0"]
    rules = {r.match: r for r in plan.rules}
    assert (rules["0.qkv"].style, rules["0.qkv"].parts) == ("colwise", [64, 64, 64])
    assert rules["0.qkv"].local_output is False
    assert rules["0.o"].style == "rowwise"
    assert tpplan.check_plan(plan, model, tp_size=tp) == []
    assert_parity(model, plan, tp, x)


def test_a_mask_of_one_per_head_is_cut_to_each_ranks_heads() -> None:
    """transformers' Doge (a region: its heads sized from shapes) hands attention a mask of
    one (q, k) plane per head in eval mode, whole on every rank and of the full head count:
    each rank attends with its own heads' planes (a local slice, no collective), where
    DTensor's own attention fails on the shapes. Parity, forward and backward."""
    from tpplan._runtime.models import build_model

    torch.manual_seed(0)
    config = {
        "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 128,
    }  # fmt: skip
    model = build_model("doge", config, device="cpu").eval()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    x = {"input_ids": ids, "use_cache": False}
    plan = tpplan.infer_plan(model, tp_size=2)
    assert [r.match for r in plan.regions] == ["model.layers.*.self_attn"]
    with torch.no_grad():  # inference: the forward that hands attention the per-head mask
        want = model(**x).logits
        with simulated_ranks(2) as mesh:
            sharded = tpplan.apply_plan(copy.deepcopy(model), mesh, plan)
            got = rank_values(sharded(**x).logits)
    assert max((g - want).abs().max().item() for g in got) < 1e-5
    assert_parity(model, plan, 2, x)


# ---- reductions over the split heads (issue 35 d and e) ---------------------------------------
class _HandNorm(nn.Module):
    """An RMSNorm written by hand in a module of its own, as transformers' OLMo-2 writes its
    q/k norms: in float32, the weight first."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * x.to(dtype)


class _ReducedOverHeads(nn.Module):
    """Attention whose code reduces over every head's features, written one of several ways:
    a q/k norm over all heads (nn.RMSNorm, nn.LayerNorm, or by hand with a weight of one
    entry per feature), or attention weights averaged or summed over the heads and returned
    beside the output, for the caller to use."""

    def __init__(self, style: str, width: int = 32, n_head: int = 4) -> None:
        super().__init__()
        self.style, self.n_head, self.head_dim = style, n_head, width // n_head
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.o = nn.Linear(width, width)
        if style == "rmsnorm":
            self.q_norm, self.k_norm = nn.RMSNorm(width), nn.RMSNorm(width)
        elif style == "layernorm":
            self.q_norm, self.k_norm = nn.LayerNorm(width), nn.LayerNorm(width)
        elif style == "by_hand":
            self.q_scale = nn.Parameter(1 + 0.1 * torch.randn(width))
        elif style == "norm_module":
            self.q_norm, self.k_norm = _HandNorm(width), _HandNorm(width)

    def _normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.style in ("rmsnorm", "layernorm", "norm_module"):
            return self.q_norm(q), self.k_norm(k)
        if self.style == "by_hand":
            rms = torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6)
            return q * rms * self.q_scale, k
        return q, k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, t, _ = x.shape
        q, k = self._normed(self.q(x), self.k(x))
        q, k, v = (
            z.view(b, t, self.n_head, self.head_dim).transpose(1, 2) for z in (q, k, self.v(x))
        )
        scores = (q @ k.transpose(-2, -1)) * self.head_dim**-0.5  # (B, H, T, T)
        p = scores.softmax(dim=-1)
        a = (p @ v).transpose(1, 2).reshape(b, t, self.n_head * self.head_dim)
        kept = {"mean": p.mean(dim=1), "sum": p.sum(dim=1)}.get(self.style)  # (B, T, T)
        return self.o(a), kept


class _OneLayer(nn.Module):
    def __init__(self, style: str) -> None:
        super().__init__()
        self.embed, self.attn = nn.Embedding(64, 32), _ReducedOverHeads(style)
        self.head = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        a, weights = self.attn(x)
        if weights is not None:  # used: the most attended position's weight, per token
            a = a + weights.amax(dim=-1, keepdim=True)
        return self.head(x + a)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("style", ["rmsnorm", "layernorm", "by_hand", "norm_module", "mean", "sum"])
def test_a_reduction_over_the_split_heads_runs_split_with_one_all_reduce(
    style: str, tp: int
) -> None:
    """Every head's features normalized at once, or attention weights averaged or summed
    over the heads for the caller: the heads stay split in a DTensor region, whose forward
    sums the reduced values (a row's statistics, the T x T weights) with an all-reduce and
    gathers nothing, at the unsharded model's numbers forward and backward."""
    model = seeded(_OneLayer, style=style)
    x = token_batch(64)
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x)
    assert [r.match for r in plan.regions] == ["attn"], plan.to_yaml()
    assert "reduces over the split features" in plan.regions[0].why
    rules = {r.match: r.style for r in plan.rules}
    assert {rules[f"attn.{n}"] for n in "qkv"} == {"colwise"}
    assert rules["attn.o"] == "rowwise"
    assert_parity(model, plan, tp, x)
    comms, _ = _one_forward(model, plan, tp, x)
    attn = {
        str(op).split(".")[-1]: n
        for op, n in comms.comm_module_counts["_OneLayer.attn"]["forward"].items()
    }
    assert set(attn) == {"all_reduce"}, attn
    assert tpplan.check_plan(plan, model, tp_size=tp) == []


# CommDebugMode's module tracking hooks the backward of modules whose inputs need no grad
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("style", ["rmsnorm", "by_hand", "norm_module"])
def test_a_norm_over_the_split_heads_sums_small_gradients_in_the_backward(style: str) -> None:
    """The backward of a norm over every head's features, by torch or by hand: only
    all-reduces of the statistics' gradients (B x S values) and of the norm's weight, never
    a reduce-scatter or a gather of B x S x C features (DTensor's own backward of a partial
    mean would reduce-scatter it)."""
    model = seeded(_OneLayer, style=style)
    x = token_batch(64)
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=x)
    assert [r.match for r in plan.regions] == ["attn"], plan.to_yaml()
    with simulated_ranks(2) as mesh:
        sharded = copy.deepcopy(model).train()
        tpplan.apply_plan(sharded, mesh, plan, local_shards=False)
        with CommDebugMode() as comms:
            sharded(x).float().pow(2).mean().backward()
    backward = {
        str(op).split(".")[-1]
        for name, per in comms.comm_module_counts.items()
        if name.startswith("_OneLayer.attn")
        for op in per.get("backward", {})
    }
    assert backward <= {"all_reduce"}, backward


@pytest.mark.parametrize("tp", [2, 4])
def test_olmo2_attention_splits_by_heads_with_its_norms_over_all_heads(tp: int) -> None:
    """transformers' OLMo-2 normalizes q and k over every head's features at once with an
    RMSNorm of its own: its attention runs as a DTensor region, q, k, v split by heads,
    the norms' statistics all-reduced, at the unsharded model's numbers on both paths (on
    local shards the region stays on DTensors: a mean over the split features there would
    read one rank's part)."""
    from transformers import AutoModelForCausalLM, Olmo2Config

    config = Olmo2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = {"input_ids": torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))}
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=ids)
    assert [r.match for r in plan.regions] == ["model.layers.*.self_attn"], plan.to_yaml()
    assert "reduces over the split features" in plan.regions[0].why
    rules = {r.match: r for r in plan.rules}
    for n in ("q_proj", "k_proj", "v_proj"):
        assert rules[f"model.layers.*.self_attn.{n}"].style == "colwise"
    assert rules["model.layers.*.self_attn.o_proj"].style == "rowwise"
    assert_parity(model, plan, tp, ids)


@pytest.mark.unit
def test_a_candidate_whose_way_fails_does_not_hide_another_s_proof() -> None:
    """Candidates are proven in one run; where one of them stops that run (an MLP tried in
    pieces it does not have), the candidates of each module class are proven apart rather
    than all dropped: one run per class, not per module."""
    from tpplan.infer.dtensor_regions import _each_proven

    runs: list[list[str]] = []

    def prove(group: dict[str, Any]) -> dict[str, Any] | None:
        runs.append(sorted(group))
        return None if any(m.endswith("mlp") for m in group) else {m: f"counted {m}" for m in group}

    def kind(m: str) -> str:
        return m.rpartition(".")[2]

    blocks = {f"{i}.{part}": {} for i in range(3) for part in ("attn", "mlp")}
    assert _each_proven(prove, blocks, kind) == {f"{i}.attn": f"counted {i}.attn" for i in range(3)}
    assert runs == [sorted(blocks), ["0.attn", "1.attn", "2.attn"], ["0.mlp", "1.mlp", "2.mlp"]]
    runs.clear()
    attention = {f"{i}.attn": {} for i in range(3)}
    assert len(_each_proven(prove, attention, kind)) == 3
    assert runs == [sorted(attention)]  # one run when it works
