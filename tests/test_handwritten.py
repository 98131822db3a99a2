"""infer_plan on models written by hand outside any library, the way people write them.

Three families, each in its own idiom rather than Hugging Face's:

- `NanoGpt` (nanoGPT, in model_zoo/nanogpt.py, which the zoo shares): one fused c_attn
  Linear cut by `.split(self.n_embd, dim=2)`, heads viewed as
  `view(B, T, self.n_head, C // self.n_head)`, a GELU MLP, a learned position embedding, and
  the token embedding tied to lm_head;
- `TitanLlama` (torchtitan / Meta's reference Llama): wq/wk/wv/wo and w1/w2/w3, a hand-written
  RMSNorm, rotary embeddings in complex arithmetic, in real arithmetic on interleaved pairs, or
  on halves (rotate_half), grouped-query attention, and views by the stored counts
  `view(bs, seqlen, self.n_heads, self.head_dim)` (head_dim 16, so no count equals it);
- `Vit` (a ViT encoder, in support/models.py, which test_stream and test_infer share): patches embedded by a Conv2d or a Linear, a class token, learned
  positions, LayerNorm, non-causal attention (timm's fused qkv or separate q/k/v) and a
  GELU MLP, classified from the class token.

For each: infer a plan, check forward and backward parity with the unsharded model on
simulated ranks at tp 2 (and 4 where the sizes allow), and assert what is sharded today.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_zoo.nanogpt import NanoGpt
from support.models import Vit, images, seeded
from support.parity import assert_parity
from support.plans import expand_rules
from torch import nn

import tpplan
from tpplan.plan import Plan

VOCAB = 64


def _tokens(batch: int = 2, seq: int = 8, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


def _styles(plan: Plan, model: nn.Module) -> dict[str, tuple[str, str | None]]:
    """{module name: (style, output layout)} of every module with a rule."""
    return {n: (r.style, getattr(r, "output", None)) for n, r in expand_rules(plan, model).items()}


def _sharded(plan: Plan, model: nn.Module) -> dict[str, tuple[str, str | None]]:
    return {n: s for n, s in _styles(plan, model).items() if s[0] != "replicate"}


def _every_kept_one_says_why(plan: Plan, model: nn.Module) -> None:
    rules = expand_rules(plan, model)
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            assert name in rules, f"{name} has no rule"
            if rules[name].style == "replicate":
                assert rules[name].why.strip(), f"{name} is replicated without a reason"


# ---- torchtitan-style Llama -----------------------------------------------------------------
def _rotary_tables(head_dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """(end, head_dim // 2) complex rotations e^{i t f}, Meta's precompute_freqs_cis."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(end).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def _rotate_complex(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x (B, T, heads, hd) rotated pairwise as complex numbers (Meta's apply_rotary_emb)."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rot = freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, xc.shape[-1])
    return torch.view_as_real(xc * rot).flatten(3).type_as(x)


def _rotate_real(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """The same rotation in real arithmetic on interleaved pairs (even, odd)."""
    cos = freqs_cis.real[: x.shape[1]].view(1, x.shape[1], 1, -1)
    sin = freqs_cis.imag[: x.shape[1]].view(1, x.shape[1], 1, -1)
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    out = torch.cat(
        [(even * cos - odd * sin).unsqueeze(-1), (even * sin + odd * cos).unsqueeze(-1)], dim=-1
    )
    return out.flatten(3)


def _rotate_half(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """The rotation on (first half, second half) pairs, as Hugging Face's rotate_half does."""
    cos = freqs_cis.real[: x.shape[1]].view(1, x.shape[1], 1, -1).repeat(1, 1, 1, 2)
    sin = freqs_cis.imag[: x.shape[1]].view(1, x.shape[1], 1, -1).repeat(1, 1, 1, 2)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


_ROTATE = {"complex": _rotate_complex, "real": _rotate_real, "half": _rotate_half}


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim).uniform_(0.5, 1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, T, kv heads, hd) -> (B, T, kv heads * n_rep, hd), each kv head repeated in place."""
    bs, slen, n_kv, hd = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, slen, n_kv, n_rep, hd).reshape(bs, slen, n_kv * n_rep, hd)


class _TitanAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, rotary: str) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.n_rep = n_heads // n_kv_heads
        self.head_dim = dim // n_heads
        self.rotary = rotary
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, self.n_heads, self.head_dim)
        xk = xk.view(bs, seqlen, self.n_kv_heads, self.head_dim)
        xv = xv.view(bs, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = _ROTATE[self.rotary](xq, freqs_cis), _ROTATE[self.rotary](xk, freqs_cis)
        keys, values = _repeat_kv(xk, self.n_rep), _repeat_kv(xv, self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        out = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class _TitanFeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, multiple_of: int = 32) -> None:
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _TitanBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, rotary: str) -> None:
        super().__init__()
        self.attention = _TitanAttention(dim, n_heads, n_kv_heads, rotary)
        self.feed_forward = _TitanFeedForward(dim, 4 * dim)
        self.attention_norm = _RMSNorm(dim)
        self.ffn_norm = _RMSNorm(dim)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(nn.Module):
    def __init__(
        self,
        dim: int = 128,
        n_layers: int = 2,
        n_heads: int = 8,
        n_kv_heads: int = 4,
        max_seq_len: int = 32,
        rotary: str = "complex",
    ) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.register_buffer(
            "freqs_cis", _rotary_tables(dim // n_heads, max_seq_len), persistent=False
        )
        # torchtitan keeps its layers in a ModuleDict keyed by str(layer_id)
        self.layers = nn.ModuleDict(
            {str(i): _TitanBlock(dim, n_heads, n_kv_heads, rotary) for i in range(n_layers)}
        )
        self.norm = _RMSNorm(dim)
        self.output = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


# ---- tests ----------------------------------------------------------------------------------
def _infer_and_check(model: nn.Module, x: torch.Tensor, tp: int) -> Plan:
    """Infer at `tp`, require a reason for every module kept whole, and hold the plan to
    forward and backward parity with the unsharded model."""
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x)
    _every_kept_one_says_why(plan, model)
    assert_parity(model, plan, tp, x)
    return plan


@pytest.mark.parametrize("tp", [2, 4])
def test_nanogpt(tp: int) -> None:
    """n_embd 32 and 4 heads of 8: tp 2 and 4 divide the heads, the MLP (128) and the vocab.
    The fused c_attn and the tied wte/lm_head are held to parity only. The head size is
    `C // self.n_head` with C read off the block's (whole) input, and the heads are merged
    back by `view(B, T, C)`: a plan that divides n_head must account for both."""
    model = seeded(NanoGpt)
    plan = _infer_and_check(model, _tokens(), tp)
    sharded = _sharded(plan, model)
    for i in range(2):
        assert sharded[f"transformer.h.{i}.mlp.c_fc"] == ("colwise", None)
        assert sharded[f"transformer.h.{i}.mlp.c_proj"] == ("rowwise", None)


@pytest.mark.parametrize("rotary", ["complex", "real", "half"])
@pytest.mark.parametrize("tp", [2, 4])
def test_titan_llama(rotary: str, tp: int) -> None:
    """8 query heads and 4 kv heads of 16; SwiGLU width 352; tp 2 and 4 divide them all.
    Views by stored counts need the plan to divide n_heads / n_kv_heads; rotary in complex
    arithmetic pairs the head features as complex numbers (view_as_complex) and back."""
    model = seeded(TitanLlama, rotary=rotary)
    plan = _infer_and_check(model, _tokens(), tp)
    sharded = _sharded(plan, model)
    for i in range(2):
        ff = f"layers.{i}.feed_forward"
        assert sharded[f"{ff}.w1"] == ("colwise", None)
        assert sharded[f"{ff}.w3"] == ("colwise", None)
        assert sharded[f"{ff}.w2"] == ("rowwise", None)
        attn = f"layers.{i}.attention"
        for p in ("wq", "wk", "wv"):
            assert sharded[f"{attn}.{p}"] == ("colwise", None)
        assert sharded[f"{attn}.wo"] == ("rowwise", None)
    assert sharded["tok_embeddings"] == ("vocab_parallel", None)
    assert sharded["output"] == ("colwise", "replicate")


@pytest.mark.parametrize("tp", [2, 4])
def test_titan_llama_sequence_parallel(tp: int) -> None:
    """Its attention takes two positional inputs (x, freqs_cis): the rule gathering the
    attention's input over the sequence lists a layout for each (torch refuses a list
    shorter than the inputs), and the plan passes check and holds parity."""
    model = seeded(TitanLlama)
    x = _tokens()
    plan = tpplan.infer_plan(model, tp_size=tp, example_inputs=x, sequence_parallel=True)
    prepare = next(r for r in plan.rules if r.match == "layers.*.attention")
    assert (prepare.style, prepare.inputs, prepare.desired_inputs) == (
        "prepare",
        ["shard(1)", None],
        ["replicate", None],
    )
    assert tpplan.check_plan(plan, model, tp_size=tp) == []
    assert_parity(model, plan, tp, x)


# Patch embedding and attention layout vary independently; two models cover both of each.
VITS = [("conv", True), ("linear", False)]


@pytest.mark.parametrize(
    ("patch_embed", "fused"), VITS, ids=[f"{p}-{'fused' if f else 'qkv'}" for p, f in VITS]
)
@pytest.mark.parametrize("tp", [2, 4])
def test_vit(patch_embed: str, fused: bool, tp: int) -> None:
    """dim 32, 4 heads of 8, MLP 128: tp 2 and 4 divide them. timm's fused qkv, viewed as
    reshape(B, N, 3, heads, hd) and unbound, splits as 3 pieces of its heads."""
    model = seeded(Vit, patch_embed=patch_embed, fused=fused)
    plan = _infer_and_check(model, images(), tp)
    sharded = _sharded(plan, model)
    for i in range(2):
        assert sharded[f"blocks.{i}.mlp.0"] == ("colwise", None)
        assert sharded[f"blocks.{i}.mlp.2"] == ("rowwise", None)
        if fused:  # the literal 3 counts the pieces: each rank its heads of q, k and v
            assert sharded[f"blocks.{i}.attn.qkv"] == ("colwise", None)
        else:  # separate q/k/v viewed with -1 heads: a head-parallel region
            for p in ("q", "k", "v"):
                assert sharded[f"blocks.{i}.attn.{p}"] == ("colwise", None)
        assert sharded[f"blocks.{i}.attn.proj"] == ("rowwise", None)
