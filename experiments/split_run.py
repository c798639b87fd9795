"""Run one journaled experiment as several processes on disjoint methods, then merge them.

    python -m experiments.split_run --processes 4 -- \\
        python -m experiments.faithfulness ... --methods A,B,C,D \\
            --journal docs/results/runs/NAME/records.jsonl.gz --resume

A journal has one writer, so a run that should use more cores (or share one GPU between several
processes) is split by method. This does what the manual recipe of ``merge_journals`` does:

1. **Plan.** The command's ``--methods`` are dealt into ``--processes`` groups of about equal
   remaining cost, largest first onto the least loaded group (longest-processing-time rule). A
   method's remaining cost is its measured CPU seconds per item in the journal
   (:mod:`experiments.run_costs`, CPU units only) times the items it still lacks (the manifest's
   ``n`` per task / dataset, less those journaled on any device). Where several journal labels
   match one requested method (a variant abandoned mid-run, e.g. a Grad-ELLM depth from before
   its tuning), the label journaled last in each task / dataset is the one whose items are
   counted and whose units there give the rate.
   A method not measured yet is priced at the median of those that are; without any
   measurement every method weighs 1.
   Methods that share one pass in a process (a signed Integrated Gradients and its pooled
   variant, :mod:`experiments.pooling_share`) are dealt as one bundle: split apart, each
   process would integrate the same path. The journal books that pass under one of them, so a
   member left to compute alone is priced at the bundle's summed rate. Methods that do not
   apply to the command's ``--model`` (e.g. DecompX on a decoder; the architecture told without
   loading it, :func:`lens_attrib.models.is_encoder_name`) are left out: the experiment skips
   them.
   The plan is printed, with each group's estimated CPU hours.
2. **Run.** Each group gets its own journal beside the main one,
   ``split-K-of-N.<journal name>``, started as a copy of the main journal (so its ``--resume``
   skips every unit already done), and its own ``--out`` folder (``<out>/split-K-of-N``), and
   runs the same command with its methods. SIGINT / SIGTERM are passed on to every process.
3. **Merge.** When they have all stopped — finished, failed or interrupted — their journals are
   merged into the main one (:func:`lens_attrib.evaluation.journal.merge_journals`: units
   already there are skipped, units computed differently are refused) and deleted. Split journals
   left by an earlier split that was killed before merging are merged first, at the start.
4. **Finish.** If every process exited with status 0, the command is run once more as given: it
   reads every unit from the merged journal, computes nothing, and writes the run's outputs
   (table, records) in ``--out``. Otherwise the exit status is the first non-zero one (a
   process killed by signal ``s``: ``128 + s``), and rerunning the same line continues.

A ``--so-far`` command (tables from the journal while the run goes on) computes nothing, so it
runs as given, as one process: a run's recorded split line with ``--resume`` replaced by
``--so-far`` gives its so-far tables. They read the main journal only, so the units of a split
still running count once it has stopped and merged.

Under :mod:`experiments.checkpoint_run` the split journals sit in the run's folder and are
committed with it, so a machine lost mid-run loses at most each process's unit in flight.

Each process loads the model and, in classifier mode, the built-in classifier. On a machine
whose cache does not hold that classifier yet, every process would train it at once: load it
once first (``load_classifier(name)``, or a plain run of the command until its first unit).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from experiments.pooling_share import sibling_group
from lens_attrib.evaluation.journal import (
    copy_journal,
    manifest_path,
    merge_journals,
    read_lines,
    remove_journal,
)
from lens_attrib.method_variants import split_method_list, split_variant

SPLIT_PREFIX = "split-"


def option_value(command: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` in ``command`` (``--flag V`` or ``--flag=V``; the last one wins)."""
    value = None
    for k, word in enumerate(command):
        if word == flag and k + 1 < len(command):
            value = command[k + 1]
        elif word.startswith(flag + "="):
            value = word[len(flag) + 1 :]
    return value


def with_option(command: Sequence[str], flag: str, value: str) -> list[str]:
    """``command`` with every ``flag`` set to ``value`` (appended when absent)."""
    out, found, k = [], False, 0
    while k < len(command):
        word = command[k]
        if word == flag and k + 1 < len(command):
            out += [flag, value]
            found, k = True, k + 2
            continue
        if word.startswith(flag + "="):
            out.append(f"{flag}={value}")
            found = True
        else:
            out.append(word)
        k += 1
    return out if found else [*out, flag, value]


def split_journal(journal: Path, k: int, n: int) -> Path:
    """Group ``k``'s (1-based) journal of an ``n``-way split, beside the main one."""
    return journal.with_name(f"{SPLIT_PREFIX}{k}-of-{n}.{journal.name}")


def leftover_journals(journal: Path) -> list[Path]:
    """Split journals of ``journal`` left by an earlier split (any number of processes)."""
    return sorted(journal.parent.glob(f"{SPLIT_PREFIX}*-of-*.{journal.name}"))


