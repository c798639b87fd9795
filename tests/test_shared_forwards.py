"""The shared, own-length, deduplicated forwards equal the plain path, with fewer forwards.

Oracles: every perturbed row forwarded on its own in the batch's padded width (Soft: the keep
mask drawn as the module documents, fixed routing replaying patterns cached at that width; AOPC
and insertion/deletion: every perturbed sequence of every item padded together) — compared in
float64 at 1e-12 relative to each array's largest magnitude, on mixed lengths, a batch of one,
and scores that make every token certain to stay or drop. The forward counter wraps the
backend's ``final_residual`` (every forward of the library passes through it).
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import replace

import pytest
import torch

import lens_attrib.forward as forward_mod
from lens_attrib import attribute
from lens_attrib.backend import arch_of, token_embedding_hook
from lens_attrib.evaluation import ScoreOptions, aopc, insertion_deletion, score
from lens_attrib.evaluation.faithfulness import (
    _perturb,
    item_views,
    n_perturbed,
    pad_sequences,
    special_ids_of,
)
from lens_attrib.evaluation.metrics import SOFT_BASE
from lens_attrib.evaluation.soft import (
    _item_seed,
    _row_uniforms,
    hellinger,
    keep_scores,
    soft_metrics,
    solve_alpha,
)
from lens_attrib.forward import head_outputs
from lens_attrib.hooks.masking import embedding_mask_hook
from lens_attrib.hooks.routing import fixed_routing_hooks, pattern_cache_hooks
from lens_attrib.inputs import pad_id_of
from lens_attrib.tiny_models import tiny_bert, tiny_llama

PIS = (0.2, 0.5, 0.8)
DRAWS = 3
PROMPTS = ["the cat sat", "a dog ran over the big hill today", "the", "big red cat sat on a mat"]


def close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-12) -> None:
    got, want = got.double(), want.double()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    ok = ~torch.isnan(want)
    scale = float(want[ok].abs().max()) if bool(ok.any()) else 1.0
    err = float((got[ok] - want[ok]).abs().max()) if bool(ok.any()) else 0.0
    assert err <= rtol * max(scale, 1e-300), (err, scale)


@pytest.fixture(scope="module")
def llama():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_llama(dtype=torch.float64)


@pytest.fixture(scope="module")
def bert():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_bert(dtype=torch.float64)


def certain(attr, b: int, fill: str):
    """Item ``b``'s scores made all-negative (every s = 0), constant (every s = 1) or 0/1."""
    scores = attr.scores.clone()
    real = attr.mask[b]
    n = int(real.sum())
    if fill == "negative":
        scores[b, real] = -torch.arange(1, n + 1, dtype=scores.dtype)
    elif fill == "constant":
        scores[b, real] = 1.0
    else:  # half exactly 1, half exactly 0
        binary = [1.0 if i % 2 else 0.0 for i in range(n)]
        scores[b, real] = torch.tensor(binary, dtype=scores.dtype)
    return replace(attr, scores=scores)


@pytest.fixture(scope="module")
def llama_attr(llama):
    attr = attribute(llama, PROMPTS, method="grad_x_input")
    return certain(certain(attr, 2, "negative"), 3, "binary")


