"""Shared fixtures: the real bundled models (loaded once per session) and tiny models."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The datasets sit beside the checkout (../shared/data) unless LENS_ATTRIB_DATA says otherwise;
# notebook kernels started by the tests inherit this environment.
os.environ.setdefault(
    "LENS_ATTRIB_DATA", str(Path(__file__).resolve().parents[1].parent / "shared" / "data")
)
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session")
def smollm2():
    from lens_attrib import load_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def minilm():
    from lens_attrib import load_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model("minilm-l6")
