"""``mode="reduce-overhead"``: a compiled graph recorded as a CUDA graph per size key
and replayed (`cudagraphs`), which graphs may be recorded (`plan`), and the recorders:
CUDA graphs and the host stand-in the CPU tests use (`recorders`).

May import: report/ (logs).  Must not import api/, distributed/, bench/ or cli/.
"""
