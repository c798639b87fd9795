"""Forced decoding of a given continuation (``Target(continuation=...)``).

Oracle: step ``s`` of a continuation ``c`` after a prompt ``x`` is the explanation of
``Target(token=c[s])`` on the prefix ``x + c[:s]`` computed on its own; batches of prompts equal
one prompt at a time; per-step foils equal separate contrastive calls; step scores equal the
softmax of logits read directly from ``model(tokens)``.
"""

from __future__ import annotations

import functools

import pytest
import torch

from lens_attrib import METHODS, Target, attribute
from lens_attrib.errors import TargetError
from lens_attrib.inputs import to_batch
from lens_attrib.tiny_models import tiny_bert, tiny_gpt2, tiny_llama
from tests.step_checks import check_step_row, close

DECODERS = {"gpt2": tiny_gpt2, "llama": tiny_llama}
PROMPT = "the keys to the"
CONTINUATION = "cabinet is on"
# Methods whose scores are random draws (seeded by the row's tokens) have no prefix oracle.
RANDOM = {"random", "reagent"}
GENERATION_METHODS = sorted(n for n, s in METHODS.items() if s.decoder and n not in RANDOM)
ARRAYS = ("scores", "layer_scores", "head_scores")


@functools.cache
def _model(arch: str):
    """One float64 model per architecture for the module (every call leaves it as it was)."""
    return DECODERS[arch](dtype=torch.float64)


def _prompt_ids(model, prompt: str) -> list[int]:
    return to_batch(model, prompt).tokens[0].tolist()


def _cont_ids(model, text: str) -> list[int]:
    return model.tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("method", GENERATION_METHODS)
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_forced_continuation_equals_each_prefix(arch, method):
    model = _model(arch)
    prompt = _prompt_ids(model, PROMPT)
    cont = _cont_ids(model, CONTINUATION)
    opts = {"n_steps": 4} if method == "integrated_gradients" else {}
    forced = attribute(model, PROMPT, Target(continuation=CONTINUATION), method=method, **opts)
    assert forced.scores.shape[0] == len(cont) == forced.meta["steps"]
    assert forced.meta["generated_ids"] == cont
    assert forced.meta["prompt_length"] == len(prompt)
    for s, token in enumerate(cont):
        prefix = torch.tensor(prompt + cont[:s])
        single = attribute(model, prefix, Target(token=token), method=method, **opts)
        assert int(forced.target.token_ids[s]) == token
        assert int(forced.target.positions[s]) == len(prompt) - 1 + s
        check_step_row(forced, s, single, len(prompt) + s, f"{method} step {s}", ARRAYS)


@pytest.mark.parametrize("method", ["grad_x_input", "alti_logit", "attnlrp"])
def test_token_ids_equal_string_continuation(method):
    model = _model("llama")
    ids = _cont_ids(model, CONTINUATION)
    by_text = attribute(model, PROMPT, Target(continuation=CONTINUATION), method=method)
    by_ids = attribute(model, PROMPT, Target(continuation=torch.tensor(ids)), method=method)
    assert torch.equal(by_text.scores, by_ids.scores)


@pytest.mark.parametrize(
    ("arch", "method"),
    [
        ("gpt2", "grad_x_input"),
        ("llama", "grad_x_input"),
        ("gpt2", "alti_logit"),
        ("llama", "alti_logit"),
    ],
)
def test_batched_prompts_equal_one_at_a_time(arch, method):
    model = _model(arch)
    opts = {"n_steps": 4} if method == "integrated_gradients" else {}
    prompts = ["the keys to the", "a dog", "the cabinet near the old"]
    conts = ["cabinet is on", "is", [5, 9]]
    batched = attribute(model, prompts, Target(continuation=conts), method=method, **opts)
    steps = [len(_cont_ids(model, c)) if isinstance(c, str) else len(c) for c in conts]
    assert batched.meta["steps"] == steps and batched.scores.shape[0] == sum(steps)
    assert batched.meta["step_prompt"] == [b for b, n in enumerate(steps) for _ in range(n)]
    row = 0
    for b, (prompt, cont) in enumerate(zip(prompts, conts, strict=True)):
        alone = attribute(model, prompt, Target(continuation=cont), method=method, **opts)
        for s in range(steps[b]):
            n_real = int(alone.mask[s].sum())
            assert int(batched.mask[row].sum()) == n_real
            check_step_row(
                batched, row, alone[s : s + 1], n_real, f"{method} prompt {b} step {s}", ARRAYS
            )
            row += 1
    if method != "grad_x_input":
        return
    alone_scores = [
        attribute(model, p, Target(continuation=c), method=method).meta["step_scores"]
        for p, c in zip(prompts, conts, strict=True)
    ]
    for key, value in batched.meta["step_scores"].items():
        close(value, torch.cat([a[key] for a in alone_scores]), f"step score {key}")


