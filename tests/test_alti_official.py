"""ALTI and ALTI-Logit equal the official implementation (mt-upc/logit-explanations).

The fixtures in ``tests/fixtures/alti_official/<checkpoint>/`` hold two random float64 GPT-2
checkpoints and the numbers the official code computed on 24 token sequences each (see the
README there). On TransformerLens 4 the checkpoint loads as a ``TransformerBridge`` through
``load_model``, on 3.9 as a ``HookedTransformer`` built by hand. Every quantity is compared
item by item, relative to the item's largest |value|, with all items of a checkpoint in one
left-padded batch.

With ``l1_eps=1e-6`` (the ε the official ``pairwise_distance`` adds) everything agrees to 1e-12.
With the default plain L1 distance (``l1_eps=0``) the quantities that do not go through the ALTI
mixing matrices (per-head and per-layer logit terms on their own positions, MLP, b_O, embedding,
bias, logit) still agree to 1e-12; the mixing matrices, the rollout and the traced ALTI-Logit
scores differ by the effect of ε, which moves every contribution ``c_ij`` by up to ``d_model·ε``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lens_attrib import Target, attribute
from lens_attrib.methods.alti import alti_mixing_matrices
from lens_attrib.models import load_model
from tests.tl_versions import BRIDGE

FIXTURES = Path(__file__).parent / "fixtures" / "alti_official"
CHECKPOINTS = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
OFFICIAL_EPS = 1e-6
EXACT = 1e-12
#: Bound on the effect of the official ε on mixing-dependent quantities at ``l1_eps=0``
#: (measured at most 1.7e-5 on these fixtures; d_model·ε / ‖y_i‖₁ is of that order).
EPS_EFFECT = 5e-5
#: Quantities computed through the ALTI mixing matrices.
MIXED = ("scores", "layer_scores", "matrix")


def tolerance(name: str, l1_eps: float) -> float:
    if l1_eps == OFFICIAL_EPS or not name.startswith(MIXED):
        return EXACT
    return EPS_EFFECT


def hooked_gpt2(folder: Path) -> Any:
    """The HF checkpoint as a float64 HookedTransformer, weights loaded as stored (built by
    hand from the config, independently of ``load_model``)."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights
    from transformers import GPT2LMHeadModel

    hf = json.loads((folder / "config.json").read_text())
    cfg = HookedTransformerConfig(
        n_layers=hf["n_layer"],
        d_model=hf["n_embd"],
        n_heads=hf["n_head"],
        d_head=hf["n_embd"] // hf["n_head"],
        d_mlp=hf["n_inner"] or 4 * hf["n_embd"],
        d_vocab=hf["vocab_size"],
        n_ctx=hf["n_positions"],
        act_fn=hf["activation_function"],
        eps=hf["layer_norm_epsilon"],
        normalization_type="LN",
        positional_embedding_type="standard",
        original_architecture="GPT2LMHeadModel",
        default_prepend_bos=False,
        dtype=torch.float64,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpt2 = GPT2LMHeadModel.from_pretrained(folder, dtype=torch.float64)
        model = HookedTransformer(cfg)
    state = {k: v.detach().clone() for k, v in convert_gpt2_weights(gpt2, cfg).items()}
    state["unembed.b_U"] = torch.zeros(cfg.d_vocab, dtype=torch.float64)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith(("IGNORE", "mask")) for k in missing), missing
    assert all(p.dtype == torch.float64 for p in model.parameters())
    return model.eval()


def bridge_gpt2(folder: Path) -> Any:
    """The HF checkpoint as a float64 TransformerBridge (TransformerLens 4), through
    ``load_model`` as a user would load their own folder."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(str(folder), dtype=torch.float64)
    assert type(model).__name__ == "TransformerBridge"
    return model


@pytest.fixture(scope="module", params=CHECKPOINTS)
def checkpoint(request):
    folder = FIXTURES / request.param
    ref = dict(np.load(folder / "official.npz"))
    lengths = ref["lengths"]
    return {
        "name": request.param,
        "model": bridge_gpt2(folder) if BRIDGE else hooked_gpt2(folder),
        "ref": ref,
        "tokens": [ref["tokens"][i, :n].tolist() for i, n in enumerate(lengths)],
    }


def relative_error(ours: torch.Tensor, official: np.ndarray, what: str) -> float:
    """``max|ours − official| / max|official|`` of one item."""
    ref = torch.as_tensor(np.asarray(official))
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    assert torch.isfinite(ref).all() and ref.abs().max() > 0, what
    return float((ours - ref).abs().max() / ref.abs().max())


def assert_within(errors: dict[str, float], l1_eps: float) -> None:
    """Every quantity's worst item error is within its tolerance (the message lists all)."""
    report = ", ".join(f"{k}: {v:.2g}" for k, v in errors.items())
    bad = [k for k, v in errors.items() if not v <= tolerance(k, l1_eps)]
    assert not bad, f"relative errors above tolerance in {bad}: {report}"


