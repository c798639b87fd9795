"""AttnLRP / CP-LRP equal LXT 2.1, Gradient×Input and Integrated Gradients equal Captum 0.9.

Oracle: relevances computed by the official packages (``lxt==2.1`` efficient AttnLRP and CP-LRP
monkey patches, ``captum==0.9.0`` ``InputXGradient`` and ``IntegratedGradients``) on the real
SmolLM2-135M-Instruct in float64 with transformers 4.52.4, stored in
``tests/fixtures/lxt_captum_smollm2/oracle.npz`` (how they were made: README.md there).
The library runs on its own TransformerLens port of the same GGUF weights, loaded in float64.

Items: 32 prompts without and with a leading BOS (id 1, ``<|im_start|>``), target = the model's
argmax at the last token; 8 prompts per BOS setting also as target − runner-up foil
(80 items). Error of an item: ``max_i |R_lib − R_ref| / max_i |R_ref|``, asserted ≤ 1e-6.

Integrated Gradients (50 steps, pad-token baseline with the first position kept) is tested on
prompt 0, with and without BOS and with and without a foil (4 items per quadrature: 50 float64
passes per item are slow on the CPU); the fixture holds 22 IG rows. Captum's ``riemann_trapezoid``
uses the nodes ``k/(n−1)`` of the library's ``rule="trapezoid"`` with weights ``1/n`` (ends
halved) instead of ``1/(n−1)``, so ``R_captum = (n−1)/n · R_lib`` exactly; Captum also rounds
its weights to float32, which leaves a uniform relative difference of 2.2e-8.
Gauss–Legendre (Captum's default) is tested the same way against ``rule="gausslegendre"``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lens_attrib import load_model
from lens_attrib.methods.registry import attribute
from lens_attrib.target import Target

FIXTURE = Path(__file__).parent / "fixtures" / "lxt_captum_smollm2" / "oracle.npz"
TOLERANCE = 1e-6
N_STEPS = 50
PAD_ID = 2
IG_TESTED_PROMPTS = (0,)
BATCH = 16  # items per attribution call (memory)
ORACLE_OF = {
    "attnlrp": "lxt_attnlrp",
    "lrp": "lxt_cp_lrp",
    "grad_x_input": "captum_input_x_gradient",
}


@pytest.fixture(scope="module")
def oracle() -> dict[str, np.ndarray]:
    with np.load(FIXTURE) as data:
        return {k: data[k] for k in data.files}


@pytest.fixture(scope="module")
def smollm2_f64() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model("smollm2-135m", dtype=torch.float64)


def item_ids(oracle: dict[str, np.ndarray], row: int) -> list[int]:
    return [int(t) for t in oracle["tokens"][row, : int(oracle["lengths"][row])]]


def item_reference(oracle: dict[str, np.ndarray], key: str, row: int) -> torch.Tensor:
    return torch.from_numpy(oracle[key][row, : int(oracle["lengths"][row])])


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def explain(
    model: Any, oracle: dict[str, np.ndarray], rows: list[int], method: str, **options: Any
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Real-token scores and explained values of ``rows`` (all with, or all without, a foil)."""
    foils = [int(oracle["foil"][r]) for r in rows]
    target = Target(
        token=[int(oracle["target"][r]) for r in rows],
        foil=foils if foils[0] >= 0 else None,
    )
    a = attribute(model, [item_ids(oracle, r) for r in rows], target, method=method, **options)
    scores = [a.scores[i][a.mask[i]].detach().cpu() for i in range(len(rows))]
    return scores, a.meta["explained_value"].detach().cpu()


def batches(oracle: dict[str, np.ndarray], size: int = BATCH) -> list[list[int]]:
    """Rows in batches of at most ``size`` items, all with or all without a foil."""
    plain = np.flatnonzero(oracle["foil"] < 0).tolist()
    contrastive = np.flatnonzero(oracle["foil"] >= 0).tolist()
    return [rows[i : i + size] for rows in (plain, contrastive) for i in range(0, len(rows), size)]


def test_fixture_tokens_are_the_library_tokenization(smollm2_f64, oracle) -> None:
    tokenizer = smollm2_f64.tokenizer
    assert tokenizer.bos_token_id == int(oracle["bos_id"])
    assert tokenizer.pad_token_id == PAD_ID == int(oracle["pad_id"])
    for row in range(len(oracle["tokens"])):
        text = str(oracle["prompts"][int(oracle["prompt_index"][row])])
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        expected = [int(oracle["bos_id"])] * bool(oracle["bos"][row]) + list(ids)
        assert item_ids(oracle, row) == expected


@pytest.mark.parametrize("method", sorted(ORACLE_OF))
def test_equals_official(smollm2_f64, oracle, method: str) -> None:
    worst = {False: 0.0, True: 0.0}
    for rows in batches(oracle):
        scores, values = explain(smollm2_f64, oracle, rows, method)
        for row, got, value in zip(rows, scores, values):
            want = item_reference(oracle, ORACLE_OF[method], row)
            bos = bool(oracle["bos"][row])
            worst[bos] = max(worst[bos], relative_error(got, want))
            assert float(value) == pytest.approx(float(oracle["value"][row]), rel=TOLERANCE)
    print(
        f"{method}: worst relative error without BOS {worst[False]:.3g}, with BOS {worst[True]:.3g}"
    )
    assert worst[False] <= TOLERANCE and worst[True] <= TOLERANCE, worst


def ig_baseline(model: Any, ids: list[int]) -> torch.Tensor:
    """Pad-token embedding everywhere except the first position, which keeps its own."""
    w_e = model.embed.W_E.detach()
    base = w_e[PAD_ID].expand(len(ids), -1).clone()
    base[0] = w_e[ids[0]]
    return base[None]


@pytest.mark.parametrize(
    ("rule", "reference", "captum_weight_ratio"),
    [
        # Captum's riemann_trapezoid: the library's nodes with weights summing to (n−1)/n
        ("trapezoid", "captum_ig_trapezoid", (N_STEPS - 1) / N_STEPS),
        ("gausslegendre", "captum_ig_gausslegendre", 1.0),  # Captum's default
    ],
)
def test_integrated_gradients_equals_captum(
    smollm2_f64, oracle, rule, reference, captum_weight_ratio
) -> None:
    rows = np.flatnonzero(np.isin(oracle["prompt_index"], IG_TESTED_PROMPTS)).tolist()
    assert rows and not np.isnan(oracle[reference][rows, 0]).any()
    for row in rows:
        ids = item_ids(oracle, row)
        foil = int(oracle["foil"][row])
        a = attribute(
            smollm2_f64,
            [ids],
            Target(token=int(oracle["target"][row]), foil=foil if foil >= 0 else None),
            method="integrated_gradients",
            baseline=ig_baseline(smollm2_f64, ids),
            rule=rule,
            n_steps=N_STEPS,
        )
        got = a.scores[0].detach().cpu() * captum_weight_ratio
        error = relative_error(got, item_reference(oracle, reference, row))
        print(f"integrated_gradients ({rule}) row {row}: relative error {error:.3g}")
        assert error <= TOLERANCE, row
        assert float(a.meta["baseline_value"][0]) == pytest.approx(
            float(oracle["ig_baseline_value"][row]), rel=TOLERANCE, abs=TOLERANCE
        )