def _label_matches(requested: str, label: str) -> bool:
    """Whether journal label ``label`` is a run of method spec ``requested``: the same method
    with at least the requested options (a journal label also names the options the run
    resolved, e.g. ``value_zeroing[aggregation=mean]`` for ``value_zeroing``)."""
    name, options = split_variant(requested)
    their_name, theirs = split_variant(label)
    return name == their_name and all(theirs.get(k) == v for k, v in options.items())


def remaining_costs(methods: Sequence[str], journal: Path | None) -> tuple[dict[str, float], bool]:
    """Each method's estimated remaining CPU seconds (module docstring, step 1), and whether
    they are measured; every method weighs 1 when the journal has no measurement."""
    from experiments.run_costs import ONE_OFF, cost_table, split_key

    unmeasured = ({m: 1.0 for m in methods}, False)
    if journal is None or not journal.is_file():
        return unmeasured
    lines = read_lines(journal, repair=True)
    n = lines[0].get("n") if lines else None
    done: dict[str, dict[str, set[int]]] = {}  # label -> where -> items, on any device
    latest: dict[tuple[str, str], int] = {}  # (label, where) -> its last unit's line
    for number, line in enumerate(lines[1:]):
        if line.get("kind") == "batch":
            where, label = split_key(line["method"])
            if not label.startswith(ONE_OFF):
                done.setdefault(label, {}).setdefault(where, set()).update(line["items"])
                latest[label, where] = number
    spent: dict[tuple[str, str], list[float]] = {}  # (label, where) -> CPU s, items (CPU units)
    for row in cost_table(journal):
        if row["method"] not in ONE_OFF:
            acc = spent.setdefault((row["method"], row["where"]), [0.0, 0.0])
            acc[0] += row["cpu_s"]
            acc[1] += row["items"]
    wheres = {w for per in done.values() for w in per} or {""}
    rates: dict[str, float | None] = {}
    left: dict[str, float] = {}
    for method in methods:
        matching = [lab for lab in done if lab == method] or [
            lab for lab in done if _label_matches(method, lab) and lab not in methods
        ]
        # per task / dataset, the label the run resolves the spec to now: the one journaled
        # last (an abandoned variant, e.g. a Grad-ELLM depth from before the tuning, stops
        # getting units)
        current: dict[str, str] = {}
        for where in wheres:
            journaled = [(latest[lab, where], lab) for lab in matching if (lab, where) in latest]
            if journaled:
                current[where] = max(journaled)[1]
        measured = [
            spent[label, where]
            for where, label in current.items()
            if (label, where) in spent and spent[label, where][1] > 0
        ]
        rates[method] = (
            sum(s for s, _ in measured) / sum(i for _, i in measured) if measured else None
        )
        if not isinstance(n, int):
            left[method] = 1.0
        else:
            left[method] = sum(
                max(0.0, n - len(done[current[where]][where])) if where in current else n
                for where in wheres
            )
    known = [r for r in rates.values() if r is not None]
    if not known:
        return unmeasured
    fallback = statistics.median(known)
    rate: dict[str, float] = {}
    for m in methods:
        measured_rate = rates[m]
        rate[m] = fallback if measured_rate is None else measured_rate
    for bundle in shared_pass_bundles(methods):
        pass_rate = sum(rate[m] for m in bundle)  # the pass is booked under one member
        for m in bundle:
            if all(left[other] == 0 for other in bundle if other != m):
                rate[m] = pass_rate  # its siblings are done: it integrates the path alone
    return {m: left[m] * rate[m] for m in methods}, True


def shared_pass_bundles(methods: Sequence[str]) -> list[list[str]]:
    """``methods`` grouped by the pass they share in one process
    (:func:`experiments.pooling_share.sibling_group`: a signed Integrated Gradients and its
    pooled variants with otherwise equal options), in the command's order; a method that
    shares no pass is a bundle of its own."""
    bundles: dict[str, list[str]] = {}
    for method in methods:
        name, options = split_variant(method)
        group = sibling_group(name, options)
        bundles.setdefault(method if group is None else group, []).append(method)
    return list(bundles.values())


def architecture_skips(command: Sequence[str], methods: Sequence[str]) -> list[str]:
    """The ``methods`` that the command's ``--model`` skips because they do not apply to its
    architecture (:meth:`lens_attrib.methods.registry.MethodSpec.applies_to`),
    where the architecture can be told without loading the model; none otherwise."""
    from lens_attrib import METHODS
    from lens_attrib.models import is_encoder_name

    model = option_value(command, "--model")
    encoder = None if model is None else is_encoder_name(model)
    if encoder is None:
        return []
    skipped = []
    for method in methods:
        spec = METHODS.get(split_variant(method)[0])
        if spec is not None and not spec.applies_to(encoder=encoder):
            skipped.append(method)
    return skipped


