"""stoker's private code, one folder per job (a room), each importing only rooms below it.

    cli/          the ``stoker`` command (demo, bench, explain, cache)       -> bench, api, report
    bench/        benchmarks, the model zoo, the demo (one rank or several)  -> api, distributed, report
    api/          stoker.compile, the torch.compile backend, the autograd switch
                                                 -> report; cudagraphs, distributed (inside functions)
    cudagraphs/   mode="reduce-overhead": record and replay CUDA graphs     -> report
    distributed/  DDP under stoker, its reducer, the collectives, launching  -> report
    report/       what stoker tells the user: logs, the timeline, the report, traces
    config.py, errors.py   options and errors: any room may import them; they import no room

Nothing here is imported by ``import stoker`` except config, errors and ``report.logs``;
the rest loads on first use.
"""
