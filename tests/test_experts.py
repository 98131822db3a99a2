"""Mixture-of-experts layers: experts found from the data flow (batched per-expert matmuls on
3-D weights), split per expert like a dense MLP (mode tensor) or by experts (mode expert), with
forward and backward parity against the unsharded model on simulated ranks."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from support.infer_models import qwen3_moe
from support.models import token_batch
from support.parity import assert_parity
from support.plans import rule_for
from torch import nn

import tpplan
from tpplan._runtime.local import rank_values, simulated_ranks
from tpplan.checkpoint import full_state_dict
from tpplan.plan import Plan, Rule


def gpt_oss() -> nn.Module:
    """Biases on every expert weight, weights stored (in, out), gate and up interleaved."""
    cfg = transformers.GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():  # its biases start at zero: give them values that matter
        for n, p in model.named_parameters():
            if n.endswith("_bias"):
                p.normal_(0, 0.5)
    return model


class DenseExperts(nn.Module):
    """Written by hand, names meaning nothing: every expert computes every token, weighted by
    its routing score (Llama 4's layout), gate and up as two weights."""

    def __init__(self, experts: int = 4, hidden: int = 16, inner: int = 8, *, bent: bool = False):
        super().__init__()
        self.a = nn.Parameter(torch.randn(experts, hidden, inner) * 0.3)
        self.b = nn.Parameter(torch.randn(experts, hidden, inner) * 0.3)
        self.c = nn.Parameter(torch.randn(experts, inner, hidden) * 0.3)
        self.bent = bent

    def forward(self, x: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        e = self.a.shape[0]
        xs = x.unsqueeze(0).expand(e, -1, -1)
        h = nn.functional.silu(torch.bmm(xs, self.a)) * torch.bmm(xs, self.b)
        out = torch.bmm(h, self.c)
        if self.bent:
            out = torch.tanh(out)  # not linear in the partial sums: must not be split
        return (out * scores.t().unsqueeze(-1)).sum(0)


class Moe(nn.Module):
    """Tokens -> router -> experts (+ a residual) -> vocab. Dense experts get every expert's
    routing score; sparse ones (`sparse`) get the chosen two experts and their weights."""

    def __init__(
        self, experts: nn.Module | None = None, *, bent: bool = False, routes: int = 4
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 16)
        self.router = nn.Linear(16, routes, bias=False)
        self.sparse = experts is not None
        self.experts = experts if experts is not None else DenseExperts(bent=bent)
        self.out = nn.Linear(16, 64, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids).reshape(-1, 16)
        scores = self.router(x).softmax(-1)
        if self.sparse:
            weights, chosen = scores.topk(2, dim=-1)
            routed = self.experts(x, chosen, weights)
        else:
            routed = self.experts(x, scores)
        return self.out(x + routed).reshape(*ids.shape, -1)


class SparseExperts(nn.Module):
    """Written by hand: each token's chosen experts gathered per token and run as batched
    matmuls, a per-expert bias added before (or, `late`, after) the routing weight."""

    def __init__(self, experts: int = 4, hidden: int = 16, inner: int = 8, *, late: bool = False):
        super().__init__()
        self.num_experts = experts
        self.w_in = nn.Parameter(torch.randn(experts, inner, hidden) * 0.3)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, inner) * 0.3)
        self.bias = nn.Parameter(torch.randn(experts, hidden) * 0.3)
        self.late = late

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        k, hidden = ids.shape[1], x.shape[1]
        flat = ids.reshape(-1)
        # how many tokens each expert got, as a load-balancing loss would count them
        self.load = nn.functional.one_hot(flat, self.num_experts).sum(0)
        h = torch.bmm(self.w_in[flat], x.repeat_interleave(k, 0).unsqueeze(-1)).squeeze(-1)
        out = torch.bmm(self.w_out[flat], h.relu().unsqueeze(-1)).squeeze(-1)
        if not self.late:
            out = out + self.bias[flat]
        out = out * weights.reshape(-1, 1)
        if self.late:
            out = out + self.bias[flat]
        return out.view(-1, k, hidden).sum(1)


