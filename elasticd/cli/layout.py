"""`elasticd layout`: print the rank groups a world gets."""

from __future__ import annotations

import argparse
import json

from elasticd.layout import DEFAULT_ORDER, ParallelConfig, format_table, plan_world


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "layout",
        help="show the rank groups (tp, pp, dp, cp, ep, ...) planned for a world",
        description="Plan the Megatron-style rank groups for WORLD ranks. dp is derived; "
        "ranks that do not fit become spares.",
    )
    p.add_argument("--world", type=int, required=True, help="ranks available (nodes × nproc)")
    for name, text in (
        ("tp", "tensor-parallel size"),
        ("pp", "pipeline-parallel size"),
        ("vpp", "virtual stages per pipeline stage"),
        ("cp", "context-parallel size"),
        ("ep", "expert-parallel size"),
    ):
        p.add_argument(f"--{name}", type=int, default=1, help=f"{text} (default 1)")
    p.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default tp)")
    p.add_argument("--order", default=DEFAULT_ORDER, help=f"axis order (default {DEFAULT_ORDER})")
    p.add_argument("--global-batch", type=int, default=None, help="samples per step")
    p.add_argument("--micro-batch", type=int, default=None, help="samples per micro-batch")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    parallel = ParallelConfig(
        tp=args.tp, pp=args.pp, vpp=args.vpp, cp=args.cp, ep=args.ep, etp=args.etp, order=args.order
    )
    global_batch, micro_batch = args.global_batch, args.micro_batch
    if global_batch is not None and micro_batch is None:
        micro_batch = 1
    layout = plan_world(args.world, parallel, global_batch=global_batch, micro_batch=micro_batch)
    if args.json:
        print(json.dumps(layout.to_dict(), separators=(",", ":")))
    else:
        print(format_table(layout))
    return 0
