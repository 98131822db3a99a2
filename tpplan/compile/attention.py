"""torch's nn.MultiheadAttention split by heads: `HeadParallelAttention`.

Start at `HeadParallelAttention`. nn.MultiheadAttention keeps its q|k|v projection in one
parameter (`in_proj_weight`) and calls its `out_proj` only through its weight, inside
`F.multi_head_attention_forward`; that function derives every size from the query's width
(`unflatten(-1, (3, E))`, `embed_dim // num_heads`), and merges batch and heads into one dim
(`view(L, N * H, head_dim)`), where DTensor's propagation loses a split over heads (it
gathers q, k and v). So neither a local region (its sizes are not attributes) nor a DTensor
region runs it split: this style runs the same computation on each rank's heads, with the
projections as DTensor ops, so that the collectives are DTensor's own (one all-reduce of the
input gradient, one of the output).

The computation mirrors torch 2.x `nn.MultiheadAttention.forward` (slow path) and
`F.multi_head_attention_forward` step by step; the eval fast path
(`torch._native_multi_head_attention`, `torch._transformer_encoder_layer_fwd`) checks that
`qkv_weight` is 3 x embed_dim, so it cannot run on a rank's rows and is never taken: the
forward pre-hook this style registers also turns off TransformerEncoderLayer's fast path
("forward pre-/hooks are attached to the module").
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ParallelStyle

from .._runtime.torch_compat import canonical_mask, mha_shape_check, none_or_dtype
from ..errors import TpplanError
from .params import changeable, split_param

__all__ = ["HeadParallelAttention"]

_MESH = "_tpplan_heads_mesh"  # where the module keeps its mesh for the forward


class HeadParallelAttention(ParallelStyle):
    """nn.MultiheadAttention with each rank holding num_heads/tp heads.

    `in_proj_weight`/`in_proj_bias` hold q|k|v end to end: each rank gets its slice of each
    piece (a `_StridedShard` whose full tensor is the original weight); separate
    `q/k/v_proj_weight` (kdim/vdim given) are split on their rows, `bias_k`/`bias_v` on their
    features; `out_proj` contracts the heads (weight split on its input dim, bias whole) and
    its partial sums are all-reduced. The module's forward is replaced by
    `_head_parallel_forward`, which takes and returns what torch's does (whole tensors;
    attention weights, when asked for, whole too).

    Example::
        >>> parallelize_module(model, mesh, {"layers.0.self_attn": HeadParallelAttention()})
    """

    src_data_rank: int | None = 0

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_splittable(module, device_mesh.size())
        assert isinstance(module, nn.MultiheadAttention)  # _check_splittable raised otherwise
        src = self.src_data_rank
        E = module.embed_dim
        if module._qkv_same_embed_dim:
            split_param(module, "in_proj_weight", module_mesh := device_mesh, 0, (E,) * 3, src)
        else:
            module_mesh = device_mesh
            for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                split_param(module, name, device_mesh, 0, None, src)
        if module.in_proj_bias is not None:
            split_param(module, "in_proj_bias", module_mesh, 0, (E,) * 3, src)
        for name in ("bias_k", "bias_v"):
            if getattr(module, name) is not None:
                split_param(module, name, device_mesh, 2, None, src)
        out = module.out_proj
        split_param(out, "weight", device_mesh, 1, None, src)
        if out.bias is not None:
            whole = distribute_tensor(out.bias, device_mesh, [Replicate()], src_data_rank=src)
            out.register_parameter("bias", nn.Parameter(whole, out.bias.requires_grad))
        module.__dict__[_MESH] = device_mesh
        module.forward = types.MethodType(_head_parallel_forward, module)  # type: ignore[method-assign]
        # A hook of any kind keeps TransformerEncoderLayer off its fused fast path, which
        # would hand the split weights to one kernel as if they were whole.
        module.register_forward_pre_hook(_refuse_nested)
        return module

    def __repr__(self) -> str:
        return "HeadParallelAttention()"


def _check_splittable(module: nn.Module, tp: int) -> None:
    if type(module).forward is not nn.MultiheadAttention.forward:
        raise TpplanError(
            f"{type(module).__name__} does not run nn.MultiheadAttention's own forward; "
            "only that computation can be split by heads this way."
        )
    assert isinstance(module, nn.MultiheadAttention)
    if module.num_heads % tp:
        raise TpplanError(
            f"nn.MultiheadAttention has {module.num_heads} heads, which do not split evenly "
            f"over tp size {tp}."
        )


def _refuse_nested(module: nn.Module, args: Any) -> None:
    if any(isinstance(a, Tensor) and a.is_nested for a in args):
        raise TpplanError(
            "a nested tensor reached a head-parallel nn.MultiheadAttention (TransformerEncoder's "
            "fast path for a key padding mask in eval mode); build the encoder with "
            "enable_nested_tensor=False."
        )


# ---- the forward, per rank -------------------------------------------------------------------


def _entering(x: Tensor, mesh: DeviceMesh) -> DTensor:
    """The whole input as a replicated DTensor: its gradient, a partial sum on each rank (each
    rank's heads only), is all-reduced on the way back."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False)


def _dt(t: Any) -> DTensor:
    """A parameter this style made a DTensor at apply."""
    assert isinstance(t, DTensor)
    return t


def _rows(w: Any, piece: int, pieces: int, mesh: DeviceMesh) -> DTensor:
    """This rank's rows of one piece of a fused q|k|v parameter, as a DTensor split on dim 0."""
    local = _dt(w).to_local().chunk(pieces)[piece]
    shape = torch.Size((w.shape[0] // pieces, *w.shape[1:]))
    return DTensor.from_local(
        local,
        mesh,
        [Shard(0)],
        run_check=False,
        shape=shape,
        stride=torch.empty(shape, device="meta").stride(),
    )


def _project(x: DTensor, w: Any, b: Any) -> Tensor:
    return _dt(F.linear(x, w, b)).to_local()  # this rank's features: (..., E/tp)


def _in_projection(
    m: nn.MultiheadAttention, q: Tensor, k: Tensor, v: Tensor, mesh: DeviceMesh
) -> tuple[Tensor, Tensor, Tensor]:
    """(q, k, v) of this rank's heads, each (L or S, N, E/tp), as torch's
    `_in_projection_packed` and `_in_projection` compute them for all heads."""
    b = m.in_proj_bias
    if m._qkv_same_embed_dim and q is k and k is v:
        # self-attention, one product as torch's: rank r's rows are [q_r | k_r | v_r]
        proj = _dt(F.linear(_entering(q, mesh), m.in_proj_weight, b)).to_local()  # (L, N, 3E/tp)
        proj = proj.unflatten(-1, (3, proj.shape[-1] // 3))  # (L, N, 3, E/tp)
        return proj[..., 0, :], proj[..., 1, :], proj[..., 2, :]
    weights: list[Any]
    if m._qkv_same_embed_dim:
        weights = [_rows(m.in_proj_weight, i, 3, mesh) for i in range(3)]
    else:
        weights = [m.q_proj_weight, m.k_proj_weight, m.v_proj_weight]
    biases = [None] * 3 if b is None else [_rows(b, i, 3, mesh) for i in range(3)]
    x_q = _entering(q, mesh)
    x_k = x_q if k is q else _entering(k, mesh)
    x_v = x_k if v is k else _entering(v, mesh)
    q_, k_, v_ = (
        _project(x, w, bias) for x, w, bias in zip((x_q, x_k, x_v), weights, biases, strict=True)
    )
    return q_, k_, v_


def _own_heads(mask: Tensor, heads: int, mesh: DeviceMesh) -> Tensor:
    """A 3-D mask of all heads, (N * H, L, S), cut to this rank's heads: (N * H/tp, L, S)."""
    n_h, L, S = mask.shape
    whole = DTensor.from_local(
        mask.view(n_h // heads, heads, L, S), mesh, [Replicate()], run_check=False
    )
    mine = whole.redistribute(placements=[Shard(1)]).to_local()  # no collective: a local cut
    return mine.reshape(-1, L, S)


def _head_parallel_forward(
    self: nn.MultiheadAttention,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None = None,
    need_weights: bool = True,
    attn_mask: Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """nn.MultiheadAttention.forward on this rank's heads; takes and returns whole tensors."""
    mesh: DeviceMesh = self.__dict__[_MESH]
    tp = mesh.size()
    heads = self.num_heads // tp
    is_batched = mha_shape_check(query, key, value, key_padding_mask, attn_mask, self.num_heads)
    if self.batch_first and is_batched:
        # keep q is k is v where it holds: self-attention projects once
        if key is value:
            if query is key:
                query = key = value = query.transpose(1, 0)
            else:
                query, key = (x.transpose(1, 0) for x in (query, key))
                value = key
        else:
            query, key, value = (x.transpose(1, 0) for x in (query, key, value))
    if not is_batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    tgt_len, bsz, embed_dim = query.shape  # (L, N, E)
    if embed_dim != self.embed_dim:
        raise AssertionError(
            f"was expecting embedding dimension of {self.embed_dim}, but got {embed_dim}"
        )
    key_padding_mask = canonical_mask(
        mask=key_padding_mask,
        mask_name="key_padding_mask",
        other_type=none_or_dtype(attn_mask),
        other_name="attn_mask",
        target_type=query.dtype,
    )
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint.")
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None
    else:
        attn_mask = canonical_mask(
            mask=attn_mask,
            mask_name="attn_mask",
            other_type=None,
            other_name="",
            target_type=query.dtype,
            check_other=False,
        )
        if key_padding_mask is not None:
            is_causal = False

    q, k, v = _in_projection(self, query, key, value, mesh)  # (L|S, N, E/tp)
    e_local = q.shape[-1]
    head_dim = e_local // heads

    if attn_mask is not None:
        if attn_mask.dim() == 2:
            attn_mask = attn_mask.unsqueeze(0)  # (1, L, S): every head alike
        else:
            attn_mask = _own_heads(attn_mask, self.num_heads, mesh)  # (N * H/tp, L, S)
    if self.bias_k is not None and self.bias_v is not None:
        k = torch.cat([k, _dt(self.bias_k).to_local().repeat(1, bsz, 1)])
        v = torch.cat([v, _dt(self.bias_v).to_local().repeat(1, bsz, 1)])
        if attn_mask is not None:
            attn_mask = F.pad(attn_mask, (0, 1))
        if key_padding_mask is not None:
            key_padding_mask = F.pad(key_padding_mask, (0, 1))

    q = q.reshape(tgt_len, bsz * heads, head_dim).transpose(0, 1)  # (N * H/tp, L, hd)
    k = k.reshape(k.shape[0], bsz * heads, head_dim).transpose(0, 1)  # (N * H/tp, S, hd)
    v = v.reshape(v.shape[0], bsz * heads, head_dim).transpose(0, 1)
    if self.add_zero_attn:
        zeros = torch.zeros((bsz * heads, 1, head_dim), dtype=k.dtype, device=k.device)
        k, v = torch.cat([k, zeros], dim=1), torch.cat([v, zeros], dim=1)
        if attn_mask is not None:
            attn_mask = F.pad(attn_mask, (0, 1))
        if key_padding_mask is not None:
            key_padding_mask = F.pad(key_padding_mask, (0, 1))
    src_len = k.size(1)
    if key_padding_mask is not None:
        key_padding_mask = (
            key_padding_mask.view(bsz, 1, 1, src_len)
            .expand(-1, heads, -1, -1)
            .reshape(bsz * heads, 1, src_len)
        )
        attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
    dropout_p = self.dropout if self.training else 0.0

    weights = None
    if need_weights:
        if is_causal and attn_mask is None:
            raise AssertionError("FIXME: is_causal not implemented for need_weights")
        q_scaled = q * (1.0 / float(head_dim) ** 0.5)
        if attn_mask is not None:
            scores = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
        else:
            scores = torch.bmm(q_scaled, k.transpose(-2, -1))
        scores = F.softmax(scores, dim=-1)  # (N * H/tp, L, S)
        if dropout_p > 0.0:
            scores = F.dropout(scores, p=dropout_p)  # torch returns the weights dropped too
        attn = torch.bmm(scores, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len * bsz, e_local)
        weights = _whole_weights(
            scores.view(bsz, heads, tgt_len, src_len), self.num_heads, average_attn_weights, mesh
        )
        if not is_batched:
            weights = weights.squeeze(0)
    else:
        if attn_mask is not None:
            if attn_mask.size(0) == 1:
                attn_mask = attn_mask.unsqueeze(0)  # (1, 1, L, S)
            else:
                attn_mask = attn_mask.view(bsz, heads, -1, src_len)  # (N, H/tp, L, S)
        q, k, v = (t.view(bsz, heads, -1, head_dim) for t in (q, k, v))  # (N, H/tp, L|S, hd)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
        attn = attn.permute(2, 0, 1, 3).contiguous().view(bsz * tgt_len, e_local)

    # out_proj contracts the heads: a partial sum on each rank, all-reduced (bias added once)
    split = DTensor.from_local(attn, mesh, [Shard(-1)], run_check=False)
    summed = _dt(F.linear(split, self.out_proj.weight, self.out_proj.bias))
    out = summed.redistribute(placements=[Replicate()]).to_local()
    out = changeable(out)
    out = out.view(tgt_len, bsz, embed_dim)  # (L, N, E)
    if not is_batched:
        out = out.squeeze(1)
    elif self.batch_first:
        out = out.transpose(1, 0)
    return out, weights


def _whole_weights(w: Tensor, heads: int, average: bool, mesh: DeviceMesh) -> Tensor:
    """This rank's attention weights (N, H/tp, L, S) made whole: averaged over all heads
    (N, L, S), or all heads (N, H, L, S)."""
    if average:
        part = DTensor.from_local(w.sum(dim=1) / heads, mesh, [Partial()], run_check=False)
        return part.redistribute(placements=[Replicate()]).to_local()
    split = DTensor.from_local(w, mesh, [Shard(1)], run_check=False)
    return split.redistribute(placements=[Replicate()]).to_local()
