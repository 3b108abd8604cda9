"""Test helpers beside the tests (``interpret_script``) import by name.

Every run gets its own cache directory: entries a previous run left in the
default one (``~/.cache/stoker``) would turn cold compiles into warm hits and
change what the tests count (compiles, segments, recompiles).
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["STOKER_CACHE_DIR"] = tempfile.mkdtemp(prefix="stoker-tests-")
