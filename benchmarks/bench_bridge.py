"""TransformerLens 4 bridge ÷ TransformerLens 3.9 fast path on SmolLM2-135M: time and peak memory.

Run (both TransformerLens majors cannot be installed in one environment, so each backend runs in
its own venv and the two are run alternately, one subprocess per measurement)::

    OMP_NUM_THREADS=1 python -m benchmarks.bench_bridge \
        --hooked-python .venv/bin/python --bridge-python .venv-tl4/bin/python \
        [--lengths 128 512] [--repeats 3] [--out results/bench_bridge.json]

Kinds: ``forward`` (logits, no grad), ``grad_x_input``, ``attnlrp``, ``alti_logit``
(``lens_attrib.attribute`` on one item of ``T`` tokens, float32, default target). Each worker
(``--worker BACKEND KIND T``) loads ``load_model("smollm2-135m", backend=BACKEND)``, warms up on
8 tokens, resets the resident-set high-water mark (``/proc/self/clear_refs``), runs the call
once and reports its wall time and ``peak Δ`` = VmHWM − VmRSS before the call (the memory the
call itself needed). For each (kind, T) the hooked and the bridge worker run back to back
``--repeats`` times (the order alternating); the ratio reported is the median over the pairs of
bridge ÷ hooked (pairs taken minutes apart share the machine's load). Goals: time ≤ 1.05,
memory ≤ 1.0.
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


def worker(backend: str, kind: str, length: int) -> dict[str, Any]:
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
    started = time.perf_counter()
    call(ids)
    seconds = time.perf_counter() - started
    peak = _status_kb("VmHWM") if exact else None
    return {
        "backend": backend,
        "kind": kind,
        "length": length,
        "seconds": seconds,
        "peak_delta_mb": ((peak or before) - before) / 1024,
        "exact_peak": exact,
        "threads": torch.get_num_threads(),
    }


def measure(python: str, backend: str, kind: str, length: int) -> dict[str, Any]:
    out = subprocess.run(
        [python, "-m", "benchmarks.bench_bridge", "--worker", backend, kind, str(length)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hooked-python", default=".venv/bin/python")
    parser.add_argument("--bridge-python", default=".venv-tl4/bin/python")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="results/bench_bridge.json")
    parser.add_argument("--worker", nargs=3, metavar=("BACKEND", "KIND", "T"))
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], int(args.worker[2]))))
        return
    python = {"hooked": args.hooked_python, "bridge": args.bridge_python}
    rows = []
    for length in args.lengths:
        for kind in args.kinds:
            pairs = []
            for rep in range(args.repeats):
                order = BACKENDS if rep % 2 == 0 else BACKENDS[::-1]
                pairs.append({b: measure(python[b], b, kind, length) for b in order})
            time_ratio = statistics.median(
                p["bridge"]["seconds"] / p["hooked"]["seconds"] for p in pairs
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
                "hooked_peak_mb": statistics.median(p["hooked"]["peak_delta_mb"] for p in pairs),
                "bridge_peak_mb": statistics.median(p["bridge"]["peak_delta_mb"] for p in pairs),
                "mem_ratio": mem_ratio,
                "raw": pairs,
            }
            rows.append(row)
            print(
                f"| {length} | {kind} | {row['hooked_s']:.2f} | {row['bridge_s']:.2f} | "
                f"{time_ratio:.3f} | {row['hooked_peak_mb']:.0f} | {row['bridge_peak_mb']:.0f} | "
                f"{mem_ratio:.3f} |",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "load_avg": os.getloadavg()}, indent=2))


if __name__ == "__main__":
    main()
