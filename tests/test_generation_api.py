"""Generation API beyond forced decoding: seeded sampling, contrastive continuations (Inseq's
``contrast_targets``), slicing / tables of batched step rows, and the step × token figure.

Oracles: sampled tokens equal an independent sampler written here (numpy filtering, the same
uniform draws); ``top_k=1`` equals greedy; a contrastive continuation equals explaining every
prefix on its own with ``Target(token, foil)``; contrast step scores equal logits read directly
from ``model(tokens)``; ``prompt_steps(b)`` equals the prompt explained alone.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
import torch

from lens_attrib import Attribution, Target, attribute
from lens_attrib.errors import TargetError
from lens_attrib.inputs import to_batch
from lens_attrib.methods.generation import align_contrast, next_token_distribution
from lens_attrib.plot import BLANK_GREY
from lens_attrib.tiny_models import tiny_gpt2, tiny_llama

PROMPT = "the keys to the"
CONTINUATION = "cabinet is on"
ARRAYS = ("scores", "layer_scores", "head_scores")


@functools.cache
def _model(arch: str = "gpt2"):
    return {"gpt2": tiny_gpt2, "llama": tiny_llama}[arch](dtype=torch.float64)


def _ids(model, text: str) -> list[int]:
    return model.tokenizer(text, add_special_tokens=False)["input_ids"]


def _prompt_ids(model, text: str) -> list[int]:
    return to_batch(model, text).tokens[0].tolist()


def _close(actual, expected, what: str, rel: float = 1e-10) -> None:
    scale = max(float(expected.abs().max()), 1e-300)
    err = float((actual - expected).abs().max())
    assert err <= rel * scale, f"{what}: max error {err:.3e} vs scale {scale:.3e}"


def _quiet(fn, *args, **kwargs):
    """Run without the foil-equals-token notice (contrasts share tokens with continuations)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Target: the foil equals the token")
        return fn(*args, **kwargs)


# --------------------------------------------------------------------------- sampling
def _reference_sample(model, prompt: list[int], steps: int, seed: int, t, k, p) -> list[int]:
    """An independent sampler: numpy filtering (temperature, then top-k with ties, then top-p
    as the smallest most-likely set reaching p), inverse CDF with the same uniform draws."""
    gen = torch.Generator().manual_seed(seed)
    seq = list(prompt)
    out = []
    for _ in range(steps):
        with torch.no_grad():
            z = model(torch.tensor([seq]))[0, -1].double().numpy() / t
        if k is not None:
            z = np.where(z >= np.sort(z)[::-1][k - 1], z, -np.inf)
        q = np.exp(z - z.max())
        q /= q.sum()
        if p is not None:
            order = np.argsort(-q, kind="stable")
            mass = 0.0
            keep = np.zeros_like(q, dtype=bool)
            for i in order:
                keep[i] = True
                mass += q[i]
                if mass >= p:
                    break
            q = np.where(keep, q, 0.0)
            q /= q.sum()
        u = float(torch.rand((), generator=gen, dtype=torch.float64))
        token = int(np.argmax(np.cumsum(q) > u * q.sum()))
        out.append(token)
        seq.append(token)
        if token == model.tokenizer.eos_token_id:
            break
    return out


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, None, None), (1.7, 6, None), (0.8, None, 0.6)]
)
def test_sampling_equals_an_independent_sampler(temperature, top_k, top_p):
    model = _model("llama")
    target = Target(generate=4, sample=True, seed=11, temperature=temperature, top_k=top_k,
                    top_p=top_p)  # fmt: skip
    attr = attribute(model, PROMPT, target, method="grad_x_input")
    expected = _reference_sample(
        model, _prompt_ids(model, PROMPT), 4, 11, temperature, top_k, top_p
    )
    assert attr.meta["generated_ids"] == expected
    assert attr.meta["sampling"] == {
        "sample": True, "seed": 11, "temperature": temperature, "top_k": top_k, "top_p": top_p
    }  # fmt: skip
    again = attribute(model, PROMPT, target, method="grad_x_input")
    assert again.meta["generated_ids"] == expected and torch.equal(again.scores, attr.scores)


