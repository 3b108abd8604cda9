"""The pipeline's stages, one module each, plain functions from one dataclass to the next:

    state.py    create_aot_state          -> AOTState      (fake inputs, forward metadata)
    capture.py  aot_stage1_graph_capture  -> CapturedGraph (the joint or inference graph)
    export.py   aot_stage2_export         -> ExportedGraph (stop here: save, edit, load)
    compile.py  aot_stage2_compile        -> CompiledFn    (partition, compile, wrap)

A stage imports only the stages before it (`torch_export.py` is export's hand-off to
``torch.export``). May import `tracing/`, `graphs/`, `partition/`, `runtime/` and the
bottom modules (`config`, `errors`, `autocast`); never `capcache/`, `api` or `dynamo`.
"""
