"""Where the real data files live."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["DATA_ENV_VAR", "data_root"]

DATA_ENV_VAR = "LENS_ATTRIB_DATA"
"""Environment variable that overrides the data folder."""

_DEFAULT_ROOT = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def data_root() -> Path:
    """The folder holding the datasets (``blimp/``, ``sst2/``, ``squad_v2/``, ...).

    Taken from the environment variable ``LENS_ATTRIB_DATA`` when set, else the repository's
    sibling folder ``../shared/data``.

    Raises:
        FileNotFoundError: the folder does not exist; the message names the variable to set.
    """
    configured = os.environ.get(DATA_ENV_VAR)
    root = Path(configured).expanduser() if configured else _DEFAULT_ROOT
    if not root.is_dir():
        source = f"${DATA_ENV_VAR}" if configured else "the default location"
        raise FileNotFoundError(
            f"data folder {root} (from {source}) does not exist; set the environment variable "
            f"{DATA_ENV_VAR} to the folder that holds blimp/, sst2/, squad_v2/, ..."
        )
    return root
