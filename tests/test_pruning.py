"""Head pruning: masks equal weight surgery, pooling by hand, curves, baselines, bookkeeping."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lens_attrib.backend import arch_of, final_residual
from lens_attrib.forward import grad_context
from lens_attrib.hooks.guard import model_state_fingerprint
from lens_attrib.hooks.masking import head_mask_hooks, item_head_mask_hooks
from lens_attrib.methods.registry import METHODS, MethodOutput, Option, prepare, register
from lens_attrib.pruning import (
    POOLINGS,
    RANDOM,
    Evaluator,
    PruningCurve,
    PruningResult,
    TaskSet,
    checkpoints,
    curve_for_order,
    head_relevance,
    head_relevance_methods,
    logit_differences,
    logit_differences_many,
    pool_head_relevance,
    prune_and_score,
    pruning_order,
    random_order,
    run_pruning,
)
from lens_attrib.scoring import single_token_items
from lens_attrib.tiny_models import tiny_gpt2, tiny_llama

ITEMS = [
    ("the key to the cabinets", " is", " are"),
    ("the keys", " are", " is"),
    ("the author of the books near the table", " is", " are"),
    ("the dogs with the man", " are", " is"),
    ("a cat", " is", " are"),
    ("the boys that the girl likes", " are", " is"),
    ("the queen", " was", " were"),
]
BUILDERS = {"gpt2": tiny_gpt2, "llama": tiny_llama}


def _model(name: str, dtype: torch.dtype = torch.float64):
    return BUILDERS[name](seed=3, dtype=dtype)


def _zero_heads_in_copy(model, keep: torch.Tensor):
    """A copy of the model whose W_O rows of the pruned heads are zero (weight surgery)."""
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for layer in range(clone.cfg.n_layers):
            for head in range(clone.cfg.n_heads):
                if not keep[layer, head]:
                    clone.blocks[layer].attn.W_O[head].zero_()
    return clone


def _last_logits(model, prompts, fwd_hooks=()):
    """Unbatched reference: full-vocabulary logits at the last token of each prompt."""
    rows = []
    with torch.no_grad(), model.hooks(fwd_hooks=list(fwd_hooks)):
        for prompt in prompts:
            rows.append(model(prompt)[0, -1])
    return torch.stack(rows)


def _ref_diffs(model, items, fwd_hooks=()):
    logits = _last_logits(model, [p for p, _, _ in items], fwd_hooks)
    tok = model.tokenizer
    t = [tok(x, add_special_tokens=False)["input_ids"][0] for _, x, _ in items]
    f = [tok(x, add_special_tokens=False)["input_ids"][0] for _, _, x in items]
    idx = torch.arange(len(items))
    return (logits[idx, t] - logits[idx, f]).double()


def _all_params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------ masks equal surgery
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_head_mask_equals_zeroed_W_O(arch):
    model = _model(arch)
    keep = torch.ones(model.cfg.n_layers, model.cfg.n_heads, dtype=torch.bool)
    keep[0, 1] = False
    keep[1, 0] = False
    keep[1, model.cfg.n_heads - 1] = False  # llama: a query head of the second KV group
    surgered = _zero_heads_in_copy(model, keep)
    prompts = [p for p, _, _ in ITEMS]
    masked = _last_logits(model, prompts, head_mask_hooks(keep))
    reference = _last_logits(surgered, prompts)
    clean = _last_logits(model, prompts)
    torch.testing.assert_close(masked, reference, rtol=1e-10, atol=1e-10)
    assert (masked - clean).abs().max() > 1e-3  # the mask does something
    # the batched, length-sorted evaluation path gives the same numbers
    task = TaskSet.build(model, ITEMS, batch_size=3)
    torch.testing.assert_close(
        logit_differences(model, task, keep), _ref_diffs(surgered, ITEMS), rtol=1e-9, atol=1e-9
    )


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_pruning_every_head_leaves_mlp_and_embedding_paths(arch):
    model = _model(arch)
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    none_kept = torch.zeros(n_layers, n_heads, dtype=torch.bool)
    no_attention = _zero_heads_in_copy(model, none_kept)

    # hooks that replace every attention output by its bias alone (an attention-free model)
    def only_bias(out, hook, layer):
        bias = model.blocks[layer].attn.b_O  # None on a bridge of a bias-free Llama
        return torch.zeros_like(out) if bias is None else bias.expand_as(out).clone()

    bias_hooks = [
        (
            f"blocks.{layer}.hook_attn_out",
            lambda out, hook, layer=layer: only_bias(out, hook, layer),
        )
        for layer in range(n_layers)
    ]
    task = TaskSet.build(model, ITEMS, batch_size=4)
    pruned = logit_differences(model, task, none_kept)
    torch.testing.assert_close(pruned, _ref_diffs(no_attention, ITEMS), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(pruned, _ref_diffs(model, ITEMS, bias_hooks), rtol=1e-9, atol=1e-9)

    # along a curve: 0 pruned = the unpruned model, all pruned = the attention-free model
    clean = _ref_diffs(model, ITEMS)
    evaluator = Evaluator(model, task)
    curve = curve_for_order(evaluator, random_order(n_layers, n_heads, 0), label="r", step=3)
    assert curve.n_pruned[0] == 0 and curve.n_pruned[-1] == n_layers * n_heads
    assert curve.accuracy[0] == pytest.approx(float((clean > 0).double().mean()), abs=0)
    assert curve.logit_diff[0] == pytest.approx(float(clean.mean()), rel=1e-9)
    assert curve.accuracy[-1] == pytest.approx(float((pruned > 0).double().mean()), abs=0)
    assert curve.logit_diff[-1] == pytest.approx(float(pruned.mean()), rel=1e-9)


def test_evaluation_batched_equals_unbatched_and_item_order():
    model = _model("llama")
    one = logit_differences(model, TaskSet.build(model, ITEMS, batch_size=1))
    many = logit_differences(model, TaskSet.build(model, ITEMS, batch_size=5))
    torch.testing.assert_close(one, many, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(one, _ref_diffs(model, ITEMS), rtol=1e-9, atol=1e-9)
    point = prune_and_score(model, TaskSet.build(model, ITEMS))
    assert point.accuracy == float((one > 0).double().mean())


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_many_masks_in_one_forward_equal_one_mask_each(arch):
    model = _model(arch)
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    gen = torch.Generator().manual_seed(1)
    keeps = torch.rand(5, n_layers, n_heads, generator=gen) > 0.4
    keeps[0] = True  # the unpruned model among them
    task = TaskSet.build(model, ITEMS, batch_size=3)
    together = logit_differences_many(model, task, keeps, max_tokens=10_000)
    one_per_pass = logit_differences_many(model, task, keeps, max_tokens=1)
    torch.testing.assert_close(together, one_per_pass, rtol=1e-9, atol=1e-9)
    for i, keep in enumerate(keeps):
        reference = _ref_diffs(_zero_heads_in_copy(model, keep), ITEMS)
        torch.testing.assert_close(together[i], reference, rtol=1e-9, atol=1e-9)
    # per-item hooks equal the shared-mask hooks item by item
    batch = task.batches[0]
    tiled = batch.select(torch.arange(batch.size).repeat(2))
    two = torch.stack([keeps[1], keeps[2]]).repeat_interleave(batch.size, 0)
    with torch.no_grad():
        with model.hooks(fwd_hooks=item_head_mask_hooks(two)):
            both = model(tiled.tokens, **tiled.model_kwargs())
        for j, keep in enumerate((keeps[1], keeps[2])):
            with model.hooks(fwd_hooks=head_mask_hooks(keep)):
                alone = model(batch.tokens, **batch.model_kwargs())
            rows = slice(j * batch.size, (j + 1) * batch.size)
            real = batch.mask
            torch.testing.assert_close(both[rows][real], alone[real], rtol=1e-9, atol=1e-9)


# --------------------------------------------------------------------------- pooling
def test_pooling_by_hand():
    # one item, one layer, one head, 3 positions (the first is padding), d_head = 2
    rel = torch.tensor([[[[[1e6, -1e6], [1.0, -3.0], [2.0, 0.5]]]]], dtype=torch.float64)
    mask = torch.tensor([[False, True, True]])
    # relu_dim: (1 + 0) + (2 + 0.5); relu_token: max(0,-2) + max(0,2.5); none: -2 + 2.5
    assert pool_head_relevance(rel, mask, "relu_dim").item() == 3.5
    assert pool_head_relevance(rel, mask, "relu_token").item() == 2.5
    assert pool_head_relevance(rel, mask, "none").item() == 0.5
    rel_nan = rel.clone()
    rel_nan[0, 0, 0, 0] = float("nan")
    assert pool_head_relevance(rel_nan, mask, "none").item() == 0.5  # padding never counts
    with pytest.raises(ValueError, match="pooling"):
        pool_head_relevance(rel, mask, "max")


def test_pooling_orderings_and_token_level_input():
    gen = torch.Generator().manual_seed(0)
    rel = torch.randn(3, 2, 4, 5, 6, generator=gen, dtype=torch.float64)
    mask = torch.rand(3, 5, generator=gen) > 0.3
    dim, tok, raw = (pool_head_relevance(rel, mask, p) for p in ("relu_dim", "relu_token", "none"))
    assert dim.shape == (3, 2, 4)
    assert (dim >= tok - 1e-12).all() and (tok >= raw - 1e-12).all() and (tok >= 0).all()
    assert (dim > tok + 1e-6).any()
    # each item pooled alone (only its real positions) equals the batched pooling
    for b in range(3):
        real = mask[b]
        alone = pool_head_relevance(rel[b : b + 1, :, :, real], mask[b : b + 1, real], "relu_dim")
        torch.testing.assert_close(alone[0], dim[b])
    # token-level scores (ALTI-Logit) are d = 1: the two ReLU poolings coincide
    token = rel[..., 0]
    torch.testing.assert_close(
        pool_head_relevance(token, mask, "relu_dim"), pool_head_relevance(token, mask, "relu_token")
    )
    torch.testing.assert_close(
        pool_head_relevance(token, mask, "none"),
        pool_head_relevance(token[..., None], mask, "none"),
    )


# ------------------------------------------------------------- relevance over a dataset
def _fake_head_relevance(model, batch):
    """A deterministic per-item head relevance [b, l, h, pos, d] with garbage at padding."""
    n_l, n_h = model.cfg.n_layers, model.cfg.n_heads
    ids = batch.tokens.double()
    grid = torch.arange(n_l * n_h * 3, dtype=torch.float64).reshape(n_l, n_h, 1, 3)
    rel = torch.sin(ids[:, None, None, :, None] * 0.37 + grid[None]) * (1 + grid[None] / 10)
    return rel.masked_fill(~batch.mask[:, None, None, :, None], 1e9)


@pytest.fixture
def fake_methods(monkeypatch):
    """Two registered methods with known head relevances (unregistered after the test)."""

    def register_temporarily(name):
        def wrap(fn):
            monkeypatch.setitem(METHODS, name, None)  # restored (removed) after the test
            return register(
                name,
                label=name,
                head_relevances=True,
                options={"heads": Option(False)},
            )(fn)

        return wrap

    @register_temporarily("_fake_dims")
    def fake_dims(model, batch, target, *, heads):
        assert heads, "head_relevance must ask for heads=True"
        resolved = target.resolve(model, batch, torch.zeros(batch.size, model.cfg.d_vocab))
        rel = _fake_head_relevance(model, batch)
        return MethodOutput(
            torch.zeros(batch.tokens.shape), resolved, parts={"head_dim_relevance": rel}
        )

    @register_temporarily("_fake_tokens")
    def fake_tokens(model, batch, target, *, heads):
        resolved = target.resolve(model, batch, torch.zeros(batch.size, model.cfg.d_vocab))
        rel = _fake_head_relevance(model, batch)[..., 0]
        return MethodOutput(torch.zeros(batch.tokens.shape), resolved, head_token_scores=rel)

    return ["_fake_dims", "_fake_tokens"]


def test_head_relevance_is_the_item_mean_and_ignores_padding(fake_methods):
    model = _model("gpt2")
    batched = head_relevance(model, ITEMS, "_fake_dims", batch_size=3)
    assert set(batched) == set(POOLINGS)
    # independent reference: every item alone (no padding), pooled, averaged
    for pooling in POOLINGS:
        per_item = []
        for item in ITEMS:
            batch, _ = prepare(model, item[0], None)
            per_item.append(
                pool_head_relevance(_fake_head_relevance(model, batch), batch.mask, pooling)[0]
            )
        torch.testing.assert_close(batched[pooling], torch.stack(per_item).mean(0))
        assert batched[pooling].abs().max() < 1e3  # the 1e9 padding garbage never counted
    tokens = head_relevance(model, ITEMS, "_fake_tokens", batch_size=3)
    torch.testing.assert_close(tokens["relu_dim"], tokens["relu_token"])


def test_pruning_order_and_checkpoints():
    rel = torch.tensor([[0.5, -1.0], [2.0, -1.0]])
    assert pruning_order(rel).tolist() == [1, 3, 0, 2]  # least relevant first, stable ties
    assert checkpoints(10, 3) == [0, 3, 6, 9, 10]
    assert checkpoints(10, 3, max_pruned=7) == [0, 3, 6, 7]
    assert checkpoints(10, 5, max_pruned=5) == [0, 5]
    with pytest.raises(ValueError):
        checkpoints(10, 0)


def test_random_order_reproducible():
    a, b, c = random_order(4, 3, 7), random_order(4, 3, 7), random_order(4, 3, 8)
    assert a.tolist() == b.tolist() and a.tolist() != c.tolist()
    assert sorted(a.tolist()) == list(range(12))


def test_auc_trapezoid():
    curve = PruningCurve("x", [0, 2, 4], [1.0, 0.5, 0.0], [2.0, 1.0, 0.0], 4, list(range(4)))
    # fractions 0, .5, 1: (1+.5)/2*.5 + (.5+0)/2*.5
    assert curve.auc() == pytest.approx(0.5)
    assert curve.auc("logit_diff") == pytest.approx(1.0)


# ------------------------------------------------------------------------- end to end
def test_run_pruning_end_to_end(fake_methods):
    model = _model("llama", torch.float32)
    before_fp, before_params = model_state_fingerprint(model), _all_params(model)
    kwargs = dict(step=3, n_random=3, seed=5, batch_size=4, progress=False)
    result = run_pruning(model, ITEMS, fake_methods, **kwargs)
    assert model_state_fingerprint(model) == before_fp
    after = _all_params(model)
    assert all(torch.equal(before_params[k], after[k]) for k in before_params)

    n_total = model.cfg.n_layers * model.cfg.n_heads
    labels = [f"{m}/{p}" for m in fake_methods for p in POOLINGS] + [RANDOM]
    assert result.labels() == labels
    for curve in result.curves:
        assert curve.n_pruned == checkpoints(n_total, 3)
        if curve.label != RANDOM:
            assert curve.order == pruning_order(result.relevance[curve.label]).tolist()
    assert [c.seed for c in result.by_label(RANDOM)] == [5, 6, 7]
    assert [c.order for c in result.by_label(RANDOM)] == [
        random_order(model.cfg.n_layers, model.cfg.n_heads, s).tolist() for s in (5, 6, 7)
    ]
    # every point equals a fresh evaluation with that mask (memoisation is transparent)
    task = TaskSet.build(model, ITEMS)
    curve = result.by_label(f"{fake_methods[0]}/none")[0]
    k = curve.n_pruned[2]
    keep = torch.ones(n_total, dtype=torch.bool)
    keep[torch.tensor(curve.order[:k])] = False
    point = prune_and_score(model, task, keep.reshape(model.cfg.n_layers, model.cfg.n_heads))
    assert curve.accuracy[2] == point.accuracy
    assert curve.logit_diff[2] == pytest.approx(point.logit_diff, rel=1e-6)
    # one forward per distinct set of pruned heads (0 pruned and all pruned are shared)
    n_points = len(checkpoints(n_total, 3))
    distinct = {frozenset(c.order[:k]) for c in result.curves for k in c.n_pruned}
    assert result.meta["masks_evaluated"] == len(distinct) < len(result.curves) * n_points

    # reproducible, JSON round trip, AUCs, plot
    again = run_pruning(model, ITEMS, fake_methods, **kwargs)
    assert [c.accuracy for c in again.curves] == [c.accuracy for c in result.curves]
    aucs = result.aucs()
    assert aucs[RANDOM][2] == 3 and aucs[labels[0]][1] == 0.0
    loaded = PruningResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert loaded.aucs() == aucs
    from lens_attrib.plot import pruning_curve

    fig = pruning_curve(result)
    names = [t.name for t in fig.data if t.showlegend is not False]
    assert len(names) == len(labels) and any("mean ± std" in n for n in names)
    band = [t for t in fig.data if t.fill == "toself"]
    assert len(band) == 1
    random_acc = np.array([c.accuracy for c in result.by_label(RANDOM)])
    np.testing.assert_allclose(band[0].y[:n_points], random_acc.mean(0) + random_acc.std(0))


def test_single_token_items_filters():
    model = _model("gpt2")
    items = [
        SimpleNamespace(prompt="the keys", target=" are", foil=" is"),
        SimpleNamespace(prompt="the keys", target=" are", foil=" zzz qqq"),
    ]
    assert single_token_items(model, items) == (items[:1], 1)


# --------------------------------------------------------- real methods, when present
REAL = head_relevance_methods()


@pytest.mark.parametrize("method", REAL)
def test_real_method_head_relevance(method):
    model = _model("llama")
    before = model_state_fingerprint(model)
    rel = head_relevance(model, ITEMS[:4], method, batch_size=2)
    assert model_state_fingerprint(model) == before
    shape = (model.cfg.n_layers, model.cfg.n_heads)
    for pooling, value in rel.items():
        assert value.shape == shape and torch.isfinite(value).all(), pooling
    assert (rel["relu_dim"] >= rel["relu_token"] - 1e-9).all()
    alone = head_relevance(model, ITEMS[:4], method, batch_size=1)
    for pooling in POOLINGS:
        torch.testing.assert_close(rel[pooling], alone[pooling], rtol=1e-6, atol=1e-9)


def test_grad_x_input_no_relu_is_the_derivative_of_a_head_mask():
    """Σ_{p,d} z·∂f/∂z of head h = ∂f/∂m_h at m = 1, m_h a multiplier on z_h (chain rule)."""
    model = _model("llama")
    items = ITEMS[:4]
    rel = head_relevance(model, items, "grad_x_input", ["none"], batch_size=4)["none"]
    task = TaskSet.build(model, items)
    with grad_context(model):
        keep = torch.ones(
            model.cfg.n_layers, model.cfg.n_heads, dtype=torch.float64, requires_grad=True
        )
        total = torch.zeros((), dtype=torch.float64)
        scale_z = [
            (f"blocks.{layer}.attn.hook_z", lambda z, hook, layer=layer: z * keep[layer, :, None])
            for layer in range(model.cfg.n_layers)
        ]
        for batch, target in zip(task.batches, task.targets()):
            with model.hooks(fwd_hooks=scale_z):  # the final residual, through the backend
                resid = final_residual(
                    model, arch_of(model), batch.tokens, batch.mask, batch.padded
                )
            value, *_ = target.evaluate(model, batch, resid)
            total = total + value.sum()
        (grad,) = torch.autograd.grad(total, keep)
    torch.testing.assert_close(rel, grad / len(items), rtol=1e-8, atol=1e-10)


def test_evaluation_leaves_model_unchanged():
    model = _model("gpt2", torch.float32)
    before, params = model_state_fingerprint(model), _all_params(model)
    task = TaskSet.build(model, ITEMS)
    with torch.enable_grad():
        prune_and_score(
            model, task, torch.zeros(model.cfg.n_layers, model.cfg.n_heads, dtype=torch.bool)
        )
    assert model_state_fingerprint(model) == before
    assert all(torch.equal(params[k], v) for k, v in _all_params(model).items())
