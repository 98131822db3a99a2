"""Stage 7, checkpoints of a sharded model: saved whole (safetensors) or sharded (DCP), loaded
at any tp size, each rank reading its own slices.

Start at load.py (`load_checkpoint`) and save.py (`save_checkpoint`, and `full_state_dict`
from tpplan/_runtime/gather.py);
then, by concern:

- dcp.py: torch.distributed.checkpoint, saved in small chunks and resharded on load;
- keys.py: a checkpoint's keys and shapes against the model's, every mismatch at once;
- buffers.py: non-persistent buffers, recomputed after a load;
- folder.py: the folder a save replaces its own files in, safe against a kill at any step;
- safetensors_io.py: safetensors headers, region reads and streamed writes;
- converted.py: tensors a Hugging Face checkpoint stores in another layout;
- progress.py: the loading progress bar;
- pretrained.py: `from_pretrained`, a model folder or cached id to a sharded model in one call.
"""

from __future__ import annotations

from ..errors import CheckpointError
from .load import load_checkpoint
from .pretrained import PretrainedError, from_pretrained
from .save import full_state_dict, save_checkpoint

__all__ = [
    "CheckpointError",
    "PretrainedError",
    "from_pretrained",
    "full_state_dict",
    "load_checkpoint",
    "save_checkpoint",
]
