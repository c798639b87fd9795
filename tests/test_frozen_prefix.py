"""Fine-tuning's forward from kept frozen-block residuals (lens_attrib.classifiers.frozen_prefix).

Oracle: the padded forward of the whole model (``head_rows``: ``to_batch`` of the mixed-length
items, the final residual at the feature position), in float64. Running the frozen lower blocks
once per item at its own length and the top blocks in right-padded length chunks must give the
same final rows and the same gradients on the trained blocks, to float64 rounding, on a decoder
with rotary positions (Llama; Pythia: partial rotary, parallel blocks), one with learned positions
(GPT-2) and an encoder with sentence-pair segments (BERT); features batched by length, or computed
from the kept residuals, equal the per-item ones in the inputs' order.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lens_attrib.backend import deep_copy
from lens_attrib.classifiers.finetune import block_parameters, fine_tune, head_rows, trainable_copy
from lens_attrib.classifiers.frozen_prefix import (
    build_prefix,
    final_rows,
    length_chunks,
    prefix_features,
)
from lens_attrib.classifiers.linear import LinearHead, item_tokens, new_head, residual_features
from lens_attrib.tiny_models import tiny_bert, tiny_gpt2, tiny_llama, tiny_pythia
from tests.tl_versions import BRIDGE

F64 = torch.float64
EXACT = 1e-10  # relative to the largest |value|: the same float64 arithmetic, other batch shapes
TEXTS = [
    "the cat sat on the mat near the door",
    "a dog",
    "the keys to the cabinet are on the table",
    "this film was not good",
    "a man sees the cat",
    "the book",
    "the movie is very good",
]
PAIRS = [
    ("the cat sat on the mat", "a dog is near the door"),
    ("the keys are", "the dog sat"),
    ("a man", "the cat"),
    ("this film was not good", "the movie is very good"),
    ("the book", "a dog"),
]
MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2, "pythia": tiny_pythia, "bert": tiny_bert}


def _inputs(kind: str) -> list[Any]:
    return PAIRS if kind == "bert" else TEXTS  # BERT: sentence pairs with their segment ids


def _close(a: torch.Tensor, b: torch.Tensor, scale: float | None = None) -> None:
    scale = float(b.abs().max()) if scale is None else scale
    assert float((a - b).abs().max()) <= EXACT * scale, float((a - b).abs().max()) / scale


@pytest.fixture(scope="module", params=sorted(MODELS))
def setting(request: Any) -> tuple[str, Any]:
    return request.param, MODELS[request.param](dtype=F64)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("overhead", [0.0, 24.0, 1e9])
def test_final_rows_equal_the_padded_forward(setting, k, overhead):
    kind, model = setting
    inputs = _inputs(kind)
    layer = int(model.cfg.n_layers) - k
    prefix = build_prefix(model, inputs, layer, batch_size=2)
    rows = [3, 0, 5, 1, 6, 2, 4] if len(inputs) == 7 else [3, 0, 4, 1, 2]
    identity = LinearHead(int(model.cfg.d_model), 1, norm=None)
    identity.linear = torch.nn.Identity()  # head_rows' head: the raw final residual rows
    with torch.no_grad():
        expected = head_rows(model, identity, [inputs[r] for r in rows])
        got = final_rows(model, prefix, rows, overhead)
    assert got.shape == expected.shape
    _close(got, expected)


def test_gradients_equal_the_padded_forward(setting):
    kind, model = setting
    inputs = _inputs(kind)
    tuned = trainable_copy(model, 2)
    prefix = build_prefix(tuned, inputs, int(model.cfg.n_layers) - 2)
    torch.manual_seed(0)
    head = new_head(tuned, 2).requires_grad_(True)
    labels = torch.tensor([i % 2 for i in range(len(inputs))])
    rows = list(range(len(inputs)))[::-1]
    grads = []
    for run in ("padded", "prefix"):
        with torch.enable_grad():
            if run == "padded":
                out = head_rows(tuned, head, [inputs[r] for r in rows])
            else:
                out = head(final_rows(tuned, prefix, rows))
            torch.nn.functional.cross_entropy(out, labels[rows]).backward()
        named = [*tuned.named_parameters(), *head.named_parameters()]
        params = [(n, p) for n, p in named if p.requires_grad]
        # a GPT-2 / NeoX bridge keeps the fused qkv weight beside the split q/k/v it runs:
        # trainable, read by no forward, so without a gradient in either run
        unused = {n for n, p in params if p.grad is None}
        assert all(".qkv." in n for n in unused) if BRIDGE else not unused, unused
        grads.append([p.grad.clone() for n, p in params if n not in unused])
        for _, p in params:
            p.grad = None
    assert len(grads[0]) > 2 and len(grads[0]) == len(grads[1])
    # rounding is relative to the gradients flowing through the blocks: some are exactly 0 in
    # exact arithmetic (e.g. through a LayerNorm's mean) and only rounding noise in either run
    scale = max(float(g.abs().max()) for g in grads[0])
    for a, b in zip(grads[1], grads[0]):
        _close(a, b, scale)


def test_residual_features_batched_by_length_keep_the_order(setting):
    kind, model = setting
    inputs = _inputs(kind)
    batched = residual_features(model, inputs, batch_size=3)
    single = torch.cat([residual_features(model, [x]) for x in inputs])
    _close(batched, single)
    assert not torch.equal(batched[0], batched[1])


def test_length_chunks_partition_the_rows():
    lengths = [5, 9, 5, 30, 9, 6, 31, 5]
    rows = [7, 3, 0, 6, 1, 4]
    for overhead in (0.0, 8.0, 24.0, 1e9):
        chunks = length_chunks(lengths, rows, overhead)
        assert sorted(r for c in chunks for r in c) == sorted(rows)
        assert all(c for c in chunks)
    # no cost per chunk: every chunk holds one length (no padding at all)
    assert all(len({lengths[r] for r in c}) == 1 for c in length_chunks(lengths, rows, 0.0))
    assert len(length_chunks(lengths, rows, 1e9)) == 1  # a call costs more than any padding
    # overhead 6: 5,5 | 9,9 (16 + 24 < one chunk's 4 * 9 + 6) | 30,31 (padding 30 -> 31 costs 1,
    # less than one more call)
    assert length_chunks(lengths, rows, 6.0) == [[7, 0], [1, 4], [3, 6]]
    with pytest.raises(ValueError, match="overhead"):
        length_chunks(lengths, rows, -1.0)


def test_prefix_features_equal_residual_features(setting):
    kind, model = setting
    inputs = _inputs(kind)
    prefix = build_prefix(model, inputs, int(model.cfg.n_layers) - 1)
    _close(prefix_features(model, prefix, batch_size=3), residual_features(model, inputs))


def test_fine_tune_takes_a_prefix_built_once(setting):
    kind, model = setting
    inputs = _inputs(kind)
    labels = torch.tensor([i % 2 for i in range(len(inputs))])
    head = new_head(model, 2)
    runs = []
    for prefix in (None, build_prefix(model, inputs, int(model.cfg.n_layers) - 1)):
        tuned, tuned_head, _ = fine_tune(
            model, head, inputs, labels, k=1, epochs=2, lr=1e-3, batch_size=3, prefix=prefix
        )
        runs.append([*tuned.parameters(), *tuned_head.parameters()])
    # the same lower weights, the same operations: the kept residuals are bit-identical
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    with pytest.raises(ValueError, match="entering block"):
        fine_tune(model, head, inputs, labels, k=1, prefix=build_prefix(model, inputs, 0))


def test_the_trainable_copy_computes_with_its_own_weights(setting):
    """Fine-tuning trains a deep copy: the copy's forward reads the copy's blocks only, and
    running it leaves the original as it was (a Llama bridge's deep copy used to run its fused
    attention on the original's weights; a BERT bridge's copy left its attention inputs, with
    their graph, on the original, which then could not be copied again: the second
    ``fine_tune`` of test_fine_tune_takes_a_prefix_built_once raised)."""
    kind, model = setting
    inputs = _inputs(kind)[:3]
    before = residual_features(model, inputs)
    tuned = trainable_copy(model, 2)  # block L-1's input then carries a graph
    prefix = build_prefix(tuned, inputs, int(model.cfg.n_layers) - 2)
    with torch.enable_grad():  # the padded forward and fine-tuning's block-by-block one
        head_rows(tuned, new_head(tuned, 2), inputs).square().sum().backward()
        final_rows(tuned, prefix, [0, 1, 2]).square().sum().backward()
    assert all(p.grad is None for p in model.parameters())
    again = deep_copy(model)  # nothing of the copy's graph was left on the original
    with torch.no_grad():
        for param in block_parameters(tuned, 2).values():
            param.mul_(1.5)
    changed = residual_features(tuned, inputs)
    assert float((changed - before).abs().max()) > 1e-3 * float(before.abs().max())
    _close(residual_features(model, inputs), before)
    _close(residual_features(again, inputs), before)


def test_hooks_on_the_trainable_copy_fire_on_the_copy(setting):
    """A hook on the copy fires in the copy's forward, one on the original does not (a BERT
    bridge's plain deep copy fired the original's ``mlp.hook_in``/``hook_out`` instead: its
    mirrors of them are closures over the original's MLP)."""
    kind, model = setting
    tuned = trainable_copy(model, 1)
    fired: list[str] = []
    for layer in range(int(model.cfg.n_layers)):
        # the MLP's own input and output points (a bridge's symbolic MLP mirrors them)
        mlp = ("mlp.hook_in", "mlp.hook_out") if BRIDGE else ("mlp.hook_pre", "mlp.hook_post")
        for point in (*mlp, "hook_resid_pre"):
            name = f"blocks.{layer}.{point}"
            tuned.hook_dict[name].add_hook(lambda x, hook: fired.append("copy"))
            model.hook_dict[name].add_hook(lambda x, hook: fired.append("original"))
    try:
        with torch.no_grad():
            tuned(item_tokens(tuned, _inputs(kind)[:1])[0].tokens[None])
    finally:
        tuned.reset_hooks()
        model.reset_hooks()
    assert fired and set(fired) == {"copy"}