class Passing(nn.Module):
    """No weights: hands its tokens back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class LoopExperts(nn.Module):
    """Written by hand, names meaning nothing: `n` experts with weights (gate|up fused in
    `g`, down in `d`) and `m` that hand their tokens back through `z` (LongCat's zero
    experts), run in a loop over the experts and summed with index_add_. `first` gives the
    passing experts the lowest ids; `gated` scales what `z` returns by a sigmoid of itself
    (not linear in it); `inline` adds the tokens without `z`."""

    def __init__(
        self,
        n: int = 4,
        m: int = 2,
        hidden: int = 16,
        inner: int = 8,
        *,
        first: bool = False,
        gated: bool = False,
        inline: bool = False,
    ) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.randn(n, 2 * inner, hidden) * 0.3)
        self.d = nn.Parameter(torch.randn(n, hidden, inner) * 0.3)
        self.z = Passing()
        self.n, self.m = n, m
        self.first, self.gated, self.inline = first, gated, inline

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.n + self.m):
            tok, k = torch.where(ids == e)
            if tok.numel() == 0:
                continue
            passing = e < self.m if self.first else e >= self.n
            if passing:
                y = x[tok] if self.inline else self.z(x[tok])
                if self.gated:
                    y = y * torch.sigmoid(y)
            else:
                j = e - self.m if self.first else e
                gate, up = nn.functional.linear(x[tok], self.g[j]).chunk(2, dim=-1)
                y = nn.functional.linear(nn.functional.silu(gate) * up, self.d[j])
            out.index_add_(0, tok, y * weights[tok, k, None])
        return out


class Twice(nn.Module):
    """Two experts modules of one structure in a row, each with its own router over 4
    experts with weights and 2 passing ones. `order` biases the routers: "weights, passing"
    sends every token of the first to experts with weights and every token of the second
    to passing ones; "passing, weights" the other way round."""

    def __init__(self, order: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 16)
        self.routers = nn.ModuleList([nn.Linear(16, 6) for _ in range(2)])
        self.experts = nn.ModuleList([LoopExperts(), LoopExperts()])
        self.out = nn.Linear(16, 64, bias=False)
        with torch.no_grad():
            for router, kind in zip(self.routers, order.split(", "), strict=True):
                # a logit 50 below or above the others: softmax gives those ids ~e-22
                passing = -50.0 if kind == "weights" else 50.0
                router.bias.copy_(torch.tensor([0.0] * 4 + [passing] * 2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids).reshape(-1, 16)
        for router, experts in zip(self.routers, self.experts, strict=True):
            weights, chosen = router(x).softmax(-1).topk(2, dim=-1)
            x = x + experts(x, chosen, weights)
        return self.out(x).reshape(*ids.shape, -1)


def longcat_flash() -> nn.Module:
    """LongCat-Flash, one layer: 4 experts with weights and 2 zero (identity) experts."""
    cfg = transformers.LongcatFlashConfig(
        vocab_size=128, hidden_size=64, num_layers=1, num_attention_heads=4,
        num_key_value_heads=4, ffn_hidden_size=96, expert_ffn_hidden_size=32,
        n_routed_experts=4, zero_expert_num=2, moe_topk=2, kv_lora_rank=16, q_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8,
        max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LongcatFlashForCausalLM(cfg).eval()


class Bank(nn.Module):
    """Every expert's weight for one matmul, run over the tokens sorted by expert (JetMoE's
    ParallelExperts): the block holding two of them splits them as one experts module."""

    def __init__(self, experts: int, d_out: int, d_in: int, *, bias: bool = False) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(experts, d_out, d_in) * 0.3)
        self.b = nn.Parameter(torch.randn(experts, d_out) * 0.3) if bias else None

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        pieces = x.split(counts, dim=0)
        out = [nn.functional.linear(p, self.w[e]) for e, p in enumerate(pieces)]
        if self.b is not None:
            out = [o + self.b[e] for e, o in enumerate(out)]
        return torch.cat(out)


class BankBlock(nn.Module):
    """Written by hand, names meaning nothing: router, gate|up bank, down bank and a bias
    added after the weighted sum, all inside one module (JetMoE's MoE block)."""

    def __init__(
        self, experts: int = 4, hidden: int = 16, inner: int = 8, *, biased: bool = False
    ) -> None:
        super().__init__()
        self.r = nn.Linear(hidden, experts, bias=False)
        self.p = Bank(experts, 2 * inner, hidden, bias=biased)
        self.q = Bank(experts, hidden, inner, bias=biased)
        self.bias = nn.Parameter(torch.randn(hidden) * 0.3)
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.r(x).softmax(-1).topk(2, dim=-1)
        flat = chosen.reshape(-1)
        order = flat.argsort()
        tokens = order // 2
        counts = torch.bincount(flat, minlength=self.experts).tolist()
        gate, up = self.p(x[tokens], counts).chunk(2, dim=-1)
        y = self.q(nn.functional.silu(gate) * up, counts) * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add(0, tokens, y) + self.bias


class BankMoe(nn.Module):
    def __init__(self, *, biased: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 16)
        self.block = BankBlock(biased=biased)
        self.out = nn.Linear(16, 64, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids).reshape(-1, 16)
        return self.out(x + self.block(x)).reshape(*input_ids.shape, -1)


@pytest.mark.parametrize("tp", [2, 4])
def test_expert_weights_held_by_two_children_are_split_at_their_parent(tp: int) -> None:
    """One child's per-expert matmuls open the split, another's close it: the block holding
    both is the experts module (its children's weights named by their dotted names), its
    bias is added after the sum, and its router stays whole inside it."""
    model = BankMoe()
    plan = tpplan.infer_plan(model, tp_size=tp)
    rule = rule_for(plan, model, "block")
    assert (rule.style, rule.mode) == ("experts", "tensor")
    assert rule.shard == {"p.w": 1, "q.w": 2} and rule.fused == {"p.w": [8, 8]}
    assert rule.after_sum == ["bias"]
    inner = rule_for(plan, model, "block.r")
    assert inner.style == "replicate" and "inside block, split as experts" in inner.why
    assert not [r for r in plan.rules if r.match in ("block.p", "block.q")]
    assert tpplan.check_plan(plan, model, tp_size=tp) == []
    assert_parity(model, plan, tp, _ids())
    with simulated_ranks(tp) as mesh:
        sharded = tpplan.apply_plan(copy.deepcopy(model), mesh, plan)
        assert sharded.block.p.w.to_local().shape == (4, 16 // tp, 16)
        got = full_state_dict(sharded)
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())


def test_experts_at_tp_1_keep_the_numbers_with_their_bias_added_once() -> None:
    """At tp 1 the experts enter and leave as they are (no tree walk, no division of the
    bias added after the sum): forward and every gradient as unsharded."""
    model = BankMoe(biased=True)
    plan = tpplan.infer_plan(model, tp_size=2)
    assert "bias" in rule_for(plan, model, "block").after_sum
    assert_parity(model, plan, 1, _ids())


def test_per_expert_biases_in_the_children_are_split_or_added_after_the_sum() -> None:
    """The opening bank's bias is split with its weight; the closing bank's, added to the
    partial sums inside that child, is added 1/tp per rank."""
    model = BankMoe(biased=True)
    plan = tpplan.infer_plan(model, tp_size=2)
    rule = rule_for(plan, model, "block")
    assert rule.shard == {"p.w": 1, "p.b": 1, "q.w": 2}
    assert rule.fused == {"p.w": [8, 8], "p.b": [8, 8]}
    assert rule.after_sum == ["bias", "q.b"]
    for tp in (2, 4):
        assert_parity(model, plan, tp, _ids())


def test_a_childs_expert_weight_the_block_lacks_is_named() -> None:
    model = BankMoe()
    plan = tpplan.infer_plan(model)
    wrong = rule_for(plan, model, "block").model_copy(
        update={"shard": {"p.v": 1, "q.w": 2}, "fused": None}
    )
    (problem,) = tpplan.check_plan(_with(plan, wrong), model, tp_size=2)
    assert "experts names p.v, which BankBlock does not hold" in problem.message
    assert "p.w (4, 16, 16)" in problem.message
    assert problem.fix.startswith("name the module's own parameters (a child's by its dotted name)")


def test_a_split_inside_an_experts_module_is_named() -> None:
    model = BankMoe()
    plan = tpplan.infer_plan(model)
    inner = Rule(match="block.r", style="colwise", output="replicate", why="hand-edited")
    (problem,) = tpplan.check_plan(_with(plan, inner), model, tp_size=2)
    assert (problem.kind, problem.module) == ("overlap", "block.r")
    assert "inside block, matched by rules[" in problem.message
    assert problem.fix == "drop this rule, or keep the module whole (style: replicate)."


def test_jetmoe_experts_are_split_at_the_block() -> None:
    cfg = transformers.JetMoeConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_key_value_heads=2,
        kv_channels=16, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.JetMoeForCausalLM(cfg).eval()
    plan = tpplan.infer_plan(model, tp_size=2)
    rule = rule_for(plan, model, "model.layers.0.mlp")
    assert rule.shard == {"input_linear.weight": 1, "output_linear.weight": 2}
    assert rule.fused == {"input_linear.weight": [64, 64]} and rule.after_sum == ["bias"]
    assert_parity(model, plan, 2, token_batch())


def _ids() -> torch.Tensor:
    return token_batch() % 64


# ---- tensor-parallel experts ------------------------------------------------------------------
@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm", "eager"])
@pytest.mark.parametrize("tp", [2, 4])
def test_qwen3_moe_experts_are_split_like_a_dense_mlp(implementation: str, tp: int) -> None:
    """All three of transformers' expert kernels: one grouped matmul, batched matmuls over
    weights gathered per token, and the eager loop over the experts hit (`nonzero`, traced
    on the model's own weights since fake tensors cannot decide it)."""
    model = qwen3_moe(implementation)
    plan = tpplan.infer_plan(model, tp_size=tp)
    rule = rule_for(plan, model, "model.layers.0.mlp.experts")
    assert (rule.style, rule.mode) == ("experts", "tensor")
    # gate|up by output features, each rank its gate slice and the matching up slice; down by
    # its input features
    assert rule.shard == {"gate_up_proj": 1, "down_proj": 2}
    assert rule.fused == {"gate_up_proj": [32, 32]}
    assert "down_proj" in rule.why and "all-reduce" in rule.why
    assert_parity(model, plan, tp, token_batch())


def test_fp32_experts_split_into_rows_a_bf16_grouped_matmul_would_refuse() -> None:
    """Each rank's 12 of every 24 features: 48-byte rows in fp32, which CPU's grouped matmul
    runs; the dry run sizes the matmul without the bf16 meta kernel, whose 16-byte rule is
    bf16's (12 values: 24 bytes), so infer, check and the numbers agree."""
    model = qwen3_moe("grouped_mm", width=24)
    plan = tpplan.infer_plan(model, tp_size=2)
    rule = rule_for(plan, model, "model.layers.0.mlp.experts")
    assert (rule.style, rule.mode) == ("experts", "tensor")
    assert tpplan.check_plan(plan, model, tp_size=2) == []
    assert_parity(model, plan, 2, token_batch())


def test_16_bit_experts_too_narrow_to_split_each_are_split_by_whole_experts() -> None:
    """torch's grouped matmul takes bf16 rows of whole 16-byte runs only: 24 features split
    over 2 ranks are 12 (24 bytes), so no expert can be split; where the routing comes in as
    inputs, each rank holds whole experts instead, the plan says why, passes its own check,
    and gives the unsharded numbers. 32 features (16 a rank, 32 bytes) split each expert."""
    model = qwen3_moe("grouped_mm", width=24).to(torch.bfloat16)
    plan = tpplan.infer_plan(model, tp_size=2)
    rule = rule_for(plan, model, "model.layers.0.mlp.experts")
    assert (rule.style, rule.mode) == ("experts", "expert")
    assert rule.why.startswith("split by whole experts, not each expert: torch's grouped matmul")
    assert "would be 12 (24 bytes) at tp 2" in rule.why
    assert tpplan.check_plan(plan, model, tp_size=2) == []
    # bf16: each rank sums its experts' outputs in bf16 before the all-reduce, an order of
    # additions the unsharded model does not share; 3e-2 is a few bf16 steps at these sizes
    assert_parity(model, plan, 2, token_batch(), tol=3e-2)
    wide = qwen3_moe("grouped_mm").to(torch.bfloat16)
    rule = rule_for(tpplan.infer_plan(wide, tp_size=2), wide, "model.layers.0.mlp.experts")
    assert (rule.style, rule.mode) == ("experts", "tensor")


def test_gpt_oss_biases_and_interleaved_gate_up() -> None:
    """The down bias is added after the partial sum (1/tp per rank); the gate_up bias is split
    with its weight; the interleaved gate/up (`[..., ::2]`) needs no reordering."""
    model = gpt_oss()
    plan = tpplan.infer_plan(model, tp_size=2)
    rule = rule_for(plan, model, "model.layers.0.mlp.experts")
    assert rule.shard == {"gate_up_proj": 2, "gate_up_proj_bias": 1, "down_proj": 1}
    assert rule.after_sum == ["down_proj_bias"] and not rule.fused
    assert_parity(model, plan, 2, token_batch())


def test_experts_written_by_hand_are_found_by_their_data_flow() -> None:
    model = Moe()
    plan = tpplan.infer_plan(model, example_inputs=_ids())
    rule = rule_for(plan, model, "experts")
    assert (rule.style, rule.shard) == ("experts", {"a": 2, "b": 2, "c": 1})
    for tp in (2, 4):
        assert_parity(model, plan, tp, _ids())


def test_experts_whose_output_is_not_linear_in_the_sum_stay_whole() -> None:
    model = Moe(bent=True)
    plan = tpplan.infer_plan(model, example_inputs=_ids())
    rule = rule_for(plan, model, "experts")
    assert rule.style == "replicate"
    assert "tanh is not linear in the experts' partial sums" in rule.why
    assert_parity(model, plan, 2, _ids())


# ---- experts that add their tokens whole (identity experts) -----------------------------------
@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("tp", [2, 4])
def test_experts_passing_tokens_through_are_counted_once(tp: int, first: bool) -> None:
    """Every rank adds the passing experts' tokens whole into its partial sum: the plan
    scales `z`'s output by 1/tp, so the all-reduce counts them once. With the passing
    experts first, their tokens start the sum before any partial sum is in it."""
    model = Moe(LoopExperts(first=first), routes=6)
    plan = tpplan.infer_plan(model, example_inputs=_ids(), tp_size=tp)
    rule = rule_for(plan, model, "experts")
    assert (rule.style, rule.mode) == ("experts", "tensor")
    assert rule.shard == {"g": 1, "d": 2} and rule.added_whole == ["z"]
    assert "z's output (made without the split weights" in rule.why
    assert_parity(model, plan, tp, _ids())


def test_experts_modules_of_one_structure_pool_what_their_routing_showed() -> None:
    """Traced on its own weights, the first module runs only experts with weights and the
    second only passing ones. Each alone would be planned wrong for other routing (the
    first without scaling `z`, the second not split at all); the plan holds for both once
    the routers' biases are gone and each module reaches both kinds."""
    model = Twice("weights, passing")
    plan = tpplan.infer_plan(model, example_inputs=_ids())
    (rule,) = [r for r in plan.rules if r.style == "experts"]
    assert rule.match == "experts.*" and rule.added_whole == ["z"]
    assert "the 2 modules of this structure share it, 1 of which ran no expert" in rule.why
    with torch.no_grad():
        for router in model.routers:
            router.bias.zero_()
    reached: list[set[bool]] = []  # per module: reached passing experts (True), others
    hooks = [
        experts.register_forward_pre_hook(
            lambda mod, args: reached.append({e >= 4 for e in args[1].flatten().tolist()})
        )
        for experts in model.experts
    ]
    model(_ids())
    for hook in hooks:
        hook.remove()
    assert reached == [{False, True}, {False, True}]
    assert_parity(model, plan, 2, _ids())


def test_an_output_added_whole_and_also_used_otherwise_stays_whole() -> None:
    """sigmoid(y) * y is not linear in y: scaling y by 1/tp would not scale the sum so."""
    model = Moe(LoopExperts(gated=True), routes=6)
    plan = tpplan.infer_plan(model, example_inputs=_ids())
    rule = rule_for(plan, model, "experts")
    assert rule.style == "replicate"
    assert "z's output is added whole to the experts' partial sums, but sigmoid" in rule.why
    assert_parity(model, plan, 2, _ids())


@pytest.mark.parametrize("first", [False, True])
def test_tokens_added_whole_without_a_submodule_stay_whole(first: bool) -> None:
    """Each rank would add them whole into its partial sum, counted tp times by the
    all-reduce: refused, with the reason, also when they start the sum (that order was
    split before, its in-place add into zeros taken for a sum of nothing)."""
    model = Moe(LoopExperts(inline=True, first=first), routes=6)
    plan = tpplan.infer_plan(model, example_inputs=_ids())
    rule = rule_for(plan, model, "experts")
    assert rule.style == "replicate"
    assert "made without the split weights (the same on every rank" in rule.why
    assert "not as the output of a parameter-free submodule" in rule.why
    assert_parity(model, plan, 2, _ids())


def test_expert_parallel_refuses_experts_passing_tokens_through() -> None:
    model = Moe(LoopExperts(), routes=6)
    plan = tpplan.infer_plan(model, example_inputs=_ids(), experts="expert")
    rule = rule_for(plan, model, "experts")
    assert rule.mode == "tensor" and rule.added_whole == ["z"]
    assert "not expert parallel: z's output is added whole" in rule.why
    assert_parity(model, plan, 2, _ids())


@pytest.mark.parametrize("tp", [2, 4])
def test_longcat_flash_zero_experts_are_counted_once(tp: int) -> None:
    model = longcat_flash()
    plan = tpplan.infer_plan(model, tp_size=tp)
    rule = rule_for(plan, model, "model.layers.0.mlp.experts")
    assert (rule.style, rule.mode) == ("experts", "tensor")
    assert rule.shard == {"gate_up_proj": 1, "down_proj": 2}
    assert rule.added_whole == ["identity_expert"]
    assert_parity(model, plan, tp, token_batch())


@pytest.mark.parametrize("tp", [2, 4])
def test_an_output_added_whole_is_scaled_once_per_rank(tp: int) -> None:
    """Written by hand: `z`'s tokens are added whole into every rank's partial sum;
    added_whole scales them by 1/tp on each rank, so the all-reduce counts them once."""
    model = Moe(LoopExperts(), routes=6)
    plan = tpplan.infer_plan(model, example_inputs=_ids())
    rule = Rule(
        match="experts", style="experts", why="hand-written", shard={"g": 1, "d": 2},
        fused={"g": [8, 8]}, added_whole=["z"],
    )  # fmt: skip
    assert_parity(model, _with(plan, rule), tp, _ids())


# ---- expert-parallel experts ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tp", "implementation"), [(2, "grouped_mm"), (4, "grouped_mm"), (2, "eager")]
)
def test_expert_parallel_holds_whole_experts_per_rank(tp: int, implementation: str) -> None:
    model = qwen3_moe(implementation)
    plan = tpplan.infer_plan(model, tp_size=tp, experts="expert")
    rule = rule_for(plan, model, "model.layers.0.mlp.experts")
    assert (rule.mode, rule.shard) == ("expert", {"down_proj": 0, "gate_up_proj": 0})
    # beside the attention's repeat count (divided by the ranks sharing a key/value head)
    (attr,) = [a for a in plan.attributes if a.by is None]
    assert attr.divide == ["num_experts"] and attr.match == "model.layers.*.mlp.experts"
    assert_parity(model, plan, tp, token_batch())
    with simulated_ranks(tp) as mesh:
        sharded = tpplan.apply_plan(copy.deepcopy(model), mesh, plan)
        experts = sharded.model.layers[0].mlp.experts
        assert experts.gate_up_proj.to_local().shape[0] == 4 // tp
        assert experts.num_experts == 4 // tp


