"""Pinned outputs of every method on tiny models (float64), for refactoring safety.

``python -m tests.pinned_outputs`` rewrites ``tests/fixtures/pinned/outputs.npz``. Do that only
for a deliberate behaviour change, and say which in the commit; ``tests/test_pinned.py`` checks
that every method still gives these arrays to 1e-12 of each array's largest magnitude (its
docstring says why not bit for bit: BLAS rounding differs between CPUs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from lens_attrib import Target, attribute
from lens_attrib.tiny_models import tiny_bert, tiny_gpt2, tiny_llama, tiny_pythia

PATH = Path(__file__).parent / "fixtures" / "pinned" / "outputs.npz"

DECODER_PROMPTS = ["the keys to the cabinet", "the author near the doors is"]
ENCODER_PROMPTS = ["the keys to the cabinet are", "the author near the doors is"]

CASES: list[tuple[str, str, dict[str, Any]]] = [
    # (model, method, options)
    *[
        (m, method, {})
        for m in ("gpt2", "llama", "pythia")
        for method in (
            "gradient",
            "grad_x_input",
            "lrp",
            "attnlrp",
            "alti_logit",
            "alti",
            "attention",
            "rollout",
            "value_zeroing",
            "random",
            "embed_norm",
            "logat",
            "normxlogit",
            "grad_ellm",
        )
    ],
    ("gpt2", "integrated_gradients", {"n_steps": 8}),
    ("llama", "integrated_gradients", {"n_steps": 8}),
    ("gpt2", "grad_x_input", {"heads": True}),
    ("llama", "attnlrp", {"heads": True}),
    *[
        ("bert", method, {})
        for method in (
            "gradient",
            "grad_x_input",
            "lrp",
            "attnlrp",
            "alti",
            "attention",
            "rollout",
            "value_zeroing",
            "random",
            "embed_norm",
            "logat",
            "normxlogit",
            "grad_ellm",
        )
    ],
]

BUILDERS = {"gpt2": tiny_gpt2, "llama": tiny_llama, "pythia": tiny_pythia, "bert": tiny_bert}


def target_for(model_name: str) -> Target:
    """Contrastive agreement target (the tiny tokenizer is word-level: no leading spaces)."""
    position = [-2, -2] if model_name == "bert" else None  # encoders: the token before [SEP]
    return Target(token=["are", "is"], foil=["is", "are"], position=position)


def compute() -> dict[str, np.ndarray]:
    """Every case's arrays, computed on one thread (reductions then sum in a fixed order)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _compute()
    finally:
        torch.set_num_threads(threads)


def _compute() -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    models = {name: build(seed=1, dtype=torch.float64) for name, build in BUILDERS.items()}
    for model_name, method, options in CASES:
        model = models[model_name]
        prompts = ENCODER_PROMPTS if model_name == "bert" else DECODER_PROMPTS
        target = target_for(model_name)
        attr = attribute(model, prompts, target, method=method, **options)
        key = f"{model_name}/{method}/{'-'.join(f'{k}={v}' for k, v in sorted(options.items()))}"
        out[key + "/scores"] = attr.scores.numpy()
        for field in ("layer_scores", "head_scores", "head_token_scores"):
            value = getattr(attr, field)
            if value is not None:
                out[key + "/" + field] = value.numpy()
    return out


if __name__ == "__main__":
    arrays = compute()
    PATH.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(PATH, **arrays)
    print(f"wrote {len(arrays)} arrays to {PATH}")
