"""Faithfulness by perturbation (NormXLogit paper Table 1; π-Soft paper Tables 1–2 analogue).

Zero-shot classification with an instruction-tuned decoder (SmolLM2-135M-Instruct by default):
SST-2 (validation), an IMDb sample and BoolQ (validation) become chat prompts —
``tokenizer.apply_chat_template`` with the generation prompt, followed by ``"Sentiment:"`` /
``"Answer:"`` in the assistant turn — or, without a chat template, plain
``"Review: …\\nSentiment (Positive or Negative):"`` / ``"…\\nQuestion: …?\\nAnswer (true or
false):"`` prompts. Labels are the single tokens ``" Positive"``/``" Negative"`` and
``" true"``/``" false"`` (checked). The explained target is the label the model prefers of the
two (its zero-shot prediction); accuracy against the gold label is reported beside.

Metrics per method (:mod:`lens_attrib.evaluation`):

- AOPC comprehensiveness (↑) and sufficiency (↓): delete the top-k% (or all but the top-k%)
  tokens, k = 10…90 %, probability of the explained label (NormXLogit paper Table 1);
- π-Soft-NC (↑) / π-Soft-NS (↑): area under the π curve (Huang & Chan), with dynamic routing and
  with fixed routing (the clean run's attention replayed);
- raw Soft-NC / Soft-NS (Zhao & Aletras) and the expected number of retained tokens E[R] of the
  Soft-NS perturbation — which differs between methods, the bias the π variants remove.

Special tokens (``<|im_start|>``…) are never perturbed; the decoder's last token is kept (the
prediction is read there). Long inputs are truncated to ``--max-tokens`` tokens of text.

    python -m experiments.faithfulness --model smollm2-135m --n 2 --out results/faithfulness

Defaults are sized for a shared 2-core CPU (2 items per dataset, 5 methods, 4 AOPC fractions, a
3-point π grid, 2 draws, 32 text tokens); a paper-sized run is e.g. ``--n 200 --methods
alti_logit,attnlrp,lrp,gradient,grad_x_input,rollout,normxlogit,grad_ellm,deeplift,reagent,random
--fractions 0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9 --pis 0.05,0.1,…,0.95 --n-draws 15
--max-tokens 256 --device cuda``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from experiments.common import (
    base_parser,
    format_table,
    parse_list,
    setup,
    write_outputs,
)
from lens_attrib import Target, attribute
from lens_attrib.cli import add_methods_argument
from lens_attrib.data import load_boolq, load_imdb, load_sst2
from lens_attrib.evaluation import aopc, soft_metrics
from lens_attrib.evaluation.records import summarize as summarize_records
from lens_attrib.hooks.guard import model_guard
from lens_attrib.inputs import to_batch

DEFAULT_METHODS = "alti_logit,attnlrp,grad_x_input,normxlogit,random"
LABELS = {
    "sst2": (" Negative", " Positive"),
    "imdb": (" Negative", " Positive"),
    "boolq": (" false", " true"),
}
COLUMNS = {
    "AOPC-comp ↑": "comprehensiveness",
    "AOPC-suff ↓": "sufficiency",
    "πNC ↑": "pi_soft_nc",
    "πNS ↑": "pi_soft_ns",
    "πNC fix ↑": "pi_soft_nc_fixed",
    "πNS fix ↑": "pi_soft_ns_fixed",
    "Soft-NC ↑": "soft_nc",
    "Soft-NS ↑": "soft_ns",
    "E[R] NS": "expected_retained_ns",
}


def parse_args(argv: Sequence[str] | None = None) -> Any:
    parser = base_parser(__doc__.split("\n")[0], n=2, out="results/faithfulness")
    parser.add_argument("--datasets", default="sst2,imdb,boolq")
    add_methods_argument(parser, DEFAULT_METHODS)
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=32,
        help="truncate each review / passage to this many tokens",
    )
    parser.add_argument("--n-draws", type=int, default=2, help="Monte-Carlo draws for Soft")
    parser.add_argument("--pis", default="0.2,0.5,0.8", help="π grid (the paper: 0.05,0.1,…,0.95)")
    parser.add_argument(
        "--fractions", default="0.2,0.4,0.6,0.8", help="AOPC fractions (the paper: 0.1,…,0.9)"
    )
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=32, help="rows per perturbed forward")
    parser.add_argument("--no-fixed", action="store_true", help="skip fixed-routing π-Soft")
    parser.add_argument("--no-chat", action="store_true", help="plain prompts, no chat template")
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------- prompts
def truncate(tokenizer: Any, text: str, max_tokens: int) -> str:
    """The first ``max_tokens`` tokens of ``text`` (decoded back; unchanged if shorter)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens]).rstrip()


