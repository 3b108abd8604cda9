"""What stoker tells the user: the ``STOKER_LOGS`` topics (`logs`), stage marks on one
clock (`timeline`), the compile report and its HTML (`report`, `svg`), live memory over
a step (`memtrace`, and the peak that benchmarks read: `memprobe`), and ``TORCH_TRACE``
/ ``STOKER_TRACE`` events (`tracelog`).

The bottom room: it imports no other room (only config and errors).  ``import stoker``
imports `logs`, so keep this ``__init__`` empty of imports.
"""