def plan_groups(costs: dict[str, float], processes: int) -> list[list[str]]:
    """Methods dealt into at most ``processes`` non-empty groups, largest cost first onto the
    group with the least cost so far (ties: the lower group); the methods of a
    :func:`shared_pass_bundles` bundle go together, at their summed cost; each group keeps
    the command's method order."""
    if processes < 1:
        raise ValueError(f"--processes must be at least 1, got {processes}")
    order = list(costs)
    bundles = shared_pass_bundles(order)
    groups: list[list[str]] = [[] for _ in range(min(processes, len(bundles)))]
    loads = [0.0] * len(groups)
    for bundle in sorted(bundles, key=lambda b: -sum(costs[m] for m in b)):
        k = loads.index(min(loads))
        groups[k] += bundle
        loads[k] += sum(costs[m] for m in bundle)
    return [sorted(g, key=order.index) for g in groups if g]


@dataclass
class SplitReport:
    """What a split did: the groups, each process's exit status, the units merged."""

    groups: list[list[str]]
    codes: list[int]
    merged: int


def merge_into(journal: Path, parts: Sequence[Path]) -> int:
    """Merge existing ``parts`` into ``journal`` (a copy of the first when there is none yet) and
    delete them (with their manifest copies); the units added."""
    parts = [p for p in parts if p.is_file() and read_lines(p, repair=True)]
    if not parts:
        return 0
    copied = 0
    if not journal.exists():
        copy_journal(parts[0], journal)
        copied = sum(line.get("kind") == "batch" for line in read_lines(journal, repair=True))
    report = merge_journals(journal, parts)
    for part in parts:
        remove_journal(part)
        manifest_path(part).unlink(missing_ok=True)  # the readable copy a compressed one keeps
    return copied + report.added


def _exit_status(code: int) -> int:
    return code if code >= 0 else 128 - code


def split_run(command: Sequence[str], processes: int) -> SplitReport:
    """Run ``command`` as ``processes`` method groups and merge them (module docstring)."""
    command = list(command)
    methods_text, journal_text = (
        option_value(command, "--methods"),
        option_value(command, "--journal"),
    )
    if methods_text is None or journal_text is None or "--resume" not in command:
        raise ValueError(
            "split_run needs a journaled command: give it --methods A,B,…, --journal PATH and "
            "--resume (each process resumes from a copy of that journal)"
        )
    journal = Path(journal_text)
    journal.parent.mkdir(parents=True, exist_ok=True)
    earlier = merge_into(journal, leftover_journals(journal))
    if earlier:
        print(f"[split_run] {earlier} units of an earlier split merged into {journal}", flush=True)
    methods = split_method_list(methods_text)
    skipped = architecture_skips(command, methods)
    if skipped:
        print(f"[split_run] not for this model's architecture (the run skips them): "
              f"{', '.join(skipped)}", flush=True)  # fmt: skip
        methods = [m for m in methods if m not in skipped]
    costs, measured = remaining_costs(methods, journal)
    finished = [m for m in methods if costs[m] == 0]
    if finished:
        print(f"[split_run] done by the journal's count: {', '.join(finished)}", flush=True)
    groups = plan_groups({m: c for m, c in costs.items() if c > 0}, processes)
    out = option_value(command, "--out")
    parts = [split_journal(journal, k + 1, len(groups)) for k in range(len(groups))]
    commands = []
    for k, (group, part) in enumerate(zip(groups, parts)):
        if journal.exists():
            copy_journal(journal, part)
        sub = with_option(command, "--methods", ",".join(group))
        sub = with_option(sub, "--journal", str(part))
        if out is not None:
            sub = with_option(sub, "--out", str(Path(out) / part.name.split(".")[0]))
        commands.append(sub)
        estimate = sum(costs[m] for m in group)
        cost = f" (≈ {estimate / 3600:.2f} CPU-h)" if measured else ""
        print(f"[split_run] process {k + 1}/{len(groups)}{cost}: {', '.join(group)}", flush=True)
    procs = [subprocess.Popen(sub) for sub in commands]

    def forward(signum: int, frame: FrameType | None) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        codes = [_exit_status(proc.wait()) for proc in procs]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    merged = merge_into(journal, parts)
    print(f"[split_run] {merged} units merged into {journal}; exit statuses {codes}", flush=True)
    return SplitReport(groups, codes, merged)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args:
        raise SystemExit("usage: python -m experiments.split_run [--processes N] -- COMMAND ...")
    cut = args.index("--")
    parser = argparse.ArgumentParser(
        prog="python -m experiments.split_run",
        description="Run a journaled experiment as N processes on disjoint --methods, merge "
        "their journals, then run the command once more to write its outputs.",
    )
    parser.add_argument("--processes", type=int, default=2, help="processes side by side")
    opts = parser.parse_args(args[:cut])
    command = args[cut + 1 :]
    if "--so-far" in command:  # reads the journal and computes nothing: nothing to split
        print("[split_run] --so-far: the command runs as one process", flush=True)
        return subprocess.call(command)
    try:
        report = split_run(command, opts.processes)
    except ValueError as err:
        parser.error(str(err))
    failed = [c for c in report.codes if c != 0]
    if failed:
        print(f"[split_run] a process failed (status {failed[0]}): rerun the same line to continue",
              file=sys.stderr, flush=True)  # fmt: skip
        return failed[0]
    return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main())
