"""ReAGent: recursive attribution generator (Zhao & Shan 2024, "ReAGent: A Model-agnostic Feature
Attribution Method for Generative Language Models"), with many probes per forward pass.

For one item with perturbable positions ``1..T``, target probability ``p = softmax(head)[y]``
(``p[y] − p[y']`` with a foil) and ``P`` probes (rows) in parallel, every row keeps logits
``s ∈ R^T`` (initialised ``U[0, 1)``) and repeats, until it stops or ``max_probe_steps``:

1. **update**: replace each position with probability ``replacing_ratio`` (mask ``r``) by a token
   of the replacer, predict ``p̂``; with ``Δ = (p − p̂)/c`` (``c`` = 1, or 2 with a foil)
   ``s_i += logit((δ_i + 1)/2)``, ``δ_i = Δ`` where ``r_i`` (a replaced token that mattered gains)
   and ``−Δ`` where not;
2. **stop check**: keep the ``keep_top_n`` positions of highest ``softmax(s)``, replace all
   others, predict; the row stops once ``y`` is among the ``stopping_condition_top_k`` highest
   outputs (and is then frozen).

The scores are ``softmax(s)`` averaged over the rows that stopped (all rows, with a warning, if
none did), as the authors' ``AggregateRationalizer`` (``mean_important_score``) and Inseq's
``reagent`` return them. Defaults are the π-Soft paper's Inseq settings (keep_top_n=3,
stopping_condition_top_k=3, replacing_ratio=0.25, max_probe_steps=32, num_probes=2).

Departures, all deliberate: every active row of every item is predicted in the same forward
pass (the authors run one forward per step of one item); special tokens (BOS/CLS/SEP) are never
replaced and score 0 (a random token in place of the attention sink or of the CLS row a class
head reads is far out of distribution); in causal models tokens after the target position are
not perturbed and score 0; the argument of ``logit`` is clamped to ``[1e-6, 1 − 1e-6]`` (the
authors' ``logit(1)`` is ``inf`` when ``p̂ = 0`` exactly).

Replacers (``replacer``): ``"uniform"`` — uniform over the vocabulary without special tokens (the
authors' ``UniformTokenSampler``; the offline default); ``"model"`` — the explained model's own
greedy prediction of each position (decoders: from the prefix before it, the authors'
``InferentialTokenSampler``; encoders with an MLM head: at the position masked); a path — a local
folder with a Hugging Face masked LM and its tokenizer (e.g. RoBERTa, as in the paper), which
predicts every position masked in the decoded text; its word is re-tokenised with the explained
model's tokenizer (first token). Random draws come from a generator seeded by ``seed`` and the
item's token ids, so an item gets the same scores alone or in any batch. (Inseq's ``reagent``,
which the π-Soft paper ran, draws uniformly among vocabulary tokens with the same NLTK POS tag;
that sampler needs NLTK's tagger data and is not offered.)

Stopping rule (``stopping_condition``). The authors' ``TopKStoppingConditionEvaluator`` stops a
probe once ``y`` is among the model's ``stopping_condition_top_k`` highest outputs with only the
``keep_top_n`` kept tokens: in the paper ``y`` is the model's own next token, so the rule asks
whether the rationale alone *reproduces the model's decision*. A contrastive target (``y`` against
a foil ``y'``, e.g. a minimal pair) explains another decision — ``y`` over ``y'`` — and ``y`` is
usually far from the top outputs there (measured on held-out agreement items with SmolLM2-135M:
in the top 3 on 1–7 of 60 items per set, median rank 32–1292), so the top-k rule is almost never
met, every probe runs to ``max_probe_steps`` and the scores average unconverged probes. With a
foil the default (``"auto"``) is therefore the contrastive rule, the same question asked of the
decision actually explained. A probe stops once the kept tokens alone

(a) give the **same order of ``y`` and ``y'`` as the clean input** (``y`` above ``y'`` if it is
    above on the clean input, below if below; a tie counts as "not above"), and
(b) rank ``y`` no lower than ``max(k, r₀)``, ``r₀`` its rank on the clean input (rank = 1 + the
    number of outputs strictly above it; ``k = stopping_condition_top_k``).

(b) is the paper's top-k rule made relative to the clean input — identical to it when ``y`` is
among the model's top ``k`` outputs, as in the paper. (a) alone is not enough: a binary order is
met by chance by about half of all random contents, so probes stop after one step with
uninformative scores (seen on a planted copy rule, where order-only probes stopped on the wrong
token). Without a foil ``"auto"`` is the paper's top-k rule.
``stopping_condition="top_k"`` or ``"contrastive"`` forces one (``"contrastive"`` needs a foil).
With a foil the update uses the selected value ``p[y] − p[y']`` (``c`` = 2). A class head with no
more outputs than ``stopping_condition_top_k`` makes every top-k probe stop after one step (a
warning says so).
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lens_attrib.backend import lm_head
from lens_attrib.errors import OptionError, TargetError
from lens_attrib.forward import head_outputs, resid_of, run
from lens_attrib.inputs import Batch
from lens_attrib.methods.registry import MethodOutput, Option, integer, positive_int, register
from lens_attrib.methods.seeding import item_seed
from lens_attrib.progress import progress_bar
from lens_attrib.target import ResolvedTarget, Target

LOGIT_CLAMP = 1e-6
REPLACERS = ("uniform", "model")
STOPPING_CONDITIONS = ("auto", "top_k", "contrastive")


@dataclass
class Probes:
    """One item's probe rows: perturbable columns, replacement table, logits and stop flags."""

    row: Int[Tensor, "pos"]
    columns: Int[Tensor, "T"]
    table: Tensor | None
    logits: Tensor
    stopped: Tensor
    gen: torch.Generator
    steps: int = 0


