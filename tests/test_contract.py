"""The contract every registered method keeps, checked for each method on each tiny architecture
it applies to (parametrised over ``METHODS``, in the manner of Captum's ``test_config``).

For every method × {GPT-2, Llama (GQA), GPT-NeoX, BERT} where its spec says it applies:

- batched with padding == one item at a time, for every array of the result (scores, layer,
  head and head-token scores, parts) and every per-item ``meta`` entry;
- the model is left exactly as it was (the guard's fingerprint: hooks, ``.grad`` identity,
  ``requires_grad``, training mode, dtype, device; and every weight's value), starting from a
  state that is not the default one (training mode, a ``.grad`` present, a frozen parameter);
- every array is finite and detached, also when the caller runs the method under
  ``torch.no_grad()`` or ``torch.inference_mode()`` (where gradient methods must still work
  and give the same numbers), and editable in place when made outside ``inference_mode``;
- padding and, for causal models, every position after the explained one score exactly 0;
- the arrays have the model's dtype, and a float32 model's result is close to the float64
  model's;
- where a method does not apply (architecture, per-head relevances) it raises the library's
  error naming a method that does;
- its results are labelled target-free (reports, plots) exactly when its spec says so.

Stochastic methods run with their ``seed`` option fixed; slow ones with their cheapest options
(:data:`CHEAP`). A method added to the registry is added here automatically.

Tolerances (relative to the largest |value| of each array of the reference result):

- batched vs one at a time, float64: :data:`BATCHING_TOL` = 1e-12. Padding is exact (masked
  keys get probability 0, padded rows are dropped), so only the order and blocking of the float
  sums differ between a padded batch and a single item: a few hundred roundings of u = 1.1e-16
  each in these 3-layer models (measured: at most 2e-14).
- float32 vs float64: :data:`FLOAT32_TOL` = 1e-4. float32's unit roundoff is 6e-8; the methods
  amplify it by up to ~10³ (DeepLIFT's Rescale multipliers divide by input differences, IG and
  LRP sum signed terms that cancel). Measured: at most 8e-6.
- quantities that are differences of the explained value and a sum (``*_gap`` in ``meta``,
  ALTI-Logit's ``parts["hooks"]``: ~1e-16 without user hooks) are measured against the
  explained value, whose rounding they carry, not against their own (tiny) size.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from model_state import model_state, state_changes

from lens_attrib import ModelError, OptionError, Target, attribute
from lens_attrib.attribution import Attribution
from lens_attrib.display import TARGET_FREE_LABEL
from lens_attrib.methods.registry import METHODS, MethodSpec
from lens_attrib.tiny_models import tiny_bert, tiny_gpt2, tiny_llama, tiny_pythia

pytestmark = pytest.mark.filterwarnings(
    "ignore:reagent. no probe .* met the stopping condition:RuntimeWarning"  # the cheap options
)

ARCHS = {"gpt2": tiny_gpt2, "llama": tiny_llama, "pythia": tiny_pythia, "bert": tiny_bert}
ENCODERS = {"bert"}

PROMPTS = ["the keys to the cabinet near the table", "a dog sees", "the author near the books is"]
TOKENS = ["is", "are", "is"]
FOIL = "the"
POSITION = -2  # decoders: the last real token comes after the explained one

CHEAP: dict[str, dict[str, Any]] = {
    "integrated_gradients": {"n_steps": 4},
    "reagent": {"max_probe_steps": 4, "num_probes": 2},
    "grad_ellm": {"n_layers": 2},
}
"""The cheapest options of the slow methods (every other method runs with its defaults)."""

HEAD_OPTIONS = ("heads", "trace_heads")
"""Boolean options that add per-head arrays: switched on, so that those arrays are checked too."""

BATCHING_TOL = 1e-12
FLOAT32_TOL = 1e-4

CALL_LEVEL_META = {"seconds", "step_batch"}
"""``meta`` entries that describe the call, not the item: the wall time, and IG's rows per
forward (chosen from the free memory and the padded length)."""

POSITION_DIMS = {"scores": 1, "layer_scores": 2, "head_token_scores": 3}
"""The position dimension of the token-indexed arrays of an Attribution."""


def applies(spec: MethodSpec, arch: str) -> bool:
    return spec.encoder if arch in ENCODERS else spec.decoder


CASES = [(name, arch) for name, spec in METHODS.items() for arch in ARCHS if applies(spec, arch)]
NOT_APPLICABLE = [
    (name, arch) for name, spec in METHODS.items() for arch in ARCHS if not applies(spec, arch)
]
IDS = [f"{name}-{arch}" for name, arch in CASES]

DISCRETE = {"reagent"}
"""Methods whose scores follow discrete choices made from compared logits (ReAGent: which tokens
to keep, when a probe stops): a float32 near-tie may choose otherwise on another CPU, so only
their dtype is checked against float64, not their values."""
CONTINUOUS = [(name, arch) for name, arch in CASES if name not in DISCRETE]


def options_of(name: str) -> dict[str, Any]:
    spec = METHODS[name]
    options = dict(CHEAP.get(name, {}))
    options.update({key: True for key in HEAD_OPTIONS if key in spec.options})
    if "seed" in spec.options:
        options["seed"] = 0
    return options


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: these tensors are tiny (d_model 32), so more threads only add their
    barriers, which dominate on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def tiny(arch: str, dtype: torch.dtype) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ARCHS[arch](dtype=dtype)


@contextmanager
def unusual_state(model: Any) -> Iterator[None]:
    """Training mode, a ``.grad`` on one parameter and another frozen: the guard must restore
    exactly this, not the default state."""
    params = list(model.parameters())
    params[0].grad = torch.zeros_like(params[0])
    params[1].requires_grad_(False)
    model.train()
    try:
        yield
    finally:
        model.eval()
        params[0].grad = None
        params[1].requires_grad_(True)


@dataclass
class Run:
    attribution: Attribution
    changes: list[str]


@functools.cache
def batched(name: str, arch: str, dtype: torch.dtype) -> Run:
    """The method on the padded batch, from an unusual model state; what the call changed."""
    model = tiny(arch, dtype)
    target = Target(token=TOKENS, foil=FOIL, position=POSITION)
    with unusual_state(model):
        before = model_state(model)
        attr = attribute(model, PROMPTS, target, method=name, **options_of(name))
        changes = state_changes(model, before)
    return Run(attr, changes)


CALLER_MODES = (torch.no_grad, torch.inference_mode, contextlib.nullcontext)
"""The autograd mode the caller runs item ``i`` alone in: gradient methods must work, and give
the same numbers, under the caller's ``no_grad`` or ``inference_mode`` too."""