def test_expert_parallel_needs_the_routing_as_inputs() -> None:
    """The hand-written experts take routing scores for every expert, no chosen ids: expert
    parallel is not proven there, so the plan stays tensor parallel and says why."""
    model = Moe()
    plan = tpplan.infer_plan(model, example_inputs=_ids(), experts="expert")
    rule = rule_for(plan, model, "experts")
    assert rule.mode == "tensor"
    assert "not expert parallel: it does not take one integer tensor" in rule.why
    assert_parity(model, plan, 2, _ids())


@pytest.mark.parametrize("late", [False, True])
def test_a_bias_after_the_routing_weight_rules_out_expert_parallel(late: bool) -> None:
    """Zeroing the weight of tokens routed to other ranks' experts removes a bias added
    before the weight, not one added after it: there the plan stays tensor parallel."""
    torch.manual_seed(0)
    model = Moe(SparseExperts(late=late))
    plan = tpplan.infer_plan(model, example_inputs=_ids(), experts="expert")
    rule = rule_for(plan, model, "experts")
    if late:
        assert rule.mode == "tensor" and rule.after_sum == ["bias"]
        assert "bias is added after the routing weights scale" in rule.why
    else:
        assert rule.mode == "expert"
        assert rule.shard == {"bias": 0, "w_in": 0, "w_out": 0}
    assert_parity(model, plan, 2, _ids())


