"""Train a small Phi-3 with tensor parallelism under Lightning, the plan inferred by tpplan,
save a checkpoint the Lightning way, and read it back into plain transformers.

Run it as a plain script: `python examples/lightning_tp.py` (needs `pip install lightning`).
Lightning starts the second rank itself; on CPU the ranks talk over gloo. Everything
tensor-parallel is the one line in `configure_model`: ModelParallelStrategy builds a 2-D
mesh (data_parallel x tensor_parallel) and tpplan shards the model over its tp axis.

Phi-3 fuses gate|up in one weight, split so each rank holds its slice of each piece; the
parameters still hold the unsharded layout, so `trainer.save_checkpoint` (torch's
distributed checkpoint under the hood), consolidated by torch's `dcp_to_torch_save`, gives a
state dict plain transformers loads. The script compares its logits with the sharded
model's and exits non-zero when they differ.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset
from transformers import Phi3Config, Phi3ForCausalLM

from tpplan import apply_plan

VOCAB = 128
TOL = 1e-5  # fp32: the sharded model sums the same products in another order


def config() -> Phi3Config:
    return Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


class TinyPhi3(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Phi3ForCausalLM(config())  # same weights on every rank: seed_everything

    def configure_model(self) -> None:
        if any(isinstance(p, DTensor) for p in self.model.parameters()):
            return  # Lightning calls this hook again for each fit/validate; shard once
        apply_plan(self.model, self.device_mesh["tensor_parallel"])

    def training_step(self, batch: list[torch.Tensor]) -> torch.Tensor:
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def tokens() -> DataLoader:
    # Both tp ranks must see the same batch. Lightning wraps this loader in a DistributedSampler
    # over the data_parallel axis (size 1: every rank reads the whole dataset) that shuffles
    # with the same seed on every rank; the data itself comes from a generator of our own.
    data = torch.randint(0, VOCAB, (8, 16), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(data), batch_size=4)


def read_back(folder: Path) -> Phi3ForCausalLM:
    """The sharded checkpoint consolidated into one file by torch's own converter, loaded
    into plain transformers. (Lightning 2.6's `consolidate_checkpoint` command looks for the
    key "model", which ModelParallelStrategy does not write; torch's converter reads any
    distributed checkpoint.)"""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, folder.with_suffix(".pt"))
    whole = torch.load(folder.with_suffix(".pt"), weights_only=False)
    state = {k.removeprefix("model."): v for k, v in whole["state_dict"].items()}
    plain = Phi3ForCausalLM(config()).eval()
    plain.load_state_dict(state)  # strict: every key, every shape
    return plain


def main() -> None:
    L.seed_everything(0)
    module = TinyPhi3()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, tokens())
    params = dict(module.model.named_parameters())
    sharded = [name for name, p in params.items() if isinstance(p, DTensor)]

    folder = Path(trainer.strategy.broadcast(tempfile.mkdtemp())) / "last.ckpt"
    trainer.save_checkpoint(folder)
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    module.model.eval()
    with torch.no_grad():
        want = module.model(x).logits  # every tp rank takes part
    if trainer.global_rank == 0:
        with torch.no_grad():
            err = (read_back(folder)(x).logits - want).abs().max().item()
        print(f"sharded: {len(sharded)} of {len(params)} parameters are DTensors")
        print(f"final loss: {trainer.callback_metrics['loss'].item():.4f}")
        print(f"consolidated checkpoint in plain transformers: max logit difference {err:.2e}")
        if err > TOL:
            sys.exit(f"the consolidated checkpoint differs from the trained model by {err:.2e}")


if __name__ == "__main__":
    main()
