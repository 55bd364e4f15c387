"""`elasticd data prepare`: turn text files into a token file the trainer memory-maps."""

from __future__ import annotations

import argparse
import os

from elasticd.errors import UsageError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "data",
        help="prepare training data",
        description="Prepare training data for the built-in trainer.",
    )
    inner = p.add_subparsers(dest="data_command", metavar="ACTION", parser_class=type(p))
    inner.required = True
    prep = inner.add_parser(
        "prepare",
        help="tokenize text files (byte-level, vocab 256) into one token file",
        description="Tokenize TEXT_FILES with the byte-level tokenizer (vocab 256, no "
        "downloads) and write one memory-mappable token file for `data: {source: file}`.",
    )
    prep.add_argument("texts", nargs="+", metavar="TEXT_FILE", help="UTF-8 or any bytes")
    prep.add_argument("-o", "--output", required=True, metavar="OUT", help="token file to write")
    prep.set_defaults(func=run_prepare)


def run_prepare(args: argparse.Namespace) -> int:
    # The trainer is imported here only: nothing else in elasticd depends on it.
    from trainer.data import byte_tokens, write_token_file
    from trainer.errors import TrainerError

    blobs = []
    for path in args.texts:
        try:
            with open(path, "rb") as fh:
                blobs.append(fh.read())
        except OSError as exc:
            raise UsageError(f"data prepare: cannot read {path}: {exc.strerror or exc}") from exc
    tokens = byte_tokens(blobs)
    if tokens.size < 2:
        raise UsageError("data prepare: the input holds fewer than 2 tokens")
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        raise UsageError(f"data prepare: {out_dir} is not a directory")
    try:
        header = write_token_file(args.output, tokens, vocab=256, tokenizer="bytes")
    except (OSError, TrainerError) as exc:
        raise UsageError(f"data prepare: cannot write {args.output}: {exc}") from exc
    print(
        f"wrote {args.output}: {header['count']} tokens ({header['dtype']}, vocab "
        f"{header['vocab']}) from {len(args.texts)} file{'s' if len(args.texts) != 1 else ''}"
    )
    return 0
