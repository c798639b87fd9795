"""Merge the journals of one run that was split over processes into one journal.

    python -m experiments.merge_journals docs/results/runs/NAME/records.jsonl.gz \\
        docs/results/runs/NAME/records.qa.jsonl.gz

A journaled experiment takes one process per journal. To use more cores, start more processes of
the same command on disjoint work (e.g. ``--tasks qa`` beside the other tasks, or disjoint
``--methods``), each with its own ``--journal`` beside the main one, and when they have all
stopped merge them into the main journal (:func:`lens_attrib.evaluation.journal.merge_journals`:
same manifest required, units already present skipped, conflicting ones refused). The run's own
command with ``--resume`` then reads every unit from the main journal; delete the merged sources.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lens_attrib.evaluation.journal import merge_journals


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.merge_journals",
        description="Append to INTO the units of SOURCE journals (same run) that it lacks.",
    )
    parser.add_argument("into", help="the run's main journal (records.jsonl.gz)")
    parser.add_argument("sources", nargs="+", help="journals of the same run to merge into it")
    args = parser.parse_args(argv)
    report = merge_journals(args.into, args.sources)
    print(
        f"{args.into}: {report.added} units added, {report.duplicates} already present; "
        f"the sources can now be deleted: {' '.join(args.sources)}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
