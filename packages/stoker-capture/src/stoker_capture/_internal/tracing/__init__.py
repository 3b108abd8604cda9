"""What the stages use while tracing a function: functionalization (`functional.py`),
the forward metadata of one fake run (`forward_meta.py`), each node's source line and
module path (`node_meta.py`), and corrections to torch decompositions (`torch_fixes.py`).

May import only `errors`; every other room may import this one.
"""
