"""Every message a bad plan file gets, word for word: one tiny invalid input per case.

Each message says what was given, what is allowed and the fix, with the YAML line where the
problem is. Only the plan stage runs here (no torch): the whole file answers in a blink.
"""

from __future__ import annotations

import pytest

from tpplan import Plan, PlanFileError

pytestmark = pytest.mark.unit

STYLES = (
    "Styles: colwise, rowwise, vocab_parallel, sequence_parallel, prepare, replicate, "
    "replicate_grad_sum, experts, split_params, heads."
)
LAYOUTS = (
    "layouts are replicate, partial, or shard(DIM) with DIM an integer such as shard(-1) or "
    "shard(1)."
)
READS = "it reads versions 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18"


def _error(text: str) -> str:
    with pytest.raises(PlanFileError) as e:
        Plan.from_yaml(text, source="p.yaml")
    return str(e.value)


def _rule(fields: str, *, version: int = 7) -> str:
    """A plan of one rule on line 3, written in flow style: `{match: a, why: x, FIELDS}`."""
    return f"tpplan: {version}\nrules:\n  - {{match: a, why: x, {fields}}}\n"


def _case(fields: str, message: str, *, version: int = 7) -> object:
    return pytest.param(_rule(fields, version=version), message, id=fields)


def _check(text: str, message: str) -> None:
    assert _error(text) == f"p.yaml: {message}"


# ---- styles -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "message"),
    [
        _case(
            "style: colwsie",
            f"line 3: rules[0].style: 'colwsie' is not a style. Did you mean 'colwise'? {STYLES}",
        ),
        _case(
            "style: Colwise",
            f"line 3: rules[0].style: 'Colwise' is not a style. Did you mean 'colwise'? {STYLES}",
        ),
        _case(
            "style: rowise",
            f"line 3: rules[0].style: 'rowise' is not a style. Did you mean 'rowwise'? {STYLES}",
        ),
        _case("style: banana", f"line 3: rules[0].style: 'banana' is not a style. {STYLES}"),
        _case(
            "style: 3",
            "line 3: rules[0].style: Input should be 'colwise', 'rowwise', 'vocab_parallel', "
            "'sequence_parallel', 'prepare', 'replicate', 'replicate_grad_sum', 'experts', "
            "'split_params' or 'heads' (got 3).",
        ),
    ],
)
def test_an_unknown_style(text: str, message: str) -> None:
    _check(text, message)


# ---- layouts ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "message"),
    [
        _case(
            "style: colwise, output: shard(last)",
            f"line 3: rules[0].output: 'shard(last)' is not a layout; {LAYOUTS}",
        ),
        _case(
            "style: colwise, input: Shard(1)",
            f"line 3: rules[0].input: 'Shard(1)' is not a layout; {LAYOUTS}",
        ),
        _case(
            "style: rowwise, input: shard()",
            f"line 3: rules[0].input: 'shard()' is not a layout; {LAYOUTS}",
        ),
        _case(
            "style: rowwise, output: 'replicate '",
            f"line 3: rules[0].output: 'replicate ' is not a layout; {LAYOUTS}",
        ),
        _case(
            "style: colwise, input: 3",
            "line 3: rules[0].input: Input should be a valid string (got 3).",
        ),
        _case(
            "style: prepare, inputs: [bad, null], desired_inputs: [replicate, null]",
            f"line 3: rules[0].inputs: 'bad' is not a layout; {LAYOUTS}",
        ),
        _case(
            "style: prepare, outputs: [replicate], desired_outputs: [shard(x)]",
            f"line 3: rules[0].desired_outputs: 'shard(x)' is not a layout; {LAYOUTS}",
        ),
        _case(
            "style: prepare, input_kwargs: {m: replicate}, desired_input_kwargs: {m: shard()}",
            f"line 3: rules[0].desired_input_kwargs: 'shard()' is not a layout; {LAYOUTS}",
        ),
        _case(
            "style: sequence_parallel, input: replicate",
            "line 3: rules[0]: sequence_parallel needs input shard(DIM) naming the sequence "
            "dim, not 'replicate'.",
        ),
        _case(
            "style: colwise, output: partial",
            "line 3: rules[0]: style 'colwise' cannot take or give layout 'partial'; use "
            "replicate or shard(DIM).",
        ),
        _case(
            "style: colwise, input: partial",
            "line 3: rules[0]: style 'colwise' cannot take or give layout 'partial'; use "
            "replicate or shard(DIM).",
        ),
    ],
)
def test_a_bad_layout(text: str, message: str) -> None:
    _check(text, message)


