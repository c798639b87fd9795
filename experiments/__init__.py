"""Scripts that reproduce the papers' tables: ``python -m experiments.NAME``.

Data default: unless ``LENS_ATTRIB_DATA`` is set, the experiments read the datasets from the
checkout's sibling folder ``../shared/data``.
"""

import os
from pathlib import Path

os.environ.setdefault(
    "LENS_ATTRIB_DATA", str(Path(__file__).resolve().parents[1].parent / "shared" / "data")
)
