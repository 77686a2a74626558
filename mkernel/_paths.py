"""Where the device sources (primitives/, templates/, kernels/) live.

In a checkout or an editable install they sit at the repository root, next to the package. A
non-editable install ships a copy of them inside the package as ``mkernel/_csrc/``.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def source_root() -> Path:
    """Return the folder that holds ``primitives/``, ``templates/`` and ``kernels/``."""
    shipped = _PACKAGE_DIR / "_csrc"
    # NOTE: the shipped copy wins because, once installed, the package's parent is site-packages,
    # where a stray top-level kernels/ folder of some other distribution must never be picked up.
    if shipped.is_dir():
        return shipped
    return _PACKAGE_DIR.parent
