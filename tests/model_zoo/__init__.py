"""The model zoo: models from packages tpplan never saw (torchtitan, timm, diffusers, and
nanoGPT's model.py), built tiny with random weights, for tests/test_zoo.py and
benchmarks/zoo.py alike. It imports no pytest, and none of those packages until a model is
built, so the benchmark can import it and the main test run can collect beside it.

models.py: `ZOO` (each model: its builder and its attention and MLP blocks) and `build`;
measure.py: what a plan does to one (parameters per rank, forward error, collectives per
block); nanogpt.py: nanoGPT's model by hand; torchvision_stub.py: why timm gets a
stand-in torchvision.
"""

from .measure import Measured, block_names, measure, output_tensor
from .models import ZOO, Entry, Inputs, build

__all__ = [
    "ZOO",
    "Entry",
    "Inputs",
    "Measured",
    "block_names",
    "build",
    "measure",
    "output_tensor",
]
