"""Markers for tests that need one TransformerLens major.

The whole suite runs under TransformerLens 3.9 (``make test``) and a selection under 4
(``make test-tl4``, the ``TransformerBridge`` backend); the flip of the default to 4 runs the
whole suite there, with 3.9 as CI's second environment. A test of 3.9-only API (building or
reading a ``HookedTransformer`` directly, TransformerLens 3.9 parameter names, hub names) is
marked :func:`hooked_only` with the reason, so that it is skipped under 4 and still runs under
3.9.
"""

from __future__ import annotations

from typing import Any

import pytest

from lens_attrib.models import transformer_lens_major

BRIDGE = transformer_lens_major() >= 4


def hooked_only(why: str) -> pytest.MarkDecorator:
    """Skip under TransformerLens ≥ 4, saying why the test needs 3.9."""
    return pytest.mark.skipif(BRIDGE, reason=f"TransformerLens 3.9 only: {why}")


def rotary_facts(model: Any) -> tuple[int, float]:
    """``(rotary_dim, rotary_base)`` of a rotary model as its forward computes them.

    TransformerLens 3.9: its config. A bridge's config leaves ``rotary_dim`` at ``None`` for a
    whole-head rotary and ``rotary_base`` at 10000 whatever the checkpoint says (SmolLM2:
    100000; TransformerLens 4.3 reads neither from transformers 5's ``rope_parameters``), while
    its forward runs Hugging Face's rotary module: read them from the Hugging Face config."""
    if not BRIDGE:
        return int(model.cfg.rotary_dim), float(model.cfg.rotary_base)
    config = model.original_model.config
    params = getattr(config, "rope_parameters", None) or {}
    base = params.get("rope_theta", getattr(config, "rope_theta", None))
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    assert base is not None, "no rope_theta in the Hugging Face config"
    return int(model.cfg.d_head * float(factor)), float(base)


def process_weights(model: Any, **options: Any) -> None:
    """TransformerLens' weight processing, in place: 3.9's ``process_weights_``, a bridge's
    ``process_weights`` (the same options: ``fold_ln``, ``center_writing_weights``,
    ``center_unembed``, all on by default, and ``fold_value_biases``)."""
    if BRIDGE:
        model.process_weights(**options)
    else:
        model.process_weights_(**options)
