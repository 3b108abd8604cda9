"""stoker-autograd's internals, in the order a backward flows through them.

Each stage imports only the stages above it in this list (``tests-integration/
test_import_rooms.py`` checks it, deferred imports included):

1. shared helpers: `graph` (the captured graph's placeholders, `Position`, the
   engine's `Walk`, `graph_module`, `fake_tensor`, `check_sizes`), `ops` and
   `final_callbacks` (the calls a captured graph makes), `session` (a compile's
   settings and counters), `functions`, `origins`, `forward_dims`, `recapture`;
2. capture: `capture` (the engine's compiler instance; it records the engine's walk
   and ends by handing it to the ``finish`` callable the engine passes in) and
   `aot_inline`;
3. the reordering passes: ``stoker_autograd.passes``;
4. retrace: `retrace`, `symbolic_decomps`;
5. segments: `segments` (the retraced graph cut at its Python calls);
6. the disk cache: `graphstore`;
7. the runtime: `runtime` (`CompiledBackward`: guards, compile, run);
8. the engine: `engine` (which backward is compiled; it wires capture to the
   runtime) and the package's ``__init__``.
"""
