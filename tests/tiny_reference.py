"""Float64 logits of the tiny models (:mod:`lens_attrib.tiny_models`) from TransformerLens 3.9.

TransformerLens 4 has no ``HookedTransformer``: there the tiny builders load Hugging Face
checkpoints of the same parameters on the bridge (:mod:`lens_attrib.tiny_checkpoints`).
``tests/test_tiny_checkpoints.py`` compares those with this file, made under TransformerLens 3.9
by::

    HF_HUB_OFFLINE=1 python -m tests.tiny_reference

which builds every case of :data:`CASES` as a HookedTransformer/HookedEncoder in float64 and
saves its logits on :data:`PROMPTS` (one forward per prompt) to
``tests/fixtures/tiny/logits.npz``, keys ``<case>/logits``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from lens_attrib import tiny_models

PATH = Path(__file__).parent / "fixtures" / "tiny" / "logits.npz"
CASES: dict[str, tuple[str, int, dict[str, Any]]] = {
    "gpt2": ("gpt2", 0, {}),
    "llama": ("llama", 0, {}),
    "pythia": ("pythia", 0, {}),
    "bert": ("bert", 0, {}),
    "gpt2_seed3_relu_2layers": ("gpt2", 3, {"act_fn": "relu", "n_layers": 2}),
    "llama_seed1_mha": ("llama", 1, {"n_key_value_heads": None}),
    "llama_d16": ("llama", 0, {"d_model": 16, "d_head": 4}),
    "pythia_seed2": ("pythia", 2, {}),
}
"""Case name → (kind, seed, overrides): the defaults and the overrides the tests use."""
PROMPTS = ["the keys to the cabinet are", "a dog sees the cat"]
ENCODER_PROMPTS = ["the dog [MASK] the cat", "a man likes the books near the table"]


def build(case: str, dtype: torch.dtype = torch.float64, **kwargs: Any) -> Any:
    """The tiny model of ``case`` on the installed backend (``kwargs``: ``backend=``)."""
    kind, seed, overrides = CASES[case]
    builder = getattr(tiny_models, f"tiny_{kind}")
    return builder(seed=seed, dtype=dtype, **kwargs, **overrides)


def logits(model: Any, case: str) -> np.ndarray:
    """Logits of the case's prompts, one forward each, concatenated along positions: decoders
    with ``<bos>``, BERT with ``[CLS] … [SEP]`` (padding and masks are the methods' business,
    covered by the pinned outputs)."""
    encoder = CASES[case][0] == "bert"
    rows = []
    for prompt in ENCODER_PROMPTS if encoder else PROMPTS:
        text = prompt if encoder else "<bos> " + prompt
        ids = model.tokenizer(text, return_tensors="pt", add_special_tokens=encoder)["input_ids"]
        with torch.no_grad():
            rows.append(model(ids)[0].detach().to(torch.float64))
    return torch.cat(rows).numpy()


def main() -> None:
    arrays = {f"{case}/logits": logits(build(case), case) for case in CASES}
    PATH.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(PATH, **arrays)
    print(f"wrote {len(arrays)} arrays to {PATH}")


if __name__ == "__main__":
    main()