@functools.cache
def one_at_a_time(name: str, arch: str) -> list[Run]:
    """The method on each prompt alone (float64), item ``i`` under ``CALLER_MODES[i]``."""
    model = tiny(arch, torch.float64)
    singles = []
    for prompt, token, mode in zip(PROMPTS, TOKENS, CALLER_MODES, strict=True):
        target = Target(token=token, foil=FOIL, position=POSITION)
        before = model_state(model)
        with mode():
            attr = attribute(model, prompt, target, method=name, **options_of(name))
        singles.append(Run(attr, state_changes(model, before)))
    return singles


def arrays(attr: Attribution) -> dict[str, torch.Tensor]:
    """Every tensor of an Attribution's result, by name (``parts.*`` and ``meta.*`` included)."""
    found = {"scores": attr.scores}
    for key in ("layer_scores", "head_scores", "head_token_scores"):
        value = getattr(attr, key)
        if value is not None:
            found[key] = value
    found.update({f"parts.{k}": v for k, v in attr.parts.items()})
    found.update({f"meta.{k}": v for k, v in attr.meta.items() if isinstance(v, torch.Tensor)})
    return found


def scale_of(name: str, reference: Attribution, array: torch.Tensor) -> float:
    """The size an array's error is measured against (module docstring)."""
    own = float(array.detach().abs().max()) if array.numel() else 0.0
    if "gap" in name or name == "parts.hooks":
        explained = reference.meta.get("explained_value", reference.parts.get("logit"))
        assert explained is not None, f"{name}: no explained value to measure it against"
        return max(own, float(explained.abs().max()))
    return own


