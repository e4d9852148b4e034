"""``kaisa bench``: list the suite's cases, run one, see where it stands, report it.

    kaisa bench list
    kaisa bench run text-lm                 # the whole protocol; resumes where it stopped
    kaisa bench run text-lm --max-units 1   # one lockstep group, then stop
    kaisa bench status text-lm
    kaisa bench report text-lm --table heldout
    kaisa bench report text-lm --plot docs/reports/text-lm.png
    kaisa bench run gram --quick            # a cost case, with its quick options
    kaisa bench run gram --option rounds=20
    kaisa bench report gram --table speed-up

Two kinds of case: time to target (:mod:`kaisa_lab.bench.cases`, run by the
tuning protocol) and cost (:mod:`kaisa_lab.bench.costs`). Records go to
``--records`` (default ``benchmarks/records``), one JSON file per run; two
``run`` commands on the same folder share a time-to-target case's work.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from kaisa_lab.bench import costs as _costs  # registers the cost cases
from kaisa_lab.bench.ab import ab, markdown_ab, revision_problem
from kaisa_lab.bench.advice import markdown_advice
from kaisa_lab.bench.campaign import Campaign, selections, work
from kaisa_lab.bench.cases import CASES, get_case, lever_cases, summary_cases
from kaisa_lab.bench.defaults import markdown_defaults
from kaisa_lab.bench.goals import checks as goal_checks
from kaisa_lab.bench.goals import markdown_goals
from kaisa_lab.bench.plots import plot_heldout, plot_levers_across
from kaisa_lab.bench.records import RecordStore
from kaisa_lab.bench.replay import Replay
from kaisa_lab.bench.report import (
    markdown_between,
    markdown_heldout,
    markdown_levers,
    markdown_levers_across,
    markdown_machine,
    markdown_selection,
    markdown_summary,
    markdown_tuning,
)
from kaisa_lab.bench.rows import FairnessError
from kaisa_lab.bench.timing import TIMING_CASES, TimingCase, latest, run_timing
from kaisa_lab.cli.compiled import BACKENDS
from kaisa_lab.cli.progress import Progress
from kaisa_lab.tasks import tuned

__all__ = ["DEFAULT_RECORDS", "add_bench_parser", "run_bench"]

del _costs

#: where records are read and written unless ``--records`` says otherwise
DEFAULT_RECORDS = Path("benchmarks/records")
TABLES = ("heldout", "between", "tuning", "selection", "machine", "levers")
STAGES = ("grid", "followup", "cost", "heldout")


def add_bench_parser(commands: Any) -> argparse.ArgumentParser:
    """The ``bench`` subcommand and its own subcommands."""
    bench = commands.add_parser(
        "bench",
        help="the benchmark suite: tune every arm of a case by one protocol, report it",
        description="The benchmark suite (docs/benchmarks.md): each case tunes every arm by "
        "the same protocol and reports held-out seeds, from records of real runs.",
    )
    sub = bench.add_subparsers(
        dest="bench_command",
        metavar="{list,run,status,report,summary,select,ab}",
        required=True,
    )
    sub.add_parser("list", help="the cases, with their tasks and arms")
    _add_case_commands(sub)
    _add_summary(sub)
    _add_select(sub)
    _add_ab(sub)
    return bench


def _add_case_commands(sub: Any) -> None:
    """``run``, ``status`` and ``report``: a case's protocol, its state, its tables."""
    run = sub.add_parser("run", help="run a case's protocol until it is done (resumable)")
    status = sub.add_parser("status", help="where each arm of a case stands")
    report = sub.add_parser("report", help="a case's tables (markdown) and plot, from its records")
    names = [*CASES, *TIMING_CASES]
    for parser in (run, status, report):
        parser.add_argument("case", choices=names, metavar="CASE", help="the case (see list)")
        parser.add_argument(
            "--records",
            type=Path,
            default=DEFAULT_RECORDS,
            help=f"folder of the records (default: {DEFAULT_RECORDS})",
        )
        parser.add_argument(
            "--selected-from",
            type=Path,
            metavar="DIR",
            help="a replay: each arm at the setting the case's campaign in DIR selected, its "
            "held-out seeds only, recorded in --records (another machine or device)",
        )
        parser.add_argument(
            "--compile-model",
            nargs="?",
            const="inductor",
            choices=BACKENDS,
            help="with --selected-from: every arm's model compiled with torch.compile under "
            "this backend (default inductor), K-FAC attached first; its own records",
        )
    run.add_argument(
        "--arms",
        help="with --selected-from: the arms to replay, comma-separated (default: every "
        "arm selected there)",
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
        "--quick",
        action="store_true",
        help="a cost case with its quick options (seconds; what make bench runs)",
    )
    run.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a cost case's option (VALUE read as JSON, else as text); repeatable",
    )
    run.add_argument(
        "--print-json",
        action="store_true",
        help="a cost case: also print its records as one JSON line at the end (for ab)",
    )
    run.add_argument(
        "--snapshot-minutes",
        type=float,
        default=10.0,
        help="save the runs of a group in flight this often, so a stopped group goes on "
        "where it was (default: 10; 0: never)",
    )
    run.add_argument(
        "--no-wait",
        action="store_true",
        help="return when every pending group is held by another worker (default: wait)",
    )
    report.add_argument(
        "--table",
        help=f"which table (time to target: {', '.join(TABLES)}, default heldout; a cost "
        "case: one of its tables, default its first)",
    )
    report.add_argument("--plot", type=Path, metavar="PNG", help="also draw the held-out plot")


