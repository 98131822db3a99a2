"""Helpers shared by the tests and the rank scripts torchrun starts from them; a test module
imports these, never another test module's privates."""