def test_gpt_oss_expert_parallel_keeps_its_biases() -> None:
    model = gpt_oss()
    plan = tpplan.infer_plan(model, tp_size=2, experts="expert")
    rule = rule_for(plan, model, "model.layers.0.mlp.experts")
    assert rule.mode == "expert" and rule.shard["down_proj_bias"] == 0
    assert_parity(model, plan, 2, token_batch())


def test_routing_that_depends_on_the_values_cannot_be_traced_on_meta() -> None:
    with torch.device("meta"):
        model = qwen3_moe("eager")
    with pytest.raises(tpplan.TpplanError, match="infer the plan from a small copy"):
        tpplan.infer_plan(model)


# ---- plan files and bad input -----------------------------------------------------------------
def _with(plan: Plan, rule: Rule) -> Plan:
    kept = [r for r in plan.rules if r.match != rule.match]
    return plan.model_copy(update={"rules": [*kept, rule]})


def test_a_tp_size_that_does_not_divide_the_experts_is_named() -> None:
    model = qwen3_moe()
    plan = tpplan.infer_plan(model, experts="expert")
    problems = tpplan.check_plan(plan, model, tp_size=8)
    assert any(
        "down_proj dim 0 (the number of experts) = 4 does not divide by tp size 8" in p.message
        for p in problems
    )