def test_seeds_and_greedy(tmp_path):
    model = _model("gpt2")
    prompt = _prompt_ids(model, PROMPT)
    drawn = {
        tuple(
            attribute(
                model,
                PROMPT,
                Target(generate=3, sample=True, seed=s, temperature=3.0),
                method="gradient",
            ).meta["generated_ids"]
        )
        for s in range(6)
    }
    assert len(drawn) > 1  # different seeds, different draws
    greedy = attribute(model, PROMPT, Target(generate=3), method="gradient")
    expected, seq = [], list(prompt)
    for _ in range(3):  # argmax read directly from the model
        with torch.no_grad():
            expected.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        seq.append(expected[-1])
    assert greedy.meta["generated_ids"] == expected and "sampling" not in greedy.meta
    for seed in (0, 1):  # top_k=1 keeps only the argmax: sampling is greedy
        top1 = Target(generate=3, sample=True, seed=seed, top_k=1, temperature=0.5)
        assert attribute(model, PROMPT, top1, method="gradient").meta["generated_ids"] == expected
    unseeded = attribute(model, PROMPT, Target(generate=3, sample=True), method="gradient")
    seed = unseeded.meta["sampling"]["seed"]
    assert Attribution.load(unseeded.save(tmp_path / "s.safetensors")).meta["sampling"] == {
        "sample": True, "seed": seed, "temperature": 1.0, "top_k": None, "top_p": None
    }  # fmt: skip
    replay = attribute(model, PROMPT, Target(generate=3, sample=True, seed=seed), method="gradient")
    assert replay.meta["generated_ids"] == unseeded.meta["generated_ids"]


def test_sampled_batch_equals_prompts_one_at_a_time():
    model = _model("llama")
    prompts = [PROMPT, "a dog", "the cabinet near the old"]
    target = Target(generate=3, sample=True, seed=5, temperature=1.5)
    batched = attribute(model, prompts, target, method="grad_x_input")
    for b, prompt in enumerate(prompts):
        alone = attribute(model, prompt, target, method="grad_x_input")
        assert batched.meta["generated_ids"][b] == alone.meta["generated_ids"]
        mine = batched.prompt_steps(b)
        assert mine.meta["generated_ids"] == alone.meta["generated_ids"]
        for r in range(len(alone)):
            _close(mine.item_scores(r), alone.item_scores(r), f"prompt {b} step {r}")


def test_next_token_distribution_keeps_the_top_p_set():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.5, -1.0], dtype=torch.float64)
    p = torch.softmax(logits, -1)
    for top_p in (0.1, p[0].item(), 0.8, 0.999):
        q = next_token_distribution(logits, top_p=top_p)
        kept = q > 0
        order = torch.argsort(p, descending=True, stable=True)
        mass = torch.cumsum(p[order], 0)
        n_keep = int((mass < top_p).sum()) + 1  # the smallest prefix reaching top_p
        assert kept.sum() == n_keep and kept[order[:n_keep]].all()
        _close(q[kept], p[kept] / p[kept].sum(), f"renormalised top_p={top_p}", rel=1e-15)
    ties = next_token_distribution(logits, top_k=3)  # the k-th value is tied: both kept
    assert (ties > 0).tolist() == [True, True, True, True, False]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Target(sample=True), "without generate=N"),
        (lambda: Target(continuation="is", seed=3), "without generate=N"),
        (lambda: Target(generate=2, temperature=0.5), "with sample=False"),
        (lambda: Target(generate=2, sample=True, temperature=0.0), "temperature must be"),
        (lambda: Target(generate=2, sample=True, top_p=1.5), "top_p must be"),
        (lambda: Target(generate=2, sample=True, top_k=0), "top_k must be"),
        (lambda: Target(generate=2, sample="yes"), "sample must be True or False"),
        (lambda: Target(generate=2, sample=True, seed="7"), "seed must be an int"),
        (lambda: Target(contrast="is"), "needs continuation"),
        (lambda: Target(continuation="is", contrast="are", foil="a"), "pass one of them"),
        (lambda: Target(continuation="is", contrast_alignments=[(0, 0)]), "without contrast"),
    ],
)
def test_bad_generation_options_are_clear_errors(make, message):
    with pytest.raises(TargetError) as err:
        make()
    assert message in str(err.value)


# --------------------------------------------------------------------------- contrast
def test_align_contrast_follows_inseq_rules():
    assert align_contrast(3, 3, []) == [0, 1, 2]  # equal lengths: 1:1
    assert align_contrast(2, 4, []) == [2, 3]  # right to left: the last with the last
    assert align_contrast(3, 4, [(0, 0)]) == [0, 2, 3]
    assert align_contrast(2, 2, [(0, 1), (1, 1), (1, 0)]) == [1, 0]  # first untaken index
    with pytest.raises(TargetError, match="has no contrast token"):
        align_contrast(3, 2, [])
    with pytest.raises(TargetError, match="fall outside"):
        align_contrast(2, 2, [(0, 5)])


