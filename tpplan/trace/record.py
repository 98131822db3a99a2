"""`Trace`, what one traced forward showed: a record of records, one per concern.

Start at `Trace`. Each record below is written by one tracker of the tracer (named in its
docstring) and read by infer/ and check/; nothing here decides a style. Names are full module
or parameter names of the model ("" is the model itself).

Words used throughout the tracer:
- opener: a Linear called on an unsplit input; its output features get a `Split`.
- closer: a Linear whose input arrives split on the dim it contracts (row-parallel).
- span: openers and closers that exchanged split tensors; it is sharded as one. (A region
  is something else: a module whose forward runs on DTensors, the plan's `regions`.)
- whole: the same full value on every rank (neither split nor a partial sum).
- table: an Embedding module (its weight is the lookup table; its rows are looked up).
- vector: a 1-D parameter (a bias, a norm's weight, a per-head attention sink).
- twin: a traced block of the same structure as an earlier traced one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from .counted import Expr
from .split import Split

__all__ = [
    "ExpertFacts",
    "LayerFacts",
    "LookupFacts",
    "ParamFacts",
    "ReadFacts",
    "SpanFacts",
    "StackFacts",
    "Trace",
]

# (module, attribute, value) of an integer attribute a forward read
AttributeRead = tuple[str, str, int]
# A view's count written as a sum: ((attribute read, its factor), ...), the constant, and the
# features one counted unit spans.
ViewSum = tuple[tuple[tuple[AttributeRead, int], ...], int, int]
ChannelUse = Literal["norm", "batch", "depthwise", "grouped"]
"""What meets split channels one group (or one channel) at a time: a GroupNorm, a BatchNorm
(one channel at a time), a depthwise convolution (one group per input channel), a grouped
one (several channels per group)."""


@dataclass
class LayerFacts:
    """Which modules ran, and which of them are linear layers (hooks.py, run.py)."""

    called: set[str] = field(default_factory=set)
    """Linear and Embedding modules (and linear-like ones) that ran."""
    ran: set[str] = field(default_factory=set)
    """Every module whose forward ran (the model itself is "")."""
    whole: dict[str, str] = field(default_factory=dict)
    """Module run whole on real tensors (its forward does not run on fake ones; whole.py)
    -> why its layers stay whole."""
    linears: dict[str, tuple[int, int, bool]] = field(default_factory=dict)
    """Linear or linear-like module -> (in features, out features, weight stored (in, out))."""
    channels: set[str] = field(default_factory=set)
    """Those of `linears` whose features sit on dim 1, not the last: convolutions of
    one group (`channel_conv`), whose channels are their features."""
    entries: dict[str, tuple[int | str, int]] = field(default_factory=dict)
    """Module -> (positional index or keyword, id) of the first tensor its first call got."""
    attention: dict[str, int] = field(default_factory=dict)
    """nn.MultiheadAttention running torch's own forward, called as one step (hooks.py's
    `hook_attention`) -> its number of heads."""
    positional: dict[str, int] = field(default_factory=dict)
    """Module -> how many positional arguments its first call got (a module-input rule
    lists a layout for each)."""


@dataclass
class SpanFacts:
    """Where each opener's split went and where it ended (the `DenseSplits` tracker)."""

    openers: dict[str, int] = field(default_factory=dict)
    """Linear called on an unsplit input -> its out_features (its output got a Split)."""
    closers: dict[str, Split] = field(default_factory=dict)
    """Linear whose input arrived split on its contracted dim -> that Split."""
    misfits: dict[str, str] = field(default_factory=dict)
    """Linear that cannot take a role (called both ways, or split along another dim) -> why."""
    parts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Opener whose output features are cut into pieces (fused q|k|v, gate|up) -> their sizes."""
    heads: dict[str, int] = field(default_factory=dict)
    """Opener -> number of heads of the first view that split its features into heads."""
    units: dict[str, int] = field(default_factory=dict)
    """Opener -> gcd of every split size its features met; tp must divide it."""
    groups: dict[str, int] = field(default_factory=dict)
    """Opener whose channels a GroupNorm normalized in groups -> how many of its groups the
    split features hold (each rank must hold whole groups)."""
    piece_units: dict[tuple[str, int, int], int] = field(default_factory=dict)
    """(opener, offset, size) of one fused piece -> the gcd of the split sizes the tensors
    holding that piece met (also in `units`): tp must divide the query pieces' own."""
    plain_units: dict[str, set[int]] = field(default_factory=dict)
    """Opener -> the split sizes its tensors met that held no one piece (also in `units`):
    all its features (the output as it came) or its query heads after attention."""
    summed_units: dict[str, set[int]] = field(default_factory=dict)
    """Opener -> the heads its views counted as sums held (`view(B, T, self.n_head + 2, D)`
    of every fused piece side by side; also in `units`)."""
    kv_parts: dict[str, frozenset[tuple[int, int]]] = field(default_factory=dict)
    """Fused opener whose own pieces met as grouped-query attention (q|k|v of unequal
    pieces in one Linear) -> the (offset, size) of the pieces that were its keys and values;
    its `kv_heads` counts their heads, its `query_heads` those of the other pieces."""
    kv_heads: dict[str, int] = field(default_factory=dict)
    """Opener whose heads reached grouped-query attention as its keys or values -> their
    number K, fewer than the query heads H: attention pairs query head i with key/value head
    i // (H/K) (consecutive groups), so at a tp that is a multiple of K each rank's query
    heads meet one key/value head, which tp/K ranks can share (`replicate_heads`)."""
    query_heads: dict[str, tuple[int, frozenset[str]]] = field(default_factory=dict)
    """Opener whose heads reached grouped-query attention as its queries -> (H, the openers
    of its keys and values)."""
    repeats: dict[str, tuple[int, AttributeRead | None]] = field(default_factory=dict)
    """Key/value opener whose heads were repeated side by side to meet the query heads ->
    (times, the attribute holding that count, or None where none does or none is needed).
    Where tp/K ranks share a head, each rank repeats its one head by (H/K)/(tp/K): the
    attribute is divided by the ranks sharing it."""
    repeat_formulas: dict[str, Expr] = field(default_factory=dict)
    """Key/value opener repeated by a count the code computed from attributes (`self.n_head
    // self.n_kv`) rather than read from one -> that formula (counted.py): no attribute
    holds the count, and infer checks that the formula, with the counts the plan divides,
    gives each rank its repeat."""
    unshared: dict[str, str] = field(default_factory=dict)
    """Key/value opener whose heads cannot be shared among ranks -> why."""
    links: set[frozenset[str]] = field(default_factory=set)
    """Groups of openers/closers that exchanged split tensors: one span each."""
    broken: dict[str, list[str]] = field(default_factory=dict)
    """Opener -> why its split could not be followed to a closer."""
    ops: dict[str, set[str]] = field(default_factory=dict)
    """Opener -> the ops its split passed through (evidence for `why`)."""
    at_output: set[str] = field(default_factory=set)
    """Openers whose split reaches the model's output."""

    def break_(self, sources: frozenset[str], reason: str) -> None:
        """The split of these openers ends here, for this reason (each reason kept once)."""
        for s in sources:
            reasons = self.broken.setdefault(s, [])
            if reason not in reasons:
                reasons.append(reason)


