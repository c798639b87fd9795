"""Prefix chunks (``lens_attrib.methods.prefix_chunks``): without user hooks, the sequence of a
forced continuation runs chunk by chunk through the key–value cache and every step's backward
stops at its chunk's end (Saliency, Gradient×Input, Integrated Gradients with a fixed
``n_steps``).

Oracles (float64, 1e-10 of each array's scale): every step row equals its prefix explained alone
(a single target, no step batch, no chunks) — GPT-2 and Llama tiny models, per-step foils, a
batch of prompts of different lengths (left padding) and per-head relevances; the chunked run
equals the one-forward path (``PREFIX_CHUNKS = 1``). The backward work is counted, not timed:
the cotangent rows × positions of every vector–Jacobian product. Under a user hook the
one-forward path runs: the hook sees whole sequences and its position-indexed edit is honoured.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import lens_attrib.methods.backprop as backprop
import lens_attrib.methods.prefix_chunks as prefix_chunks
from lens_attrib import Target, attribute
from lens_attrib.errors import ModelError
from lens_attrib.fastpath import enable_fast_forward
from lens_attrib.inputs import to_batch
from lens_attrib.models import transformer_lens_major
from lens_attrib.tiny_models import tiny_gpt2, tiny_llama
from tests.step_checks import check_step_row, close
from tests.tl_versions import BRIDGE

PROMPTS = ["the keys to the", "a dog", "the cabinet near the old red"]
CONTINUATIONS = ["cabinet is on the", "is here", "door was"]
FOILS = ["dog", "are", "near", "a"]
ARRAYS = ("scores", "head_scores", "head_token_scores")


@pytest.fixture(autouse=True)
def _step_gradient_chunks(monkeypatch):
    """Saliency and Gradient×Input chunk only when asked (``STEP_GRADIENT_CHUNKS``, off by
    default: slower on CPU); these tests ask."""
    monkeypatch.setattr(prefix_chunks, "STEP_GRADIENT_CHUNKS", True)


@functools.cache
def _model(arch: str) -> Any:
    if arch == "gpt2":
        return tiny_gpt2(dtype=torch.float64)
    llama = tiny_llama(dtype=torch.float64)
    return llama if BRIDGE else enable_fast_forward(llama)  # the bridge: load_model's fused path


def _ids(model: Any, text: str) -> list[int]:
    return list(model.tokenizer(text, add_special_tokens=False)["input_ids"])


def _case(model: Any) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Prompt ids (start token included), continuation ids and per-step foil ids of PROMPTS."""
    prompts = [to_batch(model, p).tokens[0].tolist() for p in PROMPTS]
    conts = [_ids(model, c) for c in CONTINUATIONS]
    foil_ids = [model.tokenizer.convert_tokens_to_ids(f) for f in FOILS]
    foils = [
        [foil_ids[(i + s) % len(foil_ids)] for s in range(len(c))] for i, c in enumerate(conts)
    ]
    assert len({len(p) for p in prompts}) == len(prompts), "prompts of different lengths"
    assert min(len(c) for c in conts) >= 2
    return prompts, conts, foils


