"""The modes of the generate matrix (tests/test_generate.py runs them through
tests/generate_ranks.py on gloo ranks): each mode's keyword arguments to `generate`, one
table both read."""

from __future__ import annotations

from typing import Any

__all__ = ["CACHES", "MODES"]

# transformers 5.24's cache implementations (generation/configuration_utils.py,
# ALL_CACHE_IMPLEMENTATIONS); "paged" is continuous batching's, not generate's
CACHES = (
    "dynamic",
    "offloaded",
    "static",
    "offloaded_static",
    "sliding_window",
    "hybrid",
    "hybrid_chunked",
    "offloaded_hybrid",
    "offloaded_hybrid_chunked",
    "quantized",
)

# mode -> generate's keyword arguments (besides the inputs); "padded" and "assisted" get
# their inputs and draft model in generate_ranks.py's `_call`. Every mode returns its scores, which are compared
# too: a tiny random model's attention adds little to its residual stream, so an attention
# over wrong keys can leave the tokens right (BLOOM's static cache did) but not the scores.
MODES: dict[str, dict[str, Any]] = {
    "greedy": {"do_sample": False},
    "sample": {"do_sample": True},
    "beam": {"do_sample": False, "num_beams": 4},
    "beam_sample": {"do_sample": True, "num_beams": 4},
    "padded": {"do_sample": False},
    "assisted": {"do_sample": False},
    "scores": {"do_sample": False, "output_logits": True},
    **{f"cache_{c}": {"do_sample": False, "cache_implementation": c} for c in CACHES},
    # a static cache allocated before the prefill, its sizes read from the config
    # (generation/utils.py `_prepare_static_cache`, `_get_static_cache_init_shape`)
    "cache_static_chunked": {
        "do_sample": False,
        "cache_implementation": "static",
        "prefill_chunk_size": 2,
    },
}
