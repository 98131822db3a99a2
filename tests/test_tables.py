"""Embedding tables whose own forward does more than look up: rows normed (MuseGlimmer's
text model) or overwritten in place (T5Gemma 2's end-of-image row). Split by vocab, each
rank's partial rows must be summed before a norm, at the lookup (`sum_at: lookup`); a
parameter written over rows that are then only scaled is split too, each rank writing its
share (`written`)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from support.parity import assert_parity
from support.plans import rule_for, styles
from support.tables import Table, TableModel, table_ids, writing_table_model

import tpplan
from tpplan._runtime.local import rank_values, simulated_ranks
from tpplan.checkpoint import full_state_dict, load_checkpoint, save_checkpoint
from tpplan.errors import TpplanError
from tpplan.plan import Plan, Rule


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("special", [False, True], ids=["normed", "normed_and_overwritten"])
def test_a_table_that_norms_its_rows_sums_them_at_the_lookup(tp: int, special: bool) -> None:
    torch.manual_seed(0)
    model = TableModel(special=special)
    plan = tpplan.infer_plan(model, tp_size=tp)
    rule = rule_for(plan, model, "embed")
    assert (rule.style, rule.sum_at) == ("vocab_parallel", "lookup")
    assert "right where nn.Embedding's lookup returns them" in rule.why
    assert styles(plan, model)["mlp.fc1"] == ("colwise", None)  # the rest as before
    assert tpplan.check_plan(plan, model, tp_size=tp) == []
    assert_parity(model, plan, tp, table_ids())


def test_a_table_split_by_rows_keeps_its_name_and_parameters() -> None:
    torch.manual_seed(0)
    model = TableModel(special=True)
    plan = tpplan.infer_plan(model, tp_size=2)
    with simulated_ranks(2) as mesh:
        tpplan.apply_plan(model, mesh, plan)
        assert isinstance(model.embed, Table) and type(model.embed).__name__ == "Table"
        assert [n for n, _ in model.embed.named_parameters()] == ["weight", "special"]
        assert model.embed.weight.to_local().shape == (32, 32)  # type: ignore[attr-defined]


def test_such_a_table_saves_unsplit() -> None:
    torch.manual_seed(0)
    model = TableModel(special=True)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    plan = tpplan.infer_plan(model, tp_size=2)
    with simulated_ranks(2) as mesh:
        got = full_state_dict(tpplan.apply_plan(model, mesh, plan))
    assert list(got) == list(want)
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_a_table_that_looks_up_on_its_own_stays_whole() -> None:
    model = TableModel(own_lookup=True)
    plan = tpplan.infer_plan(model, tp_size=2)
    rule = rule_for(plan, model, "embed")
    assert rule.style == "replicate"
    assert "looks its rows up with an embedding of its own" in rule.why
    assert_parity(model, plan, 2, table_ids())


def _forced(plan: Plan, **fields: object) -> Plan:
    rules = [
        Rule.parse({**r.model_dump(exclude_unset=True), "style": "vocab_parallel", **fields})
        if r.match == "embed"
        else r
        for r in plan.rules
    ]
    return Plan.model_validate({**plan.model_dump(exclude_none=True), "rules": rules})


def test_check_asks_for_sum_at_lookup_on_a_table_that_norms_its_rows() -> None:
    model = TableModel()
    plan = tpplan.infer_plan(model, tp_size=2)
    plain = _forced(plan, sum_at=None)
    (problem,) = tpplan.check_plan(plain, model, tp_size=2)
    assert problem.kind == "lookup" and problem.module == "embed"
    assert "not linear in them" in problem.message and "partial rows" in problem.message
    assert problem.fix == "add `sum_at: lookup` to the rule."


def test_check_refuses_sum_at_lookup_where_the_lookup_is_its_own() -> None:
    model = TableModel(own_lookup=True)
    plan = _forced(tpplan.infer_plan(model, tp_size=2), sum_at="lookup")
    (problem,) = tpplan.check_plan(plan, model, tp_size=2)
    assert problem.kind == "lookup"
    assert "not through nn.Embedding's forward" in problem.message
    assert problem.fix == "keep it whole (style: replicate)."


def test_sequence_parallel_refuses_a_stream_the_model_itself_adds_to_whole() -> None:
    """The table is kept whole (its rows are summed inside its forward), so the stream
    starts whole and meets the MLP's reduce-scattered output in the model's own forward
    (`h + self.mlp(h)`), where no region can hold it: infer_plan says so, also when given
    inputs, rather than hand back a plan whose first forward fails."""
    model = TableModel()
    with pytest.raises(TpplanError) as caught:
        tpplan.infer_plan(model, tp_size=2, sequence_parallel=True, example_inputs=table_ids())
    assert str(caught.value) == (
        "sequence parallel does not fit TableModel: its own forward meets the sequence-split "
        "stream with whole tensors (add), outside any submodule a region could hold. Infer "
        "without sequence parallel, or write those rules by hand."
    )


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ("sum_at: lookup, output: shard(1)", "its input and output are whole, plain tensors"),
        ("sum_at: lookup, local_output: false", "drop input, output and local_output"),
        ("sum_at: row", "Input should be 'lookup'"),
        ("written: [special], sum_at: lookup", "drop sum_at"),
        ("written: [special], output: partial", r"output replicate or shard\(DIM\)"),
        ("written: []", "at least 1 item"),
    ],
)
def test_a_bad_sum_at_or_written_is_named(extra: str, said: str) -> None:
    text = f"tpplan: 7\nrules:\n  - {{match: embed, style: vocab_parallel, why: w, {extra}}}\n"
    with pytest.raises(ValueError, match=said):
        Plan.from_yaml(text)


def test_sum_at_needs_schema_version_6() -> None:
    rule = "{match: embed, style: vocab_parallel, why: w, sum_at: lookup}"
    with pytest.raises(ValueError, match="sum_at need schema version 6"):
        Plan.from_yaml(f"tpplan: 5\nrules:\n  - {rule}\n")
    assert Plan.from_yaml(f"tpplan: 6\nrules:\n  - {rule}\n").rules[0].sum_at == "lookup"


# ---- a parameter written over rows, then only scaled: split too (`written`) ----------------
@pytest.mark.parametrize("tp", [2, 4])
def test_a_parameter_written_over_rows_is_split_and_written_by_shares(tp: int) -> None:
    model = writing_table_model()
    plan = tpplan.infer_plan(model, tp_size=tp)
    rule = rule_for(plan, model, "embed")
    assert (rule.style, rule.sum_at, rule.written) == ("vocab_parallel", None, ["special"])
    assert "each rank writes its share padded with zeros" in rule.why
    assert tpplan.check_plan(plan, model, tp_size=tp) == []
    assert_parity(model, plan, tp, table_ids())  # special's gradient included
    with simulated_ranks(tp) as mesh:
        tpplan.apply_plan(model, mesh, plan)
        assert model.embed.special.to_local().shape == (32 // tp,)  # type: ignore[union-attr]


def test_a_table_with_written_saves_unsplit_and_loads_at_another_tp(tmp_path: Path) -> None:
    model = writing_table_model()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    ids = table_ids()  # made before the ranks exist, the same on every rank
    out = model(ids)
    plan = tpplan.infer_plan(model, tp_size=2)
    with simulated_ranks(2) as mesh:
        sharded = tpplan.apply_plan(copy.deepcopy(model), mesh, plan)
        assert all(torch.equal(full_state_dict(sharded)[k], v) for k, v in want.items())
        save_checkpoint(sharded, tmp_path / "ckpt", sharded=False)
    other = TableModel(special=True, norm=False)  # other weights, loaded over at tp 4
    with simulated_ranks(4) as mesh:
        tpplan.apply_plan(other, mesh, tpplan.infer_plan(other, tp_size=4))
        load_checkpoint(other, tmp_path / "ckpt", rebuild_buffers=False)  # built off meta
        for got in rank_values(other(ids)):
            assert (got - out).abs().max().item() <= 1e-5


def test_a_written_parameter_used_elsewhere_is_kept_whole() -> None:
    """A parameter the table also uses otherwise cannot be split; the rows are summed before
    the write instead."""

    class Reused(Table):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return super().forward(input) + self.special.sum()  # type: ignore[union-attr]

    model = writing_table_model()
    model.embed.__class__ = Reused
    plan = tpplan.infer_plan(model, tp_size=2)
    rule = rule_for(plan, model, "embed")
    assert (rule.style, rule.sum_at, rule.written) == ("vocab_parallel", "lookup", None)
    assert_parity(model, plan, 2, table_ids())


def test_check_asks_for_written_where_a_parameter_is_written_over_rows() -> None:
    model = writing_table_model()
    plan = _forced(tpplan.infer_plan(model, tp_size=2), written=None)
    (problem,) = tpplan.check_plan(plan, model, tp_size=2)
    assert problem.kind == "lookup" and problem.module == "embed"
    assert "writes special over some of the looked-up rows" in problem.message
    assert "count it once per rank" in problem.message
    assert problem.fix == "add `written: [special]` to the rule (or `sum_at: lookup`)."


@pytest.mark.parametrize(
    ("table", "written", "kind", "said", "fix"),
    [
        ({"norm": False}, ["special"], "lookup", "writes no parameter", "drop written"),
        ({"special": True}, ["special"], "lookup", "not linear in them", "replace written"),
        ({"special": True, "norm": False}, ["scale"], "module_type", "names scale", "name the"),
        ({"special": True, "norm": False, "own_lookup": True}, ["special"], "lookup",
         "embedding of its own", "keep it whole"),
    ],
    ids=["nothing_written", "rows_normed", "not_a_parameter", "own_lookup"],
)  # fmt: skip
def test_a_wrong_written_is_named(
    table: dict[str, bool], written: list[str], kind: str, said: str, fix: str
) -> None:
    torch.manual_seed(0)
    model = TableModel(**table)
    plan = _forced(tpplan.infer_plan(model, tp_size=2), sum_at=None, written=written)
    (problem,) = [p for p in tpplan.check_plan(plan, model, tp_size=2) if p.kind == kind]
    assert problem.module == "embed"
    assert said in problem.message and problem.fix.startswith(fix)


def test_sequence_parallel_scatters_a_table_with_written() -> None:
    """Its one sum becomes a reduce-scatter onto sequence shards, writes and all."""
    model = writing_table_model()
    plan = tpplan.infer_plan(model, tp_size=2, sequence_parallel=True, example_inputs=table_ids())
    rule = rule_for(plan, model, "embed")
    assert (rule.written, rule.output, rule.local_output) == (["special"], "shard(1)", False)
    assert_parity(model, plan, 2, table_ids())


def test_written_needs_schema_version_7() -> None:
    rule = "{match: embed, style: vocab_parallel, why: w, written: [special]}"
    with pytest.raises(ValueError, match="written need schema version 7"):
        Plan.from_yaml(f"tpplan: 6\nrules:\n  - {rule}\n")
    assert Plan.from_yaml(f"tpplan: 7\nrules:\n  - {rule}\n").rules[0].written == ["special"]
