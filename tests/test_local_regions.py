"""DTensor regions run on local shards (compile/local_regions.py): the region's proof on fake
ranks notes, call site by call site, what each rank does differently on its local tensors;
the sharded model then runs the region's own code on plain tensors.

Each test builds a small attention written in one of the ways regions exist for (sizes read
from the opener's output, per-head weights returned, a whole per-head parameter meeting the
split heads) and checks that it runs locally, with no DTensor activation inside, at parity
forward and backward on both execution paths (assert_parity runs `local_shards=False` too);
and that what a proof cannot reproduce stays on DTensors with its reason.
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
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

import tpplan
from tpplan import Plan
from tpplan._runtime.local import rank_values, simulated_ranks

sys.path.insert(0, str(Path(__file__).parent))
from support.parity import assert_parity


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class _Attention(nn.Module):
    """Heads sized from the fused output's own shape (`c // 3 // self.heads`, global only on
    DTensors), cut by `split` at a width from the shape; optionally a learnable per-head
    scale (whole, one entry per head) on the scores, and the scores returned beside the
    output."""

    def __init__(self, dim: int = 32, heads: int = 4, *, scale: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.scale = (
            nn.Parameter(torch.linspace(0.5, 1.5, heads).view(heads, 1, 1)) if scale else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        qkv = self.qkv(x)
        c = qkv.shape[-1]  # the fused width: 3 * dim on DTensors, and so on local shards too
        q, k, v = qkv.split(c // 3, dim=-1)
        q, k, v = (
            z.view(b, t, self.heads, c // 3 // self.heads).transpose(1, 2) for z in (q, k, v)
        )
        scores = q @ k.transpose(-1, -2) / (c // 3 // self.heads) ** 0.5  # (b, heads, t, t)
        if self.scale is not None:
            scores = scores * self.scale
        weights = scores.softmax(-1)
        y = (weights @ v).transpose(1, 2).reshape(b, t, c // 3)
        return self.out(y), weights


class _Block(nn.Module):
    """An attention as a block's `attn`, its output (not what it returns beside) handed on."""

    def __init__(self, attn: nn.Module | None = None) -> None:
        super().__init__()
        self.attn = attn if attn is not None else _Attention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)[0]


def _plan(*, pieces: bool = True) -> Plan:
    return Plan.model_validate(
        {
            "tpplan": 9,
            "rules": [
                {"match": "attn.qkv", "style": "colwise", "local_output": False,
                 **({"parts": [32, 32, 32]} if pieces else {}), "why": "opens the heads"},
                {"match": "attn.out", "style": "rowwise", "why": "closes them"},
            ],
            "regions": [{"match": "attn", "why": "heads sized from shapes"}],
        }
    )  # fmt: skip


class _Activations(TorchFunctionMode):
    """Counts the DTensors other than parameters that torch calls are handed."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        leaves, _ = tree_flatten((args, kwargs or {}))
        self.seen += sum(isinstance(t, DTensor) and not isinstance(t, nn.Parameter) for t in leaves)
        return func(*args, **(kwargs or {}))


def _dtensor_activations(model: nn.Module, module: nn.Module, x: torch.Tensor) -> int:
    """DTensor activations handed to torch calls while `module`'s own code runs."""
    counting = _Activations()

    def enter(m: nn.Module, args: Any) -> None:
        counting.__enter__()

    def leave(m: nn.Module, args: Any, out: Any) -> None:
        counting.__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)
    model(x)
    return counting.seen


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_region_sized_from_its_own_shapes_runs_on_local_shards(tp: int) -> None:
    """The region's code reads its heads' sizes from the fused output's shape: on local
    shards that read answers the global size, as on DTensors, and only the view and split
    take the rank's share (at tp 1 the code runs as it is). No DTensor reaches a torch call
    inside; parity on both paths."""
    model = _Block()
    x = _randn(2, 5, 32)
    with simulated_ranks(tp) as mesh:
        sharded = tpplan.apply_plan(copy.deepcopy(model), mesh, _plan())
        assert sharded.attn._tpplan_region == "local shards"
        assert _dtensor_activations(sharded, sharded.attn, x) == 0
    assert_parity(model, _plan(), tp, x)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_whole_per_head_parameter_is_cut_and_its_gradient_summed(tp: int) -> None:
    """A learnable scale of one entry per head (a plain parameter of the region, whole on
    every rank) meets the split scores: each rank takes its heads' entries, and the
    gradient, each rank's heads' share, is summed over the ranks (parity of its gradient)."""
    model = _Block(_Attention(scale=True))
    x = _randn(2, 5, 32, seed=1)
    with simulated_ranks(tp) as mesh:
        sharded = tpplan.apply_plan(copy.deepcopy(model), mesh, _plan())
        assert sharded.attn._tpplan_region == "local shards"
    assert_parity(model, _plan(), tp, x)


class _Biased(_Attention):
    """One helper cuts both the split q, k, v and the whole input into heads (the input's
    heads added to the keys): on DTensors the whole one is cut to each rank's heads where it
    meets them, but on local shards the helper's one call site would need a size rewrite for
    one and none for the other, which no note can tell apart."""

    def _heads(self, z: torch.Tensor, b: int, t: int) -> torch.Tensor:
        return z.view(b, t, self.heads, -1).transpose(1, 2)  # (b, heads, t, head_dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        b, t, _ = x.shape
        q, k, v = (self._heads(z, b, t) for z in self.qkv(x).split(32, dim=-1))
        k = k + self._heads(x, b, t)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, t, 32)), y


