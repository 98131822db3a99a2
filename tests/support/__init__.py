"""Helpers shared by the tests and the rank scripts torchrun starts from them; a test module
imports these, never another test module's privates.

- models.py: tiny models (tiny_llama and its config, Vit, ...) and their inputs;
  infer_models.py: tiny Hugging Face families and hand-written blocks for the tracer;
  blocks.py: transformer variants built from a `Spec` (property tests); code_styles.py:
  attention and MLP blocks written many ways, as source text (issue 35's generator); tables.py,
  lora.py: an embedding table that does more than look up, a LoRA Llama.
- parity.py: `assert_parity`, the one check against the unsharded model, on both
  execution paths; plans.py: which rule a module gets, and tests/plans/llama.yaml.
- check.py: check_plan's hand-written modules and their sound plan; unrunnable.py,
  fake_limits.py: plans and models a dry run must refuse or cannot run.
- ranks.py: torchrun and how a rank script ends; torch_state.py: what test_torch_state
  shares with its ranks; shipped.py, generate.py: the shipped plans and the generate matrix.
- tiers.py: which test files can hold a unit test (what `pytest -m unit` collects).
"""
