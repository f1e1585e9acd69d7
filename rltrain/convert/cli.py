"""``rltrain convert`` / ``python -m rltrain.convert.cli``: HF ↔ Megatron checkpoint conversion.

Subcommands::

    hf-to-mcore   SRC_HF_DIR  DST_MCORE_DIR --tp N --pp N --ep N
    mcore-to-hf   SRC_MCORE_DIR DST_HF_DIR  [--tp/--pp/--ep: layout of the logits check]
    mcore-to-mcore SRC_MCORE_DIR DST_MCORE_DIR --tp N --pp N --ep N   (reshard)

SRC_MCORE_DIR holds ``latest`` (a conversion's output, or a run's ``checkpoints/step_N/actor``);
the model's HF config and tokenizer come from ``SRC_MCORE_DIR/hf`` or ``--hf-config DIR``.

By default the result is verified (bit-exact round trip of every tensor; logits vs transformers on
a probe batch of hundreds of tokens, both computed in the checkpoint's dtype, within ``--atol`` plus
three times that dtype's rounding noise for the model: how far transformers' own logits move from
running in the next wider dtype, fp32 for bf16, fp64 for fp32) and the verification is printed; ``--no-verify`` skips it. The output appears at DST only
when conversion and verification succeeded. DST must be new or empty; ``--overwrite`` clears it
first. Bad input (unreadable files, an unsupported model family, a layout the model cannot take, a
non-empty DST) is refused before any rank starts. Every failure the user can act on is one line
naming the culprit, with exit status 1. Conversion and the round-trip check stream one tensor at a
time; only the logits check holds the model (each rank its shard), so ``--no-logits`` keeps the
whole run at about the largest tensor's memory.

Importing this module costs no torch (``rltrain --help`` stays quick); ``run`` imports the launcher.
"""

from __future__ import annotations

import argparse
import sys

from rltrain.convert.report import MODES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    modes = parser.add_subparsers(dest="mode", required=True)
    for mode in MODES:
        sub = modes.add_parser(mode, help=f"convert {mode.replace('-to-', ' → ')}")
        sub.add_argument("src", help="source checkpoint directory")
        sub.add_argument("dst", help="output directory")
        layout = mode != "mcore-to-hf"
        for flag, what in (("--tp", "tensor"), ("--pp", "pipeline"), ("--ep", "expert")):
            sub.add_argument(
                flag,
                type=_positive_int,
                default=1,
                help=f"{what}-parallel size of the {'target' if layout else 'logits-check'} layout",
            )
        sub.add_argument(
            "--etp",
            type=_positive_int,
            default=None,
            help="expert tensor-parallel size of MoE experts (default: --tp)",
        )
        for flag, which in (("first", "first"), ("last", "last")):
            sub.add_argument(
                f"--decoder-{flag}-pipeline-num-layers",
                type=_positive_int,
                default=None,
                help=f"decoder layers on the {which} pipeline stage (uneven PP; default an even split)",
            )
        if mode != "hf-to-mcore":
            sub.add_argument(
                "--hf-config",
                default=None,
                help="HF config/tokenizer directory of the model (default: SRC/hf, which conversions "
                "and the trainer's actor checkpoints carry)",
            )
        sub.add_argument("--overwrite", action="store_true", help="clear a non-empty DST first")
        sub.add_argument("--no-verify", action="store_true", help="skip the round-trip and logits checks")
        sub.add_argument(
            "--atol",
            type=float,
            default=1e-4,
            help="max abs logit difference allowed on top of 3x the dtype's rounding noise for the model",
        )
        sub.add_argument("--no-logits", action="store_true", help="verify the round trip only")


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of 1 or more, got {text!r}")
    return int(text)


def add_subparser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``convert`` on a parent CLI; the parser's ``func`` runs it and returns the exit code."""
    parser = subparsers.add_parser("convert", help="convert checkpoints between HF and Megatron layouts")
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from rltrain.convert.launch import run_conversion

    try:
        report = run_conversion(
            args.mode,
            args.src,
            args.dst,
            tp=args.tp,
            pp=args.pp,
            ep=args.ep,
            verify=not args.no_verify,
            atol=None if args.no_logits else args.atol,
            hf_config_dir=getattr(args, "hf_config", None),
            overwrite=args.overwrite,
            first_stage_layers=args.decoder_first_pipeline_num_layers,
            last_stage_layers=args.decoder_last_pipeline_num_layers,
            etp=args.etp,
        )
    except RuntimeError as err:  # ConversionError: one line; a bug: the failing rank's traceback
        print(f"convert {args.mode} failed: {err}", file=sys.stderr)
        return 1
    print(report.summary())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rltrain convert", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
