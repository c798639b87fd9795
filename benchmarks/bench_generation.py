"""Explaining a forced continuation: ours against Inseq, time and peak memory per method.

    python -m benchmarks.bench_generation --peer-python /path/to/python [--reps 3]
        [--prompt-tokens 64] [--continuation-tokens 32] [--ig-steps 2] [--ig-reps 1]
        [--ig-default-steps 4] [--write docs/results/generation.md]

``--peer-python`` is a Python with ``inseq`` (and its ``transformers``, ``captum``) and the same
``torch`` version as ours, installed outside this repository; this file runs in it as a script
(``--worker``) and imports only Inseq's public API. Both sides explain the same token ids: a
``--prompt-tokens`` prompt (our start token ``<|endoftext|>`` first) and a
``--continuation-tokens`` continuation, forced (ours: ``Target(continuation=ids)``; Inseq:
``generated_texts``, with ``attributed_fn="logit"`` so that both explain the logit of each
continuation token). The worker checks that Inseq's tokenization of the texts gives exactly our ids.
Inseq runs SmolLM2 as a Hugging Face ``LlamaForCausalLM`` dequantised from the same GGUF file
(``save_pretrained`` once under our cache folder); its logits on the full sequence are checked
against ours (≤ 1e-4) before anything is timed. float32, CPU, one thread in every process.

Compared (ours ÷ Inseq): ``gradient`` (ℓ2 saliency) ÷ ``saliency``, ``grad_x_input`` ÷
``input_x_gradient``, ``integrated_gradients`` with ``n_steps=--ig-steps`` Gauss–Legendre points
÷ ``integrated_gradients`` with the same ``n_steps`` (Captum's default rule is Gauss–Legendre, and
``internal_batch_size`` is left at its default: all points in one batch, as ours). Ours alone:
``alti_logit``, ``attnlrp`` and IG at its default (``n_steps="auto"``, adaptive panels, run on the
first ``--ig-default-steps`` continuation tokens only: it costs hundreds of evaluations per step).
``gradient`` / ``grad_x_input`` run with prefix chunks (``prefix_chunks.STEP_GRADIENT_CHUNKS``,
off by default), ``gradient_unchunked`` / ``grad_x_input_unchunked`` without
(``prefix_chunks.PREFIX_CHUNKS = 1``: one forward, every step's backward over all positions, the
library's default for them), measured next to each other for the paired ratio chunked ÷
unchunked.
``reference``: one forward of the full sequence (prompt + continuation[:-1]) with gradients, the
final norm and unembedding at the last position, and one backward pass to the embedding; goals are
stated against it for ALTI-Logit (all steps ≤ 3× it) and against Inseq for the gradient methods
(≤ 0.5×).

Every measurement is a fresh process: load, one warm-up call on a short input (8-token prompt,
2-token continuation), then the high-water mark of the resident set is reset
(``/proc/self/clear_refs``) and the measured call runs; the process reports its wall time and
``VmHWM − VmRSS`` before the call (the memory the call needs beyond the loaded model). Rounds run
``--reps`` times, the order of ours and Inseq alternating; the table shows medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROMPT_TEXT = (
    "The keys to the old wooden cabinet in the hallway of my grandmother's house were lost "
    "last summer, and nobody in the family has been able to find them since then. My uncle "
    "searched the garden, the attic and the garage, while my cousins asked every neighbour on "
    "the street whether they had seen a small ring with three brass keys on it."
)
CONTINUATION_TEXT = (
    " In the end, it was the youngest child who found them, hidden inside an old boot that "
    "had been left by the back door for years, covered in dust and spider webs."
)
HF_DIR_NAME = "smollm2-135m-hf-f32-inseq"
WARM_PROMPT, WARM_STEPS = 8, 2
OURS = {
    "reference": None,
    "gradient_unchunked": None,
    "gradient": "saliency",
    "grad_x_input_unchunked": None,
    "grad_x_input": "input_x_gradient",
    "ig_matched": "integrated_gradients",
    "alti_logit": None,
    "attnlrp": None,
    "ig_default": None,
}
UNCHUNKED = "_unchunked"
GOAL_VS_INSEQ = 0.5
GOAL_ALTI_VS_REFERENCE = 3.0


# ------------------------------------------------------------------------- memory bookkeeping
def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _measure(call: Any) -> dict[str, float]:
    """Wall time of ``call()`` and the resident memory it needs beyond what was resident."""
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current VmRSS
    before = _status_kb("VmRSS")
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_extra_mb": (_status_kb("VmHWM") - before) / 1024}


# ------------------------------------------------------------------------- our side
def _our_call(kind: str, opts: dict[str, Any]) -> Any:
    import warnings

    import torch

    from lens_attrib import Target, attribute
    from lens_attrib.models import load_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model("smollm2-135m")
    import lens_attrib.methods.prefix_chunks as prefix_chunks

    if kind.endswith(UNCHUNKED):  # the one-forward path: no prefix chunks
        prefix_chunks.PREFIX_CHUNKS = 1
        kind = kind.removesuffix(UNCHUNKED)
    elif kind in ("gradient", "grad_x_input"):  # measured with chunks (off by default)
        prefix_chunks.STEP_GRADIENT_CHUNKS = True

    def call(prompt: list[int], cont: list[int]) -> None:
        tokens = torch.tensor(prompt)
        target = Target(continuation=cont)
        if kind == "reference":
            sequence = torch.tensor([prompt + cont[:-1]])
            store: dict[str, torch.Tensor] = {}

            def leaf(x: torch.Tensor, hook: Any) -> torch.Tensor:
                store["e"] = x.detach().requires_grad_(True)
                return store["e"]

            with torch.enable_grad(), model.hooks(fwd_hooks=[("hook_embed", leaf)]):
                resid = model(sequence, stop_at_layer=model.cfg.n_layers)
                logit = model.unembed(model.ln_final(resid[:, -1:]))[0, -1, cont[-1]]
                torch.autograd.grad(logit, store["e"])
        elif kind == "ig_matched":
            attribute(model, tokens, target, method="integrated_gradients", n_steps=opts["ig"])
        elif kind == "ig_default":
            attribute(
                model,
                tokens,
                Target(continuation=cont[: opts["ig_default"]]),
                method="integrated_gradients",
            )
        else:
            attribute(model, tokens, target, method=kind)

    return call


# ------------------------------------------------------------------------- Inseq's side
def _inseq_call(kind: str, opts: dict[str, Any]) -> Any:
    import inseq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(opts["hf_dir"], dtype=torch.float32)
    hf.eval()
    tokenizer = AutoTokenizer.from_pretrained(opts["hf_dir"])
    model = inseq.load_model(hf, kind, tokenizer=tokenizer)

    def texts(prompt: list[int], cont: list[int]) -> tuple[str, str]:
        source = str(tokenizer.decode(prompt))
        generated = source + str(tokenizer.decode(cont))
        ids = tokenizer(generated, add_special_tokens=True)["input_ids"]
        if ids != prompt + cont:
            raise RuntimeError(f"Inseq's tokenization differs from ours: {ids} vs {prompt + cont}")
        return source, generated

    def call(prompt: list[int], cont: list[int]) -> None:
        source, generated = texts(prompt, cont)
        extra = {"n_steps": opts["ig"]} if kind == "integrated_gradients" else {}
        model.attribute(
            source,
            generated,
            attributed_fn="logit",
            show_progress=False,
            **extra,
        )

    return call


def worker(side: str, kind: str, opts_file: str) -> None:
    import torch

    torch.set_num_threads(1)
    opts = json.loads(Path(opts_file).read_text())
    call = (_our_call if side == "ours" else _inseq_call)(kind, opts)
    prompt, cont = opts["prompt"], opts["continuation"]
    call(prompt[:WARM_PROMPT], cont[: 1 if kind == "ig_default" else WARM_STEPS])
    result = _measure(lambda: call(prompt, cont))
    print(json.dumps(result), flush=True)


# ------------------------------------------------------------------------- the driver
def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


def _run(python: str, side: str, kind: str, opts_file: str) -> dict[str, float]:
    command = [python, str(Path(__file__).resolve()), "--worker", side, kind, opts_file]
    cwd = Path(__file__).resolve().parents[1]
    out = subprocess.run(command, capture_output=True, text=True, env=_env(), cwd=cwd, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{side} {kind} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def save_unquantized(hf: Any, tokenizer: Any, folder: Path) -> None:
    """``save_pretrained`` of the dequantised model (transformers refuses a model loaded from a
    GGUF file: the same weights in a fresh model without the quantisation record)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    fresh = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    fresh.load_state_dict(hf.state_dict())
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    fresh.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, folder)


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Token ids, the exported Hugging Face folder, and the logit check (≤ 1e-4)."""
    import torch
    from transformers import AutoModelForCausalLM

    from lens_attrib.inputs import to_batch
    from lens_attrib.models import cache_root, load_model, smollm2_hf_from_gguf

    model = load_model("smollm2-135m")
    prompt = to_batch(model, PROMPT_TEXT).tokens[0].tolist()[: args.prompt_tokens]
    cont = model.tokenizer(CONTINUATION_TEXT, add_special_tokens=False)["input_ids"]
    cont = cont[: args.continuation_tokens]
    if len(prompt) != args.prompt_tokens or len(cont) != args.continuation_tokens:
        raise ValueError("PROMPT_TEXT / CONTINUATION_TEXT are too short for the asked lengths.")
    folder = cache_root() / HF_DIR_NAME
    hf, tokenizer = smollm2_hf_from_gguf(torch.float32)
    if not (folder / "config.json").exists():
        save_unquantized(hf, tokenizer, folder)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    sequence = torch.tensor([prompt + cont[:-1]])
    with torch.no_grad():
        ours = model(sequence)[0]
        theirs = hf(input_ids=sequence).logits[0]
    gap = float((ours - theirs).abs().max())
    if gap > 1e-4:
        raise RuntimeError(f"Logits of the Hugging Face export differ from ours by {gap:.2e}.")
    return {
        "prompt": prompt,
        "continuation": cont,
        "hf_dir": str(folder),
        "ig": args.ig_steps,
        "ig_default": args.ig_default_steps,
        "logit_gap": gap,
    }


def measure_all(args: argparse.Namespace, opts: dict[str, Any], opts_file: str) -> dict[str, Any]:
    results: dict[str, list[dict[str, float]]] = {}
    ours_python = sys.executable

    def record(side: str, kind: str) -> None:
        key = f"{side}:{kind}"
        got = _run(ours_python if side == "ours" else args.peer_python, side, kind, opts_file)
        got["round"] = rep
        got["load_average"] = os.getloadavg()[0]
        results.setdefault(key, []).append(got)
        if args.write:  # every measurement as it comes (a long run can be read while it runs)
            Path(args.write).write_text(json.dumps({"results": results}, indent=1))
        print(
            f"  {key}: {got['seconds']:.2f} s, +{got['peak_extra_mb']:.0f} MB, "
            f"load {got['load_average']:.1f}",
            flush=True,
        )

    for rep in range(args.reps):
        print(f"round {rep + 1}/{args.reps}", flush=True)
        for kind, peer in OURS.items():
            if kind.startswith("ig") and rep >= args.ig_reps:
                continue
            if kind == "ig_default" and not args.ig_default_steps:
                continue
            if args.only and kind not in args.only.split(","):
                continue
            pair = [("ours", kind)] + ([("inseq", peer)] if peer else [])
            for side, name in pair if rep % 2 == 0 else pair[::-1]:
                record(side, name)
    return results


def _median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def report(args: argparse.Namespace, opts: dict[str, Any], results: dict[str, Any]) -> str:
    refs = results.get("ours:reference")
    ref = _median(refs, "seconds") if refs else float("nan")
    lines = [
        "| method | ours s | Inseq s | ours ÷ Inseq | ours ÷ reference | ours +MB | Inseq +MB "
        "| n |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, peer in OURS.items():
        rows = results.get(f"ours:{kind}")
        if not rows:
            continue
        ours_s = _median(rows, "seconds")
        ours_mb = _median(rows, "peak_extra_mb")
        peer_rows = results.get(f"inseq:{peer}") if peer else None
        peer_s = f"{_median(peer_rows, 'seconds'):.2f}" if peer_rows else "–"
        peer_mb = f"{_median(peer_rows, 'peak_extra_mb'):.0f}" if peer_rows else "–"
        ratio = f"{ours_s / _median(peer_rows, 'seconds'):.2f}" if peer_rows else "–"
        label = {
            "ig_matched": f"integrated_gradients n_steps={args.ig_steps}",
            "ig_default": f"integrated_gradients auto ({args.ig_default_steps} steps only)",
            "reference": "reference: 1 forward + backward",
            "gradient": "gradient (saliency, ℓ2)",
        }.get(kind, kind)
        lines.append(
            f"| {label} | {ours_s:.2f} | {peer_s} | {ratio} | "
            f"{'–' if refs is None else f'{ours_s / ref:.2f}'} | "
            f"{ours_mb:.0f} | {peer_mb} | {len(rows)} |"
        )
    return "\n".join([*lines, "", *paired_report(results)])


def paired_report(results: dict[str, Any]) -> list[str]:
    """Per round, ours ÷ Inseq (and ALTI-Logit ÷ reference) from the measurements of that round
    (ours and the peer run back to back, so both see about the same load), and their median."""
    pairs = [
        (f"{kind} ÷ {peer}", f"ours:{kind}", f"inseq:{peer}") for kind, peer in OURS.items() if peer
    ] + [
        ("alti_logit ÷ reference (ours alone)", "ours:alti_logit", "ours:reference"),
        ("gradient chunked ÷ unchunked (ours)", "ours:gradient", "ours:gradient_unchunked"),
        (
            "grad_x_input chunked ÷ unchunked (ours)",
            "ours:grad_x_input",
            "ours:grad_x_input_unchunked",
        ),
    ]
    rounds = sorted({r["round"] for rows in results.values() for r in rows})
    head = " | ".join(f"round {r + 1}" for r in rounds)
    lines = [f"| paired ratio | {head} | median |", "|---" + "|---:" * (len(rounds) + 1) + "|"]
    for label, num, den in pairs:
        by_round = {
            r["round"]: r["seconds"] / d["seconds"]
            for r in results.get(num, [])
            for d in results.get(den, [])
            if d["round"] == r["round"]
        }
        if not by_round:
            continue
        cells = " | ".join(f"{by_round[r]:.2f}" if r in by_round else "–" for r in rounds)
        lines.append(f"| {label} | {cells} | **{statistics.median(by_round.values()):.2f}** |")
    loads = [r["load_average"] for rows in results.values() for r in rows]
    span = f"{min(loads):.1f}–{max(loads):.1f}"
    lines += ["", f"1-minute load average at the end of each measurement: {span}"]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs=3, metavar=("SIDE", "KIND", "OPTS"))
    parser.add_argument("--peer-python", default=None)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--continuation-tokens", type=int, default=32)
    parser.add_argument("--ig-steps", type=int, default=2)
    parser.add_argument("--ig-reps", type=int, default=1)
    parser.add_argument("--ig-default-steps", type=int, default=4)
    parser.add_argument("--write", default=None, help="also write the JSON results here")
    parser.add_argument(
        "--only", default=None, help="comma-separated kinds to run (e.g. ig_matched); default all"
    )
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    if not args.peer_python:
        parser.error("--peer-python is required (a Python with inseq installed)")
    opts = prepare(args)
    opts_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_generation_{os.getpid()}.json"
    opts_file.write_text(json.dumps(opts))
    print(f"logits: HF export vs ours max |Δ| = {opts['logit_gap']:.2e}", flush=True)
    results = measure_all(args, opts, str(opts_file))
    table = report(args, opts, results)
    print(table)
    if args.write:
        Path(args.write).write_text(
            json.dumps(
                {
                    "results": results,
                    "machine": platform.processor() or platform.machine(),
                    "table": table,
                    "logit_gap": opts["logit_gap"],
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
