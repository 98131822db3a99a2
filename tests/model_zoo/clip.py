"""A CLIP in open_clip's layout, written here on torch's own nn.MultiheadAttention: open_clip
is not in the zoo extra (its torchvision requirement would move the pinned CPU torch), and
what the zoo checks of CLIP is how tpplan splits nn.MultiheadAttention and the blocks
around it, which this reproduces: pre-norm residual blocks of attention and a GELU MLP
(`c_fc`, `c_proj`), an image tower from a patch convolution with a class token and learned
positions, a text tower from a token lookup with a causal mask, each pooled and projected
into one space, and the similarity logits scaled by a learned temperature."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Clip"]


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential()
        self.mlp.add_module("c_fc", nn.Linear(width, 4 * width))
        self.mlp.add_module("gelu", nn.GELU())
        self.mlp.add_module("c_proj", nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.ln_1(x)
        x = x + self.attn(y, y, y, need_weights=False, attn_mask=mask)[0]
        return x + self.mlp(self.ln_2(x))


class _Tower(nn.Module):
    def __init__(self, width: int, heads: int, layers: int) -> None:
        super().__init__()
        self.resblocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.resblocks:
            x = block(x, mask)
        return x


class _Vision(nn.Module):
    def __init__(self, image: int, patch: int, width: int, heads: int, layers: int, out: int):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, patch, stride=patch, bias=False)
        self.class_embedding = nn.Parameter(torch.randn(width) * width**-0.5)
        self.positional_embedding = nn.Parameter(
            torch.randn((image // patch) ** 2 + 1, width) * width**-0.5
        )
        self.ln_pre = nn.LayerNorm(width)
        self.transformer = _Tower(width, heads, layers)
        self.ln_post = nn.LayerNorm(width)
        self.proj = nn.Parameter(torch.randn(width, out) * width**-0.5)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.conv1(images).flatten(2).transpose(1, 2)  # (B, patches, width)
        cls = self.class_embedding.expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1) + self.positional_embedding
        x = self.transformer(self.ln_pre(x))
        return self.ln_post(x[:, 0]) @ self.proj  # the class token, projected


class Clip(nn.Module):
    """Image and text towers of `layers` blocks of `width` features in `heads` heads."""

    def __init__(
        self,
        *,
        embed_dim: int = 32,
        image: int = 32,
        patch: int = 8,
        width: int = 64,
        heads: int = 4,
        layers: int = 2,
        vocab: int = 200,
        context: int = 12,
    ) -> None:
        super().__init__()
        self.visual = _Vision(image, patch, width, heads, layers, embed_dim)
        self.token_embedding = nn.Embedding(vocab, width)
        self.positional_embedding = nn.Parameter(torch.randn(context, width) * 0.01)
        self.transformer = _Tower(width, heads, layers)
        self.ln_final = nn.LayerNorm(width)
        self.text_projection = nn.Parameter(torch.randn(width, embed_dim) * width**-0.5)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))
        causal = torch.full((context, context), float("-inf")).triu(1)
        self.register_buffer("attn_mask", causal, persistent=False)

    def encode_text(self, text: torch.Tensor) -> torch.Tensor:
        x = self.token_embedding(text) + self.positional_embedding
        x = self.ln_final(self.transformer(x, self.attn_mask))
        last = x[torch.arange(x.shape[0]), text.argmax(dim=-1)]  # the end-of-text token
        return last @ self.text_projection

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        img = nn.functional.normalize(self.visual(image), dim=-1)
        txt = nn.functional.normalize(self.encode_text(text), dim=-1)
        return self.logit_scale.exp() * img @ txt.t()  # (images, texts) similarities
