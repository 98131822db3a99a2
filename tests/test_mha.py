"""torch's nn.MultiheadAttention split by heads (`style: heads`): its fused q|k|v parameter
as each rank's slice of each piece, out_proj contracting the heads with one all-reduce, and
the module's whole inputs and outputs unchanged. Parity with the unsharded module on every
simulated rank, forward and backward (outputs, attention weights, input gradients, every
parameter's gradient), over the forms its forward takes: self- and cross-attention, batch
first or not, masks of every shape, separate key/value widths, extra key/value biases."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import tpplan
from tpplan import Plan, Rule, check_plan
from tpplan._runtime.local import rank_values, simulated_ranks
from tpplan.compile.attention import HeadParallelAttention

sys.path.insert(0, str(Path(__file__).parent))
from support.parity import assert_parity

E, H, N, L, S = 32, 4, 3, 5, 7
TOL = 2e-5  # fp32 sums in another order, relative to the largest value


def _rnd(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _encoder() -> nn.Module:
    """PyTorch's own encoder: two layers of self-attention (4 heads of 8) and an MLP."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


@pytest.mark.parametrize("tp", [2, 4])
def test_an_encoders_attention_is_split_by_heads(tp: int) -> None:
    model = _encoder()
    x = _rnd(2, 6, E, seed=1)
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x)
    styles = {r.match: (r.style, r.head_size()) for r in plan.rules}
    assert styles["layers.*.self_attn"] == ("heads", 8)
    assert styles["layers.*.linear1"][0] == "colwise"
    assert styles["layers.*.linear2"][0] == "rowwise"
    assert not any(m.endswith("out_proj") for m in styles)  # the heads style's own
    assert check_plan(plan, model, tp_size=tp) == []
    assert_parity(model, plan, tp, x)


def test_an_encoders_eval_forward_without_grad_matches_torchs_fast_path() -> None:
    """Unsharded, eval without grad takes torch's fused kernel; split, the module's hooks keep
    it on the per-rank path: the numbers agree."""
    model = _encoder().eval()
    x = _rnd(2, 6, E, seed=1)
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=x)
    with torch.no_grad():
        want = model(x)
        with simulated_ranks(2) as mesh:
            sharded = tpplan.apply_plan(copy.deepcopy(model), mesh, plan)
            got = rank_values(sharded(x))
    assert max((g - want).abs().max().item() for g in got) < TOL


# ---- the forms of nn.MultiheadAttention's forward -----------------------------------------
_CASES: dict[str, dict[str, Any]] = {
    "self": {"kind": "self"},
    "self, seq first": {"kind": "self", "batch_first": False},
    "cross": {"kind": "cross"},
    "cross, kdim and vdim": {"kind": "cross", "kdim": 24, "vdim": 16},
    "causal bool mask": {"kind": "self", "mask": "bool"},
    "float mask per head": {"kind": "cross", "mask": "heads"},
    "key padding mask": {"kind": "cross", "kpm": True},
    "weights averaged": {"kind": "cross", "need_weights": True},
    "weights per head": {"kind": "self", "need_weights": True, "average": False, "mask": "bool"},
    "bias_k and zero attention": {"kind": "cross", "extra": True, "kpm": True},
    "unbatched": {"kind": "self", "batched": False},
}


def _module(case: dict[str, Any]) -> nn.MultiheadAttention:
    torch.manual_seed(0)
    m = nn.MultiheadAttention(
        E,
        H,
        batch_first=case.get("batch_first", True),
        kdim=case.get("kdim"),
        vdim=case.get("vdim"),
        add_bias_kv=case.get("extra", False),
        add_zero_attn=case.get("extra", False),
    )
    with torch.no_grad():  # torch starts the biases at zero; make them count
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(0.1 * _rnd(*p.shape, seed=p.numel()))
    return m


def _inputs(case: dict[str, Any]) -> tuple[list[torch.Tensor], dict[str, Any]]:
    first, batched = case.get("batch_first", True), case.get("batched", True)

    def shaped(length: int, width: int, seed: int) -> torch.Tensor:
        if not batched:
            return _rnd(length, width, seed=seed)
        return _rnd(N, length, width, seed=seed) if first else _rnd(length, N, width, seed=seed)

    q = shaped(L, E, 1)
    if case["kind"] == "self":
        k = v = q
    else:
        k, v = shaped(S, case.get("kdim") or E, 2), shaped(S, case.get("vdim") or E, 3)
    src = L if case["kind"] == "self" else S
    kw: dict[str, Any] = {"need_weights": case.get("need_weights", False)}
    if kw["need_weights"]:
        kw["average_attn_weights"] = case.get("average", True)
    if case.get("mask") == "bool":
        kw["attn_mask"] = torch.triu(torch.ones(L, src, dtype=torch.bool), diagonal=1)
    elif case.get("mask") == "heads":  # a bias of its own per head: cut to each rank's
        kw["attn_mask"] = _rnd(N * H, L, src, seed=4)
    if case.get("kpm"):
        pad = torch.zeros(N, src, dtype=torch.bool)
        pad[0, -2:] = True
        kw["key_padding_mask"] = pad
    return [q, k, v], kw


