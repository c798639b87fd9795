"""Markers for tests that need one TransformerLens major.

The whole suite runs under TransformerLens 3.9 (``make test``) and a selection under 4
(``make test-tl4``, the ``TransformerBridge`` backend); the flip of the default to 4 runs the
whole suite there, with 3.9 as CI's second environment. A test of 3.9-only API (building or
reading a ``HookedTransformer`` directly, TransformerLens 3.9 parameter names, hub names) is
marked :func:`hooked_only` with the reason, so that it is skipped under 4 and still runs under
3.9.
"""

from __future__ import annotations

import pytest

from lens_attrib.models import transformer_lens_major

BRIDGE = transformer_lens_major() >= 4


def hooked_only(why: str) -> pytest.MarkDecorator:
    """Skip under TransformerLens ≥ 4, saying why the test needs 3.9."""
    return pytest.mark.skipif(BRIDGE, reason=f"TransformerLens 3.9 only: {why}")