def _replacer_check(value: Any) -> str | None:
    if value in REPLACERS:
        return None
    if isinstance(value, str | os.PathLike) and os.path.isdir(value):
        return None
    return (
        "'uniform', 'model', or the path of an existing local folder with a Hugging Face masked "
        "LM and its tokenizer (e.g. a saved roberta-base)"
    )


def _ratio_check(value: Any) -> str | None:
    ok = isinstance(value, float | int) and not isinstance(value, bool) and 0 < value < 1
    return None if ok else "a number in (0, 1)"


def candidate_ids(model: Any) -> Tensor:
    """Token ids a uniform replacement may draw: the vocabulary without special tokens."""
    n = int(model.cfg.d_vocab)
    tokenizer = model.tokenizer
    allowed = torch.ones(n, dtype=torch.bool)
    if tokenizer is not None:
        n = min(n, len(tokenizer))
        allowed[n:] = False
        special = [i for i in (tokenizer.all_special_ids or []) if 0 <= i < n]
        allowed[special] = False
    return torch.nonzero(allowed).flatten()


def _model_table(model: Any, batch: Batch, b: int, columns: Tensor) -> Tensor:
    """The explained model's greedy prediction of every column of item ``b``."""
    row = batch.tokens[b]
    head = lm_head(model, batch.arch)
    if batch.arch.encoder:
        n = len(columns)
        tokens = row[None].repeat(n, 1)
        mask_id = model.tokenizer.mask_token_id
        tokens[torch.arange(n), columns.to(tokens.device)] = mask_id
        masks = batch.mask[b][None].repeat(n, 1)
        types = None if batch.token_types is None else batch.token_types[b][None].repeat(n, 1)
        out = head_outputs(model, tokens, masks, columns, head=head, token_types=types)
        return out.argmax(-1).cpu()
    resid = resid_of(model, batch.select([b]))[0]
    before = (columns - 1).clamp_min(0).to(resid.device)
    predicted = head(resid[before]).argmax(-1).cpu()
    first = columns == int(batch.first_real[b])
    return torch.where(first, row.cpu()[columns], predicted)


@functools.lru_cache(maxsize=2)
def _masked_lm(path: str) -> tuple[Any, Any]:
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    mlm = AutoModelForMaskedLM.from_pretrained(path, local_files_only=True).eval()
    return mlm, AutoTokenizer.from_pretrained(path, local_files_only=True)