def _add_summary(sub: Any) -> None:
    """``summary``: the tables across cases (families, levers, advice, defaults, goals)."""
    summary = sub.add_parser(
        "summary",
        help="which K-FAC to use when: every family's held-out medians, K-FAC against its base",
    )
    summary.add_argument(
        "--records", type=Path, default=DEFAULT_RECORDS, help=f"default: {DEFAULT_RECORDS}"
    )
    summary.add_argument(
        "--plot", type=Path, metavar="PNG", help="with --levers: also draw it (a PNG)"
    )
    instead = summary.add_mutually_exclusive_group()
    instead.add_argument(
        "--levers",
        action="store_true",
        help="instead: each lever on every case that runs it, against K-FAC at the defaults",
    )
    instead.add_argument(
        "--advice",
        action="store_true",
        help="instead: per case and base optimizer, the fastest K-FAC arm (defaults, tuned "
        "or a lever) against the optimizer alone and the fastest first-order arm",
    )
    instead.add_argument(
        "--defaults",
        action="store_true",
        help="instead: each lever's decision: the library's default, an option, usage or "
        "not built, from its verdicts on every family",
    )
    instead.add_argument(
        "--goals",
        action="store_true",
        help="instead: the bar against the best tuned peer, each claim met or missed and why",
    )


def _add_select(sub: Any) -> None:
    """``select``: a campaign's selections, optionally written to the tasks' defaults."""
    select = sub.add_parser(
        "select",
        help="the settings a case's protocol selected; --write puts them in the task's defaults",
        description="Print each arm's selected setting; with --write, record them in "
        "kaisa_lab/tasks/tuned.json, where the task reads its tuned lrs (an arm without a "
        "selection runs at its prior and kaisa compare calls it untuned).",
    )
    select.add_argument("case", choices=list(CASES), metavar="CASE", help="a time-to-target case")
    select.add_argument(
        "--records", type=Path, default=DEFAULT_RECORDS, help=f"default: {DEFAULT_RECORDS}"
    )
    select.add_argument("--write", action="store_true", help="write them to tuned.json")