def unpad(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Real positions of one left-padded item (last dimension)."""
    return x[..., mask]


@pytest.mark.parametrize("l1_eps", [0.0, OFFICIAL_EPS])
def test_alti_logit_equals_official(checkpoint, l1_eps):
    model, ref, tokens = checkpoint["model"], checkpoint["ref"], checkpoint["tokens"]
    target_ids, foil_ids = ref["target"].tolist(), ref["foil"].tolist()
    runs = {
        0: attribute(model, tokens, Target(token=target_ids), method="alti_logit", l1_eps=l1_eps),
        1: attribute(
            model,
            tokens,
            Target(token=target_ids, foil=foil_ids),
            method="alti_logit",
            l1_eps=l1_eps,
        ),
    }

    def official(key: str, i: int, contrastive: int, n: int) -> np.ndarray:
        """The official value of item i (target − foil when contrastive), real positions."""
        value = ref[key][i, 0] - ref[key][i, 1] if contrastive else ref[key][i, 0]
        return (
            value[..., :n] if value.shape and value.shape[-1] == ref["tokens"].shape[1] else value
        )

    errors: dict[str, float] = {}
    for contrastive, a in runs.items():
        for i, n in enumerate(ref["lengths"].tolist()):
            m = a.mask[i]
            assert int(m.sum()) == n
            checks = {
                "scores": (unpad(a.scores[i], m), "alti_logit"),
                "layer_scores": (unpad(a.layer_scores[i], m), "alti_logit_layers"),
                "head_token_scores": (unpad(a.head_token_scores[i], m), "head_logit"),
                "untraced layers": (unpad(a.head_token_scores[i].sum(1), m), "logit_layers"),
                "mlp": (a.parts["mlp"][i], "mlp_logit"),
                "attn_bias": (a.parts["attn_bias"][i], "b_o_logit"),
                "embedding": (a.parts["embedding"][i], "init_logit"),
                "bias": (a.parts["bias"][i], "lnf_bias_logit"),
                "logit": (a.parts["logit"][i], "model_logit"),
            }
            for what, (ours, key) in checks.items():
                err = relative_error(ours, official(key, i, contrastive, n), what)
                name = f"{what}{' (contrastive)' if contrastive else ''}"
                errors[name] = max(errors.get(name, 0.0), err)
    assert_within(errors, l1_eps)


@pytest.mark.parametrize("l1_eps", [0.0, OFFICIAL_EPS])
def test_alti_equals_official(checkpoint, l1_eps):
    model, ref, tokens = checkpoint["model"], checkpoint["ref"], checkpoint["tokens"]
    r = attribute(model, tokens, method="alti", l1_eps=l1_eps)
    _, _, mats = alti_mixing_matrices(model, tokens, l1_eps=l1_eps)
    errors: dict[str, float] = {}
    for i, n in enumerate(ref["lengths"].tolist()):
        m = r.mask[i]
        rollout = ref["alti_rollout_layers"][i, :, :n]
        found = {
            "scores": relative_error(unpad(r.scores[i], m), rollout[-1], "scores"),
            "layer_scores": relative_error(unpad(r.layer_scores[i], m), rollout, "layer_scores"),
        }
        for layer, mat in enumerate(mats):
            expected = ref["alti_matrices"][i, layer, :n, :n]
            found[f"matrix {layer}"] = relative_error(mat[i][m][:, m], expected, "matrix")
        for k, v in found.items():
            errors[k] = max(errors.get(k, 0.0), v)
    assert_within(errors, l1_eps)


def test_fixtures_tell_the_affine_conventions_apart(checkpoint):
    """The old convention (affine term in parts['attn_bias']) misses the official numbers."""
    model, ref, tokens = checkpoint["model"], checkpoint["ref"], checkpoint["tokens"]
    target = Target(token=ref["target"].tolist())
    a = attribute(model, tokens, target, method="alti_logit", affine="separate")
    r = attribute(model, tokens, method="alti", affine="separate")
    logit_err, alti_err = [], []
    for i, n in enumerate(ref["lengths"].tolist()):
        m = a.mask[i]
        logit_err.append(relative_error(a.scores[i][m], ref["alti_logit"][i, 0, :n], "scores"))
        rollout = ref["alti_rollout_layers"][i, -1, :n]
        alti_err.append(relative_error(r.scores[i][m], rollout, "alti"))
    assert max(logit_err) > 1e-2 and max(alti_err) > 1e-2, (max(logit_err), max(alti_err))