def real_positions(got: torch.Tensor, mask: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """``got`` (one item of a padded batch) at the real tokens along each dimension whose size
    differs from ``expected``'s (the item alone has no padding)."""
    assert got.ndim == expected.ndim, (tuple(got.shape), tuple(expected.shape))
    for dim in range(got.ndim):
        if got.shape[dim] != expected.shape[dim]:
            assert got.shape[dim] == mask.shape[0], (dim, tuple(got.shape), tuple(expected.shape))
            got = got.index_select(dim, torch.nonzero(mask).flatten())
    return got


def assert_close(name: str, got: torch.Tensor, expected: torch.Tensor, scale: float, tol: float):
    assert got.shape == expected.shape, (name, tuple(got.shape), tuple(expected.shape))
    if not expected.is_floating_point():
        assert torch.equal(got, expected), name
        return
    error = float((got.double() - expected.double()).abs().max()) if got.numel() else 0.0
    assert error <= tol * scale, f"{name}: max |difference| {error:.3g} > {tol:g} × {scale:.3g}"


def assert_same_meta(name: str, got: Any, expected: Any) -> None:
    """Equal non-tensor meta (lists per item, token labels, options, ...)."""
    if isinstance(got, list | tuple):
        assert isinstance(expected, list | tuple) and len(got) == len(expected), name
        for a, b in zip(got, expected, strict=True):
            assert_same_meta(name, a, b)
    elif isinstance(got, dict):
        assert isinstance(expected, dict) and got.keys() == expected.keys(), name
        for key in got:
            assert_same_meta(f"{name}.{key}", got[key], expected[key])
    elif isinstance(got, torch.Tensor):
        assert isinstance(expected, torch.Tensor) and torch.equal(got, expected), name
    else:
        assert got == expected, f"{name}: {got!r} (batched) != {expected!r} (alone)"


# --------------------------------------------------------------------------- the contract
@pytest.mark.parametrize(("name", "arch"), CASES, ids=IDS)
def test_batched_with_padding_equals_one_at_a_time(name: str, arch: str) -> None:
    attr = batched(name, arch, torch.float64).attribution
    assert not attr.mask.all(), "the batch must contain padding"
    for item, run in enumerate(one_at_a_time(name, arch)):
        alone, sub = run.attribution, attr[item]
        mask = sub.mask[0]
        expected_arrays = arrays(alone)
        got_arrays = arrays(sub)
        assert got_arrays.keys() == expected_arrays.keys(), (item, sorted(got_arrays))
        for key, expected in expected_arrays.items():
            got = real_positions(got_arrays[key][0], mask, expected[0])
            scale = scale_of(key, alone, expected)
            assert_close(f"item {item} {key}", got, expected[0], scale, BATCHING_TOL)
        assert sub.tokens == alone.tokens
        assert torch.equal(sub.target.token_ids, alone.target.token_ids)
        assert sub.meta.keys() == alone.meta.keys()
        for key, value in alone.meta.items():
            if key not in CALL_LEVEL_META and not isinstance(value, torch.Tensor):
                assert_same_meta(f"item {item} meta.{key}", sub.meta[key], value)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize(("name", "arch"), CASES, ids=IDS)
def test_the_model_is_left_exactly_as_it_was(name: str, arch: str, dtype: torch.dtype) -> None:
    assert batched(name, arch, dtype).changes == []
    if dtype == torch.float64:  # also when the caller is in no_grad or inference_mode
        assert [run.changes for run in one_at_a_time(name, arch)] == [[], [], []]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize(("name", "arch"), CASES, ids=IDS)
def test_results_are_finite_detached_editable_and_in_the_models_dtype(
    name: str, arch: str, dtype: torch.dtype
) -> None:
    results = [batched(name, arch, dtype).attribution]
    if dtype == torch.float64:
        results += [run.attribution for run in one_at_a_time(name, arch)]  # CALLER_MODES
    for attr in results:
        assert attr.meta["dtype"] == str(dtype)
        for key, value in arrays(attr).items():
            assert not value.requires_grad, key
            if value.is_floating_point():
                assert value.dtype == dtype, (key, value.dtype)
                assert torch.isfinite(value).all(), key
            if not value.is_inference():  # made outside the caller's inference_mode
                value.mul_(1)  # an ordinary tensor the user may edit (not an expanded view)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize(("name", "arch"), CASES, ids=IDS)
def test_padding_and_positions_after_the_explained_one_score_exactly_zero(
    name: str, arch: str, dtype: torch.dtype
) -> None:
    attr = batched(name, arch, dtype).attribution
    positions = torch.arange(attr.mask.shape[1])
    silent = ~attr.mask
    if arch not in ENCODERS:
        after = positions[None, :] > attr.target.positions[:, None]
        assert after.any(dim=1).all(), "every item must have positions after the explained one"
        silent = silent | after
    for key, dim in POSITION_DIMS.items():
        value = getattr(attr, key)
        if value is None:
            continue
        for item in range(len(attr)):
            at = value[item].index_select(dim - 1, torch.nonzero(silent[item]).flatten())
            assert (at == 0).all(), (key, item)


@pytest.mark.parametrize(("name", "arch"), CONTINUOUS, ids=[f"{n}-{a}" for n, a in CONTINUOUS])
def test_float32_is_close_to_float64(name: str, arch: str) -> None:
    reference = batched(name, arch, torch.float64).attribution
    result = batched(name, arch, torch.float32).attribution
    expected_arrays = arrays(reference)
    got_arrays = arrays(result)
    assert got_arrays.keys() == expected_arrays.keys()
    for key, expected in expected_arrays.items():
        scale = scale_of(key, reference, expected)
        assert_close(key, got_arrays[key], expected, scale, FLOAT32_TOL)


@pytest.mark.parametrize(("name", "arch"), CASES, ids=IDS)
def test_the_explained_label_is_target_free_exactly_when_the_spec_is(name: str, arch: str) -> None:
    attr = batched(name, arch, torch.float64).attribution
    labels = [attr.explained_label(item) for item in range(len(attr))]
    if METHODS[name].target_free:
        assert labels == [TARGET_FREE_LABEL] * len(attr)
    else:
        assert labels == [f"{token!r} − {FOIL!r}" for token in TOKENS]


@pytest.mark.parametrize(
    ("name", "arch"), NOT_APPLICABLE, ids=[f"{n}-{a}" for n, a in NOT_APPLICABLE]
)
def test_where_a_method_does_not_apply_the_error_names_one_that_does(name: str, arch: str) -> None:
    spec = METHODS[name]
    assert spec.instead is not None and applies(METHODS[spec.instead], arch), name
    model = tiny(arch, torch.float64)
    before = model_state(model)
    with pytest.raises(ModelError, match=repr(spec.instead)):
        attribute(model, PROMPTS, method=name)
    assert state_changes(model, before) == []


@pytest.mark.parametrize(
    "name", [n for n, s in METHODS.items() if "heads" not in s.options and s.decoder]
)
def test_heads_true_without_that_option_names_a_method_that_takes_it(name: str) -> None:
    takes_heads = [n for n, s in METHODS.items() if "heads" in s.options]
    with pytest.raises(OptionError) as info:
        attribute(tiny("gpt2", torch.float64), PROMPTS, method=name, heads=True)
    message = str(info.value)
    assert "heads" in message
    if not METHODS[name].head_relevances:
        assert any(repr(other) in message for other in takes_heads), message


def test_every_registered_method_is_checked_on_every_architecture_it_claims() -> None:
    assert {name for name, _ in CASES} == set(METHODS)
    assert all(key in METHODS for key in CHEAP)
    for name, options in CHEAP.items():
        METHODS[name].resolve_options(options)  # the cheap options are valid
    for arch in ARCHS:
        assert any(a == arch for _, a in CASES)
