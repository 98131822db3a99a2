"""Hand edits of the tiny Llama's plan (tests/plans/llama.yaml) that pass the schema but
crash inside torch at the first forward, each with the words its problem must say: the
static check's where one names it, and the dry run's (tpplan/check/run.py) for all of them.
Shared by test_check, test_dry_run, test_apply and test_cli."""

from __future__ import annotations

from typing import NamedTuple

from support.plans import LLAMA_PLAN
from tpplan import Plan


class Case(NamedTuple):
    edit: str
    """The plan's text after the edit."""
    rule: str
    """The rule every problem names."""
    static: str | None
    """Words of the static check's problem; None where only the dry run sees it."""
    ran: str
    """Words of the dry run's problem: where torch raised, and why."""
    fix: str
    """Words of the fix (the static one where there is one)."""


def _plan_text() -> str:
    return LLAMA_PLAN.read_text()


def _embedding_as(style: str) -> str:
    return _plan_text().replace("    style: vocab_parallel\n", f"    style: {style}\n", 1)


def _with_rule(rule: str) -> str:
    return _plan_text().replace("rules:\n", f"rules:\n  - {rule}\n", 1)


_DIVIDE_HEAD_DIM = (
    "attributes:\n  - {match: model.layers.*.self_attn, divide: [head_dim], why: x}\n"
)
# a hand-made sequence-parallel boundary in a plan that is not sequence-parallel: the MLP's
# whole input is taken for a shard of the sequence and gathered to twice its length
_PREPARE = (
    "{match: model.layers.*.mlp, style: prepare, inputs: [shard(1)], "
    "desired_inputs: [replicate], local_input: true, why: hand edit}"
)

CASES = {
    "colwise_embedding": Case(
        _embedding_as("colwise"),
        "rules[0] (match: model.embed_tokens)",
        "colwise on an nn.Embedding gives each rank a slice of every looked-up row's features",
        "fails in model.layers.0.input_layernorm (LlamaRMSNorm), which takes the output of "
        "model.embed_tokens: RuntimeError: Attempting to broadcast",
        "colwise on an Embedding: use vocab_parallel",
    ),
    "sequence_parallel_embedding": Case(
        _embedding_as("sequence_parallel"),
        "rules[0] (match: model.embed_tokens)",
        "an nn.Embedding's input is the token ids, which every rank holds whole",
        "fails in model.layers.0.input_layernorm (LlamaRMSNorm), which takes the output of "
        "model.embed_tokens: RuntimeError: aten.mul.Tensor got mixed torch.Tensor and DTensor",
        "use vocab_parallel",
    ),
    "divided_head_dim": Case(
        _plan_text() + _DIVIDE_HEAD_DIM,
        "attributes[0] (match: model.layers.*.self_attn)",
        "its forward reads head_dim, but not as a count of the split features' heads",
        "fails in model.layers.0.self_attn (LlamaAttention): RuntimeError: Attempting to broadcast",
        "remove head_dim from divide",
    ),
    "prepare_in_the_wrong_place": Case(
        _with_rule(_PREPARE),
        "rules[0] (match: model.layers.*.mlp)",
        None,
        "fails in model.layers.0 (LlamaDecoderLayer), which takes the output of "
        "model.layers.0.mlp: RuntimeError: Attempting to broadcast a dimension of length 32",
        "keep the module whole (style: replicate)",
    ),
}


def unrunnable(case: str) -> Plan:
    return Plan.from_yaml(CASES[case].edit)
