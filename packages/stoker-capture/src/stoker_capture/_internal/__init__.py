"""stoker-capture's internals, one folder per job, imports pointing down this list:

- `api.py`, `dynamo.py`: the entry points (`aot_function`, `aot_module`, `export`,
  the ``torch.compile`` backend); they run the stages and may import every room.
- `capcache/`: the captured-graph cache (stages, tracing, graphs, partition).
- `stages/`: the pipeline, one module per stage: state -> capture -> export | compile.
- `partition/`: the joint graph split into forward and backward (tracing).
- `runtime/`: what runs after compile: the autograd.Function, wrappers, boxed calls (tracing).
- `tracing/`, `graphs/`: helpers the stages share while tracing, checking and storing graphs.
- `config.py`, `errors.py`, `autocast.py`: the bottom, imported by every room.
"""