@dataclass
class ParamFacts:
    """How parameters met tensors outside any Linear/Embedding call (the `Origins` and
    `Vectors` trackers): a parameter used so keeps its gradient right only where the plan
    shards it like the tensors it meets."""

    in_span: dict[str, set[str]] = field(default_factory=dict)
    """Parameter -> openers whose split tensors it was combined with (outside any Linear)."""
    outside: set[str] = field(default_factory=set)
    """Parameters used by ops on unsplit tensors only (outside any Linear/Embedding call)."""
    whole_vectors: set[str] = field(default_factory=set)
    """Vectors also met whole by split tensors (broadcast along the split dim)."""
    split_vectors: dict[str, set[str]] = field(default_factory=dict)
    """Vector met element by element with split tensors, one entry per element of the split
    dim (a per-head attention sink) -> the openers of those splits: it can be split alike,
    each rank holding its own entries."""
    channel_vectors: dict[str, ChannelUse] = field(default_factory=dict)
    """Those of `split_vectors` that split channels meet one entry (or kernel) per channel
    -> what uses them: a GroupNorm (its weight and bias, "norm"), a BatchNorm (its weight,
    bias and running statistics, buffers, "batch"), a depthwise or grouped convolution (its
    kernels and bias, "depthwise", "grouped")."""
    vector_dims: dict[str, int] = field(default_factory=dict)
    """Split vector -> the dim of the parameter holding its entries (0 for a vector; 1 for
    a table of one column per head that the forward looks rows up in, Swin's relative
    position bias)."""


