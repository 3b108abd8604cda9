"""Logging in the spirit of ``TORCH_LOGS``: one `logging` logger per topic.

``STOKER_LOGS=graphs,guards`` (read when `stoker` is first imported) or
``stoker.set_logs("graphs,guards")`` turns topics on.  Each topic is the
logger ``stoker.<topic>``; an enabled topic logs at INFO (``+topic``: DEBUG)
to stderr through one handler on the ``stoker`` logger.  ``all`` enables every
topic; an empty spec turns them all off.  Your own handlers on these loggers
keep working: they are ordinary `logging` loggers.
"""

from __future__ import annotations

import logging
import os
import sys

TOPICS: dict[str, str] = {
    "graphs": "the FX graph of every stage (Dynamo's, the joint, forward and backward)",
    "guards": "the guards installed for each compiled graph, with the op and line that made each",
    "recompiles": "why a call missed every cached graph and compiled again",
    "partition": "what the partitioner saved for backward and what it recomputes, in bytes",
    "kernels": "the Triton kernels generated per graph, and ops that fell back to aten",
    "autograd": "compiled autograd: backward graphs captured, cache hits and misses",
    "timings": "how long each compile stage took",
    "cache": "on-disk caches: compiled graphs loaded or compiled (and why), misses and "
    "writes (other hits at +cache), broken entries ignored",
    "cudagraphs": "mode='reduce-overhead': graphs recorded per size key, plain launches and why",
    "distributed": "DDP/FSDP2: the reducer mode chosen per DDP module, its buckets",
}

_HANDLER_NAME = "stoker-stderr"
_FORMAT = "[%(name)s] %(message)s"


class _StderrHandler(logging.Handler):
    """Writes to whatever ``sys.stderr`` is at the time (pytest and notebooks swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


class LogSpecError(ValueError):
    """A ``STOKER_LOGS`` / `set_logs` spec named a topic that does not exist."""


def parse_spec(spec: str | None) -> dict[str, int]:
    """``"graphs,+guards"`` → ``{"graphs": INFO, "guards": DEBUG}``; ``"all"`` → every topic."""
    levels: dict[str, int] = {}
    if not spec:
        return levels
    for raw in spec.replace(" ", "").split(","):
        if not raw:
            continue
        level = logging.DEBUG if raw.startswith("+") else logging.INFO
        name = raw.lstrip("+")
        if name == "all":
            for topic in TOPICS:
                levels[topic] = min(levels.get(topic, level), level)
            continue
        if name not in TOPICS:
            raise LogSpecError(
                f"unknown stoker log topic {name!r} in {spec!r}; "
                f"known topics: {', '.join(TOPICS)}, all (prefix + for DEBUG)"
            )
        levels[name] = level
    return levels


def logger(topic: str) -> logging.Logger:
    """The logger for ``topic`` (``stoker.<topic>``)."""
    if topic not in TOPICS:
        raise LogSpecError(f"unknown stoker log topic {topic!r}; known: {', '.join(TOPICS)}")
    return logging.getLogger(f"stoker.{topic}")


def set_logs(spec: str | None = None, **topics: bool) -> dict[str, int]:
    """Turn stoker's log topics on or off; returns the levels now in force.

    >>> stoker.set_logs("graphs,guards")          # like STOKER_LOGS=graphs,guards
    >>> stoker.set_logs(recompiles=True)         # keyword form
    >>> stoker.set_logs("")                      # everything off
    """
    levels = parse_spec(spec)
    for name, on in topics.items():
        if name not in TOPICS:
            raise LogSpecError(f"unknown stoker log topic {name!r}; known: {', '.join(TOPICS)}")
        if on:
            levels[name] = logging.INFO
        else:
            levels.pop(name, None)
    root = logging.getLogger("stoker")
    if not any(h.get_name() == _HANDLER_NAME for h in root.handlers):
        handler = _StderrHandler()
        handler.set_name(_HANDLER_NAME)
        handler.setFormatter(logging.Formatter(_FORMAT))
        root.addHandler(handler)
    root.propagate = False
    root.setLevel(logging.DEBUG)
    for topic in TOPICS:
        # WARNING when off: a topic's warnings (fallbacks, recompile limits) still show.
        logging.getLogger(f"stoker.{topic}").setLevel(levels.get(topic, logging.WARNING))
    return levels


def enabled(topic: str, level: int = logging.INFO) -> bool:
    """Whether ``topic`` logs at ``level`` (cheap; guards expensive formatting)."""
    return logging.getLogger(f"stoker.{topic}").isEnabledFor(level)


def init_from_env() -> None:
    """Apply ``STOKER_LOGS`` if set (called once when stoker is imported)."""
    spec = os.environ.get("STOKER_LOGS")
    if spec is None:
        return
    try:
        set_logs(spec)
    except LogSpecError as e:  # a typo in an environment variable must not break `import stoker`
        import warnings

        warnings.warn(f"STOKER_LOGS ignored: {e}", stacklevel=2)
