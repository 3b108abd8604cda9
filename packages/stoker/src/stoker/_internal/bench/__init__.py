"""Benchmarks and the demo: ``stoker bench`` (`bench`, with the GPU suite in `suite`),
the model zoo (`models`, `tiny_text`), and ``stoker demo`` on one process (`demo`) or
on several ranks under DDP / FSDP2 (`demo_distributed`).

May import: api/, distributed/, report/, config, errors.  Must not import cli/.
"""