@pytest.mark.parametrize("method", ["grad_x_input", "alti_logit", "attnlrp"])
def test_contrast_equals_each_prefix_with_its_foil(method):
    model = _model("llama")
    prompt = _prompt_ids(model, PROMPT)
    cont, contrast = _ids(model, CONTINUATION), _ids(model, "cabinets are near the")
    target = Target(continuation=cont, contrast=contrast, contrast_alignments=[(0, 0)])
    attr = _quiet(attribute, model, PROMPT, target, method=method)
    aligned = [0, 2, 3]  # step 0 given; steps 1 and 2 right to left: 4 − (3 − s)
    assert attr.meta["contrast_alignments"] == aligned
    for s, token in enumerate(cont):
        foil = contrast[aligned[s]]
        alone = _quiet(
            attribute, model, torch.tensor(prompt + cont[:s]), Target(token=token, foil=foil),
            method=method,
        )  # fmt: skip
        assert int(attr.target.foil_ids[s]) == foil
        n_real = len(prompt) + s
        for name in ARRAYS:
            a, b = getattr(attr, name), getattr(alone, name)
            assert (a is None) == (b is None)
            if a is None:
                continue
            if name == "head_scores":
                _close(a[s], b[0], f"{method} {name} step {s}")
                continue
            _close(a[s][..., attr.mask[s]][..., :n_real], b[0][..., alone.mask[0]], name)


def test_contrast_step_scores_read_from_model_logits():
    model = _model("gpt2")
    prompts = [PROMPT, "a dog"]
    conts = ["cabinet is on", "is near"]
    contrasts = ["cabinets are near the", "are the"]
    target = Target(continuation=conts, contrast=contrasts)
    attr = _quiet(attribute, model, prompts, target, method="grad_x_input")
    scores = attr.meta["step_scores"]
    assert attr.meta["contrast_alignments"] == [[1, 2, 3], [0, 1]]  # right to left
    row = 0
    for b, prompt in enumerate(prompts):
        p_ids, c_ids, k_ids = (
            _prompt_ids(model, prompt),
            _ids(model, conts[b]),
            _ids(model, contrasts[b]),
        )
        aligned = attr.meta["contrast_alignments"][b]
        with torch.no_grad():
            logits = model(torch.tensor([p_ids + c_ids]))[0]
            contrast_logits = model(torch.tensor([p_ids + k_ids]))[0]
        for s, token in enumerate(c_ids):
            z = logits[len(p_ids) - 1 + s]
            zc = contrast_logits[len(p_ids) - 1 + aligned[s]]
            foil = k_ids[aligned[s]]
            expected = {
                "logit_difference": z[token] - z[foil],  # the explained scalar: one prefix
                "contrast_logit": zc[foil],  # the contrast token under its own prefix
                "contrast_probability": torch.softmax(zc, -1)[foil],
                "contrast_logit_difference": z[token] - zc[foil],
                "contrast_probability_difference": torch.softmax(z, -1)[token]
                - torch.softmax(zc, -1)[foil],
            }
            for key, value in expected.items():
                got = float(scores[key][row])
                assert abs(got - float(value)) <= 1e-10 * max(1.0, abs(float(value))), key
            row += 1


# --------------------------------------------------------------------------- rows, tables
@functools.cache
def _batched() -> Attribution:
    model = _model("gpt2")
    prompts = [PROMPT, "a dog", "the cabinet near the old"]
    conts = ["cabinet is on", "is", "dog is near the"]
    return attribute(model, prompts, Target(continuation=conts), method="alti_logit")


def test_row_slices_keep_generation_meta_consistent():
    attr = _batched()
    steps = [3, 1, 4]
    assert attr.meta["step_prompt"] == [0, 0, 0, 1, 2, 2, 2, 2]
    assert attr.meta["step_index"] == [0, 1, 2, 0, 0, 1, 2, 3]
    part = attr[[2, 3, 5]]  # three rows: as many as prompts, a trap for per-item slicing
    assert part.meta["step_prompt"] == [0, 1, 2] and part.meta["step_index"] == [2, 0, 1]
    assert part.meta["prompt_length"] == attr.meta["prompt_length"]  # per prompt: kept whole
    assert part.meta["steps"] == steps and part.meta["generated_ids"] == attr.meta["generated_ids"]
    for key, value in attr.meta["step_scores"].items():
        assert torch.equal(part.meta["step_scores"][key], value[[2, 3, 5]]), key
    assert part.meta["target_tokens"] == [attr.meta["target_tokens"][r] for r in (2, 3, 5)]
    one = attr[4]
    assert one.meta["step_prompt"] == [2] and one.meta["step_scores"]["logit"].shape == (1,)


def test_prompt_steps_equal_the_prompt_alone():
    attr = _batched()
    model = _model("gpt2")
    for b, (prompt, cont) in enumerate([(PROMPT, "cabinet is on"), ("a dog", "is")]):
        mine = attr.prompt_steps(b)
        alone = attribute(model, prompt, Target(continuation=cont), method="alti_logit")
        for key in ("prompt_length", "generated_ids", "generated_tokens", "steps"):
            assert mine.meta[key] == alone.meta[key], key
        for key, value in alone.meta["step_scores"].items():
            _close(mine.meta["step_scores"][key], value, key)
        for r in range(len(alone)):
            _close(mine.item_scores(r), alone.item_scores(r), f"prompt {b} step {r}")
    with pytest.raises(IndexError, match="prompt=3"):
        attr.prompt_steps(3)
    with pytest.raises(ValueError, match="explains no Target"):
        attribute(model, PROMPT, method="alti_logit").prompt_steps(0)


