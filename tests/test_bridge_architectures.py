"""The newer decoder families as TransformerLens 4 bridges, against transformers and TL 3.9.

Gemma, Gemma 2, Phi-3, Mixtral, Qwen2, Qwen3 and Mistral booted by
``load_model(folder, backend="bridge")`` (``TransformerBridge.boot_transformers``):

- logits equal transformers' own model of the same folder (float64 made float64 throughout,
  :func:`tests.test_architectures.float64_throughout`; float32 to float32 rounding);
- every registered method gives what the TransformerLens 3.9 backend gives on the same folder
  (``tests/fixtures/architectures/outputs.npz``, made by ``python -m
  tests.architecture_reference`` under 3.9: TL 3.9 and 4 cannot be installed together) to
  ≤ 1e-10 of each array's largest magnitude, or raises the same error (class and message, up to
  the backend's name);
- the mixture-of-experts families TransformerLens 3.9 has no converter for (Qwen2-MoE, Qwen3-MoE):
  every method runs (or refuses as on Mixtral), batched == single, and CP-LRP conserves.

Under TransformerLens 3.9 the bridge tests are skipped (``tests/test_architectures.py`` covers the
hooked backend) and a sample of the reference cases is recomputed, to show that the file still
describes the hooked backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lens_attrib import Target, attribute, load_model
from lens_attrib.errors import ModelError
from lens_attrib.hooks.guard import model_state_fingerprint
from lens_attrib.models import transformer_lens_major
from tests import architecture_reference as ref
from tests.backend_reference import HOOKED_ONLY

F64 = torch.float64
TOLERANCE = 1e-10
BRIDGE = transformer_lens_major() >= 4
BRIDGE_ONLY = ("qwen2_moe", "qwen3_moe")
"""Mixture-of-experts families TransformerLens 4 boots and 3.9 does not convert."""

needs_bridge = pytest.mark.skipif(not BRIDGE, reason="TransformerLens ≥ 4 not installed")


@pytest.fixture(scope="module")
def bridge_only_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from lens_attrib.tiny_models import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("bridge-moe")
    return {f: save_tiny_checkpoint(f, root / f) for f in BRIDGE_ONLY}


def folder_of(family: str, bridge_only_folders: dict[str, Path]) -> Path:
    return bridge_only_folders[family] if family in BRIDGE_ONLY else ref.ROOT / family


@pytest.fixture(scope="module")
def bridges() -> dict[str, Any]:
    if not BRIDGE:
        pytest.skip("TransformerLens ≥ 4 not installed")
    return {f: load_model(str(ref.ROOT / f), dtype=F64, backend="bridge") for f in ref.FAMILIES}


def transformers_logits(folder: Path, dtype: torch.dtype) -> torch.Tensor:
    """transformers' own logits of ``folder`` (eager experts: its grouped matmul takes no
    float64), float64 throughout in float64."""
    from transformers import AutoModelForCausalLM

    from tests.test_architectures import IDS, float64_throughout, reference_logits

    config = (folder / "config.json").read_text()
    moe = '"num_local_experts"' in config or '"num_experts"' in config
    kwargs = {"experts_implementation": "eager"} if moe else {}
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).eval()
    if dtype == F64:
        float64_throughout(hf_model)
    return reference_logits(hf_model, IDS)


@needs_bridge
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("family", [*ref.FAMILIES, *BRIDGE_ONLY])
def test_bridge_logits_equal_transformers(family, dtype, bridge_only_folders):
    from tests.test_architectures import IDS
    from tests.test_architectures import TOLERANCE as LOGIT_TOLERANCE

    folder = folder_of(family, bridge_only_folders)
    model = load_model(str(folder), dtype=dtype, backend="bridge")
    assert all(p.dtype == dtype for p in model.parameters())
    with torch.no_grad():
        ours = model(IDS)
    theirs = transformers_logits(folder, dtype)
    assert ours.dtype == dtype
    worst = float((ours - theirs).abs().max() / theirs.abs().max())
    assert worst <= LOGIT_TOLERANCE[dtype], f"{family} {dtype}: max relative |Δ| = {worst:.3e}"


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    with np.load(ref.OUTPUTS) as data:
        return {key: data[key] for key in data.files}


def _case_id(case: tuple[str, str, dict[str, Any]]) -> str:
    return ref.key_of(*case).rstrip("/")


@needs_bridge
@pytest.mark.parametrize("case", ref.CASES, ids=_case_id)
def test_every_method_equals_the_hooked_backend(case, bridges, reference):
    """The bridge's Attribution equals TransformerLens 3.9's (or its refusal is the same)."""
    family, method, options = case
    model = bridges[family]
    key = ref.key_of(family, method, options)
    before = model_state_fingerprint(model)
    got = ref.case_arrays(model, family, method, options)
    assert model_state_fingerprint(model) == before
    if f"{key}/error" in reference:
        assert set(got) == {f"{key}/error"}, "the 3.9 backend refuses this case"
        assert str(got[f"{key}/error"]) == str(reference[f"{key}/error"])
        return
    if method in HOOKED_ONLY and f"{key}/error" in got:  # not on the bridge yet
        assert "backend='hooked'" in str(got[f"{key}/error"])
        return
    expected = {k for k in reference if k.startswith(key + "/")}
    assert set(got) == expected, got.get(f"{key}/error")
    for name, value in got.items():
        scale = float(np.abs(reference[name]).max())
        err = float(np.abs(value - reference[name]).max())
        assert err <= TOLERANCE * scale, f"{name}: {err:.2e} > {TOLERANCE:.0e} · {scale:.2e}"


# --------------------------------------------------------------------------- bridge-only MoE
@pytest.fixture(scope="module")
def moe_bridges(bridge_only_folders) -> dict[str, Any]:
    return {
        f: load_model(str(bridge_only_folders[f]), dtype=F64, backend="bridge") for f in BRIDGE_ONLY
    }


@needs_bridge
@pytest.mark.parametrize("method", ref.method_names())
@pytest.mark.parametrize("family", BRIDGE_ONLY)
def test_bridge_moe_method_runs_batched_equal_single_or_refuses(moe_bridges, family, method):
    """Every method runs on Qwen2-MoE / Qwen3-MoE (the padded row equals its unbatched run, the
    bridge is unchanged) or refuses as it does on Mixtral under 3.9 (the reference's error)."""
    from tests.test_architectures import IDS_BATCH

    model = moe_bridges[family]
    options = ref.FAST_OPTIONS.get(method, {})
    before = model_state_fingerprint(model)
    with np.load(ref.OUTPUTS) as data:
        mixtral_error = data.get(f"{ref.key_of('mixtral', method, options)}/error")
    if mixtral_error is not None:
        with pytest.raises(ModelError) as err:
            attribute(model, IDS_BATCH, method=method, **options)
        assert ref.error_text(err.value) == str(mixtral_error)
        assert model_state_fingerprint(model) == before
        return
    if method in HOOKED_ONLY:
        pytest.skip(f"{method} runs one block alone: not on the bridge yet")
    batched = attribute(model, IDS_BATCH, method=method, **options)
    assert model_state_fingerprint(model) == before
    assert torch.isfinite(batched.scores).all()
    assert bool(batched.mask[1, 0]) is False  # the short row is left-padded
    single = attribute(model, IDS_BATCH[1:], method=method, **options)
    ours, theirs = batched.scores[1][batched.mask[1]], single.scores[0]
    assert ours.shape == theirs.shape == (len(IDS_BATCH[1]),)
    if method not in ("random", "reagent"):  # random draws per call
        gap = float((ours - theirs).abs().max()) / (float(theirs.abs().max()) or 1.0)
        assert gap <= 1e-8, f"batched != single: {gap:.2e}"


@needs_bridge
@pytest.mark.parametrize("family", ["mixtral", *BRIDGE_ONLY])
def test_bridge_moe_lrp_conserves_without_biases(family, bridge_only_folders):
    """CP-LRP with the exact identity rule: with every bias zero the detached network is linear
    in the input embeddings, so the relevances sum to the explained logit. This needs the
    routing weights (and Qwen2-MoE's sigmoid gate of the shared expert) detached and each
    expert's gate detached: one expert or gate missed adds or drops its share."""
    from tests.test_architectures import IDS_BATCH

    model = load_model(str(folder_of(family, bridge_only_folders)), dtype=F64, backend="bridge")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.zero_()
    a = attribute(model, IDS_BATCH, Target(token=5), method="lrp", identity_eps=0.0)
    value = a.meta["explained_value"]
    gap = float((a.scores.sum(-1) - value).abs().max() / value.abs().max())
    assert gap <= 1e-10, f"{family}: Σ R − f = {gap:.2e} (relative)"
    # the attention, router and experts all carry relevance: not a trivially linear model
    plain = attribute(model, IDS_BATCH, Target(token=5), method="grad_x_input")
    assert float((plain.scores.sum(-1) - value).abs().max()) > 1e-6 * float(value.abs().max())


HOOKED_SAMPLE = [case for case in ref.CASES if case[2] in ({"heads": True}, {"trace_heads": True})]
"""Cases the 3.9 suite recomputes (AttnLRP head relevances and ALTI-Logit with traced heads on
every family: the norm, attention, MLP and MoE paths of the backend)."""


@pytest.mark.skipif(BRIDGE, reason="TransformerLens 3.9 not installed (HookedTransformer)")
@pytest.mark.parametrize("case", HOOKED_SAMPLE, ids=_case_id)
def test_the_reference_describes_the_hooked_backend(case, reference, hooked):
    family, method, options = case
    if family not in hooked:
        hooked[family] = load_model(str(ref.ROOT / family), dtype=F64, backend="hooked")
    model = hooked[family]
    got = ref.case_arrays(model, family, method, options)
    key = ref.key_of(family, method, options)
    assert set(got) == {k for k in reference if k.startswith(key + "/")}
    for name, value in got.items():
        if name.endswith("/error"):
            assert str(value) == str(reference[name])
            continue
        scale = float(np.abs(reference[name]).max())
        assert float(np.abs(value - reference[name]).max()) <= TOLERANCE * scale, name


@pytest.fixture(scope="module")
def hooked() -> dict[str, Any]:
    """HookedTransformers of the reference folders, loaded on first use."""
    return {}
