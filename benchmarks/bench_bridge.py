"""TransformerLens 4 bridge ÷ TransformerLens 3.9 fast path on SmolLM2-135M: time and peak memory.

Run (both TransformerLens majors cannot be installed in one environment, so each backend runs in
its own venv and the two are run alternately, one subprocess per measurement)::

    OMP_NUM_THREADS=1 python -m benchmarks.bench_bridge \
        --hooked-python .venv/bin/python --bridge-python .venv-tl4/bin/python \
        [--lengths 128 512] [--repeats 3] [--calls 1] [--out results/bench_bridge.json] \
        [--baseline-tree DIR]

Kinds: ``forward`` (logits, no grad), ``grad_x_input``, ``attnlrp``, ``alti_logit``
(``lens_attrib.attribute`` on one item of ``T`` tokens, float32, default target). Each worker
(``--worker BACKEND KIND T``) loads ``load_model("smollm2-135m", backend=BACKEND)``, warms up on
8 tokens, resets the resident-set high-water mark (``/proc/self/clear_refs``), runs the call
once and reports its wall time and ``peak Δ`` = VmHWM − VmRSS before the call (the memory the
call itself needed). For each (kind, T) the hooked and the bridge worker run back to back
``--repeats`` times (the order alternating); the ratio reported is the median over the pairs of
bridge ÷ hooked (pairs taken minutes apart share the machine's load). Goals: time ≤ 1.05,
memory ≤ 1.0. ``--calls K``: each worker times ``K`` calls after the warm-up and reports their
median (a loaded machine's spikes hit single calls), with the process's CPU time
(``time.process_time``, less sensitive to other processes on a loaded machine). ``--baseline-tree
DIR``: another version of the code (a ``lens_attrib`` package with its ``hooks`` copied to
``lens_attrib/hooks``, e.g. from ``git archive COMMIT lens_attrib hooks``) is measured in the same
run: each pair then runs the four workers (hooked and bridge, this tree and ``DIR``, on
``PYTHONPATH``) back to back in a rotating order, and each row gives both trees' ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any

TEXT = (
    "The keys to the old cabinet in the hallway were lost last winter, and nobody in the house "
    "remembered where the spare set had been kept. "
)
KINDS = ("forward", "grad_x_input", "attnlrp", "alti_logit")
BACKENDS = ("hooked", "bridge")


def _status_kb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def worker(backend: str, kind: str, length: int, calls: int = 1) -> dict[str, Any]:
    import torch

    from lens_attrib import attribute, load_model
    from lens_attrib.models import return_freed_memory

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model("smollm2-135m", backend=backend)
    ids = model.tokenizer(TEXT * (1 + length // 20))["input_ids"][:length]
    assert len(ids) == length

    def call(items: list[int]) -> None:
        if kind == "forward":
            with torch.no_grad():
                model(torch.tensor([items]))
        else:
            attribute(model, [items], method=kind)

    call(ids[:8])  # warm-up (thread pools, lazy buffers)
    gc.collect()
    return_freed_memory()  # both backends start from a trimmed heap (loading frees a lot)
    exact = _reset_peak()
    before = _status_kb("VmRSS") or 0
    times, cpu_times = [], []
    for _ in range(calls):
        started, cpu_started = time.perf_counter(), time.process_time()
        call(ids)
        times.append(time.perf_counter() - started)
        cpu_times.append(time.process_time() - cpu_started)
    peak = _status_kb("VmHWM") if exact else None
    import lens_attrib

    return {
        "backend": backend,
        "kind": kind,
        "length": length,
        "seconds": statistics.median(times),
        "times": times,
        "cpu_seconds": statistics.median(cpu_times),
        "code": str(Path(lens_attrib.__file__).parent),
        "peak_delta_mb": ((peak or before) - before) / 1024,
        "exact_peak": exact,
        "threads": torch.get_num_threads(),
    }


def measure(
    python: str, backend: str, kind: str, length: int, calls: int = 1, tree: str | None = None
) -> dict[str, Any]:
    """One worker in its own process; ``tree``: a baseline code tree put first on
    ``PYTHONPATH`` (the worker runs as a script, so that the working directory's
    ``lens_attrib`` does not shadow it)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    if tree is not None:
        env["PYTHONPATH"] = str(Path(tree).resolve())
    script = str(Path(__file__).resolve())
    command = [os.path.abspath(python), script, "--worker", backend, kind, str(length)]
    out = subprocess.run(
        [*command, "--calls", str(calls)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parent,
    )
    result = dict(json.loads(out.stdout.strip().splitlines()[-1]))
    expected = Path(tree).resolve() / "lens_attrib" if tree is not None else None
    if expected is not None and Path(result["code"]).resolve() != expected:
        raise RuntimeError(f"the worker imported {result['code']}, not {expected}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hooked-python", default=".venv/bin/python")
    parser.add_argument("--bridge-python", default=".venv-tl4/bin/python")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="results/bench_bridge.json")
    parser.add_argument("--calls", type=int, default=1)
    parser.add_argument("--baseline-tree", default=None)
    parser.add_argument("--worker", nargs=3, metavar=("BACKEND", "KIND", "T"))
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], int(args.worker[2]), args.calls)))
        return
    if args.baseline_tree:
        compare_trees(args, {"hooked": args.hooked_python, "bridge": args.bridge_python})
        return
    python = {"hooked": args.hooked_python, "bridge": args.bridge_python}
    rows = []
    for length in args.lengths:
        for kind in args.kinds:
            pairs = []
            for rep in range(args.repeats):
                order = BACKENDS if rep % 2 == 0 else BACKENDS[::-1]
                pairs.append({b: measure(python[b], b, kind, length, args.calls) for b in order})
            time_ratio = statistics.median(
                p["bridge"]["seconds"] / p["hooked"]["seconds"] for p in pairs
            )
            cpu_ratio = statistics.median(
                p["bridge"]["cpu_seconds"] / p["hooked"]["cpu_seconds"] for p in pairs
            )
            mem_ratio = statistics.median(
                p["bridge"]["peak_delta_mb"] / max(p["hooked"]["peak_delta_mb"], 1e-9)
                for p in pairs
            )
            row = {
                "T": length,
                "kind": kind,
                "hooked_s": statistics.median(p["hooked"]["seconds"] for p in pairs),
                "bridge_s": statistics.median(p["bridge"]["seconds"] for p in pairs),
                "time_ratio": time_ratio,
                "cpu_ratio": cpu_ratio,
                "hooked_peak_mb": statistics.median(p["hooked"]["peak_delta_mb"] for p in pairs),
                "bridge_peak_mb": statistics.median(p["bridge"]["peak_delta_mb"] for p in pairs),
                "mem_ratio": mem_ratio,
                "raw": pairs,
            }
            rows.append(row)
            print(
                f"| {length} | {kind} | {row['hooked_s']:.2f} | {row['bridge_s']:.2f} | "
                f"{time_ratio:.3f} | {row['hooked_peak_mb']:.0f} | {row['bridge_peak_mb']:.0f} | "
                f"{mem_ratio:.3f} | {cpu_ratio:.3f} |",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "load_avg": os.getloadavg()}, indent=2))