# --------------------------------------------------------------------------- plain Soft
def plain_soft(model, attr, *, routing, per_element, seed=0, pis=PIS, n_draws=DRAWS):
    """Soft-NC/NS and the π curves, every row its own forward at the padded width."""
    special = special_ids_of(model, None)
    d_model = int(model.cfg.d_model)
    hook = token_embedding_hook(arch_of(model))
    out = {k: [] for k in ("soft_nc", "soft_ns", "nc", "ns")}
    for b in range(len(attr)):
        real = attr.mask[b]
        ids = attr.token_ids[b][real].tolist()
        pert = torch.tensor([t not in special for t in ids])
        s = torch.zeros(len(ids), dtype=torch.float64)
        s[pert] = keep_scores(attr.scores[b][real][pert])
        alpha, _ = solve_alpha(s[pert], pis, warn=False)
        rows = [torch.ones(len(ids)), torch.zeros(len(ids))] + [1 - s] * n_draws + [s] * n_draws
        rows += [1 - s.pow(a) for a in alpha.tolist() for _ in range(n_draws)]
        rows += [s.pow(a) for a in alpha.tolist() for _ in range(n_draws)]
        one = slice(b, b + 1)
        hooks: list = []
        if routing == "fixed":
            store: dict = {}
            saving = pattern_cache_hooks(store)(int(model.cfg.n_layers))
            head_outputs(model, attr.token_ids[one], attr.mask[one], attr.target.positions[one],
                         hooks=lambda r, saving=saving: saving)  # fmt: skip
            hooks = fixed_routing_hooks({k: torch.cat(v) for k, v in store.items()})
        probs = []
        for k, q in enumerate(rows):
            q = q.to(torch.float64).clone()
            q[~pert] = 1.0
            shape = (len(ids), d_model) if per_element else (len(ids),)
            if bool(((q > 0) & (q < 1)).any()):
                u = _row_uniforms(_item_seed(seed, ids), k, shape)
                m = (u < (q[:, None] if per_element else q)).double()
            else:
                m = (q[:, None] if per_element else q).expand(shape)
            keep = torch.ones((1, attr.token_ids.shape[1]) + ((d_model,) if per_element else ()),
                              dtype=torch.float64)  # fmt: skip
            keep[0, real] = m
            hs = [embedding_mask_hook(keep, name=hook), *hooks]
            o = head_outputs(model, attr.token_ids[one], attr.mask[one],
                             attr.target.positions[one], hooks=lambda r, hs=hs: hs)  # fmt: skip
            probs.append(torch.softmax(o.double(), -1)[0])
        p = torch.stack(probs)
        h = hellinger(p[:1], p)
        d0 = h[1] if h[1] > 0 else torch.tensor(float("nan"), dtype=torch.float64)
        nc = h / d0
        ns = (1 - h / d0).clamp_min(0)
        out["soft_nc"].append(nc[2 : 2 + n_draws].mean())
        out["soft_ns"].append(ns[2 + n_draws : 2 + 2 * n_draws].mean())
        start, blk = 2 + 2 * n_draws, len(pis) * n_draws
        out["nc"].append(nc[start : start + blk].reshape(len(pis), n_draws).mean(-1))
        out["ns"].append(ns[start + blk : start + 2 * blk].reshape(len(pis), n_draws).mean(-1))
    return {k: torch.stack(v) for k, v in out.items()}


@pytest.mark.parametrize("routing", ["dynamic", "fixed"])
@pytest.mark.parametrize("per_element", [False, True])
def test_soft_equals_plain_rows_mixed_lengths(llama, llama_attr, routing, per_element):
    got = soft_metrics(llama, llama_attr, pis=PIS, n_draws=DRAWS, routing=routing,
                       per_element=per_element, max_batch=5)  # fmt: skip
    want = plain_soft(llama, llama_attr, routing=routing, per_element=per_element)
    close(got.soft_nc, want["soft_nc"])
    close(got.soft_ns, want["soft_ns"])
    close(got.pi_nc_curve, want["nc"])
    close(got.pi_ns_curve, want["ns"])
    pis = torch.tensor(PIS, dtype=torch.float64)
    close(got.pi_soft_nc, torch.trapezoid(want["nc"], pis, dim=-1))


@pytest.mark.parametrize("routing", ["dynamic", "fixed"])
def test_soft_batch_of_one_and_encoder(llama, bert, llama_attr, routing):
    one = llama_attr[1:2]
    got = soft_metrics(llama, one, pis=PIS, n_draws=DRAWS, routing=routing, max_batch=64)
    close(got.pi_nc_curve, plain_soft(llama, one, routing=routing, per_element=False)["nc"])
    battr = attribute(bert, ["the cat sat", "a dog ran over the hill", "the big dog"],
                      method="grad_x_input")  # fmt: skip
    battr = certain(battr, 0, "constant")
    got = soft_metrics(bert, battr, pis=PIS, n_draws=DRAWS, routing=routing, max_batch=4)
    want = plain_soft(bert, battr, routing=routing, per_element=False)
    close(got.soft_ns, want["soft_ns"])
    close(got.pi_ns_curve, want["ns"])


# --------------------------------------------------------------------------- plain AOPC
def plain_hard(model, attr, rows_of):
    """Head outputs of every item's perturbed sequences (``rows_of(view)``), all padded together."""
    encoder = arch_of(model).encoder
    mask_id = getattr(model.tokenizer, "mask_token_id", None)
    views = item_views(attr, special_ids_of(model, None))
    seqs, targets = [], []
    for v in views:
        for removed in rows_of(v):
            ids, t, _ = _perturb(v, removed, encoder, mask_id)
            seqs.append(ids)
            targets.append(t)
    side = "right" if encoder else "left"
    tokens, mask = pad_sequences(seqs, pad_id_of(model.tokenizer), side)
    offsets = (mask.shape[1] - mask.sum(-1)) if not encoder else torch.zeros(len(seqs))
    positions = torch.tensor(targets) + offsets.long()
    out = head_outputs(model, tokens, mask, positions, max_batch=1000).double()
    return torch.softmax(out, -1).reshape(len(views), -1, out.shape[-1]), views


