"""Generation steps share work: one forward per sequence for every step of a continuation.

The rows of a generation step batch of one prompt all hold the sequence prompt + continuation[:-1]
(``lens_attrib.methods.generation``). Gradient methods run that sequence once and take the ``S``
step gradients as batched vector–Jacobian products on one graph
(``lens_attrib.methods.backprop.step_gradients_at``; Grad-ELLM too, its q, k, v recorded once
per sequence); ALTI computes its mixing matrices once;
LogAt/NormXLogit read one forward. Oracles: every step equals its prefix explained alone (float64,
1e-10 of the array's scale) under the same user hook, a batch of prompts with different
continuation lengths equals one prompt at a time, per-step foils equal separate contrastive calls,
and the method runs the model exactly once per distinct sequence (counted by the user's own hook;
the step scores of ``meta["step_scores"]`` take one more no-grad forward).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

import lens_attrib.methods.backprop as backprop
import lens_attrib.methods.prefix_chunks as prefix_chunks
from lens_attrib import Target, attribute
from lens_attrib.fastpath import enable_fast_forward
from lens_attrib.inputs import to_batch
from lens_attrib.tiny_models import tiny_gpt2, tiny_llama
from tests.step_checks import check_step_row, close
from tests.tl_versions import BRIDGE

PROMPT = "the keys to the"
CONTINUATION = "cabinet is on"
SHARED = [
    "gradient",
    "grad_x_input",
    "lrp",
    "attnlrp",
    "alti_logit",
    "alti",
    "logat",
    "normxlogit",
    "grad_ellm",
    "grad_ellm:softmax",
    "grad_ellm:concat",
]
HEADS = {"gradient", "grad_x_input", "lrp", "attnlrp"}
ARRAYS = ("scores", "layer_scores", "head_scores", "head_token_scores")


@functools.cache
def _model(arch: str):
    """float64 tiny models; the Llama one with the fast path that ``load_model`` enables."""
    if arch == "gpt2":
        return tiny_gpt2(dtype=torch.float64)
    llama = tiny_llama(dtype=torch.float64)
    return llama if BRIDGE else enable_fast_forward(llama)  # the bridge: load_model's fused path


@contextmanager
def _user_hook(model) -> Iterator[list[int]]:
    """A user hook that changes the model (block 0's MLP output × 1.5) and records the number
    of sequences of every forward."""
    sizes: list[int] = []

    def hook(x, hook):
        sizes.append(int(x.shape[0]))
        return x * 1.5

    with model.hooks(fwd_hooks=[("blocks.0.hook_mlp_out", hook)]):
        yield sizes


def _options(method: str) -> dict:
    """Options of a ``SHARED`` entry (``"grad_ellm:softmax"``: Grad-ELLM with that similarity,
    every layer aggregated so that the earliest layers' gradients are checked too)."""
    if method.startswith("grad_ellm"):
        similarity = method.partition(":")[2] or "minmax"
        return {"method": "grad_ellm", "similarity": similarity, "n_layers": 2}
    return {"method": method, **({"heads": True} if method in HEADS else {})}


@pytest.mark.parametrize("method", SHARED)
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_one_forward_for_all_steps_equals_each_prefix(arch, method):
    model = _model(arch)
    prompt = to_batch(model, PROMPT).tokens[0].tolist()
    cont = model.tokenizer(CONTINUATION, add_special_tokens=False)["input_ids"]
    assert len(cont) >= 3
    with _user_hook(model) as sizes:
        forced = attribute(model, PROMPT, Target(continuation=CONTINUATION), **_options(method))
    # one no-grad forward for the step scores (generation.step_scores), one for the method
    assert sizes == [1, 1], f"{method}: forwards of {sizes} sequences, expected two of 1"
    for s, token in enumerate(cont):
        with _user_hook(model):
            single = attribute(
                model, torch.tensor(prompt + cont[:s]), Target(token=token), **_options(method)
            )
        check_step_row(forced, s, single, len(prompt) + s, f"{arch} {method} step {s}", ARRAYS)
    assert not model.hook_dict["blocks.0.hook_mlp_out"].fwd_hooks, "a hook outlived the call"


@pytest.mark.parametrize("method", ["attnlrp", "gradient", "normxlogit", "alti", "grad_ellm"])
def test_prompts_with_different_continuation_lengths_equal_one_at_a_time(method):
    model = _model("llama")
    prompts = ["the keys to the", "a dog", "the cabinet near the old"]
    conts = ["cabinet is on", "is", [5, 9]]
    with _user_hook(model) as sizes:
        batched = attribute(model, prompts, Target(continuation=conts), **_options(method))
    gradient_method = method in HEADS or method == "grad_ellm"
    # the step scores' forward of the 3 sequences, then the method's: a forward per prompt
    # (gradient methods: each prompt's backward stays on its own graph) or one of 3 sequences
    assert sizes == ([3, 1, 1, 1] if gradient_method else [3, 3]), sizes
    row = 0
    for prompt, cont in zip(prompts, conts, strict=True):
        with _user_hook(model):
            alone = attribute(model, prompt, Target(continuation=cont), **_options(method))
        for s in range(alone.scores.shape[0]):
            n_real = int(alone.mask[s].sum())
            check_step_row(batched, row, alone[s : s + 1], n_real, f"{method} row {row}", ARRAYS)
            row += 1
    assert row == batched.scores.shape[0]


@pytest.mark.parametrize("method", ["lrp", "normxlogit", "alti_logit", "gradient", "grad_ellm"])
def test_per_step_foils_on_the_shared_path(method):
    model = _model("gpt2")
    prompt = to_batch(model, PROMPT).tokens[0].tolist()
    cont = model.tokenizer(CONTINUATION, add_special_tokens=False)["input_ids"]
    foils = ["dog", "are", "near"]
    with _user_hook(model) as sizes:
        forced = attribute(
            model,
            PROMPT,
            Target(continuation=cont, foil=foils),
            **_options(method),
        )
    assert sizes == [1, 1]
    for s, (token, foil) in enumerate(zip(cont, foils, strict=True)):
        with _user_hook(model):
            single = attribute(
                model,
                torch.tensor(prompt + cont[:s]),
                Target(token=token, foil=foil),
                **_options(method),
            )
        assert int(forced.target.foil_ids[s]) == int(single.target.foil_ids[0])
        check_step_row(forced, s, single, len(prompt) + s, f"{method} foil step {s}", ARRAYS)


def test_alti_with_l1_eps_keeps_one_forward_per_step():
    """With ``l1_eps > 0`` a mixing row depends on the explained position (the official ε
    artifact), so steps are not shared; each still equals its prefix."""
    model = _model("llama")
    prompt = to_batch(model, PROMPT).tokens[0].tolist()
    cont = model.tokenizer(CONTINUATION, add_special_tokens=False)["input_ids"]
    with _user_hook(model) as sizes:
        forced = attribute(
            model, PROMPT, Target(continuation=cont), method="alti_logit", l1_eps=1e-6
        )
    assert sizes == [1, len(cont)]
    for s, token in enumerate(cont):
        with _user_hook(model):
            single = attribute(
                model,
                torch.tensor(prompt + cont[:s]),
                Target(token=token),
                method="alti_logit",
                l1_eps=1e-6,
            )
        check_step_row(forced, s, single, len(prompt) + s, f"l1_eps step {s}", ARRAYS)


def _toy_graph() -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    x = torch.randn(1, 6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 4, dtype=torch.float64)
    y = torch.tanh(x @ w).cumsum(1)  # causal mixing along positions
    unused = torch.zeros(1, 6, 2, dtype=torch.float64, requires_grad=True)
    values = (y[0, 2:] ** 2).sum(-1)  # 4 scalars at positions 2..5
    return values, [x, unused]


@pytest.mark.parametrize("chunk", [None, 3])
def test_batched_vjp_equals_one_backward_per_value(chunk):
    values, inputs = _toy_graph()
    expected = [
        torch.autograd.grad(values[i], inputs[0], retain_graph=True)[0]
        for i in range(values.shape[0])
    ]
    got = backprop.batched_vjp(values, inputs, torch.eye(4, dtype=values.dtype), chunk=chunk)
    for i, e in enumerate(expected):
        close(got[0][i], e, f"value {i}")
    assert got[0].shape == (4, 1, 6, 4)
    assert torch.equal(got[1], torch.zeros(4, 1, 6, 2, dtype=torch.float64))


def test_batched_vjp_falls_back_one_by_one(monkeypatch):
    """A graph with an operation that has no batching rule gives the same numbers."""
    values, inputs = _toy_graph()
    expected = backprop.batched_vjp(values, inputs, torch.eye(4, dtype=values.dtype))
    real = torch.autograd.grad

    def no_vmap(*args, **kwargs):
        if kwargs.get("is_grads_batched"):
            raise RuntimeError("vmap: no batching rule implemented for this operation")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", no_vmap)
    values, inputs = _toy_graph()
    got = backprop.batched_vjp(values, inputs, torch.eye(4, dtype=values.dtype), chunk=3)
    for a, b in zip(got, expected, strict=True):
        close(a, b, "fallback")


IG_META = ("explained_value", "baseline_value", "completeness_gap", "prepended_sink")


def _check_ig_meta(forced, row: int, single, what: str) -> None:
    for key in IG_META:
        a, b = forced.meta[key][row], single.meta[key][0]
        if isinstance(a, bool):
            assert a == b, f"{what}: {key} {a} vs {b}"
        else:
            close(torch.as_tensor(a), torch.as_tensor(b), f"{what} {key}")


IG_CASES = [
    ("gpt2", {}),
    ("llama", {}),
    ("llama", {"baseline": "mean", "keep_sink": True}),
    ("gpt2", {"baseline": "pad", "embeddings": "full", "rule": "trapezoid"}),
    ("gpt2", {"keep_sink": False}),
    ("llama", {"start_token": False}),  # ids without a start token: a sink is prepended
]


@pytest.mark.parametrize(("arch", "options"), IG_CASES)
def test_integrated_gradients_fixed_steps_share_the_path(arch, options):
    """IG with a fixed ``n_steps``: one path per sequence (per node batch one forward and the
    step gradients as batched VJPs; ``f(x)``, ``f(b)`` of all steps one forward each); every step
    equals IG on its prefix alone, meta included."""
    model = _model(arch)
    options = dict(options)
    start = options.pop("start_token", True)
    prompt = to_batch(model, PROMPT).tokens[0].tolist()
    if not start:
        prompt = prompt[1:] if to_batch(model, PROMPT).special[0, 0] else prompt
    cont = model.tokenizer(CONTINUATION, add_special_tokens=False)["input_ids"]
    ig = {"method": "integrated_gradients", "n_steps": 3, **options}
    with _user_hook(model) as sizes:
        forced = attribute(model, torch.tensor(prompt), Target(continuation=cont), **ig)
    # step scores; f's target; f(x); f(b); the 3 nodes in one forward
    assert sizes == [1, 1, 1, 1, 3], sizes
    assert forced.meta["prepended_sink"] == [not start] * len(cont)
    for s, token in enumerate(cont):
        with _user_hook(model):
            single = attribute(model, torch.tensor(prompt + cont[:s]), Target(token=token), **ig)
        check_step_row(forced, s, single, len(prompt) + s, f"{arch} ig step {s}", ARRAYS)
        _check_ig_meta(forced, s, single, f"{arch} ig step {s}")
    assert not model.hook_dict["blocks.0.hook_mlp_out"].fwd_hooks, "a hook outlived the call"


def test_integrated_gradients_shared_per_step_foils_and_prompt_batch():
    model = _model("llama")
    ig = {"method": "integrated_gradients", "n_steps": 2}
    prompts = ["the keys to the", "a dog"]
    conts = [
        model.tokenizer(c, add_special_tokens=False)["input_ids"] for c in ["cabinet is", "is"]
    ]
    foils = [["dog", "are", "near"], ["the"]]
    foil_ids = [[model.tokenizer.convert_tokens_to_ids(f) for f in fs] for fs in foils]
    foil_ids = [fs[: len(c)] for fs, c in zip(foil_ids, conts, strict=True)]
    assert len(conts[0]) > 1 and len(conts[1]) != len(conts[0])
    with _user_hook(model) as sizes:
        batched = attribute(model, prompts, Target(continuation=conts, foil=foil_ids), **ig)
    assert sizes == [2, 2, 1, 1, 2, 1, 1, 2], sizes
    row = 0
    for prompt, cont, fs in zip(prompts, conts, foil_ids, strict=True):
        ids = to_batch(model, prompt).tokens[0].tolist()
        c_ids = cont
        for s, (token, foil) in enumerate(zip(c_ids, fs, strict=True)):
            with _user_hook(model):
                single = attribute(
                    model, torch.tensor(ids + c_ids[:s]), Target(token=token, foil=foil), **ig
                )
            assert int(batched.target.foil_ids[row]) == foil
            n_real = int(batched.mask[row].sum()) - (len(c_ids) - 1 - s)
            check_step_row(batched, row, single, n_real, f"ig foil row {row}", ARRAYS)
            _check_ig_meta(batched, row, single, f"ig foil row {row}")
            row += 1
    assert row == batched.scores.shape[0]


def test_integrated_gradients_auto_keeps_one_path_per_step():
    """The adaptive default has per-step nodes: no sharing (one f(x) forward per step)."""
    model = _model("gpt2")
    with _user_hook(model) as sizes:
        attribute(model, PROMPT, Target(continuation="cabinet is"), method="integrated_gradients")
    assert sizes[:2] == [1, 2], sizes


@pytest.mark.parametrize(("arch", "options"), IG_CASES)
def test_integrated_gradients_prefix_chunks_equal_each_prefix(arch, options, monkeypatch):
    """Without user hooks the shared path runs in chunks of positions through the key–value
    cache, every step's backward stopping at its chunk's end
    (``integrated_gradients.chunked_path_integral``); every step still equals IG on its prefix
    alone, meta included."""
    import lens_attrib.methods.integrated_gradients as ig_module

    model = _model(arch)
    options = dict(options)
    start = options.pop("start_token", True)
    prompt = to_batch(model, PROMPT).tokens[0].tolist()
    if not start:
        prompt = prompt[1:] if to_batch(model, PROMPT).special[0, 0] else prompt
    cont = model.tokenizer(CONTINUATION + " the", add_special_tokens=False)["input_ids"]
    assert len(cont) >= 4
    used: list[list[int]] = []
    real = ig_module.chunked_path_integral

    def spy(*args):
        used.append(list(args[-1]))
        return real(*args)

    monkeypatch.setattr(ig_module, "chunked_path_integral", spy)
    monkeypatch.setattr(prefix_chunks, "PREFIX_CHUNKS", 3)
    ig = {"method": "integrated_gradients", "n_steps": 3, "step_batch": 2, **options}
    forced = attribute(model, torch.tensor(prompt), Target(continuation=cont), **ig)
    length = len(prompt) + len(cont) - 1 + int(not start)
    assert len(used) == 1 and len(used[0]) == 3 and used[0][-1] == length, used
    for s, token in enumerate(cont):
        single = attribute(model, torch.tensor(prompt + cont[:s]), Target(token=token), **ig)
        check_step_row(forced, s, single, len(prompt) + s, f"{arch} chunked ig step {s}", ARRAYS)
        _check_ig_meta(forced, s, single, f"{arch} chunked ig step {s}")
    assert len(used) == 1, "a single prefix has one step: nothing to chunk"


def test_prefix_bounds_split_the_step_positions():
    assert prefix_chunks.prefix_bounds([5, 6, 7, 8, 9, 10, 11, 12], 4) == [7, 9, 11, 13]
    assert prefix_chunks.prefix_bounds([5, 6, 7], 4) == [6, 7, 8]
    assert prefix_chunks.prefix_bounds([3, 4, 5, 6, 7], 2) == [5, 8]