def _add_ab(sub: Any) -> None:
    """``ab``: a cost case timed on two versions of the library, in turns."""
    compare = sub.add_parser(
        "ab",
        help="a cost case on two versions of the library, in alternating fresh processes",
        description="Before and after a change: the cost case on --before's src and on "
        "--after's (default: this tree), in fresh interpreters taking turns; per arm the "
        "median over rounds and after/before.",
    )
    compare.add_argument("case", metavar="CASE", help="a cost case (see list)")
    compare.add_argument(
        "--before", required=True, help="a git revision, or a folder holding src/kaisa"
    )
    compare.add_argument("--after", help="a git revision or folder (default: this tree)")
    compare.add_argument("--rounds", type=int, default=5, help="turns of each side (default 5)")
    compare.add_argument(
        "--records", type=Path, help="also write the result's records under this folder"
    )
    compare.add_argument("--quick", action="store_true", help="the case's quick options")
    compare.add_argument(
        "--option", action="append", default=[], metavar="KEY=VALUE", help="a case option"
    )


def run_bench(args: argparse.Namespace, error: Any) -> int:
    """Carry out ``kaisa bench ...``; usage problems go to ``error`` (exit 2)."""
    _check_paths(args, error)
    if args.bench_command == "list":
        return _list()
    if args.bench_command == "summary":
        store = RecordStore(args.records)
        if args.plot is not None and not args.levers:
            error("argument --plot: it draws the levers across families; give it with --levers")
        if args.levers:
            cases = [Campaign(c, store) for c in lever_cases()]
            code = _print_fair(lambda: markdown_levers_across(cases), "summary --levers")
            if code == 0 and args.plot is not None:
                plot_levers_across(cases, args.plot)
            return code
        if args.defaults:
            cases = [Campaign(c, store) for c in lever_cases()]
            return _print_fair(lambda: markdown_defaults(cases), "summary --defaults")
        if args.advice:
            measured = [Campaign(c, store) for c in CASES.values() if not c.quick]
            return _print_fair(lambda: markdown_advice(measured), "summary --advice")
        if args.goals:
            return _print_fair(lambda: markdown_goals(goal_checks(store)), "summary --goals")
        families = [Campaign(c, store) for c in summary_cases()]
        return _print_fair(lambda: markdown_summary(families), "summary")
    if args.bench_command == "ab":
        return _run_ab(args, error)
    if args.case in TIMING_CASES:
        return _run_cost(TIMING_CASES[args.case], args, error)
    if args.bench_command == "run":
        _refuse_cost_flags(args, error)
        _check_device(args.device, error)
    campaign = _campaign(args, error)
    if args.bench_command == "select":
        return _select(campaign, args.write, error)
    if args.bench_command == "status":
        print("\n".join(campaign.status()))
        return 0
    if args.bench_command == "report":
        if args.table not in (None, *TABLES):
            error(f"argument --table: choose from {', '.join(TABLES)}; got {args.table!r}")
        if isinstance(campaign, Replay) and args.table in ("tuning", "selection"):
            error(
                f"argument --table: a replay runs no tuning; read {args.table} from "
                f"--selected-from's records ({args.selected_from})"
            )
        render = {
            "tuning": markdown_tuning,
            "selection": markdown_selection,
            "machine": markdown_machine,
            "levers": markdown_levers,
            "between": markdown_between,
        }.get(args.table, markdown_heldout)
        code = _print_fair(lambda: render(campaign), "report")
        if code == 0 and args.plot is not None:
            plot_heldout(campaign, args.plot)
        return code
    return _run_campaign(campaign, args, error)


def _check_paths(args: argparse.Namespace, error: Any) -> None:
    """The folders read and the files drawn: a folder that is not there is a
    usage error (a typo in ``--records`` would otherwise read as a campaign
    with no runs yet), and a plot is a PNG."""
    plot = getattr(args, "plot", None)
    if plot is not None and plot.suffix.lower() != ".png":
        error(f"argument --plot: expected a .png file; got {plot}")
    records = getattr(args, "records", None)
    reads = args.bench_command in ("status", "report", "summary", "select")
    if reads and records is not None and not records.is_dir():
        error(f"argument --records: no folder {records} (bench run writes it)")
    source = getattr(args, "selected_from", None)
    if source is not None and not source.is_dir():
        error(f"argument --selected-from: no folder {source}")