def compare_trees(args: argparse.Namespace, python: dict[str, str]) -> None:
    """This tree and ``--baseline-tree`` in one run: per pair, the four workers back to back in
    a rotating order; per tree the median over the pairs of bridge ÷ hooked."""
    trees: dict[str, str | None] = {"this": None, "baseline": args.baseline_tree}
    workers = [(t, b) for t in trees for b in BACKENDS]
    rows = []
    for length in args.lengths:
        for kind in args.kinds:
            pairs = []
            for rep in range(args.repeats):
                order = workers[rep % 4 :] + workers[: rep % 4]
                if rep % 2:
                    order = order[::-1]
                got = {
                    (t, b): measure(python[b], b, kind, length, args.calls, trees[t])
                    for t, b in order
                }
                pairs.append(got)
            row: dict[str, Any] = {"T": length, "kind": kind, "load_avg": os.getloadavg()}
            for t in trees:
                ratios = [p[(t, "bridge")]["seconds"] / p[(t, "hooked")]["seconds"] for p in pairs]
                row[f"{t}_ratios"] = ratios
                row[f"{t}_time_ratio"] = statistics.median(ratios)
                cpu = [
                    p[(t, "bridge")]["cpu_seconds"] / p[(t, "hooked")]["cpu_seconds"] for p in pairs
                ]
                row[f"{t}_cpu_ratios"] = cpu
                row[f"{t}_cpu_ratio"] = statistics.median(cpu)
                for b in BACKENDS:
                    row[f"{t}_{b}_s"] = statistics.median(p[(t, b)]["seconds"] for p in pairs)
            row["raw"] = [{f"{t}/{b}": v for (t, b), v in p.items()} for p in pairs]
            rows.append(row)
            print(
                f"| {length} | {kind} | baseline {row['baseline_hooked_s']:.2f} / "
                f"{row['baseline_bridge_s']:.2f} s = {row['baseline_time_ratio']:.3f} | this "
                f"{row['this_hooked_s']:.2f} / {row['this_bridge_s']:.2f} s = "
                f"{row['this_time_ratio']:.3f} | pairs: baseline "
                f"{', '.join(f'{r:.3f}' for r in row['baseline_ratios'])}; this "
                f"{', '.join(f'{r:.3f}' for r in row['this_ratios'])} |",
                flush=True,
            )
            print(
                f"|   | CPU time | baseline {row['baseline_cpu_ratio']:.3f} "
                f"({', '.join(f'{r:.3f}' for r in row['baseline_cpu_ratios'])}) | this "
                f"{row['this_cpu_ratio']:.3f} "
                f"({', '.join(f'{r:.3f}' for r in row['this_cpu_ratios'])}) |",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "load_avg": os.getloadavg()}, indent=2))


if __name__ == "__main__":
    main()
