"""Benchmarks and the demo: ``stoker bench`` (the harness in `harness`, every benchmark
named in `registry`, one module per family in `benchmarks`; the model benchmarks in
`bench`, with the GPU suite in `suite`), the model zoo (`models`, `tiny_text`), and
``stoker demo`` on one process (`demo`) or on several ranks under DDP / FSDP2
(`demo_distributed`).

May import: api/, cudagraphs, distributed/, report/, config, errors.  Must not import cli/.
"""