def test_an_expert_weight_the_module_lacks_is_named() -> None:
    model = qwen3_moe()
    rule = Rule(
        match="model.layers.*.mlp.experts", style="experts", why="hand-written",
        shard={"gate_up": 1, "down_proj": 2},
    )  # fmt: skip
    (problem,) = [
        p for p in tpplan.check_plan(_with(tpplan.infer_plan(model), rule), model, tp_size=2)
    ]
    assert "experts names gate_up, which Qwen3MoeExperts does not hold" in problem.message
    assert "gate_up_proj (4, 64, 64)" in problem.message


def test_fused_pieces_other_than_the_models_are_named() -> None:
    """[16, 48] adds up like the model's [32, 32], so the rule's own check passes it; each
    rank would get the wrong slices of gate and up."""
    model = qwen3_moe()
    plan = tpplan.infer_plan(model)
    inferred = rule_for(plan, model, "model.layers.0.mlp.experts")
    wrong = inferred.model_copy(update={"fused": {"gate_up_proj": [16, 48]}})
    (problem,) = tpplan.check_plan(_with(plan, wrong), model, tp_size=2)
    assert problem.kind == "parts"
    assert problem.message == (
        "the rule states fused gate_up_proj [16, 48], but the model cuts its 64 output "
        "features of gate_up_proj per expert into the pieces [32, 32]."
    )
    assert problem.fix.startswith("set fused: {gate_up_proj: [32, 32]} in the rule")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ("", "experts needs shard"),
        (", shard: {w: 0}, fused: {v: [2, 2]}", "fused names v, which is not in shard"),
        (", shard: {w: 0}, mode: expert, after_sum: [b]", "mode expert splits every expert"),
        (", shard: {w: 1}, mode: pipeline", "'tensor' or 'expert'"),
    ],
)
def test_bad_experts_rules_are_refused(fields: str, message: str) -> None:
    text = f"tpplan: 3\nrules:\n  - {{match: experts, style: experts, why: x{fields}}}\n"
    with pytest.raises(tpplan.TpplanError, match=message.replace("'", ".")):
        Plan.from_yaml(text)


