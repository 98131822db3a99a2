"""`save_pretrained` of a model apply_plan sharded (tpplan/apply/saving.py) writes the files
the unsharded model's `save_pretrained` writes: transformers models (tied or not), a peft
model's adapter (only the adapter gathered), a state dict the caller hands in (as Hugging
Face's Trainer does), and a merged model. Real ranks: tests/pretrained_ranks.py and
tests/peft_ranks.py save on every gloo rank."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from support.lora import lora_llama, train_step
from support.models import tiny_llama, token_batch
from torch import nn
from transformers import LlamaForCausalLM

import tpplan
import tpplan._runtime.gather
from tpplan._runtime.local import own_replicas, simulated_ranks

# fp32, 2 layers: a trained adapter differs from the unsharded one by the order of its sums
# (~1e-7); a rank's shard saved for the whole is off in shape, a wrong slice by O(0.1)
TOL = 1e-5


def _files(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files, by name."""
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_sharded_model_saves_the_unsharded_model_s_files(
    tmp_path: Path, tp: int, tied: bool
) -> None:
    """The same tensor names (a tied head left out as transformers leaves it out), the same
    values, and transformers loads the folder into the unsharded model's logits."""
    ref = tiny_llama(tied=tied)
    ref.save_pretrained(tmp_path / "unsharded")
    with simulated_ranks(tp) as mesh:
        model = tpplan.apply_plan(copy.deepcopy(ref), mesh)
        model.save_pretrained(tmp_path / "sharded")
    got, want = _files(tmp_path / "sharded"), _files(tmp_path / "unsharded")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    x = token_batch()
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "sharded").eval()
    assert torch.equal(loaded(x).logits, ref(x).logits)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_peft_model_saves_its_trained_adapter_whole_gathering_nothing_else(
    tmp_path: Path, tp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a training step, with no state_dict given: the adapter file peft writes for the
    unsharded model, and only adapter tensors were gathered (never the frozen base)."""
    ref, tokens = lora_llama(), token_batch()
    start = copy.deepcopy(ref)
    train_step(ref, tokens)
    ref.save_pretrained(tmp_path / "unsharded")
    gathered: list[tuple[int, ...]] = []
    whole = tpplan._runtime.gather.whole_tensor
    monkeypatch.setattr(
        tpplan._runtime.gather, "whole_tensor", lambda t: gathered.append(t.shape) or whole(t)
    )
    with simulated_ranks(tp) as mesh:
        model = own_replicas(tpplan.apply_plan(copy.deepcopy(start), mesh), tp)
        train_step(model, tokens)
        model.save_pretrained(tmp_path / "sharded")
    got, want = _files(tmp_path / "sharded"), _files(tmp_path / "unsharded")
    assert got.keys() == want.keys() and len(want) == 2 * 2 * 7  # 2 layers, A and B, 7 targets
    for name, value in want.items():
        assert torch.allclose(got[name], value, atol=TOL), name
    assert len(gathered) == len(want)  # one per adapter tensor
    loaded = PeftModel.from_pretrained(tiny_llama(), tmp_path / "sharded").eval()
    with torch.no_grad():
        assert torch.allclose(loaded(tokens).logits, ref.eval()(tokens).logits, atol=TOL)


def test_a_state_dict_handed_in_is_saved_whole(tmp_path: Path) -> None:
    """Hugging Face's Trainer passes the model's own state dict (DTensors here): its split
    tensors are gathered, its plain ones written as they are."""
    ref = tiny_llama()
    ref.save_pretrained(tmp_path / "unsharded")
    with simulated_ranks(2) as mesh:
        model = tpplan.apply_plan(copy.deepcopy(ref), mesh)
        model.save_pretrained(tmp_path / "sharded", state_dict=model.state_dict())
    got, want = _files(tmp_path / "sharded"), _files(tmp_path / "unsharded")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_merged_model_saves_the_unsharded_merged_model(tmp_path: Path) -> None:
    """merge_and_unload hands back the base model inside the peft model; its own
    save_pretrained gathers too."""
    ref, tokens = lora_llama(), token_batch()
    start = copy.deepcopy(ref)
    merged_ref = ref.merge_and_unload()
    with simulated_ranks(2) as mesh:
        merged = tpplan.apply_plan(copy.deepcopy(start), mesh).merge_and_unload()
        merged.save_pretrained(tmp_path / "merged")
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert torch.allclose(loaded(tokens).logits, merged_ref(tokens).logits, atol=TOL)


class _OwnSave(nn.Module):
    """A model with a save_pretrained of its own that takes no state dict (as diffusers')."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))

    def save_pretrained(self, folder: str) -> str:
        return folder


def test_a_save_pretrained_that_takes_no_state_dict_is_left_alone() -> None:
    with simulated_ranks(2) as mesh:
        model = tpplan.apply_plan(_OwnSave(), mesh)
    assert "save_pretrained" not in vars(model)
    with simulated_ranks(2) as mesh:
        llama = tpplan.apply_plan(tiny_llama(), mesh)
    assert "save_pretrained" in vars(llama)
