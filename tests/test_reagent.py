"""ReAGent: a planted one-token rule ranks first, seeded reproducibility, batching, replacers."""

from __future__ import annotations

import pytest
import torch

from lens_attrib import OptionError, Target, TargetError, attribute
from lens_attrib.tiny_models import tiny_bert, tiny_gpt2, tiny_tokenizer
from tests.tl_versions import hooked_only

F64 = torch.float64
PROMPTS = ["the keys to the cabinet", "the author near the books is", "a dog sees the cats"]


PLANTED = hooked_only(
    "the planted model is a norm-free GPT-2 written through HookedTransformer's weights; no "
    "GPT2LMHeadModel checkpoint expresses it (tiny_checkpoints refuses normalization_type=None). "
    "ReAGent on a bridge: the other tests of this file"
)


def planted_model():
    """A decoder that predicts, at every position after the first two, the token at position 1.

    No norms; unit-norm token embeddings live in dims 0–7; head 0 of the single layer has a
    constant query and keys that read a marker the positional embedding puts on position 1
    only, so it attends to position 1 alone (scores 1000 apart); its values copy dims 0–7 into
    dims 16–23, the only dims the unembedding reads, with ``W_U = 10 · W_Eᵀ`` there (a copy
    rule: the largest logit is the token itself). Every other head, the MLP and the other
    tokens' residual path are invisible to the head.
    """
    model = tiny_gpt2(dtype=F64, normalization_type=None, n_layers=1)
    gen = torch.Generator().manual_seed(0)
    d_head = model.cfg.d_head
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        emb = torch.randn(model.cfg.d_vocab, d_head, generator=gen, dtype=F64)
        model.embed.W_E[:, :d_head] = emb / emb.norm(dim=-1, keepdim=True)
        model.pos_embed.W_pos[1, 31] = 1.0
        attn = model.blocks[0].attn
        attn.b_Q[0, 0] = 1000.0 * d_head**0.5
        attn.W_K[0, 31, 0] = 1.0
        attn.W_V[0, :d_head, :] = torch.eye(d_head, dtype=F64)
        attn.W_O[0, :, 16 : 16 + d_head] = torch.eye(d_head, dtype=F64)
        model.unembed.W_U[16 : 16 + d_head] = 10.0 * model.embed.W_E[:, :d_head].T
    return model


def first_words(attr):
    """The real-token index of every item's highest score (padding removed)."""
    return [int(attr.scores[b][attr.mask[b]].argmax()) for b in range(len(attr.scores))]


def head_of(model):
    return lambda x: model.unembed(x[:, None, :])[:, 0, :]


@PLANTED
@pytest.mark.parametrize("replacer", ["uniform", "model"])
@pytest.mark.parametrize("contrastive", [False, True])
def test_the_token_a_planted_rule_reads_ranks_first(replacer, contrastive):
    model = planted_model()
    head = head_of(model)
    target = Target(head=head)
    if contrastive:
        with torch.no_grad():
            pred = attribute(model, PROMPTS, target, method="random").target.token_ids
        target = Target(
            pred.tolist(), foil=[(int(p) + 1) % model.cfg.d_vocab for p in pred], head=head
        )
    attr = attribute(
        model,
        PROMPTS,
        target,
        method="reagent",
        replacer=replacer,
        keep_top_n=1,
        stopping_condition_top_k=1,
        max_probe_steps=64,
    )
    assert attr.meta["stopped_probes"] == [2, 2, 2]
    assert first_words(attr) == [1, 1, 1]  # <bos> is position 0


def test_same_seed_same_scores_other_seed_other_scores():
    model = tiny_gpt2(dtype=F64)
    first = attribute(model, PROMPTS, method="reagent", seed=3)
    again = attribute(model, PROMPTS, method="reagent", seed=3)
    other = attribute(model, PROMPTS, method="reagent", seed=4)
    assert torch.equal(first.scores, again.scores)
    assert not torch.equal(first.scores, other.scores)
    torch.testing.assert_close(first.scores.sum(-1), torch.ones(3, dtype=F64))


def test_batched_equals_unbatched_with_the_masked_lm_replacer():
    # the default (uniform) replacer on every architecture: tests/test_contract.py
    model = tiny_bert(dtype=F64)
    options = {"max_probe_steps": 8, "num_probes": 4, "replacer": "model"}
    batched = attribute(model, PROMPTS, method="reagent", **options)
    for b, prompt in enumerate(PROMPTS):
        alone = attribute(model, prompt, method="reagent", **options)
        torch.testing.assert_close(batched.scores[b][batched.mask[b]], alone.scores[0])
        assert batched.meta["probe_steps"][b] == alone.meta["probe_steps"][0]


def test_special_tokens_and_later_tokens_are_not_perturbed():
    model = tiny_gpt2(dtype=F64)
    attr = attribute(model, PROMPTS[0], Target(position=3), method="reagent")
    assert float(attr.scores[0, 0]) == 0.0  # <bos>
    assert float(attr.scores[0, 4:].abs().sum()) == 0.0  # after the target position
    torch.testing.assert_close(attr.scores[0, 1:4].sum(), torch.tensor(1.0, dtype=F64))


