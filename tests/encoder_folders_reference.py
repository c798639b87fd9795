"""Reference outputs of every encoder method on RoBERTa and sequence-classifier folders, from
TransformerLens 3.9.

The folders are the kind users save: ``RobertaForMaskedLM``, ``RobertaModel``,
``RobertaForSequenceClassification`` and ``BertForSequenceClassification`` (tiny, random, every
bias and norm gain random, the word-level tokenizer of
:func:`lens_attrib.tiny_models.tiny_tokenizer`, whose ``[UNK]`` id 1 is RoBERTa's
``pad_token_id``). They are not committed: :func:`write_folders` builds them from seeds in any
directory (``tests/test_bridge_encoder_folders.py`` writes them to ``tmp_path``), and
:data:`DIGEST_KEY` arrays in the reference file prove the rebuilt weights are the ones the
references came from. Made under TransformerLens 3.9 by::

    HF_HUB_OFFLINE=1 python -m tests.encoder_folders_reference

which runs every case of :data:`CASES`, evaluation metrics (:func:`evaluation_arrays`) and
:data:`ABLATION_CASES` (with a user's hook zeroing head 1 of layer 1 at ``hook_z``) on
``load_model(folder, dtype=float64, backend="hooked")`` on one thread and writes
``tests/fixtures/backends/encoder_folders.npz``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lens_attrib import Target
from tests import backend_reference as ref

OUTPUTS = ref.ROOT / "encoder_folders.npz"
DIGEST_KEY = "digest"
"""``{folder}/digest``: the sum and the sum of squares of every parameter, in name order."""

FOLDERS = ("roberta_mlm", "roberta_model", "roberta_cls", "bert_cls")
LABELS = {0: "negative", 1: "positive"}

ROBERTA_PROMPTS = ["the dog [MASK] the zebra", "a man likes the books"]
"""``zebra`` is ``[UNK]`` (id 1, RoBERTa's padding id) inside a row."""
CLASSIFIER_TEXTS = ["the keys to the zebra are", "a dog is near the cat"]
PAIRS = [("the keys to the cabinet are", "a dog is near the cat"), ("the keys are", "the dog is")]
"""Sentence pairs for the BERT classifier (segment ids 0 and 1)."""

CLASS_METHODS = ref.ENCODER_METHODS
REAGENT = {"num_probes": 2, "max_probe_steps": 2, "stopping_condition_top_k": 1}
CASES: list[tuple[str, str, dict[str, Any]]] = [
    *[("roberta_mlm", method, {}) for method in ref.ENCODER_METHODS],
    ("roberta_mlm", "integrated_gradients", {"n_steps": 8}),
    ("roberta_mlm", "grad_x_input", {"heads": True}),
    ("roberta_mlm", "attnlrp", {"heads": True}),
    ("roberta_mlm", "decompx", {"biases": "separate"}),
    *[("roberta_model", method, {}) for method in ref.HEADLESS_METHODS],
    *[(folder, method, {}) for folder in ("roberta_cls", "bert_cls") for method in CLASS_METHODS],
    *[(folder, "integrated_gradients", {"n_steps": 8}) for folder in ("roberta_cls", "bert_cls")],
    *[(folder, "attnlrp", {"heads": True}) for folder in ("roberta_cls", "bert_cls")],
    *[(folder, "reagent", REAGENT) for folder in ("roberta_mlm", "roberta_cls", "bert_cls")],
]
EVAL_FOLDERS = ("roberta_mlm", "roberta_cls", "bert_cls")
"""Folders whose AttnLRP attribution is evaluated (:func:`evaluation_arrays`)."""
ABLATION_CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("roberta_cls", "attnlrp", {"heads": True}),
    ("bert_cls", "grad_x_input", {"heads": True}),
]


def inputs(folder: str) -> Any:
    if folder == "bert_cls":
        return PAIRS
    return CLASSIFIER_TEXTS if folder == "roberta_cls" else ROBERTA_PROMPTS


def target(folder: str) -> Target:
    """The masked verb against the other one (MLM), position 3 (no head), or the checkpoint's own
    class head's label ``positive`` at ``[CLS]`` (classifiers: the head is the model's)."""
    if folder == "roberta_mlm":
        return Target(token=["sees", "likes"], foil=["likes", "sees"], position=3)
    if folder == "roberta_model":
        return Target(position=3)
    return Target(label="positive")