def _run(m: nn.Module, xs: list[torch.Tensor], kw: dict[str, Any]) -> tuple[Any, Any, list[Any]]:
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    # self-attention passes one tensor three times, as models do (one projection)
    if xs[0] is xs[1]:
        leaves = [leaves[0]] * 3
    out, weights = m(*leaves, **kw)
    out.square().sum().backward()
    return out, weights, [x.grad for x in dict.fromkeys(leaves)]


def _off(got: Any, want: Any) -> float:
    if want is None:
        assert got is None
        return 0.0
    if isinstance(got, DTensor):
        got = got.full_tensor()
    scale = max(1.0, want.abs().max().item())
    return max((g - want).abs().max().item() / scale for g in rank_values(got))


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("case", list(_CASES), ids=list(_CASES))
def test_a_head_split_attention_matches_the_unsharded_one(case: str, tp: int) -> None:
    form = _CASES[case]
    whole = _module(form)
    xs, kw = _inputs(form)
    want = _run(whole, xs, kw)
    with simulated_ranks(tp) as mesh:
        split = parallelize_module(copy.deepcopy(whole), mesh, HeadParallelAttention())
        got = _run(split, xs, kw)
        worst = max(
            _off(got[0], want[0]),
            _off(got[1], want[1]),
            *(_off(g, w) for g, w in zip(got[2], want[2], strict=True)),
            *(
                _off(p.grad, q.grad)
                for p, q in zip(split.parameters(), whole.parameters(), strict=True)
            ),
        )
    assert worst < TOL, f"{case} at tp {tp}: off by {worst:.3g}"


@pytest.mark.unit
def test_the_fused_projection_is_the_unsharded_one_split_by_heads() -> None:
    """State dicts see q|k|v in its own order; each rank holds its slice of each piece."""
    whole = _module({"kind": "self"})
    with simulated_ranks(2) as mesh:
        split = parallelize_module(copy.deepcopy(whole), mesh, HeadParallelAttention())
        for name, p in split.state_dict().items():
            assert torch.equal(p.full_tensor(), whole.state_dict()[name]), name
        assert split.in_proj_weight.to_local().shape == (3 * E // 2, E)
        assert split.out_proj.weight.to_local().shape == (E, E // 2)


@pytest.mark.unit
def test_heads_the_tp_size_does_not_divide_are_named() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.MultiheadAttention(48, 6, batch_first=True))
    plan = Plan(rules=[Rule(match="0", style="heads", head_dim=8, why="a test")])
    assert [str(p) for p in check_plan(plan, model, tp_size=4)] == [
        "rules[0] (match: 0), module 0: 6 heads (of head_dim 8) do not split evenly over tp "
        "size 4; every rank must hold whole heads. Fix: use a tp size among 1, 2, 3, 6, or "
        "keep this module replicated."
    ]


@pytest.mark.unit
def test_a_rule_inside_a_head_split_attention_is_named() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.MultiheadAttention(32, 4, batch_first=True))
    plan = Plan(
        rules=[
            Rule(match="0", style="heads", head_dim=8, why="a test"),
            Rule(match="0.out_proj", style="rowwise", why="a test"),
        ]
    )
    said = [str(p) for p in check_plan(plan, model, tp_size=2)]
    assert (
        "rules[1] (match: 0.out_proj), module 0.out_proj: it is inside 0, matched by rules[0] "
        "(style heads), which splits its out_proj itself. Fix: drop this rule, or keep the "
        "module whole (style: replicate)."
    ) in said


class _OwnForward(nn.MultiheadAttention):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return super().forward(*args, **kwargs)


@pytest.mark.unit
def test_heads_on_an_attention_with_a_forward_of_its_own_is_refused() -> None:
    with torch.device("meta"):
        model = nn.Sequential(_OwnForward(32, 4, batch_first=True))
    plan = Plan(rules=[Rule(match="0", style="heads", head_dim=8, why="a test")])
    assert [str(p) for p in check_plan(plan, model, tp_size=2)] == [
        "rules[0] (match: 0), module 0: style 'heads' runs nn.MultiheadAttention's own "
        "computation split by heads; _OwnForward has a forward of its own. Fix: keep this "
        "module replicated (style: replicate)."
    ]
