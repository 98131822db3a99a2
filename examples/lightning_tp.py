"""Train a small Llama with tensor parallelism under Lightning, the plan inferred by tpplan.

Run it as a plain script: `python examples/lightning_tp.py` (needs `pip install lightning`).
Lightning starts the second rank itself; on CPU the ranks talk over gloo. Everything
tensor-parallel is the one line in `configure_model`: ModelParallelStrategy builds a 2-D
mesh (data_parallel x tensor_parallel) and tpplan shards the model over its tp axis.
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

from tpplan import apply_plan

VOCAB = 128


class TinyLlama(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
        )  # fmt: skip
        self.model = LlamaForCausalLM(config)  # same weights on every rank: seed_everything

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


def main() -> None:
    L.seed_everything(0)
    module = TinyLlama()
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
    if trainer.global_rank == 0:
        print(f"sharded: {len(sharded)} of {len(params)} parameters are DTensors")
        print(f"final loss: {trainer.callback_metrics['loss'].item():.4f}")


if __name__ == "__main__":
    main()
