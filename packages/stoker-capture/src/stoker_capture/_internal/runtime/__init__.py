"""What runs once a graph is compiled: stoker's own ``torch.autograd.Function``
(`function.py`), the wrappers from the compiled outputs back to eager semantics
(`wrappers.py`, with `symeval.py` for symbolic sizes at run time), and boxed calls that
free each input after its last reader (`boxed.py`).

May import `tracing/` and the bottom modules (`autocast`, `errors`); never a stage,
`partition/` or `capcache/`.
"""
