"""``kaisa bench``: list the suite's cases, run one, see where it stands, report it.

    kaisa bench list
    kaisa bench run text-lm                 # the whole protocol; resumes where it stopped
    kaisa bench run text-lm --max-units 1   # one lockstep group, then stop
    kaisa bench status text-lm
    kaisa bench report text-lm --table heldout
    kaisa bench report text-lm --plot docs/reports/text-lm.png

Records go to ``--records`` (default ``benchmarks/records``), one JSON file per
run; two ``run`` commands on the same folder share the work.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from kaisa_lab.bench.campaign import Campaign, work
from kaisa_lab.bench.cases import CASES, get_case
from kaisa_lab.bench.records import RecordStore
from kaisa_lab.bench.report import FairnessError, markdown_heldout, markdown_tuning, plot
from kaisa_lab.cli.progress import Progress

__all__ = ["DEFAULT_RECORDS", "add_bench_parser", "run_bench"]

#: where records are read and written unless ``--records`` says otherwise
DEFAULT_RECORDS = Path("benchmarks/records")
TABLES = ("heldout", "tuning")
STAGES = ("grid", "followup", "heldout")


def add_bench_parser(commands: Any) -> argparse.ArgumentParser:
    """The ``bench`` subcommand and its own subcommands."""
    bench = commands.add_parser(
        "bench",
        help="the benchmark suite: tune every arm of a case by one protocol, report it",
        description="The benchmark suite (docs/benchmarks.md): each case tunes every arm by "
        "the same protocol and reports held-out seeds, from records of real runs.",
    )
    sub = bench.add_subparsers(
        dest="bench_command", metavar="{list,run,status,report}", required=True
    )
    sub.add_parser("list", help="the cases, with their tasks and arms")
    run = sub.add_parser("run", help="run a case's protocol until it is done (resumable)")
    status = sub.add_parser("status", help="where each arm of a case stands")
    report = sub.add_parser("report", help="a case's tables (markdown) and plot, from its records")
    for parser in (run, status, report):
        parser.add_argument("case", choices=list(CASES), help="the case")
        parser.add_argument(
            "--records",
            type=Path,
            default=DEFAULT_RECORDS,
            help=f"folder of the records (default: {DEFAULT_RECORDS})",
        )
    run.add_argument(
        "--max-units", type=int, help="stop after this many lockstep groups (default: all)"
    )
    run.add_argument(
        "--stages",
        default=",".join(STAGES),
        help=f"comma-separated stages to take ({', '.join(STAGES)}; default: all)",
    )
    run.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads of this worker (default 1)"
    )
    run.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where to train (default cpu)"
    )
    run.add_argument(
        "--no-wait",
        action="store_true",
        help="return when every pending group is held by another worker (default: wait)",
    )
    report.add_argument(
        "--table", choices=TABLES, default="heldout", help="which table (default: heldout)"
    )
    report.add_argument("--plot", type=Path, metavar="PNG", help="also draw the held-out plot")
    return bench


def run_bench(args: argparse.Namespace, error: Any) -> int:
    """Carry out ``kaisa bench ...``; usage problems go to ``error`` (exit 2)."""
    if args.bench_command == "list":
        for case in CASES.values():
            quick = " (quick)" if case.quick else ""
            arms = ", ".join(arm.name for arm in case.arms)
            print(f"{case.name}{quick}: {case.description}\n    arms: {arms}")
        return 0
    case = get_case(args.case)
    campaign = Campaign(case, RecordStore(args.records))
    if args.bench_command == "status":
        print("\n".join(campaign.status()))
        return 0
    if args.bench_command == "report":
        try:
            table = markdown_heldout if args.table == "heldout" else markdown_tuning
            print(table(campaign), end="")
            if args.plot is not None:
                plot(campaign, args.plot)
        except FairnessError as err:
            print(f"kaisa bench report: {err}", file=sys.stderr)
            return 1
        return 0
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    if not stages or set(stages) - set(STAGES):
        error(f"argument --stages: choose from {', '.join(STAGES)}; got {args.stages!r}")
    if args.threads < 1:
        error(f"argument --threads: expected a positive integer; got {args.threads}")
    torch.set_num_threads(args.threads)
    progress = Progress(enabled=True, bars=False)
    done = work(
        campaign,
        progress,
        max_units=args.max_units,
        wait_s=0.0 if args.no_wait else 30.0,
        stages=stages,
        device=args.device,
    )
    print(f"ran {done} group(s)")
    print("\n".join(campaign.status()))
    return 0
