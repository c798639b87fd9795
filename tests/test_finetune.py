"""Light fine-tuning (lens_attrib.classifiers.finetune) on tiny models: the caller's model is
untouched, only the last k blocks move, the loss falls, save → load is bit-exact, and Target(head=h)
on the tuned model explains exactly what running the tuned model and head gives."""

import math

import pytest
import torch
from test_classifier_linear import toy_sentiment

from lens_attrib import Target, attribute
from lens_attrib.classifiers.finetune import (
    fine_tune,
    head_rows,
    save_blocks,
    trainable_copy,
    tuned_block_names,
    tuned_model,
)
from lens_attrib.classifiers.linear import feature_position, load_head, new_head, save_head
from lens_attrib.tiny_models import tiny_bert, tiny_llama


@pytest.fixture(scope="module", params=["llama", "bert"])
def setting(request):
    torch.manual_seed(0)
    model = tiny_llama() if request.param == "llama" else tiny_bert()
    texts, labels = toy_sentiment()
    texts, labels = texts[:48], labels[:48]
    head = new_head(model, 2)  # an untrained start (loss ln 2): the blocks must learn
    torch.nn.init.zeros_(head.linear.weight)
    torch.nn.init.zeros_(head.linear.bias)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    tuned, tuned_head, info = fine_tune(
        model, head, texts, labels, k=1, epochs=8, lr=3e-3, batch_size=8, seed=0
    )
    return model, head, texts, labels, before, grads, tuned, tuned_head, info


def _loss(model, head, texts, labels):
    with torch.no_grad():
        out = head_rows(model, head, texts)
    return float(torch.nn.functional.cross_entropy(out, labels))


def test_callers_model_and_head_unchanged(setting):
    model, head, _, _, before, grads, tuned, tuned_head, _ = setting
    assert tuned is not model and tuned_head is not head
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]) and param.requires_grad == grads[name]
        assert param.grad is None
    assert head.norm is None or head.norm is not tuned_head.norm


def test_only_last_blocks_move_and_loss_falls(setting):
    model, head, texts, labels, before, _, tuned, tuned_head, info = setting
    moved = {n for n, p in tuned.named_parameters() if not torch.equal(p, before[n])}
    assert moved and moved <= set(tuned_block_names(model, 1))
    assert all(not p.requires_grad and p.grad is None for p in tuned.parameters())
    assert _loss(model, head, texts, labels) == pytest.approx(math.log(2))
    assert _loss(tuned, tuned_head, texts, labels) < 0.5
    assert info["k"] == 1 and info["steps"] == 8 * 6


def test_save_load_bit_exact_and_target_explains_tuned_head(setting, tmp_path):
    model, _, texts, _, _, _, tuned, tuned_head, _ = setting
    save_blocks(tuned, 1, tmp_path)
    save_head(tuned_head, tmp_path, {"note": "test"})
    loaded = tuned_model(model, tmp_path)
    for (name, a), (_, b) in zip(tuned.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), name
    head, _ = load_head(tmp_path, loaded)
    assert torch.equal(head.linear.weight, tuned_head.linear.weight)
    with torch.no_grad():
        direct = head_rows(loaded, head, texts[:5])
    target = Target(head=head, position=feature_position(loaded))
    attr = attribute(loaded, texts[:5], target, method="grad_x_input")
    explained = torch.as_tensor([float(v) for v in attr.meta["explained_value"]])
    torch.testing.assert_close(explained, direct.max(-1).values.float(), rtol=1e-5, atol=1e-6)


def test_k_out_of_range():
    model = tiny_llama()
    with pytest.raises(ValueError, match="k must be between 1"):
        trainable_copy(model, model.cfg.n_layers + 1)
