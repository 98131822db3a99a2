"""A fused q|k|v of unequal pieces (grouped-query attention in one Linear, issue 35 a) cut apart
in the ways code writes it: slices at bounds written as attributes or sums of them, a split at
such sizes, and a k|v piece cut again by `split`, `chunk`, or a view with a count of pieces
and `unbind`; sizes and bounds written as products of a head count and the head size
(`self.n_head * self.head_dim`). Each rank holds its slice of every piece (`parts`), the
attribute sizes (or the products' head counts) are divided, and the layer computes with a working copy of its own rows (compile/own_rows.py), so
the block's every call makes one all-reduce and no all-gather. Sizes computed from the width
read off the output (`qkv.shape[-1] // (self.groups + 2)`) shrink on a shard by themselves. Cuts that cannot be followed
on a shard (a literal bound, a term that also sizes the dims each rank keeps whole, a piece
read whole and also cut finer) leave the output gathered, with the reason.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from support.models import AttentionLm, token_batch
from support.parity import assert_parity, every_call_collectives
from torch import nn
from torch.distributed.tensor import Shard

import tpplan
from tpplan._runtime.local import rank_values, simulated_ranks

WIDTH, HEADS, KV, HEAD_DIM, VOCAB = 32, 8, 4, 6, 50
Q, KVW = HEADS * HEAD_DIM, KV * HEAD_DIM

SPLIT = [
    "slices",
    "slices_product",
    "split_product",
    "split_sizes",
    "split_width",
    "split_split",
    "split_chunk",
    "split_unflatten",
    "split_view",
]


class _Attention(nn.Module):
    def __init__(self, style: str, kv: int = KV) -> None:
        super().__init__()
        self.style = style
        self.n_head, self.n_kv, self.head_dim = HEADS, kv, HEAD_DIM
        self.q_size, self.kv_size = Q, kv * HEAD_DIM
        self.groups = HEADS // kv
        self.q_heads, self.d_twice = HEADS // 2, 2 * HEAD_DIM
        self.qkv = nn.Linear(WIDTH, Q + 2 * self.kv_size)
        self.o = nn.Linear(Q, WIDTH)

    def _cut(self, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, t, _ = qkv.shape
        style, q_size, kv_size = self.style, self.q_size, self.kv_size
        if style == "slices":
            q = qkv[..., :q_size]
            k = qkv[..., q_size : q_size + kv_size]
            return q, k, qkv[..., q_size + kv_size :]
        if style == "split_sizes":
            return qkv.split([q_size, kv_size, kv_size], dim=-1)
        d, h, kv = self.head_dim, self.n_head, self.n_kv
        if style == "slices_product":  # bounds as products of a head count and head_dim
            return qkv[..., : h * d], qkv[..., h * d : (h + kv) * d], qkv[..., (h + kv) * d :]
        if style == "split_product":
            return qkv.split([h * d, kv * d, kv * d], dim=-1)
        if style == "product_of_no_count":  # 4 * 12: neither a view's count nor its head_dim
            return qkv.split([self.q_heads * self.d_twice, kv * d, kv * d], dim=-1)
        if style == "split_width":  # sizes computed from the width read off the output
            kv_size = qkv.shape[-1] // (self.groups + 2)
            return qkv.split([qkv.shape[-1] - 2 * kv_size, kv_size, kv_size], dim=-1)
        if style == "literal_bound":
            k_end = Q + self.n_kv * HEAD_DIM
            return qkv[..., :Q], qkv[..., Q:k_end], qkv[..., k_end:]
        if style == "head_dim_term":  # 8 * head_dim: head_dim also sizes the heads' views
            q_end, k_end = HEADS * self.head_dim, (HEADS + KV) * self.head_dim
            return qkv[..., :q_end], qkv[..., q_end:k_end], qkv[..., k_end:]
        q, kv = qkv.split([q_size, 2 * kv_size], dim=-1)
        if style == "split_split":
            k, v = kv.split(kv_size, dim=-1)
        elif style == "split_chunk":
            k, v = kv.chunk(2, dim=-1)
        elif style == "split_unflatten":
            k, v = kv.unflatten(-1, (2, self.n_kv, self.head_dim)).flatten(-2).unbind(2)
        elif style == "split_view":
            k, v = kv.view(b, t, 2, self.n_kv, self.head_dim).flatten(-2).unbind(2)
        else:  # read_whole_first: kv viewed whole as heads before it is cut into k and v
            k, v = kv.view(b, t, -1, self.head_dim).chunk(2, dim=2)
            k, v = k.flatten(-2), v.flatten(-2)
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self._cut(self.qkv(x))
        q = q.reshape(b, t, self.n_head, self.head_dim)
        k, v = (z.reshape(b, t, self.n_kv, self.head_dim) for z in (k, v))
        group = self.n_head // self.n_kv
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return self.o(a.reshape(b, t, self.n_head * self.head_dim))


def _model(style: str, kv: int = KV) -> AttentionLm:
    torch.manual_seed(0)
    return AttentionLm(lambda: _Attention(style, kv), VOCAB, WIDTH)


def _ids() -> torch.Tensor:
    return token_batch(VOCAB, batch=2, seq=6)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("style", SPLIT)
def test_unequal_pieces_split_the_megatron_way(style: str, tp: int) -> None:
    model = _model(style)
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=_ids())
    rules = {r.match: r for r in plan.rules}
    qkv = rules["attn.qkv"]
    assert (qkv.style, qkv.parts, qkv.output_layout()) == ("colwise", [Q, KVW, KVW], "shard(-1)")
    assert f"3 fused pieces ({Q} | {KVW} | {KVW})" in qkv.why
    assert rules["attn.o"].style == "rowwise"
    divided = {a for attr in plan.attributes for a in attr.divide}
    # a width formula's term is divided only by the ranks sharing a key/value head past
    # their count (1 here: tp divides the 4 heads)
    assert all(attr.by == "replicas" for attr in plan.attributes if "groups" in attr.divide)
    if style.endswith("_product"):  # the head counts of the products, not head_dim
        assert {"n_head", "n_kv"} <= divided and "head_dim" not in divided
    else:
        assert {"q_size", "kv_size"} <= divided or style == "split_width"
    assert not tpplan.check_plan(plan, model, tp_size=tp)
    assert_parity(model, plan, tp, _ids())
    assert every_call_collectives(model, plan, tp, _ids(), "AttentionLm.attn") == {"all_reduce": 1}


@pytest.mark.parametrize("style", ["literal_bound", "head_dim_term", "product_of_no_count"])
def test_cuts_no_attribute_holds_split_in_a_region(style: str) -> None:
    """Bounds no plan attribute can divide (a number, a term that also sizes the heads'
    views, a product with no head count): no local split, so the attention is a DTensor
    region the fused layer opens in the pieces its code cuts (compile/region_pieces.py); they
    were split then gathered before."""
    model = _model(style)
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=_ids())
    qkv = next(r for r in plan.rules if r.match == "attn.qkv")
    assert (qkv.style, qkv.parts, qkv.local_output) == ("colwise", [Q, KVW, KVW], False)
    assert [r.match for r in plan.regions] == ["attn"], plan.to_yaml()
    assert not tpplan.check_plan(plan, model, tp_size=2)
    assert_parity(model, plan, 2, _ids())


def test_a_piece_read_whole_before_its_cut_is_gathered_with_the_reason() -> None:
    model = _model("read_whole_first")
    plan = tpplan.infer_plan(model, tp_size=2, example_inputs=_ids())
    qkv = next(r for r in plan.rules if r.match == "attn.qkv")
    assert (qkv.style, qkv.output_layout(), qkv.parts) == ("colwise", "replicate", None)
    assert "the fused features are cut two different ways" in qkv.why
    assert_parity(model, plan, 2, _ids())


class _GroupedFused(nn.Module):
    """q|k|v laid out per key/value head: for each of the K groups its H/K query heads, then
    its k and v (Falcon's new decoder architecture), viewed (B, T, -1, H/K + 2, D) with the
    ratio written as a formula of the two head counts, and k and v taken out `style`'s way."""

    def __init__(self, style: str) -> None:
        super().__init__()
        # 16 // 4 + 2 = 6 pieces per group, as Falcon-40B's 128 // 8 + 2 = 18
        heads, kv, head_dim = 16, 4, 8
        self.style, self.n_head, self.n_kv, self.head_dim = style, heads, kv, head_dim
        self.qkv = nn.Linear(WIDTH, (heads + 2 * kv) * head_dim)
        self.o = nn.Linear(heads * head_dim, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        g = self.qkv(x).view(b, t, -1, self.n_head // self.n_kv + 2, self.head_dim)
        if self.style == "index":
            q, k, v = g[:, :, :, :-2], g[:, :, :, [-2]], g[:, :, :, [-1]]
        elif self.style == "slices":
            q, k, v = g[..., :-2, :], g[..., -2:-1, :], g[..., -1:, :]
        else:
            q, k, v = g.split([self.n_head // self.n_kv, 1, 1], dim=3)
        k, v = torch.broadcast_to(k, q.shape), torch.broadcast_to(v, q.shape)
        q, k, v = (z.flatten(2, 3).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return self.o(a.reshape(b, t, self.n_head * self.head_dim))


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("style", ["index", "slices", "split"])
def test_qkv_grouped_per_kv_head_splits_by_groups(style: str, tp: int) -> None:
    """Each rank holds whole groups (its key/value heads with their query heads): a plain
    colwise split of the fused layer, both head counts divided."""
    torch.manual_seed(0)
    model = AttentionLm(lambda: _GroupedFused(style), VOCAB, WIDTH)
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=_ids())
    rules = {r.match: r for r in plan.rules}
    qkv = rules["attn.qkv"]
    assert (qkv.style, qkv.parts, qkv.output_layout()) == ("colwise", None, "shard(-1)")
    assert rules["attn.o"].style == "rowwise"
    assert {a for attr in plan.attributes for a in attr.divide} == {"n_head", "n_kv"}
    assert not tpplan.check_plan(plan, model, tp_size=tp)
    assert_parity(model, plan, tp, _ids())
    assert every_call_collectives(model, plan, tp, _ids(), "AttentionLm.attn") == {"all_reduce": 1}


# ---- key/value pieces past their head count ---------------------------------------------------
# (kv heads, tp): grouped heads at tp 4 over 2 (each key/value head shared by 2 ranks), one
# key/value head (multi-query) at tp 2 and 4
SHARED = [(2, 4), (1, 2), (1, 4)]


@pytest.mark.parametrize(("kv", "tp"), SHARED)
@pytest.mark.parametrize(
    "style", ["slices", "split_sizes", "split_chunk", "split_view", "slices_product"]
)
def test_key_value_pieces_past_their_count_share_whole_heads(style: str, kv: int, tp: int) -> None:
    """With fewer key/value heads than ranks, each rank's query heads meet one key/value head:
    the key and value pieces go whole to the ranks holding its query heads (colwise `parts`
    with `replicate_heads`), their counts divided by the heads' shards, the query's by tp.
    The block runs one all-reduce per call and matches the unsharded model forward and
    backward; `check` and `verify` take the plan."""
    model = _model(style, kv)
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=_ids())
    qkv = next(r for r in plan.rules if r.match == "attn.qkv")
    kv_w = kv * HEAD_DIM
    assert (qkv.style, qkv.parts, qkv.replicate_heads, qkv.head_dim) == (
        "colwise",
        [Q, kv_w, kv_w],
        True,
        HEAD_DIM,
    )
    assert "its key and value pieces hold" in qkv.why
    by = {a: (attr.by, attr.of) for attr in plan.attributes for a in attr.divide}
    assert by["n_head"] == (None, None)
    assert by["n_kv"] == ("shards", "qkv")
    if style in ("slices", "split_sizes"):
        assert by["kv_size"] == ("shards", "qkv")
    assert not tpplan.check_plan(plan, model, tp_size=tp)
    assert tpplan.verify_plan(model, plan, tp_size=tp, backward=True, inputs={"ids": _ids()}).ok
    assert_parity(model, plan, tp, _ids())
    assert every_call_collectives(model, plan, tp, _ids(), "AttentionLm.attn") == {"all_reduce": 1}


def test_pieces_of_one_size_written_with_different_attributes_keep_their_own() -> None:
    """`split([self.q_size, 2 * self.kv_size])` where q_size = 2 * kv_size (8 query heads
    over 4 key/value heads): each piece is sized by the attribute written at its place, so
    kv_size counts the key/value pieces alone and, past their count (tp 8), they are
    shared; it once counted the query piece too, which refused the sharing."""
    model = _model("split_split", 4)
    plan = tpplan.infer_plan(model, tp_size=8, example_inputs=_ids())
    qkv = next(r for r in plan.rules if r.match == "attn.qkv")
    assert (qkv.parts, qkv.replicate_heads, qkv.output_layout()) == (
        [Q, 4 * HEAD_DIM, 4 * HEAD_DIM],
        True,
        "shard(-1)",
    )
    by = {a: (attr.by, attr.of) for attr in plan.attributes for a in attr.divide}
    assert by["kv_size"] == ("shards", "qkv") and by["q_size"] == (None, None)
    assert not tpplan.check_plan(plan, model, tp_size=8)
    # the vocab of 50 splits unevenly at tp 8, whose backward simulated ranks cannot run
    # (test_uneven_vocab.py runs it on real ones): the attention's rules alone here
    attention = plan.model_copy(update={"rules": [r for r in plan.rules if r.match != "head"]})
    assert_parity(model, attention, 8, _ids())


def test_shared_key_value_pieces_keep_the_original_weight_and_a_shard_per_rank() -> None:
    """The fused weight stays a plain shard of the original (1/tp of its rows per rank, no
    reordering): the whole state dict, after a forward that built the working rows, is the
    unsharded model's."""
    tp, model = 4, _model("split_sizes", 2)
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=_ids())
    with simulated_ranks(tp) as mesh:
        sharded = tpplan.apply_plan(copy.deepcopy(model), mesh, plan)
        sharded(_ids())
        weight = sharded.attn.qkv.weight
        assert weight.placements == (Shard(0),)
        assert weight.to_local().shape == ((Q + 2 * 2 * HEAD_DIM) // tp, WIDTH)
        got = tpplan.full_state_dict(sharded)
    for name, t in model.state_dict().items():
        for v in rank_values(got[name]):
            torch.testing.assert_close(v, t, atol=0, rtol=0, msg=name)


def test_sizes_read_off_the_width_divide_the_group_count_past_the_key_value_heads() -> None:
    """`qkv.shape[-1] // (self.groups + 2)` shrinks by tp on a plain shard by itself; with
    the key/value heads shared, a rank's width is its query heads' and one key/value head's,
    so `groups` (query heads per key/value head) is divided by the ranks sharing a head, the
    one division that gives every rank its own sizes at every tp past the heads."""
    model = _model("split_width", 2)
    plan = tpplan.infer_plan(model, tp_size=4, example_inputs=_ids())
    qkv = next(r for r in plan.rules if r.match == "attn.qkv")
    assert (qkv.output_layout(), qkv.replicate_heads) == ("shard(-1)", True)
    by = {a: attr.by for attr in plan.attributes for a in attr.divide}
    assert by["groups"] == "replicas"
    assert not tpplan.check_plan(plan, model, tp_size=4)
    assert_parity(model, plan, 4, _ids())
    assert every_call_collectives(model, plan, 4, _ids(), "AttentionLm.attn") == {"all_reduce": 1}


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt_bigcode_multi_query_generates_as_the_unsharded_model(tp: int) -> None:
    """transformers' GPT-BigCode (one key/value head in its fused c_attn, cut off as
    (B, 1, T, D)): split with that head on every rank, it generates the unsharded model's
    tokens and scores greedily, by beam search and with a static cache."""
    from support.generate import MODES
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    config = GPTBigCodeConfig(
        vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4, multi_query=True,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=1, eos_token_id=1,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPTBigCodeForCausalLM(config).eval()
    ids = torch.randint(2, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=ids)
    c_attn = next(r for r in plan.rules if r.match.endswith("attn.c_attn"))
    assert (c_attn.parts, c_attn.replicate_heads) == ([64, 16, 16], True)
    with simulated_ranks(tp) as mesh:
        sharded = tpplan.apply_plan(copy.deepcopy(model), mesh, plan)
        for mode in ("greedy", "beam", "cache_static"):
            kw = {**MODES[mode], "max_new_tokens": 5, "output_scores": True}
            want = model.generate(ids, return_dict_in_generate=True, **kw)
            got = sharded.generate(ids, return_dict_in_generate=True, **kw)
            for seq in rank_values(got.sequences):
                assert torch.equal(seq, want.sequences), mode
            for g, w in zip(got.scores, want.scores, strict=True):
                for v in rank_values(g):
                    torch.testing.assert_close(v, w, atol=1e-5, rtol=1e-5, msg=mode)


class _Config:
    """Sizes every layer reads, one object they all hold."""

    def __init__(self, kv: int) -> None:
        self.n_head, self.n_kv, self.head_dim = HEADS, kv, HEAD_DIM


class _ConfigAttention(nn.Module):
    """q|k|v cut at products read from the shared config (`cfg.n_head * cfg.head_dim`), the
    heads viewed with -1, as transformers' Phi-3 does."""

    def __init__(self, cfg: _Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(WIDTH, (cfg.n_head + 2 * cfg.n_kv) * cfg.head_dim)
        self.o = nn.Linear(cfg.n_head * cfg.head_dim, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        c = self.cfg
        q_end = c.n_head * c.head_dim
        k_end = q_end + c.n_kv * c.head_dim
        qkv = self.qkv(x)
        q, k, v = (
            z.view(b, t, -1, c.head_dim).transpose(1, 2)
            for z in (qkv[..., :q_end], qkv[..., q_end:k_end], qkv[..., k_end:])
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(a.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize(("kv", "tp"), [(4, 2), (2, 4)])
def test_sizes_from_a_shared_config_are_divided_on_each_modules_own_copy(kv: int, tp: int) -> None:
    """Bounds written as products read from a config object two layers share: the plan
    divides the head counts (`cfg.n_head`, `cfg.n_kv`), not head_dim, and each attention gets
    a copy of its own, so the config the model holds keeps its whole values. Parity, one
    all-reduce per block."""
    torch.manual_seed(0)
    cfg = _Config(kv)
    model = nn.Sequential(nn.Embedding(VOCAB, WIDTH), _ConfigAttention(cfg), _ConfigAttention(cfg))
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=_ids())
    divided = {a for attr in plan.attributes for a in attr.divide}
    assert {"cfg.n_head", "cfg.n_kv"} <= divided and "cfg.head_dim" not in divided
    assert not tpplan.check_plan(plan, model, tp_size=tp)
    assert_parity(model, plan, tp, _ids())
    with simulated_ranks(tp) as mesh:
        sharded = tpplan.apply_plan(copy.deepcopy(model), mesh, plan)
        assert sharded[1].cfg is not sharded[2].cfg
        assert sharded[1].cfg.n_head == HEADS // tp
    assert (cfg.n_head, cfg.n_kv) == (HEADS, kv)


@pytest.mark.parametrize(("kv", "tp"), [("gqa", 2), ("mqa", 4)])
def test_a_fused_1x1_convolution_of_unequal_pieces_computes_with_its_own_rows(
    kv: str, tp: int
) -> None:
    """q|k|v as one 1x1 convolution over channels, cut by slices at sizes from a shared
    config: like a fused Linear, it computes with a copy of each rank's own rows (its key and
    value head whole past their count), so the block gathers nothing per call; parity."""
    from support.code_styles import Spec, measure_case

    got = measure_case(Spec(proj="conv", qkv="slices", sizes="config", kv=kv), tp)  # type: ignore[arg-type]
    assert got.parity == "ok", got.detail
    assert got.gathers == {"layers.0.attn": 0, "layers.0.mlp": 0}
    assert got.megatron["layers.0.attn"], got.whys
