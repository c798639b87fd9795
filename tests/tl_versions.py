"""Markers for tests that need one TransformerLens major.

The suite runs under TransformerLens 4 (``TransformerBridge``, the default install) and, in CI's
second environment, under 3.9 (``HookedTransformer``). A test of 3.9-only API (building or
reading a ``HookedTransformer`` directly, TransformerLens 3.9 parameter names, hub names) is
marked :func:`hooked_only` with the reason; it still runs in the 3.9 environment.
"""

from __future__ import annotations

import pytest

from lens_attrib.models import transformer_lens_major

BRIDGE = transformer_lens_major() >= 4


def hooked_only(why: str) -> pytest.MarkDecorator:
    """Skip under TransformerLens ≥ 4, saying why the test needs 3.9."""
    return pytest.mark.skipif(BRIDGE, reason=f"TransformerLens 3.9 only: {why}")