@dataclass
class ReadFacts:
    """Integer attributes the forward read, and what they sized (the `AttributeReads`
    tracker): the plan divides the ones that size a split dim, and no other."""

    counts: dict[str, set[AttributeRead]] = field(default_factory=dict)
    """Opener -> (module, attribute, value) of head counts (and fused cut sizes) its views
    read from attributes."""
    width_cuts: dict[tuple[str, int, int], tuple[Expr, int, int, int]] = field(default_factory=dict)
    """(opener, offset, size) of a fused piece a cut sized by a formula of the width read off
    the tensor it cuts (`qkv.shape[-1] // (self.groups + 2)`) -> (the formula, that width,
    the offset and size of the opener's features the cut tensor held)."""
    piece_counts: dict[tuple[str, int, int], set[AttributeRead]] = field(default_factory=dict)
    """(opener, offset, size) of one fused piece -> those of its counts that sized that
    piece: a view of it, or the size it was cut at (also in `counts`)."""
    groups: dict[tuple[str, str], ChannelUse] = field(default_factory=dict)
    """(module, attribute) of those counts that are groups of split channels -> what counts
    them: a GroupNorm's groups ("norm"), a depthwise convolution's, one per channel
    ("depthwise"), a grouped convolution's ("grouped")."""
    unsplit_sizes: set[tuple[str, str]] = field(default_factory=set)
    """(module, attribute) read to size an op on unsplit tensors: never to be divided."""
    ints: set[tuple[str, str]] = field(default_factory=set)
    """(module, attribute) of every integer attribute a module's forward read."""
    beside_sizes: set[tuple[str, str]] = field(default_factory=set)
    """(module, attribute) a view of split features read to size a dim beside the split one
    (`self.head_dim` in `view(B, T, -1, self.head_dim)`): each rank keeps that size whole."""
    width_terms: set[tuple[str, str]] = field(default_factory=set)
    """(module, attribute) in a fused cut's size computed from the width read off the tensor
    it cuts (`qkv.shape[-1] // (self.groups + 2)`): the width shrinks on a shard by itself,
    so the attribute must stay whole."""
    cut_terms: set[tuple[str, str]] = field(default_factory=set)
    """(module, attribute) divided as a term of a fused cut's size or bound written as a sum
    of attributes (`4 * self.head_dim`): right only where nothing keeps it whole."""
    piece_products: dict[tuple[str, int, int], set[tuple[AttributeRead, ...]]] = field(
        default_factory=dict
    )
    """(opener, offset, size) of a fused piece -> the products of `products` whose value is
    its size (the piece's own, written `self.n_kv * self.head_dim`)."""
    view_sums: dict[str, set[ViewSum]] = field(default_factory=dict)
    """Opener -> each count a view gave its split dim written as a sum of attributes and
    maybe a constant (`self.num_heads + 2`, the query heads and a key and a value head whole
    on every rank): its terms, which infer matches to the fused pieces they count, and the
    features per counted unit."""
    products: dict[str, set[tuple[AttributeRead, ...]]] = field(default_factory=dict)
    """Opener -> the factors of each term of its fused cut sizes or bounds written as
    products of attributes (`self.n_head * self.head_dim`): exactly one of each must be a
    head count its views read (divided by the plan), the others kept whole."""


@dataclass
class LookupFacts:
    """How tables looked up their rows (the `Lookups` tracker): a vocab-parallel table hands
    each rank its partial rows, summed after the lookup."""

    token_ids: dict[str, bool] = field(default_factory=dict)
    """Table -> whether every lookup it made read the model's input (token ids); absent when
    it made no plain lookup."""
    not_linear: dict[str, str] = field(default_factory=dict)
    """Table whose forward returns something not linear in its looked-up rows -> the op that
    was not linear (a norm inside the embedding module)."""
    written_rows: dict[str, set[str]] = field(default_factory=dict)
    """Table -> its own parameters (by their own names) that its forward writes over
    looked-up rows as they are (`rows[ids == eoi] = self.eoi_embedding`), a write linear in
    the rows when each rank writes its share of the parameter padded with zeros."""
    used_otherwise: set[str] = field(default_factory=set)
    """Parameters of tables (not their weights) that an op inside the table's forward used
    otherwise than to write them over rows: such a parameter cannot be split."""
    at_lookup_place: dict[str, bool] = field(default_factory=dict)
    """Embedding subclass with a forward of its own -> whether every lookup of its table ran
    in nn.Embedding.forward's place in its class order (its `super().forward(ids)`), where a
    vocab-parallel split with `sum_at: lookup` sums the rows (and one with `written` looks
    up each rank's own)."""


