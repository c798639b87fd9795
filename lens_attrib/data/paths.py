"""Where the real data files live."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["DATA_ENV_VAR", "data_root"]

DATA_ENV_VAR = "LENS_ATTRIB_DATA"
"""Environment variable that overrides the data folder."""


def data_root(root: str | Path | None = None) -> Path:
    """The folder holding the datasets (``blimp/``, ``sst2/``, ``squad_v2/``, ...).

    ``root`` when given, else the environment variable ``LENS_ATTRIB_DATA``. The library never
    guesses a location: the experiments and the test suite set ``LENS_ATTRIB_DATA`` to the
    checkout's sibling ``../shared/data`` when it is unset.

    Raises:
        FileNotFoundError: no folder configured, or it does not exist; the message names the
        variable to set.
    """
    configured = str(root) if root is not None else os.environ.get(DATA_ENV_VAR)
    if not configured:
        raise FileNotFoundError(
            f"no data folder configured: set the environment variable {DATA_ENV_VAR} to the "
            "folder that holds blimp/, sst2/, squad_v2/, ..."
        )
    path = Path(configured).expanduser()
    if not path.is_dir():
        source = "the root argument" if root is not None else f"${DATA_ENV_VAR}"
        raise FileNotFoundError(
            f"data folder {path} (from {source}) does not exist; set the environment variable "
            f"{DATA_ENV_VAR} to the folder that holds blimp/, sst2/, squad_v2/, ..."
        )
    return path
