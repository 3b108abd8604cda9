"""The ``stoker`` command (`commands`: demo, bench, explain, cache) and what
``stoker cache`` reads and clears (`cache`).  ``stoker.cli`` is its public face.

May import every other room, inside the command that needs it (the command starts
fast: nothing heavy is imported to parse arguments).  No room imports this one.
"""
