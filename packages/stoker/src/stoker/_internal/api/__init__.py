"""The compile API: `stoker.compile` (`compile_api`), the torch.compile backend
``"stoker"`` (`backend`: Dynamo graph -> stoker-capture -> an executor, each compile
recorded in the report) and the scope in which stoker-autograd compiles backwards
(`autograd_switch`).

May import: report/, config, errors; cudagraphs/ and distributed/ only inside the
functions that need them (so ``import stoker`` stays light).  Must not import bench/
or cli/ (they import this room).
"""
