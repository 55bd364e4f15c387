"""`elasticd report`: a run's output directory as a picture and one HTML page."""

from __future__ import annotations

import argparse
import os


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="draw a run: loss, throughput, world, faults, recoveries, checkpoint times",
        description="Read a job's output_dir (metrics.jsonl, events.jsonl, and run.json "
        "from `elasticd run`) and draw loss and tokens/s over steps with world changes, "
        "faults and recoveries marked, a bar per recovery split into its parts, and the "
        "checkpoint save and load times, into one HTML page (and a PNG with --png).",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the job's output_dir")
    p.add_argument("-o", "--output", default=None, metavar="HTML",
                   help="the page to write (default RUN_DIR/report.html)")  # fmt: skip
    p.add_argument("--png", nargs="?", const="", default=None, metavar="PNG",
                   help="also write the picture as a PNG (default RUN_DIR/report.png)")  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from elasticd.report import load_run, png_bytes, write_html, write_png

    report = load_run(args.run_dir)
    out = args.output or os.path.join(args.run_dir, "report.html")
    picture = png_bytes(report)
    write_html(report, out, png=picture)
    print(f"report: {out}")
    if args.png is not None:
        path = args.png or os.path.join(args.run_dir, "report.png")
        write_png(report, path, png=picture)
        print(f"picture: {path}")
    return 0