def make_prompt(tokenizer: Any, dataset: str, item: Any, max_tokens: int, chat: bool) -> str:
    """A zero-shot prompt ending right before the label token."""
    if dataset == "boolq":
        passage = truncate(tokenizer, item.meta["passage"], max_tokens)
        question = item.meta["question"].rstrip("?").strip()
        user = f"{passage}\nQuestion: {question}? Answer true or false."
        plain, lead = f"{passage}\nQuestion: {question}?\nAnswer (true or false):", "Answer:"
    else:
        review = truncate(tokenizer, item.prompt.replace("<br />", " "), max_tokens)
        user = f"Review: {review}\nIs the sentiment of this review Positive or Negative?"
        plain, lead = f"Review: {review}\nSentiment (Positive or Negative):", "Sentiment:"
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
        return str(text) + lead
    return plain


def label_ids(tokenizer: Any, dataset: str) -> list[int]:
    """The two label token ids (index = gold label); raises if a label is not one token."""
    ids = []
    for word in LABELS[dataset]:
        toks = tokenizer(word, add_special_tokens=False)["input_ids"]
        if len(toks) != 1:
            raise ValueError(f"label {word!r} is {len(toks)} tokens for this tokenizer: {toks}")
        ids.append(int(toks[0]))
    return ids


def load(dataset: str, n: int, seed: int) -> list[Any]:
    if dataset == "sst2":
        return load_sst2("validation", n=n, seed=seed)
    if dataset == "imdb":
        return load_imdb(n=n, seed=seed)
    if dataset == "boolq":
        return load_boolq(n=n, seed=seed)
    raise SystemExit(f"unknown dataset {dataset!r}: use sst2, imdb, boolq")


def predict(model: Any, prompts: list[str], ids: list[int]) -> list[int]:
    """Index (0/1) of the preferred label token at the last position of every prompt."""
    out: list[int] = []
    with model_guard(model), torch.no_grad():
        for start in range(0, len(prompts), 4):
            batch = to_batch(model, prompts[start : start + 4])
            logits = model(batch.tokens, **batch.model_kwargs())
            last = logits[torch.arange(batch.size), batch.last_real.to(logits.device)]
            out += last[:, ids].argmax(-1).tolist()
    return out


# ------------------------------------------------------------------------------- metrics
def evaluate_batch(
    model: Any, attr: Any, args: Any, pis: list[float]
) -> tuple[dict[str, torch.Tensor], Any, Any]:
    """All metric columns for one Attribution, plus the AOPC and dynamic Soft results."""
    values: dict[str, torch.Tensor] = {}
    fractions = [float(f) for f in parse_list(args.fractions)]
    res_a = aopc(model, attr, fractions=fractions, label="target", max_batch=args.max_batch)
    values["comprehensiveness"] = res_a.comprehensiveness
    values["sufficiency"] = res_a.sufficiency
    res_d = None
    for routing in ("dynamic",) if args.no_fixed else ("dynamic", "fixed"):
        res = soft_metrics(
            model,
            attr,
            pis=pis,
            n_draws=args.n_draws,
            routing=routing,
            seed=args.seed,
            max_batch=args.max_batch,
        )
        suffix = "" if routing == "dynamic" else "_fixed"
        for key, v in res.as_dict().items():
            values[key + suffix] = v
        if routing == "dynamic":
            res_d = res
    return values, res_a, res_d