def test_experts_rules_need_schema_version_3() -> None:
    text = "tpplan: 2\nrules:\n  - {match: experts, style: experts, why: x, shard: {w: 0}}\n"
    with pytest.raises(tpplan.TpplanError, match="need schema version 3"):
        Plan.from_yaml(text)


def test_added_whole_needs_schema_version_5_and_mode_tensor() -> None:
    rule = "{match: experts, style: experts, why: x, shard: {w: 1}, added_whole: [z]"
    with pytest.raises(tpplan.TpplanError, match="added_whole need schema version 5"):
        Plan.from_yaml(f"tpplan: 4\nrules:\n  - {rule}}}\n")
    with pytest.raises(tpplan.TpplanError, match="takes no fused, after_sum or added_whole"):
        Plan.from_yaml(f"tpplan: 5\nrules:\n  - {rule.replace('1', '0')}, mode: expert}}\n")
    assert Plan.from_yaml(f"tpplan: 5\nrules:\n  - {rule}}}\n").rules[0].added_whole == ["z"]


def test_an_added_whole_submodule_the_module_lacks_is_named() -> None:
    model = Moe(LoopExperts(), routes=6)
    rule = Rule(
        match="experts", style="experts", why="hand-written", shard={"g": 1, "d": 2},
        added_whole=["y"],
    )  # fmt: skip
    plan = _with(tpplan.infer_plan(model, example_inputs=_ids()), rule)
    (problem,) = tpplan.check_plan(plan, model, tp_size=2)
    assert "added_whole names y, which LoopExperts does not hold (its submodules: z)" in (
        problem.message
    )