@pytest.mark.parametrize("overhead", [None, 0.0, 1e9])
@pytest.mark.parametrize("which", ["llama", "bert"])
def test_aopc_and_curves_equal_one_padded_plan(
    llama, bert, llama_attr, which, overhead, monkeypatch
):
    """Hard rows bucketed as the plan chooses (default cost), never padded (overhead 0: exact
    lengths are always cheaper) or all padded together (huge overhead): the same numbers."""
    import lens_attrib.length_buckets as buckets

    if overhead is not None:
        monkeypatch.setattr(buckets, "FORWARD_OVERHEAD_TOKENS", overhead)
    model = llama if which == "llama" else bert
    attr = llama_attr if which == "llama" else attribute(
        bert, ["the cat sat", "a dog ran over the hill", "the big dog"], method="grad_x_input"
    )  # fmt: skip
    fractions = (0.1, 0.3, 0.5, 0.9)

    def aopc_rows(v):
        out = [set()]
        for f in fractions:
            top = set(v.ranked[: n_perturbed(f, len(v.ranked))])
            out += [top, set(v.ranked) - top]
        return out

    probs, _ = plain_hard(model, attr, aopc_rows)
    label = attr.target.token_ids
    idx = torch.arange(len(attr))
    p_full = probs[idx, 0, label]
    value = probs[idx[:, None], torch.arange(1, probs.shape[1])[None], label[:, None]]
    value = value.reshape(len(attr), len(fractions), 2)
    got = aopc(model, attr, fractions=fractions, label="target", max_batch=3)
    close(got.comprehensiveness_k, p_full[:, None] - value[..., 0])
    close(got.sufficiency_k, p_full[:, None] - value[..., 1])
    steps = 4
    fr = torch.linspace(0, 1, steps + 1, dtype=torch.float64).tolist()

    def curve_rows(v):
        out = []
        for f in fr:
            top = set(v.ranked[: n_perturbed(f, len(v.ranked))])
            out += [top, set(v.ranked) - top]
        return out

    probs, _ = plain_hard(model, attr, curve_rows)
    pred = probs.argmax(-1)  # the prediction on the full input is the f = 0 deletion row
    val = probs[idx[:, None], torch.arange(probs.shape[1])[None], label[:, None]]
    val = val.reshape(len(attr), steps + 1, 2)
    res = insertion_deletion(model, attr, steps=steps, label="target", max_batch=2)
    close(res.deletion, val[..., 0])
    close(res.insertion, val[..., 1])
    flips = pred.reshape(len(attr), steps + 1, 2)
    full = flips[:, :1, 0]
    assert torch.equal(res.deletion_flipped, flips[..., 0] != full)
    assert torch.equal(res.insertion_flipped, flips[..., 1] == full)
    # flip-probability AUCs: the trapezoid of the "prediction differs" indicator, by hand
    for b in range(len(attr)):
        for curve, got in ((0, res.deletion_flip_auc[b]), (1, res.insertion_flip_auc[b])):
            ind = [float(flips[b, k, curve] != full[b, 0]) for k in range(steps + 1)]
            want = sum((ind[k] + ind[k + 1]) / 2 * (fr[k + 1] - fr[k]) for k in range(steps))
            assert abs(float(got) - want) <= 1e-12


# --------------------------------------------------------------------------- forward counts
class Counter:
    def __init__(self, monkeypatch):
        self.rows = 0
        self.padded = 0
        real = forward_mod.final_residual

        def counted(model, arch, tokens, mask, padded, token_types=None):
            self.rows += int(tokens.shape[0])
            self.padded += int((~mask).any(-1).sum())
            return real(model, arch, tokens, mask, padded, token_types)

        monkeypatch.setattr(forward_mod, "final_residual", counted)