def test_to_pandas_rows_of_batched_steps():
    attr = _batched()
    df = attr.to_pandas()
    assert len(df) == int(attr.mask.sum())
    for r, (b, s) in enumerate(zip(attr.meta["step_prompt"], attr.meta["step_index"], strict=True)):
        rows = df[(df["item"] == b) & (df["step"] == s)]
        assert rows["score"].tolist() == attr.item_scores(r).double().tolist()
        assert rows["token"].tolist() == attr.tokens[r]
        assert set(rows["target"]) == {attr.meta["target_tokens"][r]}
    sliced = attr[5:7].to_pandas()
    assert sorted(set(zip(sliced["item"], sliced["step"], strict=True))) == [(2, 1), (2, 2)]
    layers = attr.to_pandas("layer_scores")
    assert {"item", "step", "layer", "position"} <= set(layers.columns)


def test_saved_generation_round_trips(tmp_path):
    attr = _batched()
    path = attr.save(tmp_path / "gen.safetensors")
    loaded = Attribution.load(path)
    assert loaded.meta["step_prompt"] == attr.meta["step_prompt"]
    for key, value in attr.meta["step_scores"].items():
        assert torch.equal(loaded.meta["step_scores"][key], value)
    assert torch.equal(loaded.prompt_steps(2).scores, attr.prompt_steps(2).scores)


# --------------------------------------------------------------------------- figure
def test_step_heatmap_blanks_the_causal_triangle():
    attr = _batched()
    fig = attr.plot_steps(2)
    z = np.asarray(fig.data[0].z, dtype=float)
    steps = attr.prompt_steps(2)
    prompt_length = attr.meta["prompt_length"][2]
    assert z.shape == (4, prompt_length + 3)
    for s in range(4):
        explained = prompt_length - 1 + s
        values = steps.item_scores(s).double().numpy()
        assert np.isnan(z[s, explained + 1 :]).all()  # after the explained token: blank
        assert np.array_equal(z[s, : explained + 1], values[: explained + 1])  # before: scores
    assert list(fig.data[0].y) == [f"{s}: {t}" for s, t in enumerate(steps.meta["target_tokens"])]
    assert fig.layout.shapes[0].x0 == prompt_length - 0.5  # where the prompt ends
    assert fig.layout.plot_bgcolor == BLANK_GREY  # blank cells: not a colour of the scale
    fig.to_json()  # a self-contained figure, nothing fetched
    with pytest.raises(ValueError, match="explains no Target"):
        attribute(_model("gpt2"), PROMPT, method="alti_logit").plot_steps()


def test_step_heatmap_of_words():
    model = _model("gpt2")
    attr = attribute(model, PROMPT, Target(continuation=CONTINUATION), method="grad_x_input")
    words = attr.to_words(tokenizer=model.tokenizer)
    z = np.asarray(words.plot_steps().data[0].z, dtype=float)
    assert z.shape == (3, 7)  # <bos> + 4 prompt words + 2 continuation words
    for s in range(3):  # word k holds token k here: the same triangle as tokens
        assert np.isnan(z[s, 5 + s :]).all() and not np.isnan(z[s, : 5 + s]).any()
        assert np.array_equal(z[s, : 5 + s], attr.item_scores(s).double().numpy()[: 5 + s])


# --------------------------------------------------------------------------- conservation
@pytest.mark.parametrize("method", ["lrp", "alti_logit"])
def test_word_sums_conserve_the_explained_logit_of_every_step(method):
    """LRP (no biases: tiny Llama) and ALTI-Logit (with its parts) decompose every step's
    logit, read here from one forward (step_scores); word sums keep every step's total."""
    model = _model("llama")
    attr = attribute(model, PROMPT, Target(continuation=CONTINUATION), method=method)
    logit = attr.meta["step_scores"]["logit"]
    tokens = attr.scores.sum(-1)
    if method == "lrp":
        _close(tokens, logit, "Σ tokens = logit", rel=1e-6)
    else:
        parts = attr.parts
        total = tokens + parts["mlp"].sum(-1) + parts["attn_bias"].sum(-1)
        total = total + parts["embedding"] + parts["bias"]
        _close(total, logit, "Σ tokens + parts = logit")
    words = attr.to_words(tokenizer=model.tokenizer)
    _close(words.scores.sum(-1), tokens, "Σ words = Σ tokens", rel=1e-12)
    if attr.layer_scores is not None:
        _close(words.layer_scores.sum(-1), attr.layer_scores.sum(-1), "layers", rel=1e-12)
