"""Make the shared test helpers (capture_compare.py) importable under importlib mode."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
