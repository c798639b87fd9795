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
ARCHS = ("gpt2", "llama", "neox")

PROMPTS = ["the keys to the cabinet", "the author near the doors is"]

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

HOOKED_ONLY = ("value_zeroing",)
"""Methods the bridge refuses with a ModelError naming ``backend="hooked"`` (they run one block
alone, ``backend.block_forward``, which :mod:`lens_attrib.backend_bridge` does not support yet);
their reference arrays check the hooked backend only."""

CASES: list[tuple[str, str, dict[str, Any]]] = [
    *[(arch, method, {}) for arch in ARCHS for method in METHODS],
    *[(arch, "integrated_gradients", {"n_steps": 8}) for arch in ARCHS],
    *[(arch, "grad_x_input", {"heads": True}) for arch in ARCHS],
    *[(arch, "attnlrp", {"heads": True}) for arch in ARCHS],
    *[(arch, "alti_logit", {"trace_heads": True}) for arch in ARCHS],
]
FIELDS = ("scores", "layer_scores", "head_scores", "head_token_scores")

ABLATED_HOOK, ABLATED_HEAD = "blocks.1.attn.hook_z", 1
"""The user's own ablation in the ablation cases: head 1 of layer 1 zeroed at ``hook_z``."""
ABLATION_CASES: list[tuple[str, str, dict[str, Any]]] = [
    *[(arch, "alti_logit", {"trace_heads": True}) for arch in ARCHS],
    *[(arch, "attnlrp", {"heads": True}) for arch in ARCHS],
]


def ablate_head(z: torch.Tensor, hook: Any) -> torch.Tensor:
    """A user's hook: zero one head's output (a copy, returned)."""
    z = z.clone()
    z[:, :, ABLATED_HEAD] = 0.0
    return z


def target() -> Target:
    """Contrastive agreement target (the tiny tokenizer is word-level: no leading spaces)."""
    return Target(token=["are", "is"], foil=["is", "are"])


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


BUILDERS: dict[str, Callable[[int], Any]] = {"gpt2": _gpt2, "llama": _llama, "neox": _neox}


def write_folder(arch: str, folder: Path) -> None:
    """A tiny random checkpoint (every bias and norm gain random too) with a word tokenizer."""
    from lens_attrib.tiny_models import tiny_tokenizer

    torch.manual_seed(0)
    tok = tiny_tokenizer()
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
        models = {arch: load(ROOT / arch) for arch in ARCHS}
        out: dict[str, np.ndarray] = {}
        for arch, method, options in CASES:
            out.update(case_arrays(models[arch], arch, method, options))
        for arch in ARCHS:
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
    """The arrays of one case, keyed ``[prefix]arch/method/options/field``."""
    attr = attribute(model, PROMPTS, target(), method=method, **options)
    key = prefix + key_of(arch, method, options)
    return {
        f"{key}/{field}": getattr(attr, field).numpy()
        for field in FIELDS
        if getattr(attr, field) is not None
    }


def evaluation_arrays(model: Any, arch: str) -> dict[str, np.ndarray]:
    """Evaluation on the model's AttnLRP attribution (hard and soft perturbation, dynamic and
    fixed routing), a generation target and ReAGent: keys ``eval/arch/what/field``."""
    import warnings

    from lens_attrib.evaluation.faithfulness import aopc, insertion_deletion
    from lens_attrib.evaluation.soft import soft_metrics

    attr = attribute(model, PROMPTS, target(), method="attnlrp")
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
    out = {
        f"eval/{arch}/{what}/{field}": getattr(results[what], field).numpy()
        for what, names in fields.items()
        for field in names
    }
    generated = attribute(model, ["the keys"], Target(generate=2), method="grad_x_input")
    out[f"eval/{arch}/generation/scores"] = generated.scores.numpy()
    reagent = attribute(
        model, PROMPTS[:1], Target(token="is"), method="reagent", max_probe_steps=2, num_probes=2
    )
    out[f"eval/{arch}/reagent/scores"] = reagent.scores.numpy()
    return out


def main() -> None:
    from lens_attrib import load_model

    for arch in ARCHS:
        if not (ROOT / arch / "config.json").exists():
            write_folder(arch, ROOT / arch)
    arrays = compute(lambda folder: load_model(str(folder), dtype=torch.float64, backend="hooked"))
    np.savez_compressed(OUTPUTS, **arrays)
    print(f"wrote {len(arrays)} arrays to {OUTPUTS}")


if __name__ == "__main__":
    main()
