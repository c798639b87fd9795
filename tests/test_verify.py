"""verify(model): every check passes on healthy tiny models, and each check can fail.

Oracles: on tiny GPT-2, Llama (grouped-query) and BERT models in float64 and float32 every
applicable check passes and the rest say n/a with a reason; each check is then shown to catch a
deliberately broken case (an IG budget too small, a corrupted LRP option, methods whose
reported gaps or parts are falsified, a batch-dependent attention hook, a dtype-dependent hook, a
method that edits a weight); the model is unchanged after verify (compared independently).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from lens_attrib import ModelError, OptionError, Target, TargetError, VerifyReport, verify
from lens_attrib.classifiers.linear import new_head
from lens_attrib.hooks.guard import model_state_fingerprint
from lens_attrib.methods import METHODS
from lens_attrib.methods.registry import MethodOutput
from lens_attrib.tiny_models import tiny_bert, tiny_gpt2, tiny_llama
from lens_attrib.verify import CHECKS, CheckRow, VerificationError, sum_tolerance
from tests.tl_versions import BRIDGE

F64 = torch.float64
BUILDERS = {"gpt2": tiny_gpt2, "llama": tiny_llama, "bert": tiny_bert}


def statuses(report: VerifyReport) -> dict[tuple[str, str | None], str]:
    return {(r.check, r.method): r.status for r in report.rows}


def corrupt(monkeypatch: pytest.MonkeyPatch, method: str, edit: Any) -> None:
    """Register ``method`` with a core whose output ``edit(model, out)`` falsifies."""
    spec = METHODS[method]

    def core(model: Any, batch: Any, target: Any, **options: Any) -> MethodOutput:
        out = spec.core(model, batch, target, **options)
        edit(model, out)
        return out

    monkeypatch.setitem(METHODS, method, dataclasses.replace(spec, core=core))


# ------------------------------------------------------------------ healthy models pass
@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_every_check_passes_on_tiny_models(arch, dtype, capsys) -> None:
    model = BUILDERS[arch](dtype=dtype)
    before = model_state_fingerprint(model)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    capsys.readouterr()  # the builder's own messages
    report = verify(model)
    assert capsys.readouterr().out == ""  # prints nothing unless asked
    assert report.ok, str(report)
    report.raise_if_failed()
    expected_na = set()
    if dtype == F64:
        expected_na |= {r for r in statuses(report) if r[0] == "float32_vs_float64"}
    if arch == "bert":
        expected_na.add(("alti_logit_decomposition", "alti_logit"))
    for key, status in statuses(report).items():
        assert status == ("n/a" if key in expected_na else "pass"), (key, str(report))
    assert {r.check for r in report.rows} == set(CHECKS)
    for row in report.rows:
        assert isinstance(row, CheckRow)
        if row.status == "pass":
            assert row.error is not None and row.tolerance is not None
            assert 0 <= row.error <= row.tolerance
        else:
            assert row.detail  # n/a says why
    # the model is as it was (checked here independently of verify's own row)
    assert model_state_fingerprint(model) == before
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_na_rows_give_the_reason() -> None:
    report = verify(tiny_bert(dtype=F64), checks=["alti_logit_decomposition", "float32_vs_float64"])
    alti = report.row("alti_logit_decomposition")
    assert alti.status == "n/a" and "does not apply" in alti.detail and "alti" in alti.detail
    assert report.row("float32_vs_float64", "alti").detail == "the model is already float64"
    one = verify(
        tiny_gpt2(dtype=F64), ["the keys to the cabinet"], checks=["batched_equals_single"]
    )
    assert {r.status for r in one.rows if r.check == "batched_equals_single"} == {"n/a"}
    assert report.ok  # n/a is not a failure


def test_plain_function_head_is_na_for_copies() -> None:
    model = tiny_gpt2(dtype=F64)
    head = new_head(model, 3)

    def as_function(x: torch.Tensor) -> torch.Tensor:
        return head(x)

    report = verify(model, target=Target(head=as_function), checks=["lrp_conservation"])
    assert report.row("lrp_conservation").status == "n/a"
    assert "nn.Module" in report.row("lrp_conservation").detail


def test_class_head_is_copied_with_the_model() -> None:
    # LinearHead calls the model's own ln_final: the copy's head must call the copy's, or the
    # LRP patches (installed on the copy) would miss it and conservation would fail.
    model = tiny_gpt2(dtype=F64)
    head = new_head(model, 3)
    with torch.no_grad():
        head.linear.weight.normal_(generator=torch.Generator().manual_seed(1))
        head.linear.bias.fill_(0.3)
    report = verify(model, target=Target(head=head), checks=["lrp_conservation", "attnlrp_gap"])
    assert report.ok, str(report)
    assert float(head.linear.bias.detach()[0]) == 0.3  # the user's head is untouched


def test_headless_encoder_gets_a_probe_head() -> None:
    model = tiny_bert(dtype=F64)
    model.lens_attrib_no_lm_head = True
    report = verify(model, checks=["lrp_conservation", "ig_completeness", "batched_equals_single"])
    assert "probe" in report.target
    assert report.ok and all(r.status == "pass" for r in report.rows), str(report)


# ------------------------------------------------------------------ each check can fail
def test_ig_budget_too_small_fails() -> None:
    model = tiny_gpt2(dtype=F64)
    report = verify(
        model, options={"integrated_gradients": {"n_steps": 2}}, checks=["ig_completeness"]
    )
    row = report.row("ig_completeness")
    assert row.status == "fail" and row.error is not None and row.tolerance == 0.01
    assert row.error > row.tolerance
    assert "n_steps=2" in row.detail
    with pytest.raises(VerificationError, match="ig_completeness"):
        report.raise_if_failed()


def test_lrp_with_a_wrong_identity_rule_fails() -> None:
    model = tiny_gpt2(dtype=F64)  # GELU MLP: the identity rule applies (CP-LRP detaches gates)
    report = verify(model, options={"lrp": {"identity_eps": 0.5}}, checks=["lrp_conservation"])
    assert report.row("lrp_conservation").status == "fail", str(report)
    assert not report.ok


def test_lrp_conservation_catches_a_one_in_a_billion_error(monkeypatch) -> None:
    def scale(model: Any, out: MethodOutput) -> None:
        out.scores = out.scores * (1 + 1e-9)

    corrupt(monkeypatch, "lrp", scale)
    report = verify(tiny_gpt2(dtype=F64), checks=["lrp_conservation"])
    assert report.row("lrp_conservation").status == "fail"


def test_attnlrp_with_a_misreported_gap_fails(monkeypatch) -> None:
    corrupt(
        monkeypatch,
        "attnlrp",
        lambda m, out: out.meta.update(completeness_gap=out.meta["completeness_gap"] * 0.99),
    )
    report = verify(tiny_gpt2(dtype=F64), checks=["attnlrp_gap"])
    assert report.row("attnlrp_gap").status == "fail"


def test_deeplift_whose_relevances_do_not_sum_fails(monkeypatch) -> None:
    def scale(model: Any, out: MethodOutput) -> None:
        out.scores = out.scores * 1.01  # the reported gap no longer matches

    corrupt(monkeypatch, "deeplift", scale)
    report = verify(tiny_gpt2(dtype=F64), checks=["deeplift_summation"])
    row = report.row("deeplift_summation")
    assert row.status == "fail" and "not the true one" in row.detail


def test_alti_logit_with_a_wrong_part_fails(monkeypatch) -> None:
    def shift(model: Any, out: MethodOutput) -> None:
        out.parts["mlp"] = out.parts["mlp"] + 1e-6

    corrupt(monkeypatch, "alti_logit", shift)
    report = verify(tiny_llama(dtype=F64), checks=["alti_logit_decomposition"])
    assert report.row("alti_logit_decomposition").status == "fail"


def test_batch_dependent_attention_fails_batched_equals_single() -> None:
    model = tiny_gpt2(dtype=F64)

    def mix_batch(pattern: torch.Tensor, hook: Any) -> torch.Tensor:
        # attention that depends on the other items of the batch: batched != single
        return 0.9 * pattern + 0.1 * pattern.mean(0, keepdim=True)

    model.blocks[1].attn.hook_pattern.add_hook(mix_batch)
    report = verify(model, checks=["batched_equals_single"])
    assert report.row("batched_equals_single", "grad_x_input").status == "fail", str(report)
    assert report.row("model_unchanged").status == "pass"  # the user's own hook stays
    assert len(model.blocks[1].attn.hook_pattern.fwd_hooks) == 1


def test_dtype_dependent_model_fails_float32_vs_float64() -> None:
    model = tiny_llama(dtype=torch.float32)

    def float32_only(x: torch.Tensor, hook: Any) -> torch.Tensor:
        return x * 1.001 if x.dtype == torch.float32 else x

    model.blocks[0].hook_resid_post.add_hook(float32_only)
    report = verify(model, checks=["float32_vs_float64"])
    assert report.row("float32_vs_float64", "grad_x_input").status == "fail", str(report)


def test_a_method_that_edits_a_weight_fails_model_unchanged(monkeypatch) -> None:
    def edit(model: Any, out: MethodOutput) -> None:
        with torch.no_grad():
            model.blocks[0].ln1.w.mul_(1.001)

    corrupt(monkeypatch, "grad_x_input", edit)
    model = tiny_gpt2(dtype=F64)
    report = verify(model, checks=["batched_equals_single"])
    row = report.row("model_unchanged")
    assert row.status == "fail" and "blocks.0.ln1.w" in row.detail


def test_a_crashing_method_is_a_failure_and_html_is_escaped(monkeypatch) -> None:
    def boom(model: Any, out: MethodOutput) -> None:
        raise RuntimeError("<b>boom</b>")

    corrupt(monkeypatch, "deeplift", boom)
    report = verify(tiny_gpt2(dtype=F64), checks=["deeplift_summation"])
    row = report.row("deeplift_summation")
    assert row.status == "fail" and "RuntimeError" in row.detail
    page = report._repr_html_()
    assert "&lt;b&gt;boom&lt;/b&gt;" in page and "<b>boom" not in page
    text = str(report)
    assert "FAILED" in text and "deeplift_summation" in text and "tolerance" in text


# ------------------------------------------------------------------ tolerances and API
def test_sum_tolerance_follows_the_dtype() -> None:
    assert sum_tolerance(F64, 3, 32) < 1e-13 < sum_tolerance(torch.float32, 3, 32) < 1e-4
    assert sum_tolerance(torch.bfloat16, 30, 576) == 0.05


def test_bad_check_names_and_options_are_errors() -> None:
    model = tiny_gpt2(dtype=F64)
    with pytest.raises(ValueError, match="unknown checks"):
        verify(model, checks=["conservation"])
    with pytest.raises(OptionError, match="unknown method"):
        verify(model, options={"ig": {"n_steps": 8}})
    with pytest.raises(OptionError, match="n_step"):
        verify(model, options={"integrated_gradients": {"n_step": 8}})


def test_verbose_prints_rows(capsys) -> None:
    model = tiny_gpt2(dtype=F64)
    capsys.readouterr()
    verify(model, checks=["lrp_conservation"], verbose=True)
    out = capsys.readouterr().out
    assert "lrp_conservation (lrp): pass" in out and "model_unchanged" in out


def test_a_wrong_target_or_nan_weights_are_errors_not_na_rows() -> None:
    model = tiny_gpt2(dtype=F64)
    with pytest.raises(TargetError):
        verify(model, target=Target(token="the dog"))  # two tokens
    with pytest.raises(TargetError, match="generate"):
        verify(model, target=Target(generate=2))
    with torch.no_grad():
        model.blocks[1].attn.W_Q[0, 0, 0] = float("nan")
    # the parameter named as the model names it: a bridge by its Hugging Face module's path
    named = (
        r"transformer\.h\.1\._original_component\.attn\.q\." if BRIDGE else r"blocks\.1\.attn\.W_Q"
    )
    with pytest.raises(ModelError, match=named):
        verify(model)


# ------------------------------------------------------------------ the bundled real models
def test_smollm2_passes_the_fast_checks(smollm2) -> None:
    fast = ["lrp_conservation", "alti_logit_decomposition", "batched_equals_single"]
    report = verify(smollm2, checks=fast)
    assert report.ok and all(r.status == "pass" for r in report.rows), str(report)


def test_minilm_passes_every_check_with_a_probe_head(minilm) -> None:
    report = verify(minilm)
    assert report.ok, str(report)
    assert "probe" in report.target
    assert report.row("alti_logit_decomposition").status == "n/a"
    assert report.row("lrp_conservation").status == "pass"
