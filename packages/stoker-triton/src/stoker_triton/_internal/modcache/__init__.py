"""Generated modules (kernels, wrappers): stored in the disk cache keyed by their
content (`modules.py`) and imported from memory (`srcmodule.py`, torch-free: the
compile workers import it).

The bottom room of the generated code: imports nothing of stoker-triton's. Keep this
file free of imports.
"""