def _mlm_table(model: Any, batch: Batch, b: int, columns: Tensor, path: str) -> Tensor:
    """A local masked LM's prediction of every column, masked in the decoded text."""
    mlm, mlm_tok = _masked_lm(path)
    tokenizer = model.tokenizer
    ids = batch.tokens[b].tolist()
    texts, pieces = [], []
    for c in columns.tolist():
        before = tokenizer.decode(ids[:c], skip_special_tokens=True).rstrip()
        after = tokenizer.decode(ids[c + 1 : int(batch.last_real[b]) + 1], skip_special_tokens=True)
        texts.append(f"{before} {mlm_tok.mask_token} {after.lstrip()}".strip())
        pieces.append(tokenizer.decode([ids[c]]))
    enc = mlm_tok(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = mlm(**enc).logits
    where = enc["input_ids"] == mlm_tok.mask_token_id
    scores = logits[where]
    scores[:, [i for i in mlm_tok.all_special_ids if i < scores.shape[-1]]] = float("-inf")
    table = []
    for piece, row in zip(pieces, scores):
        for candidate in row.argsort(descending=True)[:5].tolist():
            word = mlm_tok.decode([candidate]).strip()
            if word and word != piece.strip():
                break
        space = " " if piece.startswith(" ") else ""
        new = tokenizer(space + word, add_special_tokens=False)["input_ids"]
        table.append(int(new[0]) if new else ids[0])
    return torch.tensor(table, dtype=torch.long)


def _replace(probes: Probes, where: Tensor, candidates: Tensor, n: int) -> Int[Tensor, "n pos"]:
    """``n`` copies of the item's row with the columns flagged in ``where [n, T]`` replaced."""
    rows = probes.row.cpu()[None].repeat(n, 1)
    if probes.table is not None:
        new = probes.table[None].expand(n, -1)
    else:
        draw = torch.randint(len(candidates), (n, len(probes.columns)), generator=probes.gen)
        new = candidates[draw]
    current = rows[:, probes.columns]
    rows[:, probes.columns] = torch.where(where, new, current)
    return rows


def _predict(
    model: Any,
    batch: Batch,
    parts: list[tuple[int, Tensor]],
    resolved: ResolvedTarget,
    head: Callable[[Tensor], Tensor],
    reduce: Callable[[Tensor, Tensor], Tensor],
    rows_per_forward: int,
) -> list[Tensor]:
    """``reduce(head outputs, item index)`` for every (item, rows) part, all in shared forwards."""
    if not parts:
        return []
    tokens = torch.cat([rows for _, rows in parts])
    items = torch.cat([torch.full((len(rows),), b) for b, rows in parts])
    mask = batch.mask.cpu()[items]
    positions = resolved.positions.cpu()[items]
    types = None if batch.token_types is None else batch.token_types.cpu()[items]
    out = head_outputs(
        model,
        tokens,
        mask,
        positions,
        head=head,
        reduce=lambda h, rows: reduce(h, items[rows]),
        max_batch=rows_per_forward,
        token_types=types,
    )
    return list(torch.split(out.cpu(), [len(rows) for _, rows in parts]))


def check_applies(model: Any, batch: Batch, target: Target, replacer: str) -> None:
    """Errors for a regression target and for ``replacer="model"`` on an encoder without an MLM
    head or mask token."""
    if target.regression:
        raise TargetError(
            "reagent measures the drop in the target's probability; a regression head has no "
            "probabilities. Use a gradient method (grad_x_input, integrated_gradients, deeplift)."
        )
    if replacer == "model" and batch.arch.encoder:
        tokenizer = model.tokenizer
        if not batch.arch.lm_head or getattr(tokenizer, "mask_token_id", None) is None:
            raise OptionError(
                "reagent: replacer='model' on an encoder predicts each token masked, which needs "
                "a masked-LM head and a mask token; this model has no such head or mask token. "
                "Use replacer='uniform' or the path of a local masked-LM folder."
            )


def perturbable(batch: Batch, positions: Tensor) -> Bool[Tensor, "batch pos"]:
    """Real, non-special tokens; in causal models only those up to the target position."""
    allowed = batch.mask & ~batch.special
    if batch.arch.causal:
        index = torch.arange(batch.length, device=allowed.device)[None]
        allowed = allowed & (index <= positions.to(allowed.device)[:, None])
    return allowed


def make_probes(
    model: Any, batch: Batch, allowed: Tensor, replacer: str, seed: int, num_probes: int
) -> list[Probes]:
    """Every item's probes: its generator (seeded by ``seed`` and its real token ids), the
    replacement table of a deterministic replacer, logits ``U[0, 1)``, nothing stopped."""
    probes: list[Probes] = []
    for b in range(batch.size):
        columns = torch.nonzero(allowed[b].cpu()).flatten()
        ids = batch.tokens[b].cpu()[batch.mask[b].cpu()].tolist()
        gen = torch.Generator().manual_seed(item_seed(seed, ids))
        table = None
        if replacer == "model" and len(columns):
            table = _model_table(model, batch, b, columns)
        elif replacer not in REPLACERS and len(columns):
            table = _mlm_table(model, batch, b, columns, str(replacer))
        logits = torch.rand(num_probes, len(columns), generator=gen, dtype=torch.float64)
        stopped = torch.zeros(num_probes, dtype=torch.bool)
        probes.append(Probes(batch.tokens[b].cpu(), columns, table, logits, stopped, gen))
    return probes


def updated_logits(
    logits: Float[Tensor, "probe T"], replaced: Bool[Tensor, "probe T"], drop: Tensor
) -> Float[Tensor, "probe T"]:
    """One ReAGent update: ``s_i += logit((δ_i + 1)/2)``, ``δ_i = ±drop`` (+ where replaced).

    ``drop [probe]``: the fall of the explained value ``(p − p̂)/c`` in ``[−1, 1]``; the logit's
    argument is clamped to ``[1e-6, 1 − 1e-6]``.
    """
    delta = torch.where(replaced, drop[:, None], -drop[:, None])
    return logits + torch.logit((delta * 0.5 + 0.5).clamp(LOGIT_CLAMP, 1 - LOGIT_CLAMP))


def aggregate(probes: list[Probes], batch: Batch) -> tuple[Tensor, list[int]]:
    """Scores: ``softmax(s)`` averaged over the stopped probes (all probes where none stopped,
    those items are returned too)."""
    scores = torch.zeros(batch.size, batch.length, dtype=torch.float64)
    unstopped = []
    for b, p in enumerate(probes):
        if not len(p.columns):
            continue
        rows = p.stopped if bool(p.stopped.any()) else torch.ones_like(p.stopped)
        unstopped += [] if bool(p.stopped.any()) else [b]
        scores[b, p.columns] = p.logits.softmax(-1)[rows].mean(0)
    return scores, unstopped


def target_rank(
    head_out: Float[Tensor, "n n_out"], token_ids: Int[Tensor, "n"]
) -> Int[Tensor, "n"]:
    """1 + the number of outputs strictly above the target's (1: the top output)."""
    idx = torch.arange(head_out.shape[0], device=head_out.device)
    own = head_out[idx, token_ids.to(head_out.device)]
    return 1 + (head_out > own[:, None]).sum(-1)


def stopping_rule(stopping_condition: str, resolved: ResolvedTarget) -> str:
    """The rule used: ``"auto"`` is ``"contrastive"`` with a foil and ``"top_k"`` without."""
    contrastive = resolved.foil_ids is not None
    if stopping_condition == "auto":
        return "contrastive" if contrastive else "top_k"
    if stopping_condition == "contrastive" and not contrastive:
        raise OptionError(
            "reagent: stopping_condition='contrastive' compares the target with the foil, but "
            "the target has no foil. Pass Target(token=..., foil=...) or use "
            "stopping_condition='top_k' (or 'auto')."
        )
    return stopping_condition


@register(
    "reagent",
    label="ReAGent",
    options={
        "keep_top_n": Option(3, check=positive_int),
        "stopping_condition_top_k": Option(3, check=positive_int),
        "replacing_ratio": Option(0.25, check=_ratio_check),
        "max_probe_steps": Option(32, check=positive_int),
        "num_probes": Option(2, check=positive_int),
        "replacer": Option("uniform", check=_replacer_check),
        "seed": Option(0, check=integer),
        "batch_size": Option(64, check=positive_int, help="probe rows per forward"),
        "stopping_condition": Option(
            "auto",
            choices=STOPPING_CONDITIONS,
            help="'auto': 'contrastive' with a foil, else 'top_k' (the paper's)",
        ),
    },
)
def reagent(
    model: Any,
    batch: Batch,
    target: Target,
    *,
    keep_top_n: int,
    stopping_condition_top_k: int,
    replacing_ratio: float,
    max_probe_steps: int,
    num_probes: int,
    replacer: str,
    seed: int,
    batch_size: int,
    stopping_condition: str,
) -> MethodOutput:
    """ReAGent (Zhao & Shan 2024): recursive replace-and-predict importance (module docstring).

    keep_top_n (3), stopping_condition_top_k (3), replacing_ratio (0.25), max_probe_steps (32),
    num_probes (2): the π-Soft paper's settings. replacer: ``"uniform"`` (default), ``"model"``,
    or a local masked-LM folder. seed: with the item's token ids, seeds its random draws.
    stopping_condition: ``"auto"`` (contrastive with a foil, else top-k), ``"top_k"``,
    ``"contrastive"`` (module docstring). ``meta``: ``probe_steps`` and ``stopped_probes`` per
    item; ``meta["options"]["stopping_condition"]``: the rule used.
    """
    check_applies(model, batch, target, replacer)
    clean = run(model, batch, target)
    assert clean.head_out is not None
    resolved = clean.resolved
    rule = stopping_rule(stopping_condition, resolved)
    head = target.head_fn(model)
    n_out = int(clean.head_out.shape[-1])
    if rule == "top_k" and stopping_condition_top_k >= n_out:
        warnings.warn(
            f"reagent: stopping_condition_top_k={stopping_condition_top_k} ≥ the head's {n_out} "
            "outputs, so every probe stops after its first step; pass a smaller value (e.g. 1).",
            RuntimeWarning,
            stacklevel=4,
        )
    scale = 2.0 if resolved.foil_ids is not None else 1.0
    token_ids = resolved.token_ids.cpu()

    def value(h: Tensor, items: Tensor) -> Tensor:
        sub = resolved.index(items.to(resolved.token_ids.device))
        return sub.select(torch.softmax(h.double(), -1))

    clean_above = (resolved.select(clean.head_out.double()) > 0).cpu()
    clean_rank = target_rank(clean.head_out, resolved.token_ids).cpu()

    def hit(h: Tensor, items: Tensor) -> Tensor:
        if rule == "contrastive":
            sub = resolved.index(items.to(resolved.token_ids.device))
            same_order = (sub.select(h.double()) > 0).cpu() == clean_above[items]
            rank = target_rank(h, sub.token_ids).cpu()
            return same_order & (rank <= clean_rank[items].clamp_min(stopping_condition_top_k))
        top = h.topk(min(stopping_condition_top_k, n_out), -1).indices.cpu()
        return (top == token_ids[items][:, None]).any(-1)

    p0 = value(clean.head_out, torch.arange(batch.size)).cpu()
    candidates = candidate_ids(model)
    allowed = perturbable(batch, resolved.positions)
    probes = make_probes(model, batch, allowed, replacer, seed, num_probes)

    active = [b for b, p in enumerate(probes) if len(p.columns)]
    rounds = progress_bar(desc="reagent", unit="round")  # stops early: no total
    for _ in range(max_probe_steps):
        if not active:
            break
        rounds.update()
        rounds.set_postfix_str(f"{len(active)} items probing", refresh=False)
        masks, live, parts = {}, {}, []
        for b in active:
            p = probes[b]
            masks[b] = torch.rand(p.logits.shape, generator=p.gen) < replacing_ratio
            live[b] = ~p.stopped
            parts.append((b, _replace(p, masks[b], candidates, num_probes)[live[b]]))
        outs = _predict(model, batch, parts, resolved, head, value, batch_size)
        checks = []
        for (b, _), p_hat in zip(parts, outs):
            p = probes[b]
            p.steps += 1
            drop = torch.zeros(num_probes, dtype=torch.float64)
            drop[live[b]] = (p0[b] - p_hat.double()) / scale
            update = updated_logits(p.logits, masks[b], drop)
            p.logits = torch.where(live[b][:, None], update, p.logits)
            keep = p.logits.softmax(-1).topk(min(keep_top_n, len(p.columns)), -1).indices
            replace = torch.ones_like(masks[b]).scatter(-1, keep, False)
            checks.append((b, _replace(p, replace, candidates, num_probes)[live[b]]))
        hits = _predict(model, batch, checks, resolved, head, hit, batch_size)
        for (b, _), h in zip(checks, hits):
            probes[b].stopped[live[b]] |= h.bool()
        active = [b for b in active if not bool(probes[b].stopped.all())]

    rounds.close()
    scores, unstopped = aggregate(probes, batch)
    if unstopped:
        warnings.warn(
            f"reagent: no probe of items {unstopped} met the stopping condition within "
            f"max_probe_steps={max_probe_steps} (stopping_condition={rule!r}); their scores "
            "average all probes. Raise max_probe_steps or "
            + ("keep_top_n." if rule == "contrastive" else "stopping_condition_top_k."),
            RuntimeWarning,
            stacklevel=4,
        )
    return MethodOutput(
        scores.to(batch.arch.work_dtype),
        resolved,
        options={"stopping_condition": rule},
        meta={
            "probe_steps": [p.steps for p in probes],
            "stopped_probes": [int(p.stopped.sum()) for p in probes],
        },
    )
