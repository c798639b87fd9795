"""Cases of adaptive Integrated Gradients (``n_steps="auto"``) whose outputs are pinned in
``tests/fixtures/ig_adaptive/reference.npz`` (made by ``python -m tests.ig_adaptive_cases``
from the per-item implementation before the lockstep rounds; see that folder's README)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from lens_attrib.methods.registry import attribute
from lens_attrib.target import Target
from lens_attrib.tiny_models import tiny_bert, tiny_gpt2, tiny_llama

F64 = torch.float64
FIXTURE = Path(__file__).parent / "fixtures" / "ig_adaptive" / "reference.npz"
PROMPTS = [
    "the dog sees the cat near the house",
    "a man likes books",
    "the keys to the cabinet",
    "the cat",
]


def _bos_less(model: Any, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [model.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    length = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (length - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (length - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def run_case(name: str) -> Any:
    """The Attribution of case ``name`` (float64 tiny models, mixed lengths)."""
    if name == "llama_mixed":
        model = tiny_llama(dtype=F64)
        return attribute(
            model, PROMPTS, Target(foil="cat"), method="integrated_gradients", tolerance=1e-7
        )
    if name == "llama_sink_capped":  # prepended sinks; a tight tolerance caps some items
        model = tiny_llama(dtype=F64)
        ids, mask = _bos_less(model, PROMPTS)
        return attribute(
            model,
            ids,
            attention_mask=mask,
            method="integrated_gradients",
            tolerance=1e-6,
            max_steps=48,
        )
    if name == "gpt2_full":
        model = tiny_gpt2(dtype=F64)
        return attribute(
            model,
            PROMPTS[:3],
            method="integrated_gradients",
            embeddings="full",
            step_batch=5,
            tolerance=1e-8,
        )
    if name == "bert_mixed":
        model = tiny_bert(dtype=F64)
        return attribute(
            model, PROMPTS, Target(position=1), method="integrated_gradients", tolerance=1e-8
        )
    raise KeyError(name)


CASES = ("llama_mixed", "llama_sink_capped", "gpt2_full", "bert_mixed")
KEYS = ("explained_value", "baseline_value", "completeness_gap")


def arrays(name: str, a: Any) -> dict[str, np.ndarray]:
    out = {f"{name}/scores": a.scores.detach().cpu().numpy()}
    for key in KEYS:
        out[f"{name}/{key}"] = np.asarray(a.meta[key].detach().cpu().numpy())
    out[f"{name}/n_steps"] = np.asarray(a.meta["n_steps"])
    out[f"{name}/panels"] = np.asarray(a.meta["panels"])
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    pinned: dict[str, np.ndarray] = {}
    for case in CASES:
        result = run_case(case)
        pinned.update(arrays(case, result))
        print(case, result.meta["n_steps"], result.meta["panels"])
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    np.savez(FIXTURE, **pinned)
