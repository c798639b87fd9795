"""Sentence pairs and segment ids (token_type_ids) through every encoder method and metric.

Oracle: the same run with the segment embedding supplied by a user hook on
``embed.hook_token_type_embed`` (the way the DecompX/GlobEnc comparison emulated the authors'
pair inputs). A pair run must equal it to float64 rounding, and must differ from the run with
segment 0 everywhere (so the equality is not trivially true).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from lens_attrib import METHODS, InputError, Target, attribute
from lens_attrib.evaluation.faithfulness import aopc
from lens_attrib.inputs import to_batch
from lens_attrib.tiny_models import tiny_bert, tiny_gpt2
from tests.tl_versions import BRIDGE

F64 = torch.float64
PAIR = ("the cat sat on the mat", "a dog is near the door")
PAIRS = [PAIR, ("the keys are", "the dog sat")]
EXACT = 1e-10  # relative to the largest |value|: both runs do the same float64 arithmetic
ENCODER_METHODS = sorted(n for n, s in METHODS.items() if s.encoder and n != "random")
# methods whose scores depend on the segment embedding through more than a constant
SEGMENT_SENSITIVE = ["alti", "decompx", "globenc", "grad_x_input", "integrated_gradients"]
QUICK = {"integrated_gradients": {"n_steps": 8}, "reagent": {"num_probes": 2, "max_probe_steps": 2}}


@pytest.fixture(scope="module")
def bert() -> Any:
    return tiny_bert(dtype=F64)


@contextmanager
def segments_by_hook(model: Any, types: torch.Tensor) -> Iterator[None]:
    """Replace the segment embedding by ``W_token_type[types]`` (rows repeat over the batch)."""
    if BRIDGE:  # the BERT bridge's segment table is a component of its own, with its own hook
        weight, name = model.token_type_embed.W_E, "token_type_embed.hook_out"
    else:
        weight, name = model.embed.token_type_embed.W_token_type, "embed.hook_token_type_embed"

    def hook(x: torch.Tensor, hook: Any) -> torch.Tensor:
        rows = types.to(x.device)
        rows = rows.expand(x.shape[0], -1) if rows.shape[0] == 1 else rows
        return weight[rows[:, : x.shape[1]]]

    model.add_hook(name, hook)
    try:
        yield
    finally:
        model.reset_hooks()


def pair_ids(model: Any, pairs: list[tuple[str, str]]) -> tuple[torch.Tensor, ...]:
    enc = model.tokenizer(
        [a for a, _ in pairs],
        [b for _, b in pairs],
        padding=True,
        return_tensors="pt",
        return_token_type_ids=True,
    )
    return enc["input_ids"], enc["attention_mask"], enc["token_type_ids"]


def close(a: torch.Tensor, b: torch.Tensor, tol: float = EXACT) -> bool:
    scale = max(float(a.abs().max()), float(b.abs().max()), 1e-300)
    return float((a - b).abs().max()) <= tol * scale


def run(model: Any, inputs: Any, method: str, **kw: Any) -> Any:
    target = Target(position=0) if method in ("logat", "normxlogit") else None
    return attribute(model, inputs, target, method=method, **QUICK.get(method, {}), **kw)


def test_pair_batch_carries_segments(bert):
    batch = to_batch(bert, PAIRS)
    ids, mask, types = pair_ids(bert, PAIRS)
    assert torch.equal(batch.tokens, ids.masked_fill(~mask.bool(), batch.tokens[1, -1]))
    assert torch.equal(batch.mask, mask.bool())
    assert torch.equal(batch.token_types, types * mask)
    # [CLS] a [SEP] is segment 0, b [SEP] segment 1
    assert batch.token_types[0, 0] == 0 and batch.token_types[0, int(batch.lengths[0]) - 1] == 1


@pytest.mark.parametrize("method", ENCODER_METHODS)
def test_pair_equals_segments_supplied_by_hook(bert, method):
    ids, mask, types = pair_ids(bert, [PAIR])
    paired = run(bert, PAIR, method)
    with segments_by_hook(bert, types):
        hooked = run(bert, ids, method, attention_mask=mask)
    assert close(paired.scores, hooked.scores)
    if paired.layer_scores is not None:
        assert close(paired.layer_scores, hooked.layer_scores)
    assert torch.equal(paired.token_types, types)
    assert hooked.token_types is None  # no segments given: segment 0 everywhere


@pytest.mark.parametrize("method", SEGMENT_SENSITIVE)
def test_segments_change_the_scores(bert, method):
    ids, mask, _ = pair_ids(bert, [PAIR])
    paired = run(bert, PAIR, method)
    flat = run(bert, ids, method, attention_mask=mask)
    assert not close(paired.scores, flat.scores, 1e-4)


@pytest.mark.parametrize("method", ["decompx", "grad_x_input", "alti"])
def test_every_input_form_gives_the_same_segments(bert, method):
    ids, mask, types = pair_ids(bert, PAIRS)
    enc = bert.tokenizer(
        [a for a, _ in PAIRS],
        [b for _, b in PAIRS],
        padding=True,
        return_tensors="pt",
        return_token_type_ids=True,
    )
    forms = [
        run(bert, PAIRS, method),
        run(bert, enc, method),
        run(bert, ids, method, attention_mask=mask, token_type_ids=types),
        run(
            bert,
            [r[m.bool()].tolist() for r, m in zip(ids, mask)],
            method,
            token_type_ids=[t[m.bool()].tolist() for t, m in zip(types, mask)],
        ),
    ]
    for other in forms[1:]:
        assert torch.equal(other.token_types, forms[0].token_types)
        assert close(other.scores, forms[0].scores)
    # batched == one at a time
    for i, pair in enumerate(PAIRS):
        alone = run(bert, pair, method)
        n = int(alone.mask.sum())
        assert close(forms[0].scores[i, :n], alone.scores[0, :n], 1e-9)


def test_aopc_keeps_the_segments(bert):
    ids, mask, types = pair_ids(bert, [PAIR])
    attr = run(bert, PAIR, "grad_x_input")
    with segments_by_hook(bert, types):
        hooked_attr = run(bert, ids, "grad_x_input", attention_mask=mask)
        hooked = aopc(bert, hooked_attr)
    paired = aopc(bert, attr)
    flat = aopc(bert, hooked_attr)
    assert torch.allclose(paired.comprehensiveness_k, hooked.comprehensiveness_k, 0, 1e-12)
    assert torch.allclose(paired.sufficiency_k, hooked.sufficiency_k, 0, 1e-12)
    assert not torch.allclose(paired.comprehensiveness_k, flat.comprehensiveness_k, 0, 1e-6)


def test_bad_segment_ids_are_errors(bert):
    ids, mask, types = pair_ids(bert, [PAIR])
    with pytest.raises(InputError, match="segment"):
        to_batch(bert, ids, attention_mask=mask, token_type_ids=types * 2)
    with pytest.raises(InputError, match="per token"):
        to_batch(bert, ids, attention_mask=mask, token_type_ids=types[:, :3])
    gpt2 = tiny_gpt2()
    with pytest.raises(InputError, match="decoder"):
        to_batch(gpt2, "the cat sat", token_type_ids=[[0, 1, 1]])
    # a decoder's all-zero segment ids (a tokenizer's default) are accepted and dropped
    assert to_batch(gpt2, "the cat sat", token_type_ids=[[0, 0, 0, 0]]).token_types is None


def test_plots_separate_the_segments(bert):
    from lens_attrib.plot import layer_heatmap, method_grid, token_heatmap

    attr = run(bert, PAIRS, "logat")
    n_first = len(bert.tokenizer(PAIRS[1][0])["input_ids"])  # [CLS] a [SEP]
    for fig in (token_heatmap(attr, 1), layer_heatmap(attr, 1), method_grid([attr], item=1)):
        lines = [s for s in fig.layout.shapes if s.type == "line"]
        assert [line.x0 for line in lines] == [n_first - 0.5]
    single = run(bert, "the cat sat", "logat")
    assert not [s for s in token_heatmap(single).layout.shapes if s.type == "line"]
