"""Make the shared test helpers (capture_compare.py) importable under importlib mode;
keep the captured-graph cache of these tests out of the user's cache directory."""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("STOKER_CACHE_DIR", tempfile.mkdtemp(prefix="stoker-capture-tests-"))
