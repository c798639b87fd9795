"""Reference outputs of every decoder method on the newer families, from TransformerLens 3.9.

The companion of :mod:`tests.backend_reference` for the families of
:mod:`lens_attrib.architectures` (Gemma, Gemma 2, Phi-3, Mixtral, Qwen2, Qwen3, Mistral): made
under TransformerLens 3.9 by::

    HF_HUB_OFFLINE=1 python -m tests.architecture_reference

which (1) writes each family's tiny random checkpoint
(:func:`lens_attrib.tiny_models.save_tiny_checkpoint`, seed 0) into
``tests/fixtures/architectures/<family>/`` when missing (the committed folders are the fixed
weights both backends load), and (2) runs every registered method (:data:`CASES`) on
``load_model(folder, dtype=float64, backend="hooked")`` and saves the arrays, or the error a
method raises (``<key>/error``: the exception's class and message), to
``tests/fixtures/architectures/outputs.npz``. ``tests/test_bridge_architectures.py`` loads the
same folders as TransformerBridges under TransformerLens 4 and compares (1e-10 of each array's
largest magnitude; the same error, up to the backend's name in it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.backend_reference import FIELDS

ROOT = Path(__file__).parent / "fixtures" / "architectures"
OUTPUTS = ROOT / "outputs.npz"
FAMILIES = ("gemma", "gemma2", "phi3", "mixtral", "qwen2", "qwen3", "mistral")

ITEMS = [[2, 30, 41, 25, 60, 8, 19], [2, 33, 70, 12, 52]]
"""Token ids (each family's own tokenizer class splits words differently): the second item is
left-padded in the batch, both are longer than the 3-token sliding windows."""
TOKENS, FOILS = [5, 9], [9, 5]
"""Contrastive targets per item (token id − foil id)."""

FAST_OPTIONS: dict[str, dict[str, Any]] = {
    "integrated_gradients": {"n_steps": 8},
    "reagent": {"max_probe_steps": 2, "num_probes": 2},
}
"""Options that keep the slow methods cheap (the tests run them on every family)."""


def method_names() -> list[str]:
    from lens_attrib.methods.registry import METHODS

    return list(METHODS)


CASES: list[tuple[str, str, dict[str, Any]]] = [
    *[(f, m, FAST_OPTIONS.get(m, {})) for f in FAMILIES for m in method_names()],
    *[(f, "attnlrp", {"heads": True}) for f in FAMILIES],
    *[(f, "alti_logit", {"trace_heads": True}) for f in FAMILIES],
]


def key_of(family: str, method: str, options: dict[str, Any]) -> str:
    return f"{family}/{method}/{'-'.join(f'{k}={v}' for k, v in sorted(options.items()))}"


def error_text(err: BaseException) -> str:
    """The error as compared across backends: class and message, the model kind left out."""
    message = str(err)
    for kind in ("HookedTransformer", "TransformerBridge", "HookedEncoder"):
        message = message.replace(kind, "<backend>")
    return f"{type(err).__name__}: {message}"


def case_arrays(model: Any, family: str, method: str, options: dict[str, Any]) -> dict[str, Any]:
    """The arrays of one case (``key/field``), or its error (``key/error``)."""
    from lens_attrib import Target, attribute

    key = key_of(family, method, options)
    try:
        target = Target(token=TOKENS, foil=FOILS)
        attr = attribute(model, ITEMS, target, method=method, **options)
    except Exception as err:
        return {f"{key}/error": np.array(error_text(err))}
    return {
        f"{key}/{field}": getattr(attr, field).numpy()
        for field in FIELDS
        if getattr(attr, field) is not None
    }


def main() -> None:
    from lens_attrib import load_model
    from lens_attrib.tiny_models import save_tiny_checkpoint

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    try:
        for family in FAMILIES:
            folder = ROOT / family
            if not (folder / "config.json").exists():
                save_tiny_checkpoint(family, folder)
            model = load_model(str(folder), dtype=torch.float64, backend="hooked")
            for fam, method, options in CASES:
                if fam == family:
                    out.update(case_arrays(model, family, method, options))
    finally:
        torch.set_num_threads(threads)
    np.savez_compressed(OUTPUTS, **out)
    print(f"wrote {len(out)} arrays to {OUTPUTS}")


if __name__ == "__main__":
    main()