def test_full_state_dict_of_split_experts_is_the_unsharded_one() -> None:
    model = qwen3_moe()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with simulated_ranks(2) as mesh:
        sharded = tpplan.apply_plan(copy.deepcopy(model), mesh, tpplan.infer_plan(model))
        got = tpplan.full_state_dict(sharded)
        for name, value in want.items():
            for v in rank_values(got[name]):
                assert torch.equal(v, value), name


def test_sequence_parallel_with_experts_is_refused_with_the_reason() -> None:
    """The router reads the stream sequence parallel keeps split: not supported yet, and
    said so rather than run (the plan is tried on fake ranks before it is returned)."""
    with pytest.raises(
        tpplan.TpplanError, match="sequence parallel does not fit Qwen3MoeForCausalLM"
    ):
        tpplan.infer_plan(qwen3_moe(), tp_size=2, sequence_parallel=True)


class RawHeads(nn.Module):
    """Raw weights by heads, as einsum reads them: `w_out` is (heads, head_dim, width), a
    3-D weight like an expert stack, but no experts."""

    def __init__(self, width: int = 16, heads: int = 4, head_dim: int = 4) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(width, heads * head_dim) * 0.3)
        self.w_out = nn.Parameter(torch.randn(heads, head_dim, width) * 0.3)
        self.head_dim = head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = (x @ self.w_in).unflatten(-1, (-1, self.head_dim)).relu()  # (B, T, heads, dim)
        return torch.einsum("bthd,hdc->btc", h, self.w_out)


