"""Key/value heads every split query head shares, inside a DTensor region (issue 35 j, and
multi-query attention beside b, d, e, f): attention whose sizes no attribute a plan may
divide holds (a shared config object, literals, raw weights, heads folded into the batch
dim) runs on DTensors; its one key/value head (or fewer key/value heads than ranks) cannot
be split, so its layers stay whole on every rank and each rank's query heads use it whole,
the query and output layers split by heads. Nothing is gathered in the forward.

Written by hand in several styles: `repeat_interleave` or `expand`, SDPA or an explicit
softmax, heads in their own dim or in the batch dim, Linear layers or raw weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from support.models import seeded, token_batch
from support.parity import assert_parity, forward_collectives
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

import tpplan
from tpplan._runtime.local import simulated_ranks

WIDTH, HEADS, HEAD_DIM = 32, 4, 8


class _Config:
    """Sizes every layer reads from one shared object (a plan divides them on each
    module's own copy)."""

    n_head, head_dim = HEADS, HEAD_DIM


class _SharedKv(nn.Module):
    """Attention with `kv` key/value heads, written `style`'s way, its sizes literals (or
    read from a config object, `sizes="config"`)."""

    def __init__(self, style: str, kv: int, sizes: str = "literal") -> None:
        super().__init__()
        self.style, self.cfg, self.kv, self.sizes = style, _Config(), kv, sizes
        if style == "raw":  # raw weights used as `x @ w`
            self.w_q = nn.Parameter(torch.randn(WIDTH, HEADS * HEAD_DIM) * WIDTH**-0.5)
            self.w_k = nn.Parameter(torch.randn(WIDTH, kv * HEAD_DIM) * WIDTH**-0.5)
            self.w_v = nn.Parameter(torch.randn(WIDTH, kv * HEAD_DIM) * WIDTH**-0.5)
            self.w_o = nn.Parameter(torch.randn(HEADS * HEAD_DIM, WIDTH) * WIDTH**-0.5)
        else:
            self.q_proj = nn.Linear(WIDTH, HEADS * HEAD_DIM)
            self.k_proj = nn.Linear(WIDTH, kv * HEAD_DIM)
            self.v_proj = nn.Linear(WIDTH, kv * HEAD_DIM)
            self.o_proj = nn.Linear(HEADS * HEAD_DIM, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h, d = (self.cfg.n_head, self.cfg.head_dim) if self.sizes == "config" else (HEADS, HEAD_DIM)
        if self.style == "raw":
            q, k, v = x @ self.w_q, x @ self.w_k, x @ self.w_v
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, t, h, d).transpose(1, 2)  # (B, H, T, D)
        k, v = (z.view(b, t, -1, d).transpose(1, 2) for z in (k, v))  # (B, KV, T, D)
        if self.style == "batch":  # expanded, heads folded into the batch, a softmax
            k, v = (
                z[:, :, None].expand(b, k.shape[1], h // k.shape[1], t, d).reshape(b * h, t, d)
                for z in (k, v)
            )
            q = q.reshape(b * h, t, d)
            s = (q @ k.transpose(1, 2)) * d**-0.5
            keep = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            a = s.masked_fill(~keep, float("-inf")).softmax(-1) @ v
            a = a.view(b, h, t, d)
        else:
            k, v = (z.repeat_interleave(h // z.shape[1], dim=1) for z in (k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = a.transpose(1, 2).reshape(b, t, h * d)
        return a @ self.w_o if self.style == "raw" else self.o_proj(a)


class _Model(nn.Module):
    def __init__(self, style: str, kv: int, sizes: str = "literal") -> None:
        super().__init__()
        self.embed = nn.Embedding(64, WIDTH)
        self.attn = _SharedKv(style, kv, sizes)
        self.head = nn.Linear(WIDTH, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.head(x + self.attn(x))


def _gathers(model: nn.Module, plan: tpplan.Plan, tp: int, x: torch.Tensor) -> dict[str, int]:
    with simulated_ranks(tp) as mesh:
        sharded = copy.deepcopy(model)
        tpplan.apply_plan(sharded, mesh, plan)
        with CommDebugMode() as comms:
            sharded(x)
        return forward_collectives(comms, "_Model.attn")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize(
    ("style", "kv"),
    [("linear", 1), ("raw", 1), ("batch", 1), ("linear", 2)],
    ids=["mqa-linear-sdpa", "mqa-raw-matmul", "mqa-batch-softmax", "gqa-2-heads"],
)
def test_shared_key_value_heads_stay_whole_in_a_region(style: str, kv: int, tp: int) -> None:
    """The query and output split by heads in a DTensor region, the key/value layers (or
    weights) whole on every rank with a reason that names why; one all-reduce and no
    all-gather in the attention's forward; check passes; parity forward and backward.
    Two key/value heads at tp 2 split with the query heads instead, and at tp 4 each rank
    holds one of them."""
    torch.manual_seed(0)
    model = seeded(_Model, style=style, kv=kv)
    x = token_batch(64)
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x)
    rules = {r.match: r for r in plan.rules}
    assert [r.match for r in plan.regions] == ["attn"], plan.to_yaml()
    shared = kv < tp
    if style == "raw":
        rule = rules["attn"]
        assert rule.style == "split_params", plan.to_yaml()
        expect = {"w_q": 1, "w_o": 0} if shared else {"w_q": 1, "w_k": 1, "w_v": 1, "w_o": 0}
        assert rule.shard == expect
    else:
        assert rules["attn.q_proj"].style == "colwise"
        assert rules["attn.o_proj"].style == "rowwise"
        for name in ("attn.k_proj", "attn.v_proj"):
            if shared and kv == 1:
                assert rules[name].style == "replicate", plan.to_yaml()
                assert "every split head shares it" in rules[name].why
            elif shared:
                # two heads at tp 4: each rank the one its query heads use (see
                # test_region_shared_heads.py)
                assert rules[name].shares_heads() and rules[name].hands_dtensors()
            else:
                assert rules[name].style == "colwise", plan.to_yaml()
    assert tpplan.check_plan(plan, model, tp_size=tp) == []
    assert_parity(model, plan, tp, x)
    assert _gathers(model, plan, tp, x) == {"all_reduce": 1}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("style", ["linear", "batch"])
def test_shared_key_value_heads_sized_from_a_shared_config_split_on_local_shards(
    style: str, tp: int
) -> None:
    """The same attention with its sizes read from a config object: the plan divides its
    head count on the module's own copy of the config, so the layers run on local shards,
    with no region: the one key/value head goes whole to every rank (`replicate_heads`),
    the query and output split by heads. One all-reduce, no gather, parity."""
    model = seeded(_Model, style=style, kv=1, sizes="config")
    x = token_batch(64)
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x)
    rules = {r.match: r for r in plan.rules}
    assert plan.regions == [], plan.to_yaml()
    assert rules["attn.q_proj"].style == "colwise"
    assert rules["attn.o_proj"].style == "rowwise"
    for name in ("attn.k_proj", "attn.v_proj"):
        assert (rules[name].style, rules[name].replicate_heads) == ("colwise", True)
    assert "cfg.n_head" in {a for attr in plan.attributes for a in attr.divide}
    assert tpplan.check_plan(plan, model, tp_size=tp) == []
    assert_parity(model, plan, tp, x)
    assert _gathers(model, plan, tp, x) == {"all_reduce": 1}


def test_verify_passes_a_region_with_whole_key_value_layers() -> None:
    """`tpplan verify`'s check, forward and backward against the unsharded model, on the
    multi-query region; the sharded model's state dict is the original one."""
    from tpplan.diagnose.verify import verify_plan

    model = seeded(_Model, style="linear", kv=1)
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=token_batch(64))
    assert verify_plan(model, plan, tp_size=2, backward=True, tol=1e-4).ok


@pytest.mark.parametrize(
    ("heads", "kv", "tp"), [(6, 2, 3), (12, 4, 3)], ids=["6-of-2-tp3", "12-of-4-tp3"]
)
def test_transformers_key_value_heads_tp_does_not_split(heads: int, kv: int, tp: int) -> None:
    """transformers' Llama with key/value heads tp neither divides nor is a multiple of
    (so no rank can hold whole ones of its own), inferred with no example inputs: its
    attention runs on DTensors with q split by heads and k/v whole, and
    transformers' own SDPA call (`enable_gqa`, the grouped heads given whole on CPU) gets
    each rank's key/value heads repeated for its query heads; parity on both paths."""
    import transformers

    config = transformers.LlamaConfig(
        num_hidden_layers=1,
        vocab_size=96,
        hidden_size=16 * heads,
        head_dim=16,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=96,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = {"input_ids": torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))}
    plan = tpplan.infer_plan(model, tp_size=tp)
    rules = {r.match: r for r in plan.rules}
    assert rules["model.layers.0.self_attn.k_proj"].style == "replicate", plan.to_yaml()
    assert [r.match for r in plan.regions] == ["model.layers.0.self_attn"], plan.to_yaml()
    assert rules["model.layers.0.self_attn.q_proj"].style == "colwise"
    assert tpplan.check_plan(plan, model, tp_size=tp) == []
    assert_parity(model, plan, tp, ids)