def _spy(monkeypatch: Any, module: Any, name: str, calls: list[int] | None = None) -> list[int]:
    """Count the calls of ``module.name`` (in ``calls``, a new list by default)."""
    calls = [] if calls is None else calls
    real = getattr(module, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


GRADIENT_CASES = [
    ("gpt2", {"method": "gradient", "heads": True}),
    ("gpt2", {"method": "grad_x_input", "heads": True}),
    ("llama", {"method": "gradient", "norm": "l1"}),
    ("llama", {"method": "grad_x_input", "heads": True}),
]


@pytest.mark.parametrize(("arch", "options"), GRADIENT_CASES)
def test_chunked_steps_equal_each_prefix_alone(arch, options, monkeypatch):
    """A batch of prompts of different lengths with per-step foils: the chunked run (used once
    for the whole batch) equals every prefix explained alone, per-head relevances included."""
    model = _model(arch)
    prompts, conts, foils = _case(model)
    chunked = _spy(monkeypatch, prefix_chunks, "chunked_step_gradients_at")
    batched = attribute(model, PROMPTS, Target(continuation=conts, foil=foils), **options)
    assert chunked == [1], "the chunked path did not run"
    row = 0
    for prompt, cont, fs in zip(prompts, conts, foils, strict=True):
        for s, (token, foil) in enumerate(zip(cont, fs, strict=True)):
            single = attribute(
                model, torch.tensor(prompt + cont[:s]), Target(token=token, foil=foil), **options
            )
            assert int(batched.target.foil_ids[row]) == foil
            what = f"{arch} {options['method']} row {row}"
            check_step_row(batched, row, single, len(prompt) + s, what, ARRAYS)
            if "explained_value" in single.meta:
                close(
                    torch.as_tensor(batched.meta["explained_value"][row]),
                    torch.as_tensor(single.meta["explained_value"][0]),
                    f"{what} explained_value",
                )
            row += 1
    assert row == batched.scores.shape[0]


CHUNKED_VS_ONE_FORWARD = [
    ("gpt2", {"method": "gradient", "heads": True}),
    ("llama", {"method": "grad_x_input", "heads": True}),
    ("gpt2", {"method": "integrated_gradients", "n_steps": 3, "step_batch": 2}),
    ("llama", {"method": "integrated_gradients", "n_steps": 2, "baseline": "mean"}),
]


@pytest.mark.parametrize(("arch", "options"), CHUNKED_VS_ONE_FORWARD)
def test_chunked_equals_the_one_forward_path(arch, options, monkeypatch):
    model = _model(arch)
    _, conts, foils = _case(model)
    target = Target(continuation=conts, foil=foils)
    chunked = attribute(model, PROMPTS, target, **options)
    monkeypatch.setattr(prefix_chunks, "PREFIX_CHUNKS", 1)
    one_forward = attribute(model, PROMPTS, target, **options)
    for name in ARRAYS:
        a, b = getattr(chunked, name), getattr(one_forward, name)
        assert (a is None) == (b is None)
        if a is not None:
            close(a, b, f"{arch} {options['method']} {name}")
    for key in ("explained_value", "baseline_value", "completeness_gap"):
        if key in one_forward.meta:
            close(
                torch.as_tensor(chunked.meta[key]),
                torch.as_tensor(one_forward.meta[key]),
                f"{arch} {options['method']} {key}",
            )


def _count_backward(monkeypatch: Any, modules: list[Any]) -> list[int]:
    """Per vector–Jacobian product: cotangent rows (steps × node rows) × the positions the
    inputs span (one hook name: the token embedding)."""
    counts: list[int] = []
    real = backprop.batched_vjp

    def counting(output, inputs, cotangents, *args, **kwargs):
        rows = int(cotangents.shape[0]) * (int(cotangents.shape[1]) if cotangents.ndim == 4 else 1)
        counts.append(rows * sum(int(x.shape[1]) for x in inputs))
        return real(output, inputs, cotangents, *args, **kwargs)

    for module in modules:
        monkeypatch.setattr(module, "batched_vjp", counting)
    return counts


@pytest.mark.parametrize(
    "options",
    [
        {"method": "gradient"},
        {"method": "grad_x_input"},
        {"method": "integrated_gradients", "n_steps": 2, "step_batch": 2},
    ],
)
def test_chunks_back_propagate_fewer_step_positions(options, monkeypatch):
    """Counted, not timed: the one-forward path back-propagates every step over all ``L``
    positions (``S · L`` per node row), the chunks ``Σ_k S_k e_k``; both give the same scores."""
    import lens_attrib.methods.integrated_gradients as ig_module
    from lens_attrib.backend import embedding_hooks

    model = _model("llama")
    prompt = to_batch(model, PROMPTS[2]).tokens[0].tolist()
    cont = _ids(model, CONTINUATIONS[0] + " " + CONTINUATIONS[2])
    embeddings = "full" if options["method"] == "grad_x_input" else "partial"
    assert len(embedding_hooks(to_batch(model, PROMPTS[2]).arch, embeddings)) == 1
    n_steps, length = len(cont), len(prompt) + len(cont) - 1
    rows = options.get("n_steps", 1)
    positions = [len(prompt) - 1 + s for s in range(n_steps)]
    bounds = prefix_chunks.prefix_bounds(positions, prefix_chunks.PREFIX_CHUNKS)
    assert len(bounds) == prefix_chunks.PREFIX_CHUNKS and bounds[-1] == length

    counts = _count_backward(monkeypatch, [prefix_chunks, backprop, ig_module])
    chunked = attribute(model, torch.tensor(prompt), Target(continuation=cont), **options)
    chunked_count = sum(counts)
    counts.clear()
    monkeypatch.setattr(prefix_chunks, "PREFIX_CHUNKS", 1)
    one_forward = attribute(model, torch.tensor(prompt), Target(continuation=cont), **options)
    one_forward_count = sum(counts)

    assert one_forward_count == rows * n_steps * length
    expected = rows * sum(next(e for e in bounds if p < e) for p in positions)
    assert (
        chunked_count == expected == rows * prefix_chunks.backward_step_positions(positions, bounds)
    )
    assert chunked_count < one_forward_count
    close(chunked.scores, one_forward.scores, f"{options['method']} scores")


USER_HOOK_METHODS = [
    {"method": "gradient"},
    {"method": "grad_x_input"},
    {"method": "integrated_gradients", "n_steps": 2},
]


@pytest.mark.parametrize("options", USER_HOOK_METHODS)
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_user_hook_sees_whole_sequences_and_its_edit_is_honoured(arch, options, monkeypatch):
    """A user's position-indexed edit (block 0's output at position 1 × 1.5): with it the
    one-forward path runs (no chunk forward), the hook sees only whole sequences, and every step
    equals its prefix explained alone under the same hook — which differs from the unhooked
    explanation, so the edit was applied."""
    model = _model(arch)
    prompt = to_batch(model, PROMPTS[0]).tokens[0].tolist()
    cont = _ids(model, CONTINUATIONS[0])
    lengths: list[int] = []

    def edit(x: torch.Tensor, hook: Any) -> torch.Tensor:
        lengths.append(int(x.shape[1]))
        scale = torch.ones(x.shape[1], 1, dtype=x.dtype, device=x.device)
        scale[1] = 1.5
        return x * scale

    hooks = [("blocks.0.hook_resid_post", edit)]
    import lens_attrib.methods.integrated_gradients as ig_module

    chunk_forwards = _spy(monkeypatch, prefix_chunks, "chunked_forward")
    _spy(monkeypatch, ig_module, "chunked_forward", chunk_forwards)
    with model.hooks(fwd_hooks=hooks):
        hooked = attribute(model, torch.tensor(prompt), Target(continuation=cont), **options)
    assert not chunk_forwards, "chunks ran under a user hook"
    length = len(prompt) + len(cont) - 1
    assert lengths and set(lengths) == {length}, f"the hook saw lengths {sorted(set(lengths))}"
    plain = attribute(model, torch.tensor(prompt), Target(continuation=cont), **options)
    assert chunk_forwards, "without the hook the chunks run"
    for s, token in enumerate(cont):
        lengths.clear()
        with model.hooks(fwd_hooks=hooks):
            single = attribute(
                model, torch.tensor(prompt + cont[:s]), Target(token=token), **options
            )
        assert set(lengths) == {len(prompt) + s}
        what = f"{arch} {options['method']} step {s}"
        check_step_row(hooked, s, single, len(prompt) + s, what, ARRAYS)
    change = float((hooked.scores - plain.scores).abs().max())
    assert change > 1e-3 * float(plain.scores.abs().max()), "the edit changed nothing"
    assert not model.hook_dict["blocks.0.hook_resid_post"].fwd_hooks, "a hook outlived the call"


def test_saliency_chunks_only_when_asked(monkeypatch):
    model = _model("llama")
    _, conts, _ = _case(model)
    chunk_forwards = _spy(monkeypatch, prefix_chunks, "chunked_forward")
    monkeypatch.setattr(prefix_chunks, "STEP_GRADIENT_CHUNKS", False)
    attribute(model, PROMPTS, Target(continuation=conts), method="grad_x_input")
    assert not chunk_forwards


def test_a_cache_that_disagrees_with_the_full_forward_keeps_the_one_forward_path(monkeypatch):
    """The probe (``prefix_chunks.cache_agrees``): a backend whose cached forward ignores the
    cache (here: every chunk gets a fresh one) is not chunked, and the numbers are those of the
    one-forward path."""
    model = _model("llama")
    _, conts, _ = _case(model)
    target = Target(continuation=conts)
    expected = attribute(model, PROMPTS, target, method="gradient")
    real = prefix_chunks.cached_final_residual

    def forgetful(model, arch, tokens, cache):
        return real(model, arch, tokens, prefix_chunks.key_value_cache(model, arch, 1, "cpu"))

    monkeypatch.setattr(prefix_chunks, "cached_final_residual", forgetful)
    batch = to_batch(model, PROMPTS[0])
    assert not prefix_chunks.cache_agrees(model, batch.arch)
    chunk_forwards = _spy(monkeypatch, prefix_chunks, "chunked_forward")
    got = attribute(model, PROMPTS, target, method="gradient")
    assert not chunk_forwards
    close(got.scores, expected.scores, "one-forward path")


# ----------------------------------------------------------------- TransformerLens 4's bridge
needs_bridge = pytest.mark.skipif(
    transformer_lens_major() < 4, reason="TransformerLens ≥ 4 not installed"
)


@functools.cache
def _bridge(arch: str) -> Any:
    from lens_attrib import load_model
    from tests import backend_reference as ref

    return load_model(str(ref.ROOT / arch), dtype=torch.float64, backend="bridge")


@needs_bridge
@pytest.mark.parametrize(
    "options",
    [
        {"method": "gradient"},
        {"method": "grad_x_input", "heads": True},
        {"method": "integrated_gradients", "n_steps": 2},
    ],
)
@pytest.mark.parametrize("arch", ["gpt2", "llama", "neox"])
def test_bridge_chunks_equal_each_prefix_alone(arch, options, monkeypatch):
    """On the bridge the chunks run through Hugging Face's ``DynamicCache``
    (``backend_bridge.cached_final_residual``): a batch of prompts of different lengths with
    per-step foils equals every prefix explained alone and the one-forward path."""
    import lens_attrib.methods.integrated_gradients as ig_module

    model = _bridge(arch)
    prompts = [to_batch(model, p).tokens[0].tolist() for p in PROMPTS[:2]]
    conts = [_ids(model, c) for c in (" cabinet is on the", " is here")]
    vocab = int(model.cfg.d_vocab)
    foils = [[(7 * (i + 1) + s) % vocab for s in range(len(c))] for i, c in enumerate(conts)]
    target = Target(continuation=conts, foil=foils)
    chunk_forwards = _spy(monkeypatch, prefix_chunks, "chunked_forward")
    _spy(monkeypatch, ig_module, "chunked_forward", chunk_forwards)
    batched = attribute(model, PROMPTS[:2], target, **options)
    assert chunk_forwards, "the chunks did not run on the bridge"
    row = 0
    for prompt, cont, fs in zip(prompts, conts, foils, strict=True):
        for s, (token, foil) in enumerate(zip(cont, fs, strict=True)):
            single = attribute(
                model, torch.tensor(prompt + cont[:s]), Target(token=token, foil=foil), **options
            )
            check_step_row(
                batched, row, single, len(prompt) + s, f"bridge {arch} row {row}", ARRAYS
            )
            row += 1
    monkeypatch.setattr(prefix_chunks, "PREFIX_CHUNKS", 1)
    one_forward = attribute(model, PROMPTS[:2], target, **options)
    for name in ARRAYS:
        a, b = getattr(batched, name), getattr(one_forward, name)
        if b is not None:
            close(a, b, f"bridge {arch} {name} vs one forward")


@needs_bridge
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_bridge_attention_reads_the_cache_only_with_past_key_values(arch, monkeypatch):
    """transformers 5 passes the cache to attention as ``cache=``; TransformerLens 4's GPT-2 and
    Llama attention bridges read ``past_key_values=``. Without the mapping of
    ``cached_final_residual`` the cache stays empty: the chunked residual is wrong, the call is
    a ModelError, and the probe keeps the one-forward path."""
    from lens_attrib import backend_bridge
    from lens_attrib.backend import arch_of, cached_final_residual, key_value_cache
    from lens_attrib.hooks.guard import model_guard

    model = _bridge(arch)
    arch_facts = arch_of(model)
    tokens = torch.tensor([[3, 5, 7, 9]])
    with model_guard(model), torch.no_grad():
        cache = key_value_cache(model, arch_facts, 1, tokens.device)
        cached_final_residual(model, arch_facts, tokens[:, :2], cache)
        assert int(cache.get_seq_length()) == 2
        assert prefix_chunks.cache_agrees(model, arch_facts)
        monkeypatch.setattr(backend_bridge, "_attention_bridges", lambda model: [])
        cache = key_value_cache(model, arch_facts, 1, tokens.device)
        with pytest.raises(ModelError, match="cache grew by 0 positions"):
            cached_final_residual(model, arch_facts, tokens[:, :2], cache)
        assert not prefix_chunks.cache_agrees(model, arch_facts)


@pytest.mark.parametrize(
    "options", [{"method": "gradient"}, {"method": "integrated_gradients", "n_steps": 2}]
)
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_pad_token_ids_in_the_sequence_are_real_tokens(arch, options, monkeypatch):
    """The pad-token id as a real token of prompt and continuation (SmolLM2's ``<|im_end|>``
    ends every chat turn): a cached forward must not hide it (TransformerLens 3 builds a missing
    attention mask from the tokenizer), so chunks equal the one-forward path and each prefix.
    The continuation's pad token is special as in the prefix's own batch (IG keeps it off the
    path; ``generation.steps_of`` marked continuation tokens never special before)."""
    import lens_attrib.methods.integrated_gradients as ig_module

    model = _model(arch)
    pad = int(model.tokenizer.pad_token_id)
    prompt = to_batch(model, PROMPTS[0]).tokens[0].tolist()
    prompt = [*prompt[:2], pad, *prompt[2:]]
    words = _ids(model, CONTINUATIONS[0])
    cont = [words[0], pad, *words[1:]]
    chunk_forwards = _spy(monkeypatch, prefix_chunks, "chunked_forward")
    _spy(monkeypatch, ig_module, "chunked_forward", chunk_forwards)
    chunked = attribute(model, torch.tensor(prompt), Target(continuation=cont), **options)
    assert chunk_forwards, "the chunks did not run"
    for s, token in enumerate(cont):
        single = attribute(model, torch.tensor(prompt + cont[:s]), Target(token=token), **options)
        check_step_row(chunked, s, single, len(prompt) + s, f"{arch} pad step {s}", ARRAYS)
    monkeypatch.setattr(prefix_chunks, "PREFIX_CHUNKS", 1)
    one_forward = attribute(model, torch.tensor(prompt), Target(continuation=cont), **options)
    close(chunked.scores, one_forward.scores, f"{arch} pad vs one forward")