@dataclass
class ExpertFacts:
    """Mixture-of-experts modules: modules holding 3-D expert weights used by batched
    per-expert matmuls (the `Experts` and `WholeOutputs` trackers). Split per expert, each
    rank's experts leave a partial sum that the all-reduce at the module's output adds up."""

    roles: dict[str, tuple[str, int]] = field(default_factory=dict)
    """3-D expert weight -> ("open" | "close", the dim of the stored weight that holds the
    features it makes or contracts), from a batched per-expert matmul (grouped_mm, bmm)."""
    biases: dict[str, tuple[str, int]] = field(default_factory=dict)
    """Per-expert bias added to an opening expert matmul's output -> (that weight, the
    bias's dim that holds the features)."""
    grouped_mm: set[str] = field(default_factory=set)
    """3-D expert weights multiplied by torch's grouped matmul, whose kernel takes 16-bit
    operands only with rows of whole 16-byte runs (a rank's share of the features too)."""
    after_sum: dict[str, str] = field(default_factory=dict)
    """Per-expert bias added to the closing matmul's partial sums -> its module."""
    after_weighting: set[str] = field(default_factory=set)
    """Those of them added after the routing weights scaled the partial sums."""
    added_whole: dict[str, str] = field(default_factory=dict)
    """Parameter-free submodule of a module holding 3-D expert weights, whose output (made
    without the split weights, so whole: an identity expert) is added to the closing
    matmuls' partial sums -> that module."""
    whole_used_otherwise: dict[str, str] = field(default_factory=dict)
    """Such a submodule -> how its output is also used other than added to the partial sums
    (then scaling it by 1/tp would change more than the sum)."""
    sum_breaks: dict[str, str] = field(default_factory=dict)
    """Module holding 3-D expert weights -> why something its forward did to its sum before
    any partial sum was in it cannot be split (seen where the routing reached no expert
    with weights: no weight's split ends there, so the module holds the reason)."""
    exits: dict[str, str | None] = field(default_factory=dict)
    """Module holding 3-D expert weights -> None when every floating-point output it returns
    is a sum of its closing matmuls' partial sums (linear in them), else why not."""
    routing: dict[str, str | None] = field(default_factory=dict)
    """Such a module -> None when it takes one integer tensor (the chosen experts) and one
    floating-point tensor shaped like it (their weights), else why not."""
    counts: dict[str, set[AttributeRead]] = field(default_factory=dict)
    """Such a module -> (module, attribute, value) of integer attributes its forward read that
    hold its number of experts."""
    by_counts: set[str] = field(default_factory=set)
    """Such modules given their tokens grouped by expert and one integer count of tokens per
    expert (torchtitan's GroupedExperts), rather than each token's chosen experts: where
    the counts' running sum set the groups of a grouped matmul, which shows the grouping."""
    routers: dict[str, str] = field(default_factory=dict)
    """Layer whose split ended, and whose output then reached an integer input of such a
    module (its chosen experts, or its tokens per expert) -> that module: a router."""


@dataclass
class StackFacts:
    """Long stacks of identical blocks, traced through a prefix (blocks.py)."""

    traced: list[str] = field(default_factory=list)
    """Prefixes of the traced blocks of shortened stacks."""
    untraced: dict[str, str] = field(default_factory=dict)
    """Untraced block prefix -> the traced block prefix of identical structure it copies."""
    twins: dict[str, str] = field(default_factory=dict)
    """Traced block prefix -> an earlier traced block of identical structure (must agree)."""


@dataclass
class Trace:
    """Facts seen in one traced forward, by concern."""

    layers: LayerFacts = field(default_factory=LayerFacts)
    spans: SpanFacts = field(default_factory=SpanFacts)
    params: ParamFacts = field(default_factory=ParamFacts)
    reads: ReadFacts = field(default_factory=ReadFacts)
    lookups: LookupFacts = field(default_factory=LookupFacts)
    experts: ExpertFacts = field(default_factory=ExpertFacts)
    stacks: StackFacts = field(default_factory=StackFacts)

    def written_elsewhere(self, table: str, params: Any) -> bool:
        """Whether any of the table's `params` (its own names) is used otherwise than by
        being written over its looked-up rows, so that it cannot be split."""
        full = [f"{table}.{p}".lstrip(".") for p in params]
        return any(
            p in self.lookups.used_otherwise or p in self.params.outside or p in self.params.in_span
            for p in full
        )