def concat_results(parts: list[Any]) -> Any:
    """Concatenate per-batch AOPC/Soft results along the item axis (curve fields only)."""
    from types import SimpleNamespace

    first = parts[0]
    fields = {}
    for name in ("comprehensiveness_k", "sufficiency_k", "pi_nc_curve", "pi_ns_curve"):
        if hasattr(first, name):
            fields[name] = torch.cat([getattr(p, name) for p in parts])
    for name in ("fractions", "pis"):
        if hasattr(first, name):
            fields[name] = getattr(first, name)
    return SimpleNamespace(**fields)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    args = parse_args(argv)
    model = setup(args)
    tok = model.tokenizer
    methods, datasets = parse_list(args.methods), parse_list(args.datasets)
    pis = [float(p) for p in parse_list(args.pis)]
    records: list[dict[str, Any]] = []
    accuracy: dict[str, float] = {}
    figs: list[Any] = []
    examples: list[Any] = []
    for dataset in datasets:
        ids = label_ids(tok, dataset)
        items = load(dataset, args.n, args.seed)
        prompts = [make_prompt(tok, dataset, it, args.max_tokens, not args.no_chat) for it in items]
        pred = predict(model, prompts, ids)
        accuracy[dataset] = sum(int(p == it.label) for p, it in zip(pred, items)) / max(
            len(items), 1
        )
        lengths = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts]
        print(
            f"{dataset}: {len(items)} items, zero-shot accuracy {accuracy[dataset]:.2f}, "
            f"prompt tokens {min(lengths)}–{max(lengths)}",
            flush=True,
        )
        aopc_parts: dict[str, list[Any]] = {m: [] for m in methods}
        soft_parts: dict[str, list[Any]] = {m: [] for m in methods}
        for start in range(0, len(prompts), args.batch_size):
            sl = slice(start, start + args.batch_size)
            target = Target(token=[ids[p] for p in pred[sl]])
            for method in methods:
                opts = {"seed": args.seed + start} if method == "random" else {}
                attr = attribute(model, prompts[sl], target, method=method, **opts)
                if start == 0 and dataset == datasets[0]:
                    examples.append(attr[0])
                values, res_a, res_d = evaluate_batch(model, attr, args, pis)
                aopc_parts[method].append(res_a)
                soft_parts[method].append(res_d)
                for metric, column in values.items():
                    for j, v in enumerate(column.tolist()):
                        records.append(
                            {
                                "dataset": dataset,
                                "item": start + j,
                                "method": method,
                                "metric": metric,
                                "value": float(v),
                                "gold": items[start + j].label,
                                "prediction": pred[start + j],
                            }
                        )
        if prompts:
            from lens_attrib.plot import aopc_curves, pi_curves

            figs.append(
                aopc_curves(
                    {m: concat_results(p) for m, p in aopc_parts.items()},
                    title=f"{dataset}: AOPC curves",
                )
            )
            figs.append(
                pi_curves(
                    {m: concat_results(p) for m, p in soft_parts.items()},
                    title=f"{dataset}: π-Soft curves (dynamic routing)",
                )
            )
    summary = summarize(records)
    table = render(summary, datasets, methods, accuracy, args)
    print(table)
    paths = write_outputs(
        args.out,
        "faithfulness",
        config={**vars(args), "pis": pis},
        summary=summary,
        records=records,
        figures=figs,
        table=table,
        extra={"accuracy": accuracy},
        examples=examples,
        argv=argv,
        started=started,
    )
    return {"summary": summary, "accuracy": accuracy, "paths": paths, "table": table}


def summarize(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and bootstrap 95% CI per dataset × method × metric."""
    return summarize_records(records, ("dataset", "method", "metric"))


def render(
    summary: Sequence[dict[str, Any]],
    datasets: Sequence[str],
    methods: Sequence[str],
    accuracy: dict[str, float],
    args: Any,
) -> str:
    index = {(r["dataset"], r["method"], r["metric"]): r["mean"] for r in summary}
    lines = [
        f"Faithfulness on {args.model} (zero-shot, {'chat' if not args.no_chat else 'plain'}"
        f" prompts, ≤{args.max_tokens} text tokens; π grid {args.pis}, {args.n_draws} "
        "draws; mean over items)"
    ]
    for dataset in datasets:
        cols = [c for c, key in COLUMNS.items() if any(k[2] == key for k in index)]
        rows = [[m] + [index.get((dataset, m, COLUMNS[c])) for c in cols] for m in methods]
        lines += [
            "",
            f"[{dataset}] zero-shot accuracy {accuracy.get(dataset, float('nan')):.2f}",
            format_table(rows, ["method", *cols]),
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
