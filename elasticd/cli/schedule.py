"""`elasticd schedule`: print a pipeline schedule's timeline per stage and its bubble."""

from __future__ import annotations

import argparse
import json

from elasticd.errors import UsageError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "schedule",
        help="show the pipeline timeline per stage (1F1B, interleaved 1F1B or gpipe)",
        description="Simulate every pipeline stage with unit costs (forward 1, backward 2 "
        "per chunk, transfers free) and print the timeline and the bubble fraction.",
    )
    p.add_argument("--pp", type=int, required=True, help="pipeline stages")
    p.add_argument("--vpp", type=int, default=1, help="model chunks per stage (default 1)")
    p.add_argument("--microbatches", type=int, required=True, help="micro-batches per step")
    p.add_argument(
        "--kind", default="1f1b", help="1f1b (interleaved when vpp > 1) or gpipe (default 1f1b)"
    )
    p.add_argument("--json", action="store_true",
                   help="print each stage's compute actions as {op, microbatch, chunk}, in the "
                   "text's order")  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # The trainer is imported here only: elasticd never imports it at module level.
    from trainer.parallel.schedule import ScheduleError, compute_order
    from trainer.parallel.schedule_sim import format_timeline, simulate, summary

    try:
        if args.json:
            sizes = {"pp": args.pp, "vpp": args.vpp, "microbatches": args.microbatches}
            # Fields in the order the timeline prints them: F<microbatch>.<chunk>.
            stages = [
                [{"op": act.op.value, "microbatch": act.microbatch, "chunk": act.chunk}
                 for act in compute_order(**sizes, stage=s, kind=args.kind)]
                for s in range(max(args.pp, 1))
            ]  # fmt: skip
            print(json.dumps({**sizes, "stages": stages}, separators=(",", ":")))
            return 0
        result = simulate(pp=args.pp, vpp=args.vpp, microbatches=args.microbatches, kind=args.kind)
    except ScheduleError as exc:
        raise UsageError(f"schedule: {exc}") from exc
    print(format_timeline(result))
    if args.vpp > 1:
        forward = "F<m>.<c>: forward of micro-batch m on model chunk c (one cell)"
    else:
        forward = "F<m>: forward of micro-batch m (one cell)"
    print(f"legend: {forward}; B: its backward (two cells); dots: idle")
    print(summary(result))
    return 0
