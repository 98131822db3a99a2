"""Embedding tables whose own forward does more than look up (tests/test_tables.py, and the
gloo ranks of tests/gloo_parity.py `written`): `Table` norms or scales the rows it looks up
and may write a learned row over one token's rows in place; `TableModel` puts it before an
MLP and a head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from support.infer_models import Mlp

__all__ = ["SPECIAL", "Table", "TableModel", "table_ids", "writing_table_model"]

SPECIAL = 3  # the token whose rows the table overwrites


class Table(nn.Embedding):
    """A table that norms the rows it looks up (or, with `norm` false, scales them) and,
    with `special`, writes a learned row over one token's rows in place. With `own_lookup`
    it looks up with F.embedding itself rather than through nn.Embedding's forward."""

    def __init__(
        self, *, special: bool = False, own_lookup: bool = False, norm: bool = True
    ) -> None:
        super().__init__(64, 32, padding_idx=0)
        self.special = nn.Parameter(torch.randn(32)) if special else None
        self.own_lookup = own_lookup
        self.norm = norm
        self.register_buffer("scale", torch.tensor(32**0.5), persistent=False)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(input, self.weight) if self.own_lookup else super().forward(input)
        if self.norm:
            rows = F.rms_norm(rows, (rows.shape[-1],))
        else:
            rows = rows * self.scale.to(rows.dtype)
        if self.special is not None:
            rows[input == SPECIAL] = self.special.to(rows.dtype)
        return rows


class TableModel(nn.Module):
    def __init__(self, **table: bool) -> None:
        super().__init__()
        self.embed = Table(**table)
        self.mlp = Mlp(32, 48)
        self.head = nn.Linear(32, 64)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        return self.head(h + self.mlp(h))


def table_ids() -> torch.Tensor:
    """Tokens with SPECIAL and the padding token 0 among them, drawn from a seed."""
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    ids[0, 1] = SPECIAL
    ids[1, 2] = 0  # the padding row: looked up, never trained
    return ids


def writing_table_model(**table: bool) -> TableModel:
    """A TableModel whose table scales its rows and writes the SPECIAL row over them."""
    torch.manual_seed(0)
    return TableModel(special=True, norm=False, **table)
