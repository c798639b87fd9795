"""Benchmark the ForwardMemo: a table's methods evaluated on one batch, with and without it.

    OMP_NUM_THREADS=1 python -m benchmarks.bench_forward_memo [--model minilm-l6] [--n 8]
        [--metric-groups soft,curves] [--methods ...]

Items: SST-2 dev sentences for a seeded random linear head (``benchmarks.bench_protocols``:
the trained classifiers have the same architecture, so the same forward cost), explained by
every method of the π-Soft tables (``--methods``), the attributions made once and not timed.
Each batch of ``--batch-size`` items is evaluated by the faithfulness experiment's protocol
(``--paper-protocol``: π = 0.05 … 0.95, 15 draws, dynamic and fixed routing, K = 10 … 90 %,
20 deletion/insertion steps; ``--metric-groups`` as the run's) method after method: once with
a fresh :class:`~lens_attrib.evaluation.SharedForwards` per call (before), once with one
:class:`~lens_attrib.evaluation.ForwardMemo` per batch (the experiment now). Reports the rows
forwarded and the CPU seconds per item and method, and the largest difference of any record
(float32; the memo's rows were computed in another batch composition).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from types import SimpleNamespace
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

METHODS = (
    "alti,attnlrp,lrp,gradient,grad_x_input,integrated_gradients,deeplift,rollout,attention,"
    "logat,normxlogit,embed_norm,grad_ellm,value_zeroing,decompx,globenc,random"
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="minilm-l6")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--metric-groups", default="soft,curves")
    parser.add_argument("--methods", default=METHODS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from benchmarks.bench_protocols import classifier_for, counting
    from experiments import faithfulness as fx
    from experiments.method_settings import experiment_options
    from lens_attrib import METHODS as REGISTERED
    from lens_attrib import attribute, load_model
    from lens_attrib.backend import arch_of
    from lens_attrib.evaluation import ForwardMemo, score
    from lens_attrib.method_variants import base_method

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(args.model)
    clf, _ = classifier_for(args.model, model)
    encoder = arch_of(model).encoder
    ns = SimpleNamespace(n=args.n, seed=0, max_tokens=128)
    inputs, gold = fx.classifier_items(clf.model, clf, "sst2", ns)
    pargs = fx.parse_args(
        ["--model", args.model, "--paper-protocol", "--metric-groups", args.metric_groups]
    )
    pis = [float(p) for p in pargs.pis.split(",")]
    proto = fx.protocol(pargs, pis, zero_shot=False, regression=False)
    methods = [
        m
        for m in args.methods.split(",")
        if (REGISTERED[base_method(m)].encoder if encoder else REGISTERED[base_method(m)].decoder)
    ]
    starts = range(0, len(inputs), args.batch_size)
    attrs: dict[tuple[int, str], Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in starts:
            for m in methods:
                opts = experiment_options(m, 0, model, pargs, 4)
                attrs[(s, m)] = attribute(
                    clf.model, inputs[s : s + args.batch_size], clf.target(),
                    method=base_method(m), **opts,
                )  # fmt: skip

    def evaluate(memo: bool) -> tuple[dict[tuple, float], float, int]:
        records: dict[tuple, float] = {}
        cpu = 0.0
        with counting(clf.model) as counter, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            counter.active = True
            for s in starts:
                kept = ForwardMemo(clf.model, clf.head) if memo else None
                gold_b = torch.as_tensor(gold[s : s + args.batch_size])
                for m in methods:
                    t0 = time.process_time()
                    out = score(clf.model, attrs[(s, m)], proto.metrics, gold=gold_b,
                                options=proto.options, memo=kept)  # fmt: skip
                    cpu += time.process_time() - t0
                    for r in out:
                        records[(s, m, r.item, r.name)] = r.value
            rows = counter.rows
        return records, cpu, rows

    before, cpu_before, rows_before = evaluate(memo=False)
    after, cpu_after, rows_after = evaluate(memo=True)
    per = len(inputs) * len(methods)
    diff = max(
        (abs(after[k] - v) for k, v in before.items() if v == v and after[k] == after[k]),
        default=0.0,
    )
    nan_same = all((v != v) == (after[k] != after[k]) for k, v in before.items())
    print(
        f"{args.model}, random head, {len(inputs)} SST-2 items × {len(methods)} methods, "
        f"batch {args.batch_size}, metric groups {args.metric_groups}, paper protocol"
    )
    print("| evaluation | rows per item and method | CPU-s per item and method |")
    print("|---|---|---|")
    print(f"| one SharedForwards per call | {rows_before / per:.0f} | {cpu_before / per:.2f} |")
    print(f"| one ForwardMemo per batch | {rows_after / per:.0f} | {cpu_after / per:.2f} |")
    ratios = f"rows {rows_after / rows_before:.2f}, CPU {cpu_after / cpu_before:.2f}"
    print(f"ratio after ÷ before: {ratios}")
    print(f"largest record difference {diff:.2e}; NaN in the same records: {nan_same}")


if __name__ == "__main__":
    main()