# ---- fields a style does not take ---------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "message"),
    [
        _case(
            "style: replicate, head_dim: 8",
            "line 3: rules[0]: style 'replicate' takes no head_dim; its optional fields are: none.",
        ),
        _case(
            "style: replicate_grad_sum, output: replicate, input: replicate",
            "line 3: rules[0]: style 'replicate_grad_sum' takes no input, output; its optional "
            "fields are: none.",
        ),
        _case(
            "style: colwise, shard: {w: 0}",
            "line 3: rules[0]: style 'colwise' takes no shard; its optional fields are: "
            "group, head_dim, input, local_output, output, parts, replicate_heads, transposed, "
            "uneven.",
        ),
        _case(
            "style: rowwise, head_dim: 8, replicate_heads: true",
            "line 3: rules[0]: style 'rowwise' takes no replicate_heads; its optional fields "
            "are: group, head_dim, input, local_output, output, parts, transposed, uneven.",
            version=11,
        ),
        _case(
            "style: colwise, replicate_heads: true, output: replicate",
            "line 3: rules[0]: colwise with replicate_heads (whole key/value heads shared among "
            "ranks) takes no transposed or output.",
            version=12,
        ),
        _case(
            # version 12 reads the head_dim left out from the model (check/complete.py)
            "style: colwise, replicate_heads: true",
            "line 1: plan: rules[0].replicate_heads without head_dim need schema version 12; "
            "change the first line to 'tpplan: 12'.",
            version=11,
        ),
        _case(
            "style: colwise, head_dim: 8, replicate_heads: true",
            "line 1: plan: rules[0].replicate_heads need schema version 11; change the first "
            "line to 'tpplan: 11'.",
            version=10,
        ),
        _case(
            "style: colwise, output: replicate, uneven: true",
            "line 1: plan: rules[0].uneven need schema version 14; change the "
            "first line to 'tpplan: 14'.",
            version=13,
        ),
        _case(
            "style: colwise, head_dim: 8, replicate_heads: true, parts: [64, 8, 8]",
            "line 1: plan: rules[0].replicate_heads with parts need schema version 15; "
            "change the first line to 'tpplan: 15'.",
            version=14,
        ),
        _case(
            "style: colwise, parts: [64, 32, 32], local_output: false",
            "line 1: plan: rules[0].local_output: false with parts of unequal sizes need schema "
            "version 16; change the first line to 'tpplan: 16'.",
            version=15,
        ),
        _case(
            "style: colwise, head_dim: 8, uneven: true",
            "line 1: plan: rules[0].uneven with head_dim (heads split unevenly) need schema "
            "version 17; change the first line to 'tpplan: 17'.",
            version=16,
        ),
        _case(
            "style: rowwise, head_dim: 8, uneven: true, group: 7",
            "line 1: plan: rules[0].uneven, rules[0].group need schema version 17; change the "
            "first line to 'tpplan: 17'.",
            version=16,
        ),
        _case(
            "style: rowwise, parts: [8, 8]",
            "line 1: plan: rules[0].parts (style rowwise) need schema version 9; change the "
            "first line to 'tpplan: 9'.",
            version=8,
        ),
        _case(
            "style: rowwise, sum_at: lookup",
            "line 3: rules[0]: style 'rowwise' takes no sum_at; its optional fields are: "
            "group, head_dim, input, local_output, output, parts, transposed, uneven.",
        ),
        _case(
            "style: vocab_parallel, head_dim: 8",
            "line 3: rules[0]: style 'vocab_parallel' takes no head_dim; its optional fields "
            "are: input, local_output, output, sum_at, uneven, written.",
        ),
        _case(
            "style: sequence_parallel, output: replicate",
            "line 3: rules[0]: style 'sequence_parallel' takes no output; its optional fields "
            "are: input, local_output.",
        ),
        _case(
            "style: prepare, input: replicate",
            "line 3: rules[0]: style 'prepare' takes no input; its optional fields are: "
            "desired_input_kwargs, desired_inputs, desired_outputs, input_kwargs, inputs, "
            "local_input, local_output, outputs.",
        ),
        _case(
            "style: experts, shard: {w: 0}, output: replicate",
            "line 3: rules[0]: style 'experts' takes no output; its optional fields are: "
            "added_whole, after_sum, fused, mode, shard.",
        ),
        _case(
            "style: split_params, shard: {s: 0}, mode: tensor",
            "line 3: rules[0]: style 'split_params' takes no mode; its optional fields are: fused, shard.",
        ),
        _case(
            # null is a value given: a field named at all must be one the style takes
            "style: replicate, input: null",
            "line 3: rules[0]: style 'replicate' takes no input; its optional fields are: none.",
        ),
    ],
)
def test_a_field_the_style_does_not_take(text: str, message: str) -> None:
    _check(text, message)