class HeadsAndExperts(nn.Module):
    """A block whose two children hold 3-D weights: raw heads, then experts whose own
    per-expert matmuls open and close their split."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 16)
        self.block = nn.Module()
        self.block.heads = RawHeads()
        self.block.router = nn.Linear(16, 4, bias=False)
        self.block.experts = DenseExperts()
        self.out = nn.Linear(16, 64, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.block.heads(x)
        flat = x.reshape(-1, 16)
        routed = self.block.experts(flat, self.block.router(flat).softmax(-1))
        return self.out(x + routed.view_as(x))


@pytest.mark.parametrize("tp", [2, 4])
def test_experts_beside_raw_heads_of_3d_weights_sum_their_own_split(tp: int) -> None:
    """Two children hold 3-D weights, but the experts' matmuls open and close their split
    in the one child: it sums its partial sums at its own output, where the block's
    residual add would otherwise end them. The block, holding none, gets no rule."""
    model = HeadsAndExperts()
    plan = tpplan.infer_plan(model, tp_size=tp)
    rule = rule_for(plan, model, "block.experts")
    assert (rule.style, rule.mode) == ("experts", "tensor")
    assert not [r for r in plan.rules if r.match == "block"]
    assert tpplan.check_plan(plan, model, tp_size=tp) == []
    assert_parity(model, plan, tp, _ids())
