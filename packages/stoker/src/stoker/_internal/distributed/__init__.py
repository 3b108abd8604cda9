"""Distributed training under stoker: which reducer a DDP module gets and the report's
summary (`distributed`), stoker's bucketed DDP reducer (`ddp_reducer`), the collectives
each step issues and where they sit in the backward graph (`collectives`), and local
multi-process runs (`launch`).

May import: report/ (logs), config, errors, and stoker-autograd (the captured backward
graphs come from its default session).  Must not import api/ (which imports this room),
cudagraphs/, bench/ or cli/.
"""