# ---- what each style needs ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "message"),
    [
        _case(
            "style: prepare, inputs: [shard(1)]",
            "line 3: rules[0]: prepare needs both inputs and desired_inputs (as they arrive, as "
            "wanted); only inputs is given.",
        ),
        _case(
            "style: prepare, desired_outputs: [replicate]",
            "line 3: rules[0]: prepare needs both outputs and desired_outputs (as they arrive, "
            "as wanted); only desired_outputs is given.",
        ),
        _case(
            "style: prepare, inputs: [shard(1)], desired_inputs: [replicate, replicate]",
            "line 3: rules[0]: prepare: inputs and desired_inputs must name the same inputs.",
        ),
        _case(
            "style: prepare, input_kwargs: {a: replicate}, desired_input_kwargs: {b: replicate}",
            "line 3: rules[0]: prepare: input_kwargs and desired_input_kwargs must name the same "
            "inputs.",
        ),
        _case(
            "style: prepare, local_input: true",
            "line 3: rules[0]: prepare needs at least one pair of layouts: inputs/desired_inputs, "
            "input_kwargs/desired_input_kwargs or outputs/desired_outputs.",
        ),
        _case(
            "style: experts",
            "line 3: rules[0]: experts needs shard: {parameter: dim} naming the expert weights "
            "it splits (e.g. {gate_up_proj: 1, down_proj: 2} for mode tensor, dim 0 for mode "
            "expert).",
        ),
        _case(
            "style: experts, shard: {w: 1}, fused: {v: [4, 4]}",
            "line 3: rules[0]: experts: fused names v, which is not in shard; fused pieces are "
            "cut along a split dim.",
        ),
        _case(
            "style: experts, shard: {w: 1}, after_sum: [w]",
            "line 3: rules[0]: experts: after_sum names w, which is also in shard; a parameter "
            "added after the sum is whole on every rank.",
        ),
        _case(
            "style: experts, mode: expert, shard: {w: 1}",
            "line 3: rules[0]: experts with mode expert splits every expert weight on dim 0 "
            "(the experts) and takes no fused, after_sum or added_whole; use shard: {name: 0} "
            "for each.",
        ),
        _case(
            "style: experts, mode: expert, shard: {w: 0}, added_whole: [s]",
            "line 3: rules[0]: experts with mode expert splits every expert weight on dim 0 "
            "(the experts) and takes no fused, after_sum or added_whole; use shard: {name: 0} "
            "for each.",
        ),
        _case(
            "style: experts, mode: bogus, shard: {w: 0}",
            "line 3: rules[0].mode: Input should be 'tensor' or 'expert' (got 'bogus').",
        ),
        _case(
            "style: experts, shard: {w: -1}",
            "line 3: rules[0].shard.w: Input should be greater than or equal to 0 (got -1).",
        ),
        _case(
            "style: split_params, shard: {}",
            "line 3: rules[0]: split_params needs shard: {parameter: dim} naming the module's "
            "own parameters it splits (e.g. {sinks: 0}).",
        ),
        _case(
            "style: vocab_parallel, sum_at: lookup, input: shard(0)",
            "line 3: rules[0]: vocab_parallel with sum_at: lookup takes the token ids as they "
            "are and sums the rows inside the module's forward, so its input and output are "
            "whole, plain tensors; drop input, output and local_output, or drop sum_at.",
        ),
        _case(
            "style: vocab_parallel, sum_at: lookup, local_output: false",
            "line 3: rules[0]: vocab_parallel with sum_at: lookup takes the token ids as they "
            "are and sums the rows inside the module's forward, so its input and output are "
            "whole, plain tensors; drop input, output and local_output, or drop sum_at.",
        ),
        _case(
            "style: vocab_parallel, sum_at: output",
            "line 3: rules[0].sum_at: Input should be 'lookup' (got 'output').",
        ),
        _case(
            "style: vocab_parallel, written: [e], output: partial",
            "line 3: rules[0]: vocab_parallel with written takes the token ids as they are and "
            "sums the rows as its forward returns (output replicate or shard(DIM)); drop "
            "sum_at, input and output partial, or drop written.",
        ),
        _case(
            "style: vocab_parallel, written: []",
            "line 3: rules[0].written: List should have at least 1 item after validation, not 0 "
            "(got []).",
        ),
        _case(
            "style: vocab_parallel, written: ['']",
            "line 3: rules[0].written[0]: String should have at least 1 character (got '').",
        ),
        _case(
            "style: colwise, parts: [8]",
            "line 3: rules[0].parts: List should have at least 2 items after validation, not 1 "
            "(got [8]).",
        ),
        _case(
            "style: colwise, parts: [8, 0]",
            "line 3: rules[0].parts[1]: Input should be greater than 0 (got 0).",
        ),
        _case(
            "style: colwise, head_dim: 0",
            "line 3: rules[0].head_dim: Input should be greater than 0 (got 0).",
        ),
        _case(
            "style: colwise, head_dim: x",
            "line 3: rules[0].head_dim: Input should be a valid integer, unable to parse string "
            "as an integer (got 'x').",
        ),
        _case(
            "style: colwise, local_output: maybe",
            "line 3: rules[0].local_output: Input should be a valid boolean, unable to interpret "
            "input (got 'maybe').",
        ),
    ],
)
def test_what_a_style_needs(text: str, message: str) -> None:
    _check(text, message)


