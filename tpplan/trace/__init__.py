"""Stage 2, the tracer: run a model once on fake tensors and record how each layer's output
features travel (split, viewed into heads, contracted, summed) until a layer contracts them.
Start at tracer.py (`trace_model`, `Trace`)."""

from __future__ import annotations

from .tracer import Trace, TraceError, trace_model

__all__ = ["Trace", "TraceError", "trace_model"]