def _check_device(device: str, error: Any) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        error("argument --device: cuda, but this torch sees no CUDA device")


def _refuse_cost_flags(args: argparse.Namespace, error: Any) -> None:
    """``--option``, ``--quick`` and ``--print-json`` belong to cost cases; on a
    time-to-target case they would be ignored, so they are refused."""
    given = [
        flag
        for flag, on in (
            ("--option", args.option),
            ("--quick", args.quick),
            ("--print-json", args.print_json),
        )
        if on
    ]
    if given:
        error(
            f"argument {given[0]}: a cost case's flag; {args.case} is a time-to-target "
            f"case (its protocol is declared in kaisa_lab/bench/cases.py)"
        )


def _campaign(args: argparse.Namespace, error: Any) -> Campaign:
    """The case's campaign over ``--records``; with ``--selected-from``, a
    replay of its held-out seeds at that folder's selections."""
    case = get_case(args.case)
    store = RecordStore(args.records)
    source = getattr(args, "selected_from", None)
    arms = getattr(args, "arms", None)
    compiled = getattr(args, "compile_model", None)
    if source is None:
        if arms is not None:
            error("argument --arms: it names the arms of a replay; give it with --selected-from")
        if compiled is not None:
            error(
                "argument --compile-model: a replay's option (a campaign tunes eager runs); "
                "give it with --selected-from"
            )
        return Campaign(case, store)
    if source.resolve() == args.records.resolve():
        error("argument --selected-from: a replay records into a folder of its own (--records)")
    names = None if arms is None else [a.strip() for a in arms.split(",") if a.strip()]
    try:
        return Replay(case, store, Campaign(case, RecordStore(source)), names, compiled)
    except ValueError as exc:
        error(f"argument --{exc}")
        raise


def _list() -> int:
    print("time to target (kaisa bench run CASE: the tuning protocol, resumable):")
    for case in CASES.values():
        quick = " (quick)" if case.quick else ""
        arms = ", ".join(arm.name for arm in case.arms)
        print(f"  {case.name}{quick}: {case.description}\n      arms: {arms}")
    print("cost (kaisa bench run CASE [--quick]):")
    for timing in TIMING_CASES.values():
        where = "" if timing.device == "cpu" else f" [{timing.device}]"
        tables = ", ".join(timing.tables) or "-"
        print(f"  {timing.name}{where}: {timing.description}\n      tables: {tables}")
    return 0


def _print_fair(render: Any, command: str) -> int:
    """Print ``render()``; a comparison whose arms started apart is an error (exit 1)."""
    try:
        print(render(), end="")
    except FairnessError as err:
        print(f"kaisa bench {command}: {err}", file=sys.stderr)
        return 1
    return 0


def _run_ab(args: argparse.Namespace, error: Any) -> int:
    if args.case not in TIMING_CASES:
        error(f"argument CASE: ab times a cost case ({', '.join(TIMING_CASES)})")
    if args.rounds < 1:
        error(f"argument --rounds: expected a positive integer; got {args.rounds}")
    for flag, rev in (("--before", args.before), ("--after", args.after)):
        problem = "" if rev is None else revision_problem(rev)
        if problem:
            error(f"argument {flag}: {rev!r} is {problem}")
    try:
        TIMING_CASES[args.case].resolve(_parse_options(args.option, error), args.quick)
    except KeyError as err:
        error(f"argument --option: {err.args[0]}")
    extra = ["--quick"] * args.quick + [f"--option={o}" for o in args.option]
    records = ab(
        args.case,
        args.before,
        after=args.after,
        rounds=args.rounds,
        arguments=extra,
        store=None if args.records is None else RecordStore(args.records),
    )
    print(markdown_ab(records), end="")
    return 0


