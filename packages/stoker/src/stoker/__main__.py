"""``python -m stoker ...``: the ``stoker`` command (demo, bench, explain, cache)."""

from .cli import main

raise SystemExit(main())