@PLANTED
def test_a_local_masked_lm_folder_replaces_tokens(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    tokenizer = tiny_tokenizer(encoder=True)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
    )
    torch.manual_seed(0)
    BertForMaskedLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model = planted_model()
    attr = attribute(
        model,
        PROMPTS,
        Target(head=head_of(model)),
        method="reagent",
        replacer=str(tmp_path),
        keep_top_n=1,
        stopping_condition_top_k=1,
        max_probe_steps=64,
    )
    assert first_words(attr) == [1, 1, 1]


def test_bad_replacers_and_regression_targets_are_errors(tmp_path):
    model = tiny_gpt2(dtype=F64)
    with pytest.raises(OptionError, match="existing local folder"):
        attribute(model, "the dog", method="reagent", replacer=str(tmp_path / "missing"))
    headless = tiny_bert(dtype=F64)
    headless.lens_attrib_no_lm_head = True
    with pytest.raises(OptionError, match="masked-LM head"):
        attribute(
            headless,
            "the dog",
            Target(0, head=torch.nn.Linear(32, 2).double()),
            method="reagent",
            replacer="model",
        )
    head = torch.nn.Linear(32, 1).double()
    with pytest.raises(TargetError, match="regression"):
        attribute(model, "the dog", Target(head=head, regression=True), method="reagent")


def test_one_update_moves_replaced_and_kept_tokens_apart_by_the_drop():
    from lens_attrib.methods.reagent import updated_logits

    logits = torch.zeros(2, 3, dtype=F64)
    replaced = torch.tensor([[True, False, False], [False, True, True]])
    drop = torch.tensor([0.5, -1.0], dtype=F64)  # p fell by 0.5; p rose to 1 from 0
    out = updated_logits(logits, replaced, drop)
    ln3 = torch.log(torch.tensor(3.0, dtype=F64))
    torch.testing.assert_close(out[0], torch.stack([ln3, -ln3, -ln3]))
    bound = torch.logit(torch.tensor(1e-6, dtype=F64))  # logit(0) clamped, not -inf
    torch.testing.assert_close(out[1], torch.stack([-bound, bound, bound]))


def ranked_head(model):
    """8 outputs whose order never changes: 0–4 near 10, 5 near 0, 6 near −10, 7 near −20; the
    input moves each by less than 1 (``tanh`` of a random projection of the residual)."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(model.cfg.d_model, 8, generator=gen, dtype=F64)
    bias = torch.tensor([10.0, 10.0, 10.0, 10.0, 10.0, 0.0, -10.0, -20.0], dtype=F64)
    return lambda x: bias.to(x) + 0.9 * torch.tanh(x @ weight.to(x))


def test_contrastive_rule_stops_where_the_top_k_rule_cannot():
    """Target 5 (rank 6 on every input) against foil 6: the order and the clean rank hold with any
    kept tokens, so the contrastive rule stops every probe after one round; target 5 is never in
    the top 3, so the paper's rule (forced, or by default without a foil) never stops."""
    model = tiny_gpt2(dtype=F64)
    head = ranked_head(model)
    contrastive = Target(token=[5] * 3, foil=[6] * 3, head=head)
    attr = attribute(model, PROMPTS, contrastive, method="reagent", max_probe_steps=5)
    assert attr.meta["options"]["stopping_condition"] == "contrastive"
    assert attr.meta["probe_steps"] == [1, 1, 1] and attr.meta["stopped_probes"] == [2, 2, 2]
    for forced, target in [("top_k", contrastive), ("auto", Target(token=[5] * 3, head=head))]:
        with pytest.warns(RuntimeWarning, match="no probe of items"):
            paper = attribute(
                model, PROMPTS, target, method="reagent", max_probe_steps=5,
                stopping_condition=forced,
            )  # fmt: skip
        assert paper.meta["options"]["stopping_condition"] == "top_k"
        assert paper.meta["probe_steps"] == [5, 5, 5] and paper.meta["stopped_probes"] == [0, 0, 0]
    # the top-k rule does stop once the target is within the top k
    wide = attribute(
        model, PROMPTS, contrastive, method="reagent", max_probe_steps=5,
        stopping_condition="top_k", stopping_condition_top_k=6,
    )  # fmt: skip
    assert wide.meta["probe_steps"] == [1, 1, 1]


def test_contrastive_rule_needs_the_clean_order_and_rank():
    """Target 5 is below its foil 4 on the clean input and on every perturbed one: the rule asks
    for the clean order (below), so it stops after one round. 'contrastive' without a foil is an
    error naming the fix."""
    model = tiny_gpt2(dtype=F64)
    head = ranked_head(model)
    below = Target(token=[5] * 3, foil=[4] * 3, head=head)
    attr = attribute(model, PROMPTS, below, method="reagent", max_probe_steps=3)
    assert attr.meta["probe_steps"] == [1, 1, 1]
    with pytest.raises(OptionError, match="has no foil"):
        attribute(model, PROMPTS, Target(token=[5] * 3, head=head), method="reagent",
                  stopping_condition="contrastive")  # fmt: skip