# ---- schema versions ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param(
            "tpplan: 19\nrules: []\n",
            f"schema version 19 is not one this tpplan reads ({READS}). Upgrade tpplan (pip "
            "install -U tpplan) if the file is newer, or regenerate it with `tpplan infer`.",
            id="newer",
        ),
        pytest.param(
            "tpplan: 0\n",
            f"schema version 0 is not one this tpplan reads ({READS}). Upgrade tpplan (pip "
            "install -U tpplan) if the file is newer, or regenerate it with `tpplan infer`.",
            id="zero",
        ),
        pytest.param(
            "tpplan: '1'\n",
            f"schema version '1' is not one this tpplan reads ({READS}). Upgrade tpplan (pip "
            "install -U tpplan) if the file is newer, or regenerate it with `tpplan infer`.",
            id="a string",
        ),
        pytest.param(
            "rules: []\n",
            "not a tpplan plan: the top-level key 'tpplan: 18' (the schema version) is missing.",
            id="missing",
        ),
        _case(
            "style: colwise, parts: [8, 4]",
            "line 1: plan: rules[0].parts need schema version 2; change the first line to "
            "'tpplan: 2'.",
            version=1,
        ),
        _case(
            "style: colwise, transposed: true",
            "line 1: plan: rules[0].transposed need schema version 2; change the first line to "
            "'tpplan: 2'.",
            version=1,
        ),
        _case(
            "style: experts, shard: {w: 0}",
            "line 1: plan: rules[0].shard, rules[0].style experts need schema version 3; change "
            "the first line to 'tpplan: 3'.",
            version=2,
        ),
        _case(
            "style: split_params, shard: {w: 0}",
            "line 1: plan: rules[0].style split_params need schema version 4; change the first "
            "line to 'tpplan: 4'.",
            version=3,
        ),
        _case(
            "style: experts, shard: {w: 0}, added_whole: [s]",
            "line 1: plan: rules[0].added_whole need schema version 5; change the first line to "
            "'tpplan: 5'.",
            version=4,
        ),
        _case(
            "style: vocab_parallel, sum_at: lookup",
            "line 1: plan: rules[0].sum_at need schema version 6; change the first line to "
            "'tpplan: 6'.",
            version=5,
        ),
        _case(
            "style: vocab_parallel, written: [e]",
            "line 1: plan: rules[0].written need schema version 7; change the first line to "
            "'tpplan: 7'.",
            version=6,
        ),
        pytest.param(
            "tpplan: 3\nmodel: {class: X, command: tpplan infer x}\n",
            "line 1: plan: model.command need schema version 4; change the first line to "
            "'tpplan: 4'.",
            id="model.command",
        ),
        pytest.param(
            # the newest version any field needs is named, with every field that needs it
            "tpplan: 1\nrules:\n  - {match: a, style: colwise, parts: [4, 4], why: x}\n"
            "  - {match: b, style: experts, shard: {w: 0}, fused: {w: [2, 2]}, why: x}\n",
            "line 1: plan: rules[1].shard, rules[1].fused, rules[1].style experts need schema "
            "version 3; change the first line to 'tpplan: 3'.",
            id="the newest needed",
        ),
    ],
)
def test_a_schema_version(text: str, message: str) -> None:
    _check(text, message)