@pytest.mark.parametrize("method", ["grad_x_input", "alti_logit", "attnlrp"])
def test_per_step_foils_equal_contrastive_calls(method):
    model = _model("gpt2")
    prompt = _prompt_ids(model, PROMPT)
    cont = _cont_ids(model, CONTINUATION)
    foils = ["dog", "are", "near"]
    assert len(foils) == len(cont)
    forced = attribute(model, PROMPT, Target(continuation=cont, foil=foils), method=method)
    for s, (token, foil) in enumerate(zip(cont, foils, strict=True)):
        single = attribute(
            model, torch.tensor(prompt + cont[:s]), Target(token=token, foil=foil), method=method
        )
        assert int(forced.target.foil_ids[s]) == int(single.target.foil_ids[0])
        check_step_row(forced, s, single, len(prompt) + s, f"{method} foil step {s}", ARRAYS)
    # A batch: one foil list per prompt.
    both = attribute(
        model,
        [PROMPT, "a dog"],
        Target(continuation=[cont, "is"], foil=[foils, ["are"]]),
        method=method,
    )
    close(both.scores[: len(cont)][:, -forced.scores.shape[1] :], forced.scores, "batched foils")


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_step_scores_equal_softmax_of_model_logits(arch):
    model = _model(arch)
    prompts = ["the keys to the", "a dog"]
    conts = ["cabinet is on the", "is near"]
    foils = [["dog", "are", "near", "a"], ["are", "the"]]
    attr = attribute(model, prompts, Target(continuation=conts, foil=foils), method="grad_x_input")
    scores = attr.meta["step_scores"]
    rows = 0
    for b, (prompt, cont) in enumerate(zip(prompts, conts, strict=True)):
        p_ids, c_ids = _prompt_ids(model, prompt), _cont_ids(model, cont)
        f_ids = [model.tokenizer.convert_tokens_to_ids(f) for f in foils[b]]
        with torch.no_grad():
            logits = model(torch.tensor([p_ids + c_ids]))[0]
        for s, token in enumerate(c_ids):
            z = logits[len(p_ids) - 1 + s]
            p = torch.softmax(z, -1)
            expected = {
                "probability": p[token],
                "log_probability": torch.log(p[token]),
                "entropy": -(p * torch.log(p)).sum(),
                "logit": z[token],
                "logit_difference": z[token] - z[f_ids[s]],
            }
            for key, value in expected.items():
                got = scores[key][rows]
                assert abs(float(got) - float(value)) <= 1e-10 * max(1.0, abs(float(value))), key
            rows += 1
    assert all(len(v) == rows for v in scores.values())
    assert (
        "logit_difference"
        not in attribute(
            model, prompts[0], Target(continuation=conts[0]), method="grad_x_input"
        ).meta["step_scores"]
    )


def test_generate_unchanged_by_continuation_machinery():
    model = _model("gpt2")
    gen = attribute(model, PROMPT, Target(generate=3), method="grad_x_input")
    forced = attribute(
        model, PROMPT, Target(continuation=gen.meta["generated_ids"]), method="grad_x_input"
    )
    assert torch.equal(gen.scores, forced.scores)
    # Target(generate=N) has step scores too: softmax of the logits read directly
    ids = _prompt_ids(model, PROMPT)
    generated = list(gen.meta["generated_ids"])
    with torch.no_grad():
        logits = model(torch.tensor([ids + generated]))[0]
    scores = gen.meta["step_scores"]
    assert set(scores) == set(forced.meta["step_scores"])
    for s, token in enumerate(generated):
        z = logits[len(ids) - 1 + s]
        p = torch.softmax(z, -1)
        expected = {
            "probability": p[token],
            "log_probability": torch.log(p[token]),
            "entropy": -(p * torch.log(p)).sum(),
            "logit": z[token],
        }
        for key, value in expected.items():
            close(scores[key][s], value, f"generate step {s} {key}")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda m: attribute(m, PROMPT, Target(continuation="")), "empty string"),
        (lambda m: attribute(m, PROMPT, Target(continuation=[])), "continuation is empty"),
        (lambda m: Target(continuation=[[3], []]), "continuation of prompt 1 is empty"),
        (lambda m: Target(continuation="a dog", generate=2), "pass one of them"),
        (
            lambda m: attribute(tiny_bert(), "the dog", Target(continuation="is")),
            "needs a decoder",
        ),
        (
            lambda m: attribute(m, PROMPT, Target(continuation="cabinet is", foil=["dog"])),
            "has 1 entries but its continuation has 2 steps",
        ),
        (
            lambda m: attribute(
                m, [PROMPT, "a dog"], Target(continuation=["is", "is"], foil=[["a"]])
            ),
            "1 foil list(s) for 2 prompt(s)",
        ),
        (
            lambda m: attribute(m, [PROMPT, "a dog"], Target(continuation="is")),
            "1 continuation(s) for 2 prompt(s)",
        ),
        (
            lambda m: attribute(m, PROMPT, Target(continuation="is", token="dog")),
            "cannot be combined",
        ),
        (lambda m: attribute(m, PROMPT, Target(continuation=[10**6])), "outside the vocabulary"),
        (lambda m: Target(continuation=torch.tensor([1.5])), "integer token ids"),
    ],
)
def test_bad_inputs_are_clear_errors(make, message):
    model = _model("gpt2")
    with pytest.raises(TargetError) as err:
        make(model)
    assert message in str(err.value)
