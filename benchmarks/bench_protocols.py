"""Evaluation protocols against their floor: CPU-s per item for attribution and evaluation.

For ``experiments.faithfulness`` (classifier mode: SST-2 dev sentences, a seeded random linear
head on SmolLM2-135M and on MiniLM-L6 in place of the trained one, same architecture and
the cost of a forward does not depend on the head's training) and ``experiments.agreement``
(template SVA items on SmolLM2; the experiment is decoder-only), every method is explained and
scored exactly as the experiment's units do (``attribute`` then ``score`` with the experiment's
own metric list and options), timed with ``time.process_time`` (CPU seconds; run with
``OMP_NUM_THREADS=1``).

The floor is measured, not guessed. While the evaluation runs, a counter wraps the backend's
``final_residual`` (every forward of the library goes through it) and reads the input of the
first block (``blocks.0.hook_resid_pre``) at the real positions of every row: the number of
*distinct* model inputs (the real-position input bytes, plus whether fixed routing replayed a
clean pattern in that forward) is the number of forwards the protocol needs, and the number of
rows is the number it made. The floor of an item is then ``Σ_inputs c(len)`` with ``c(L)`` the
best measured CPU-s of one unmasked forward at length ``L`` over batch sizes 1, 8 and 32 (the
same backend call, no hooks); ``eval ÷ floor`` is the report's figure of merit.

    OMP_NUM_THREADS=1 python -m benchmarks.bench_protocols [--n 6] [--models smollm2-135m,minilm-l6]
        [--methods grad_x_input,normxlogit,random] [--pis 0.1,0.3,0.5,0.7,0.9] [--n-draws 5]
        [--fractions 0.1,…,0.9] [--steps 20] [--protocols faithfulness,agreement]
        [--head-position 0]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FRACTIONS = "0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9"


# --------------------------------------------------------------------------- forward counter
class ForwardCounter:
    """Rows forwarded and distinct inputs seen while active (see the module doc)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.rows = 0
        self.distinct: dict[tuple[bool, bytes], int] = {}  # key -> real length
        self._mask: torch.Tensor | None = None
        self._tokens: torch.Tensor | None = None
        self._hashes: list[bytes] = []
        self._fixed = False
        self.active = False

    def resid_pre_hook(self, x: torch.Tensor, hook: Any) -> torch.Tensor:
        if self.active and self._mask is not None:
            mask = self._mask.to(x.device)
            for r in range(x.shape[0]):
                real = mask[r]
                h = hashlib.sha1(x[r][real].detach().cpu().contiguous().numpy().tobytes())
                h.update(self._tokens[r][real.cpu()].numpy().tobytes())
                self._hashes.append(h.digest())
        return x

    def routing_flag(self) -> None:
        self._fixed = True

    def before(self, tokens: torch.Tensor, mask: torch.Tensor) -> None:
        self._mask, self._tokens, self._hashes, self._fixed = mask, tokens.cpu(), [], False

    def after(self, mask: torch.Tensor) -> None:
        if not self.active:
            return
        self.rows += int(mask.shape[0])
        lengths = mask.sum(-1).tolist()
        for h, n in zip(self._hashes, lengths):
            self.distinct.setdefault((self._fixed, h), int(n))
        self._mask = None

    def reset(self) -> None:
        self.rows = 0
        self.distinct = {}


@contextmanager
def counting(model: Any) -> Iterator[ForwardCounter]:
    """Install the counter: wrap ``final_residual`` where the library looks it up, flag fixed
    routing when its replay hooks fire, read ``blocks.0.hook_resid_pre``."""
    import lens_attrib.hooks.routing as routing

    counter = ForwardCounter(model)
    real_final = sys.modules["lens_attrib.backend"].final_residual
    real_fixed = routing.fixed_routing_hooks

    def final_residual(model_, arch, tokens, mask, padded, token_types=None):
        counter.before(tokens, mask)
        out = real_final(model_, arch, tokens, mask, padded, token_types)
        counter.after(mask)
        return out

    def fixed_routing_hooks(*args: Any, **kwargs: Any) -> list[Any]:
        hooks = real_fixed(*args, **kwargs)

        def flagged(fn: Any) -> Any:
            def hook(pattern: torch.Tensor, hook: Any) -> torch.Tensor:
                counter.routing_flag()
                return fn(pattern, hook)

            return hook

        return [(name, flagged(fn)) for name, fn in hooks]

    patched: list[tuple[Any, str, Any]] = []
    for mod in list(sys.modules.values()):
        if not getattr(mod, "__name__", "").startswith(("lens_attrib", "experiments")):
            continue
        for name, new, old in (
            ("final_residual", final_residual, real_final),
            ("fixed_routing_hooks", fixed_routing_hooks, real_fixed),
        ):
            if getattr(mod, name, None) is old:
                patched.append((mod, name, old))
                setattr(mod, name, new)
    hp = model.blocks[0].hook_resid_pre
    hp.add_hook(counter.resid_pre_hook, dir="fwd", is_permanent=True)
    try:
        yield counter
    finally:
        for mod, name, old in patched:
            setattr(mod, name, old)
        hp.remove_hooks("fwd", including_permanent=True)