def distinct_soft_masks(model, attr, b, n_draws, pis, seed=0):
    """Distinct keep masks of item ``b`` (per token, as bytes), all-ones excluded, and the
    number of rows."""
    special = special_ids_of(model, None)
    real = attr.mask[b]
    ids = attr.token_ids[b][real].tolist()
    pert = torch.tensor([t not in special for t in ids])
    s = torch.zeros(len(ids), dtype=torch.float64)
    s[pert] = keep_scores(attr.scores[b][real][pert])
    alpha, _ = solve_alpha(s[pert], pis, warn=False)
    rows = [torch.ones(len(ids)), torch.zeros(len(ids))] + [1 - s] * n_draws + [s] * n_draws
    rows += [1 - s.pow(a) for a in alpha.tolist() for _ in range(n_draws)]
    rows += [s.pow(a) for a in alpha.tolist() for _ in range(n_draws)]
    seen = set()
    for k, q in enumerate(rows):
        q = q.to(torch.float64).clone()
        q[~pert] = 1.0
        if bool(((q > 0) & (q < 1)).any()):
            m = _row_uniforms(_item_seed(seed, ids), k, (len(ids),)) < q
        else:
            m = q.bool()
        if not bool(m.all()):
            seen.add(m.numpy().tobytes())
    return seen, len(rows)


def test_score_forwards_each_distinct_input_once_unpadded(llama, llama_attr, monkeypatch):
    counter = Counter(monkeypatch)
    fractions, steps = (0.1, 0.2, 0.3, 0.5, 0.9), 4
    names = ["comprehensiveness", "sufficiency", "deletion_auc", "insertion_auc"]
    names += [m + s for s in ("", "_fixed") for m in SOFT_BASE]
    opts = ScoreOptions(max_batch=7, aopc={"fractions": fractions, "label": "target"},
                        curves={"steps": steps, "label": "target"},
                        soft={"pis": PIS, "n_draws": DRAWS})  # fmt: skip
    score(llama, llama_attr, names, options=opts)
    views = item_views(llama_attr, special_ids_of(llama, None))
    hard = 0
    plain_rows = 0
    for v in views:
        seqs = {tuple(v.ids)}  # the clean input
        for f in list(fractions) + torch.linspace(0, 1, steps + 1).tolist():
            top = set(v.ranked[: n_perturbed(f, len(v.ranked))])
            for removed in (top, set(v.ranked) - top):
                seqs.add(tuple(_perturb(v, removed, False, None)[0]))
        hard += len(seqs)
        plain_rows += 1 + 2 * len(fractions) + 1 + 2 * (steps + 1)
    soft = 0
    for b in range(len(llama_attr)):
        distinct, rows = distinct_soft_masks(llama, llama_attr, b, DRAWS, PIS)
        soft += 2 * len(distinct)  # dynamic and fixed routing; the clean row is the shared forward
        plain_rows += 2 * rows + 1  # + the pattern-caching forward
    assert counter.rows == hard + soft
    # only hard rows are padded (neighbouring lengths bucketed); clean and Soft at own length
    assert counter.padded <= hard - len(views)
    # the claim: short items and certain tokens repeat rows; the plain protocol made them all
    assert counter.rows < 0.8 * plain_rows, (counter.rows, plain_rows)


def test_certain_tokens_cost_no_random_forwards(llama, llama_attr, monkeypatch):
    """Item 2 (every score negative: every s = 0) has only deterministic rows: keep all (the
    clean forward) or drop all — one forward besides the clean one, whatever the draws."""
    one = llama_attr[2:3]
    counter = Counter(monkeypatch)
    res = soft_metrics(llama, one, pis=PIS, n_draws=DRAWS)
    assert counter.rows == 1 + 1  # clean + all dropped
    assert math.isclose(float(res.soft_nc[0]), 0.0, abs_tol=1e-15)  # nothing removed


# --------------------------------------------------------------------------- agreement
def test_agreement_explains_target_free_methods_once_per_batch(llama, monkeypatch):
    """Target-free methods are explained once per batch, not once per mode; their records in
    both modes equal those of an explanation made for that mode."""
    from experiments import agreement

    calls: list[str] = []
    real = agreement.attribute
    monkeypatch.setattr(
        agreement, "attribute", lambda *a, **k: calls.append(k["method"]) or real(*a, **k)
    )
    vocab = llama.tokenizer.get_vocab()
    cat, dog = vocab["cat"], vocab["dog"]
    data = agreement.Prepared(["the big dog", "a red cat sat"], [cat, dog], [dog, cat],
                              [[1], [2]], 2, 2)  # fmt: skip
    records = agreement.score_task(llama, "t", data, ["random", "gradient"], 2, 0)
    assert sorted(calls) == ["gradient", "gradient", "random"]
    for mode, foil in (("contrastive", data.foils), ("plain", None)):
        target = agreement.Target(token=data.targets, foil=foil)
        want = agreement.unit_records(llama, "t", data.prompts, data.evidence, target,
                                      "random", mode, 0, 0)  # fmt: skip
        got = [r for r in records if r["method"] == "random" and r["mode"] == mode]
        assert json.dumps(got) == json.dumps(want)  # NaN cells included