def _config(family: str, vocab: int, **extra: Any) -> Any:
    from transformers import BertConfig, RobertaConfig

    common = {
        "vocab_size": vocab,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "hidden_act": "gelu",
        "layer_norm_eps": 1e-12,
        "initializer_range": 0.1,  # heads that move the output: well-conditioned value zeroing
        **extra,
    }
    if family == "bert":
        return BertConfig(max_position_embeddings=64, type_vocab_size=2, **common)
    # positions from pad_token_id + 1 = 2, one segment
    return RobertaConfig(max_position_embeddings=66, pad_token_id=1, type_vocab_size=1, **common)


def build(folder: str, vocab: int) -> Any:
    """The transformers model of ``folder`` (random, seeded)."""
    import transformers

    family, kind = {
        "roberta_mlm": ("roberta", "ForMaskedLM"),
        "roberta_model": ("roberta", "Model"),
        "roberta_cls": ("roberta", "ForSequenceClassification"),
        "bert_cls": ("bert", "ForSequenceClassification"),
    }[folder]
    extra: dict[str, Any] = {}
    if kind == "ForSequenceClassification":
        extra = {"id2label": LABELS, "label2id": {v: k for k, v in LABELS.items()}}
    cls = getattr(transformers, f"{family.capitalize()}{kind}")
    torch.manual_seed(FOLDERS.index(folder))
    if kind == "Model":
        return cls(_config(family, vocab, **extra), add_pooling_layer=False)
    return cls(_config(family, vocab, **extra))


def write_folders(root: Path) -> dict[str, Path]:
    """Every folder of :data:`FOLDERS` saved under ``root`` (``save_pretrained``)."""
    from lens_attrib.tiny_models import tiny_tokenizer

    out = {}
    for name in FOLDERS:
        tok = tiny_tokenizer(encoder=True)
        hf_model = build(name, len(tok)).eval()
        gen = torch.Generator().manual_seed(100 + FOLDERS.index(name))
        with torch.no_grad():
            for param_name, p in hf_model.named_parameters():
                if p.ndim == 1:
                    base = 1.0 if "weight" in param_name else 0.0
                    p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
        hf_model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        out[name] = root / name
    return out


def digest(folder: Path) -> np.ndarray:
    """Sum and sum of squares of every saved tensor, in name order (float64)."""
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    rows = [(float(t.double().sum()), float(t.double().square().sum())) for _, t in
            sorted(tensors.items())]  # fmt: skip
    return np.asarray(rows, dtype=np.float64)


def case_arrays(
    model: Any, folder: str, method: str, options: dict[str, Any], prefix: str = ""
) -> dict[str, np.ndarray]:
    """The arrays of one case, keyed ``[prefix]folder/method/options/field``."""
    from lens_attrib import attribute

    attr = attribute(model, inputs(folder), target(folder), method=method, **options)
    key = prefix + ref.key_of(folder, method, options)
    return {
        f"{key}/{field}": getattr(attr, field).numpy()
        for field in ref.FIELDS
        if getattr(attr, field) is not None
    }


def evaluation_arrays(model: Any, folder: str) -> dict[str, np.ndarray]:
    """AOPC, insertion/deletion and Soft-NC/NS (dynamic and fixed routing) of the folder's
    AttnLRP attribution, through its target's head: keys ``eval/folder/what/field``."""
    from lens_attrib import attribute

    attr = attribute(model, inputs(folder), target(folder), method="attnlrp")
    return ref.perturbation_arrays(model, attr, folder)


def compute(models: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every case on ``models`` (folder name → loaded model), on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out: dict[str, np.ndarray] = {}
        for folder, method, options in CASES:
            out.update(case_arrays(models[folder], folder, method, options))
        for folder in EVAL_FOLDERS:
            out.update(evaluation_arrays(models[folder], folder))
        for folder, method, options in ABLATION_CASES:
            models[folder].add_hook(ref.ABLATED_HOOK, ref.ablate_head)
            try:
                out.update(case_arrays(models[folder], folder, method, options, "ablated/"))
            finally:
                models[folder].reset_hooks()
        return out
    finally:
        torch.set_num_threads(threads)


def load_reference() -> dict[str, np.ndarray]:
    with np.load(OUTPUTS) as data:
        return {key: data[key] for key in data.files}


def main() -> None:
    from lens_attrib import load_model

    with tempfile.TemporaryDirectory() as tmp:
        folders = write_folders(Path(tmp))
        models = {
            name: load_model(str(path), dtype=torch.float64, backend="hooked")
            for name, path in folders.items()
        }
        arrays = compute(models)
        for name, path in folders.items():
            arrays[f"{name}/{DIGEST_KEY}"] = digest(path)
    np.savez_compressed(OUTPUTS, **arrays)
    print(f"wrote {len(arrays)} arrays to {OUTPUTS}")


if __name__ == "__main__":
    main()