# --------------------------------------------------------------------------- cost of a forward
def forward_costs(model: Any, lengths: set[int], sample: torch.Tensor) -> dict[int, float]:
    """``c(L)``: best CPU-s per row of an unmasked forward at length L over batch 1, 8, 32."""
    from lens_attrib.backend import arch_of, final_residual
    from lens_attrib.hooks.guard import model_guard

    arch = arch_of(model)
    out: dict[int, float] = {}
    for length in sorted(lengths):
        ids = sample[: max(1, length)]
        if ids.numel() < length:
            ids = ids.repeat(length // ids.numel() + 1)[:length]
        best = float("inf")
        for b in (1, 8, 32):
            tokens = ids[None].repeat(b, 1).to(model.cfg.device)
            mask = torch.ones_like(tokens, dtype=torch.bool)
            for _ in range(2):
                with model_guard(model), torch.inference_mode():
                    t0 = time.process_time()
                    final_residual(model, arch, tokens, mask, False, None)
                    best = min(best, (time.process_time() - t0) / b)
        out[length] = best
    return out


# --------------------------------------------------------------------------- protocols
def classifier_for(model_name: str, model: Any, head_position: int | None = None) -> Any:
    """A seeded random linear head (as tests/experiments_small.py): the trained classifiers
    have the same architecture, so the same forward cost, and training one is not a benchmark."""
    from lens_attrib.classifiers import Classifier, ClassifierInfo, LinearHead

    dtype = next(model.parameters()).dtype
    head = LinearHead(int(model.cfg.d_model), 2).to(dtype)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        head.linear.weight.copy_(torch.randn(head.linear.weight.shape, generator=gen) / 4)
        head.linear.bias.copy_(torch.randn(head.linear.bias.shape, generator=gen) / 4)
    from lens_attrib.backend import arch_of

    # read at [CLS] (encoders) or the last token (decoders: position None), as the built-ins;
    # --head-position 0 on a decoder reads the start token (every score 0: the hard rows
    # dominate the evaluation, the first run of docs/results/protocols.md)
    position = 0 if arch_of(model).encoder else head_position
    info = ClassifierInfo(f"{model_name}-sst2", ("negative", "positive"), False, position, {})
    return Classifier(model, head, info), "random head"


def faithfulness_units(model_name: str, model: Any, args: Any) -> tuple[Any, Any, str, Any]:
    """(batches of (inputs, target, gold), protocol, head kind) as experiments.faithfulness."""
    from experiments import faithfulness as fx

    clf, kind = classifier_for(model_name, model, args.head_position)
    ns = SimpleNamespace(n=args.n, seed=0, max_tokens=args.max_tokens)
    inputs, gold = fx.classifier_items(clf.model, clf, "sst2", ns)
    pargs = SimpleNamespace(
        fractions=args.fractions,
        no_curves=False,
        no_fixed=False,
        max_batch=args.max_batch,
        seed=0,
        steps=args.steps,
        n_draws=args.n_draws,
    )
    pis = [float(p) for p in args.pis.split(",")]
    proto = fx.protocol(pargs, pis, zero_shot=False, regression=False)
    gold_t = torch.as_tensor(gold)
    batches = [
        (inputs[s : s + args.batch_size], clf.target(), gold_t[s : s + args.batch_size])
        for s in range(0, len(inputs), args.batch_size)
    ]
    return batches, proto, kind, clf.model


def bench_faithfulness(model_name: str, model: Any, args: Any) -> list[dict[str, Any]]:
    from lens_attrib import METHODS, attribute
    from lens_attrib.backend import arch_of
    from lens_attrib.evaluation.items import method_options
    from lens_attrib.evaluation.metrics import score

    batches, proto, kind, explained = faithfulness_units(model_name, model, args)
    encoder = arch_of(explained).encoder
    rows = []
    for method in args.methods.split(","):
        spec = METHODS[method]
        if not (spec.encoder if encoder else spec.decoder):
            continue
        t_attr = t_eval = 0.0
        n = 0
        with counting(explained) as counter:
            per_length: list[int] = []
            for inputs, target, gold in batches:
                t0 = time.process_time()
                attr = attribute(explained, inputs, target, method=method,
                                 **method_options(method, 0))  # fmt: skip
                t1 = time.process_time()
                counter.active = True
                score(explained, attr, proto.metrics, gold=gold, options=proto.options)
                counter.active = False
                t_eval += time.process_time() - t1
                t_attr += t1 - t0
                n += len(inputs)
                per_length += attr.mask.sum(-1).tolist()
            distinct = dict(counter.distinct)
            made = counter.rows
        rows.append(
            {
                "protocol": "faithfulness",
                "model": model_name,
                "head": kind,
                "method": method,
                "n": n,
                "attr_s": t_attr / n,
                "eval_s": t_eval / n,
                "rows": made / n,
                "needed": len(distinct) / n,
                "_lengths": list(distinct.values()),
                "_sample": attr.token_ids[0][attr.mask[0]].cpu(),
            }
        )
        print(f"  {model_name} {method}: attr {t_attr / n:.2f}  eval {t_eval / n:.2f} CPU-s/item",
              flush=True)  # fmt: skip
    if rows:
        lengths = {length for r in rows for length in r["_lengths"]}
        costs = forward_costs(explained, lengths, rows[0]["_sample"])
        for r in rows:
            r["floor_s"] = sum(costs[length] for length in r.pop("_lengths")) / r["n"]
            r.pop("_sample")
            r["ratio"] = r["eval_s"] / r["floor_s"] if r["floor_s"] > 0 else float("nan")
    return rows


def bench_agreement(model_name: str, model: Any, args: Any) -> list[dict[str, Any]]:
    from experiments import agreement as ag
    from lens_attrib import METHODS, Target, attribute
    from lens_attrib.backend import arch_of
    from lens_attrib.evaluation.items import load_task, method_options
    from lens_attrib.evaluation.metrics import ScoreOptions, score

    if arch_of(model).encoder:
        return []  # the agreement experiment explains next-token predictions (decoders)
    data = ag.prepare_items(model, load_task("sva", args.n, 0), args.n)
    special_out = sorted(int(i) for i in (model.tokenizer.all_special_ids or []))
    names = [*ag.METRICS.values(), "degenerate"]
    rows = []
    for method in args.methods.split(","):
        if not METHODS[method].decoder:
            continue
        t_attr = t_eval = 0.0
        with counting(model) as counter:
            for s in range(0, len(data.prompts), args.batch_size):
                sl = slice(s, s + args.batch_size)
                for contrastive in (True, False):
                    target = Target(
                        token=list(data.targets[sl]),
                        foil=list(data.foils[sl]) if contrastive and data.foils else None,
                    )
                    t0 = time.process_time()
                    attr = attribute(model, list(data.prompts[sl]), target, method=method,
                                     **method_options(method, 0))  # fmt: skip
                    t1 = time.process_time()
                    counter.active = True
                    for ids in ([], special_out):
                        score(model, attr, names, evidence=list(data.evidence[sl]),
                              options=ScoreOptions(special_ids=ids))  # fmt: skip
                    counter.active = False
                    t_eval += time.process_time() - t1
                    t_attr += t1 - t0
            made, needed = counter.rows, len(counter.distinct)
        n = len(data.prompts)
        rows.append(
            {
                "protocol": "agreement",
                "model": model_name,
                "head": "lm",
                "method": method,
                "n": n,
                "attr_s": t_attr / n,
                "eval_s": t_eval / n,
                "rows": made / n,
                "needed": needed / n,
                "floor_s": 0.0,
                "ratio": float("nan"),
            }
        )
        print(f"  {model_name} {method}: attr {t_attr / n:.3f}  eval {t_eval / n:.4f} CPU-s/item",
              flush=True)  # fmt: skip
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    head = ("| protocol | model | method | n | attr CPU-s/item | eval CPU-s/item | rows/item | "
            "needed/item | floor CPU-s/item | eval ÷ floor |")  # fmt: skip
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        ratio = "n/a (no forwards)" if r["floor_s"] == 0 else f"{r['ratio']:.2f}"
        lines.append(
            f"| {r['protocol']} | {r['model']} | {r['method']} | {r['n']} | {r['attr_s']:.3f} | "
            f"{r['eval_s']:.3f} | {r['rows']:.1f} | {r['needed']:.1f} | {r['floor_s']:.3f} | "
            f"{ratio} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="smollm2-135m,minilm-l6")
    parser.add_argument("--protocols", default="faithfulness,agreement")
    parser.add_argument("--methods", default="grad_x_input,normxlogit,random")
    parser.add_argument("--n", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4, help="items per unit")
    parser.add_argument("--max-batch", type=int, default=32, help="rows per perturbed forward")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--pis", default="0.1,0.3,0.5,0.7,0.9")
    parser.add_argument("--n-draws", type=int, default=5)
    parser.add_argument("--fractions", default=FRACTIONS)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--head-position",
        type=int,
        default=None,
        help="decoders: the position the random head reads (default the last token; 0: the "
        "start token, whose scores are all 0, so the hard rows dominate the evaluation)",
    )
    parser.add_argument("--out", default="results/bench_protocols.json")
    args = parser.parse_args(argv)

    from lens_attrib import load_model

    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = load_model(name)
        for proto in args.protocols.split(","):
            print(f"{proto} on {name}", flush=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fn = bench_faithfulness if proto == "faithfulness" else bench_agreement
                rows += fn(name, model, args)
    table = render(rows)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1), encoding="utf-8")
    return rows


if __name__ == "__main__":
    main()