def _select(campaign: Campaign, write: bool, error: Any) -> int:
    case = campaign.case
    if case.name != case.task:
        error(f"argument CASE: {case.name} is not a task's own case; nothing to select")
    chosen = selections(campaign)
    for arm, picked in chosen.items():
        knobs = "".join(f", {k} {v}" for k, v in picked.kfac.items())
        print(
            f"{arm}: lr {picked.lr:g}, warm-up {picked.warmup_epochs:g} ep, "
            f"{picked.schedule}{knobs} ({picked.settings} settings, {picked.runs} runs)"
        )
    if write:
        tuned.write({case.task: chosen})
        print(f"wrote {len(chosen)} selection(s) for {case.task} to {tuned.PATH}")
    return 0


def _run_campaign(campaign: Campaign, args: argparse.Namespace, error: Any) -> int:
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    if not stages or set(stages) - set(STAGES):
        error(f"argument --stages: choose from {', '.join(STAGES)}; got {args.stages!r}")
    if args.threads < 1:
        error(f"argument --threads: expected a positive integer; got {args.threads}")
    if not math.isfinite(args.snapshot_minutes) or args.snapshot_minutes < 0:
        error(f"argument --snapshot-minutes: expected >= 0; got {args.snapshot_minutes}")
    torch.set_num_threads(args.threads)
    done = work(
        campaign,
        Progress(enabled=True, bars=False),
        max_units=args.max_units,
        wait_s=0.0 if args.no_wait else 30.0,
        stages=stages,
        device=args.device,
        snapshot_every_s=60.0 * args.snapshot_minutes or None,
    )
    print(f"ran {done} group(s)")
    print("\n".join(campaign.status()))
    return 0


def _parse_options(items: list[str], error: Any) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            error(f"argument --option: expected KEY=VALUE; got {item!r}")
        try:
            options[key] = json.loads(text)
        except json.JSONDecodeError:
            options[key] = text
    return options


def _run_cost(case: TimingCase, args: argparse.Namespace, error: Any) -> int:
    """``run``/``status``/``report`` of a cost case."""
    store = RecordStore(args.records)
    if args.bench_command == "status":
        records = latest(store, case.name)
        when = records[0]["run"] if records else "never"
        print(f"{case.name}: {len(records)} record(s) in the newest measurement ({when})")
        return 0
    if args.bench_command == "report":
        records = latest(store, case.name)
        if not records:
            error(f"no records of {case.name} under {args.records}; run it first")
        name = str(args.table or next(iter(case.tables), ""))
        if name not in case.tables:
            error(f"argument --table: {case.name} has {', '.join(case.tables) or 'no tables'}")
        print(case.tables[name](records), end="")
        if args.plot is not None and case.plot is not None:
            case.plot(records, args.plot)
        return 0
    given = _parse_options(args.option, error)
    if "device" in case.options and "device" not in given:
        given["device"] = args.device  # a case that can measure on either takes --device
    try:
        options = case.resolve(given, args.quick)
    except KeyError as err:
        error(f"argument --option: {err.args[0]}")
    if case.device == "cuda" and args.device != "cuda":
        error(f"argument --device: {case.name} measures a GPU; pass --device cuda")
    if case.device == "cpu" and args.device != "cpu":
        error(f"argument --device: {case.name} measures on the CPU only")
    _check_device(options.get("device", args.device), error)
    torch.set_num_threads(args.threads)
    records = run_timing(case, options, store, args.device)
    for name, render in case.tables.items():
        print(f"{name}:\n{render(records)}")
    print(f"wrote {len(records)} record(s) under {store.root / case.name}")
    if args.print_json:
        print(json.dumps(records))
    return 0
