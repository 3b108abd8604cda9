"""FX graphs between stages: the debug checks every graph keeps (`lint.py`) and graphs to
and from JSON, for export files and caches (`serialize.py`).

May import only `errors`; never a stage.
"""