# ---- the plan's shape ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param(
            "- a\n- b\n",
            "a plan is a mapping with keys tpplan, model, options, rules; got list.",
            id="a list",
        ),
        pytest.param(
            "",
            "a plan is a mapping with keys tpplan, model, options, rules; got NoneType.",
            id="empty",
        ),
        pytest.param(
            "tpplan: 7\nrulez: []\n",
            "line 2: unknown field 'rulez' in plan; remove it or check its spelling.",
            id="unknown top-level field",
        ),
        pytest.param(
            "tpplan: 7\nmodel: {}\n",
            "line 2: model is missing the required field 'class'.",
            id="model without class",
        ),
        pytest.param(
            "tpplan: 7\nmodel: {class: X, bogus: 1}\n",
            "line 2: unknown field 'bogus' in model; remove it or check its spelling.",
            id="unknown model field",
        ),
        pytest.param(
            "tpplan: 7\nmodel: {class: X, fingerprint: 3}\n",
            "line 2: model.fingerprint: Input should be a valid string (got 3).",
            id="a number for a string",
        ),
        pytest.param(
            "tpplan: 7\noptions: {loss_parallel: maybe}\n",
            "line 2: options.loss_parallel: Input should be a valid boolean, unable to interpret "
            "input (got 'maybe').",
            id="an option not a boolean",
        ),
        pytest.param(
            "tpplan: 7\noptions: {tensor_parallel: true}\n",
            "line 2: unknown field 'tensor_parallel' in options; remove it or check its spelling.",
            id="unknown option",
        ),
        pytest.param(
            "tpplan: 7\nrules: {a: colwise}\n",
            "line 2: rules: Input should be a valid list (got {'a': 'colwise'}).",
            id="rules not a list",
        ),
        pytest.param(
            "tpplan: 7\nrules:\n  - colwise\n",
            "line 3: rules[0]: Input should be a valid dictionary or instance of Rule (got "
            "'colwise').",
            id="a rule not a mapping",
        ),
        pytest.param(
            "tpplan: 7\nrules:\n  - {style: colwise, why: x}\n",
            "line 3: rules[0] is missing the required field 'match'.",
            id="rule without match",
        ),
        pytest.param(
            "tpplan: 7\nrules:\n  - {match: a, why: x}\n",
            "line 3: rules[0] is missing the required field 'style'.",
            id="rule without style",
        ),
        pytest.param(
            "tpplan: 7\nrules:\n  - {match: a, style: colwise}\n",
            "line 3: rules[0] is missing the required field 'why'. Every rule says why it "
            "exists, in words a reviewer can check.",
            id="rule without why",
        ),
        pytest.param(
            "tpplan: 7\nrules:\n  - {match: '', style: colwise, why: x}\n",
            "line 3: rules[0].match: String should have at least 1 character (got '').",
            id="empty match",
        ),
        pytest.param(
            "tpplan: 7\nrules:\n  - {match: a, style: colwise, why: ''}\n",
            "line 3: rules[0].why: String should have at least 1 character (got '').",
            id="empty why",
        ),
        pytest.param(
            "tpplan: 7\nattributes:\n  - {match: a, divide: [], why: x}\n",
            "line 3: attributes[0].divide: List should have at least 1 item after validation, "
            "not 0 (got []).",
            id="attributes dividing nothing",
        ),
        pytest.param(
            "tpplan: 7\nattributes:\n  - {match: a, divide: [n]}\n",
            "line 3: attributes[0] is missing the required field 'why'. Every rule says why it "
            "exists, in words a reviewer can check.",
            id="attributes without why",
        ),
        pytest.param(
            "tpplan: 11\nattributes:\n  - {match: a, divide: [n], by: replicas, why: x}\n",
            "line 3: attributes[0]: attributes: by replicas needs of; by replicas or shards "
            "names the layer whose heads are shared (of: k_proj).",
            id="attributes by replicas without of",
        ),
        pytest.param(
            "tpplan: 10\nattributes:\n  - {match: a, divide: [n], by: shards, of: k, why: x}\n",
            "line 1: plan: attributes[0].by, attributes[0].of need schema version 11; change "
            "the first line to 'tpplan: 11'.",
            id="attributes by shards in an older file",
        ),
        pytest.param(
            "tpplan: 16\nattributes:\n  - {match: a, divide: [n], uneven: q_proj, why: x}\n",
            "line 1: plan: attributes[0].uneven need schema version 17; change the first line "
            "to 'tpplan: 17'.",
            id="attributes of uneven heads in an older file",
        ),
        pytest.param(
            "tpplan: 17\nrules:\n  - {match: a, style: colwise, group: 7, why: x}\n",
            "line 3: rules[0]: colwise takes group with uneven heads only (uneven: true and "
            "head_dim); drop group, or add them.",
            id="a group without uneven heads",
        ),
        pytest.param(
            "tpplan: 17\nrules:\n  - {match: a, style: rowwise, uneven: true, why: x}\n",
            "line 3: rules[0]: rowwise with uneven takes heads tp does not divide, so it needs "
            "their head_dim; add head_dim to the rule.",
            id="uneven rowwise without head_dim",
        ),
        pytest.param(
            "tpplan: 17\nrules:\n  - {match: a, style: colwise, uneven: true, head_dim: 8, "
            "local_output: false, why: x}\n",
            "line 3: rules[0]: colwise with uneven heads computes whole heads of its own rows on "
            "local shards, so it takes no input or output layouts, replicate_heads or "
            "local_output: false (nor parts, rowwise); drop them, or uneven.",
            id="uneven heads handing DTensors on",
        ),
        pytest.param(
            "tpplan: 17\nrules:\n  - {match: a, style: rowwise, uneven: true, head_dim: 8, "
            "parts: [8, 8], why: x}\n",
            "line 3: rules[0]: rowwise with uneven heads computes whole heads of its own rows on "
            "local shards, so it takes no input or output layouts, replicate_heads or "
            "local_output: false (nor parts, rowwise); drop them, or uneven.",
            id="uneven rowwise heads with parts",
        ),
        pytest.param(
            "tpplan: 17\nrules:\n  - {match: a, style: colwise, replicate_heads: true, "
            "head_dim: 8, local_output: false, why: x}\n",
            "line 1: plan: rules[0].replicate_heads with local_output: false need schema "
            "version 18; change the first line to 'tpplan: 18'.",
            id="shared heads handed to a region in an older file",
        ),
    ],
)
def test_the_shape_of_a_plan(text: str, message: str) -> None:
    _check(text, message)


