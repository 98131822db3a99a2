"""compile/linear_probe.py: a Linear subclass's forward of its own is proved to compute
`F.linear(input, weight, bias)` by the ops it runs on meta tensors, or it is not (any other
use of the weight or the bias, a scale, a norm, a second use, a sign)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tpplan.compile.linear_probe import computes_linear

pytestmark = pytest.mark.unit


class _Matmul(nn.Linear):  # Falcon's: the product, then the bias added apart
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.weight.T
        return out if self.bias is None else out + self.bias


class _Functional(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _BiasFirst(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bias + torch.matmul(x, self.weight.transpose(0, 1))


class _Scaled(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.weight.T * 2) + self.bias


class _Normed(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight / self.weight.norm(dim=1, keepdim=True)
        return F.linear(x, w, self.bias)


class _TwoBiases(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t() + self.bias + self.bias


class _Subtracted(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t() - self.bias


class _ScaledOutput(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) * 0.5


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("layer", [_Matmul, _Functional])
def test_a_linear_written_out_is_proved(layer: type[nn.Linear], bias: bool) -> None:
    assert computes_linear(layer(4, 6, bias=bias))


def test_the_bias_added_first_is_proved() -> None:
    assert computes_linear(_BiasFirst(4, 6))


@pytest.mark.parametrize("layer", [_Scaled, _Normed, _TwoBiases, _Subtracted, _ScaledOutput])
def test_any_other_use_of_the_parameters_is_no_proof(layer: type[nn.Linear]) -> None:
    assert not computes_linear(layer(4, 6))


def test_only_linear_layers_are_probed() -> None:
    assert not computes_linear(nn.Conv1d(4, 6, 1))


class _Caching(nn.Linear):
    """Keeps the transposed weight it computed on itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cached = self.weight.T
        return x @ self.cached + self.bias


def test_the_probe_leaves_the_module_as_it_was() -> None:
    """What the forward writes on itself, and the module's hooks, stay out of the probe: it
    runs the class's forward on a copy holding meta stand-ins for the parameters."""
    layer, called = _Caching(4, 6), []
    layer.register_forward_pre_hook(lambda *_: called.append(1))
    weight = layer.weight
    assert computes_linear(layer)
    assert not hasattr(layer, "cached") and called == [] and layer.weight is weight
