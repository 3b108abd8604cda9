"""Build the five packages' wheels into one folder (``nox -s build`` runs this).

    python tools/build_wheels.py [OUT]        # default OUT: dist/

Needs hatchling in the running interpreter (``pip install hatchling``): the
wheels are built without build isolation, so nothing is fetched. Older
``stoker*.whl`` files in OUT are removed first, so ``pip install OUT/*.whl``
installs exactly this checkout; each package requires its siblings with
floors (``stoker-shapes>=0.1``), which pip resolves from the files given:

    pip install torch==2.13.0 ...             # the torch build you want, first
    pip install dist/*.whl                    # offline once torch is there
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# dependency order (pip resolves them together; the order only reads well)
PACKAGES = ("stoker-shapes", "stoker-capture", "stoker-autograd", "stoker-triton", "stoker")


def build(out: Path, pip: list[str] | None = None) -> list[Path]:
    """Build every package's wheel into ``out``. ``pip`` is the pip command whose
    environment has hatchling (default: this interpreter's; a test passes
    ``[python, -m, pip, --python, other]`` to build with another venv's hatchling)."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("stoker*.whl"):
        old.unlink()
    subprocess.run(
        [
            *(pip or [sys.executable, "-m", "pip"]),
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(out),
            *(str(ROOT / "packages" / p) for p in PACKAGES),
        ],
        check=True,
    )
    wheels = sorted(out.glob("stoker*.whl"))
    if len(wheels) != len(PACKAGES):
        raise SystemExit(f"expected {len(PACKAGES)} wheels in {out}, found {len(wheels)}")
    return wheels


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", default=str(ROOT / "dist"), help="folder (default dist/)")
    a = p.parse_args(argv)
    try:
        import hatchling  # noqa: F401
    except ImportError:
        print(
            "tools/build_wheels.py needs hatchling: pip install hatchling (or run nox -s build)",
            file=sys.stderr,
        )
        return 2
    for w in build(Path(a.out)):
        print(w)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