def test_a_region_its_proof_cannot_run_locally_stays_on_dtensors_with_the_reason() -> None:
    model = _Block(_Biased())
    with simulated_ranks(2) as mesh:
        sharded = tpplan.apply_plan(copy.deepcopy(model), mesh, _plan())
        why = sharded.attn._tpplan_region
    assert why.startswith("DTensor: a DTensor region, not run on local shards: view at ")
    assert why.endswith("one site called with split and whole tensors alike")
    assert "_heads" in why  # the site is named: file, line and function
    assert_parity(model, _plan(), 2, _randn(2, 5, 32))
    stats = tpplan.plan_stats(model, _plan(), tp_size=2)
    assert stats.execution["attn"] == why


def test_stats_say_which_regions_run_on_local_shards() -> None:
    stats = tpplan.plan_stats(_Block(), _plan(), tp_size=2)
    assert stats.execution["attn"] == "region on local shards"
    assert stats.execution["attn.qkv"] == "local shards"


def _tiny_phi3() -> nn.Module:
    """transformers' Phi-3, one layer of 4 heads: q|k|v cut from its fused output by slices
    at positions from the config (split on local shards, its copy of the config divided;
    a region before products of attributes were followed)."""
    from tpplan._runtime.models import build_model

    torch.manual_seed(0)
    config = {
        "num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 128,
        "pad_token_id": 0, "eos_token_id": 0,
    }  # fmt: skip
    return build_model("phi3", config, device="cpu").eval()


def test_a_kv_cache_holds_plain_tensors_where_the_region_runs_locally() -> None:
    """Phi-3's attention (q|k|v cut from the fused output at positions from the config) run
    on local shards: the cache it fills holds each rank's heads as plain tensors, so
    transformers' own cache code (reorder, crop, static writes) meets no DTensor."""
    model = _tiny_phi3()
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    plan = tpplan.infer_plan(model, tp_size=2)
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=True)
        with simulated_ranks(2) as mesh:
            sharded = tpplan.apply_plan(copy.deepcopy(model), mesh, plan)
            out = sharded(input_ids=ids, use_cache=True)
            layer = out.past_key_values.layers[0]
            assert not isinstance(layer.keys, DTensor) and not isinstance(layer.values, DTensor)
            assert layer.keys.shape[1] == 2  # this rank's 2 of 4 heads
            got = rank_values(out.logits)
    assert all(torch.allclose(g, want.logits, atol=1e-5) for g in got)


def test_sdpa_inside_a_local_region_sees_the_rank_s_heads() -> None:
    """F.scaled_dot_product_attention on local q, k, v of the rank's heads: the same
    numbers as the unsharded model's heads."""

    class _Sdpa(_Attention):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
            b, t, _ = x.shape
            q, k, v = self.qkv(x).split(32, dim=-1)
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out(y.transpose(1, 2).reshape(b, t, 32)), y

    assert_parity(_Block(_Sdpa()), _plan(), 2, _randn(2, 5, 32))


@pytest.mark.parametrize("batch", [1, 3])
def test_heads_merged_into_the_batch_dim_run_locally_at_any_batch(batch: int) -> None:
    """BLOOM merges heads into the batch dim (`(B * heads, q, d)`) and adds ALiBi's bias of
    one row per batch and head: a split the proof sees with its own batch of 2. At another
    batch each rank still takes its own heads' rows of the bias (the pieces are counted
    from the run's batch), with the unsharded model's logits."""
    from tpplan._runtime.models import build_model

    torch.manual_seed(0)
    model = build_model("bloom", {"n_layer": 1, "vocab_size": 128}, device="cpu").eval()
    ids = torch.randint(0, 128, (batch, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        with simulated_ranks(2) as mesh:
            sharded = tpplan.apply_plan(copy.deepcopy(model), mesh, "bloom")
            assert sharded.transformer.h[0].self_attention._tpplan_region == "local shards"
            got = rank_values(sharded(ids).logits)
    # fp32, one layer: the split sums the same products in another order (~1e-7)
    assert max((g - want).abs().max().item() for g in got) < 1e-5


@pytest.mark.parametrize("local_shards", [True, False])
def test_a_static_cache_is_written_by_a_region_on_either_path(local_shards: bool) -> None:
    """A static KV cache preallocates plain buffers and writes them in place (index_copy_).
    On local shards it holds each rank's heads; a region on DTensors (`local_shards=False`,
    or one its proof leaves there) writes the whole keys into it. Before, DTensor wrote a
    sharded copy of the buffer and left the buffer zero, and Phi-3 decoded other tokens
    than the unsharded model with no error."""
    from transformers import StaticCache

    model = _tiny_phi3()
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    plan = tpplan.infer_plan(model, tp_size=2)

    def two_steps(m: nn.Module) -> torch.Tensor:
        cache = StaticCache(config=m.config, max_cache_len=16)
        m(input_ids=ids, cache=cache, use_cache=True)
        step = m(input_ids=ids[:, :1], cache=cache, use_cache=True)
        return step.logits

    with torch.no_grad():
        want = two_steps(model)
        with simulated_ranks(2) as mesh:
            sharded = tpplan.apply_plan(copy.deepcopy(model), mesh, plan, local_shards=local_shards)
            got = rank_values(two_steps(sharded))
    assert all(torch.allclose(g, want, atol=1e-5) for g in got)