def test_every_problem_is_one_line_with_its_own_line_number() -> None:
    text = (
        "tpplan: 7\nrules:\n- match: a\n  style: colwise\n"
        "- match: b\n  style: rowwise\n  why: x\n  bogus: 3\n"
    )
    assert _error(text) == (
        "p.yaml has 2 problems:\n"
        "  - line 3: rules[0] is missing the required field 'why'. Every rule says why it "
        "exists, in words a reviewer can check.\n"
        "  - line 8: unknown field 'bogus' in rules[1]; remove it or check its spelling."
    )


def test_a_problem_deep_in_a_block_names_the_line_of_its_key() -> None:
    text = "tpplan: 7\nrules:\n- match: a\n  why: x\n  style: colwise\n  output: shard(q)\n"
    assert _error(text) == f"p.yaml: line 6: rules[0].output: 'shard(q)' is not a layout; {LAYOUTS}"


def test_json_messages_have_no_line_numbers() -> None:
    with pytest.raises(PlanFileError) as e:
        Plan.from_json('{"tpplan": 7, "rules": [{"match": "a", "style": "colwise"}]}', source="p")
    assert str(e.value) == (
        "p: rules[0] is missing the required field 'why'. Every rule says why it exists, in "
        "words a reviewer can check."
    )


def test_the_error_keeps_its_source_and_issues() -> None:
    with pytest.raises(PlanFileError) as e:
        Plan.from_yaml("tpplan: 7\nrulez: []\nmodell: {}\n", source="p.yaml")
    assert e.value.source == "p.yaml"
    assert [i.split(":")[0] for i in e.value.issues] == ["line 2", "line 3"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tpplan: 1\nrules:\n  - match: [a\n", "line 4, column 1: malformed YAML: "),
        ("tpplan: 1\n\trules: []\n", "line 2, column 1: malformed YAML: "),
        ("a: b: c\n", "line 1, column 5: malformed YAML: "),
    ],
)
def test_malformed_yaml_names_line_and_column(text: str, message: str) -> None:
    assert _error(text).startswith(f"p.yaml: {message}")
