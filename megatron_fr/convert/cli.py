"""`convert_checkpoint` / `megatron-fr convert`: HF <-> megatron checkpoints, and a logit check.

hf-to-megatron --hf-dir D --out O          HF safetensors -> megatron torch_dist (any layout)
megatron-to-hf --megatron-dir O --out D2   -> sharded safetensors + index + config.json
verify --hf-dir D [--megatron-dir O] [--tp N --ep N --etp N --pp N]
                                           max |dlogit| vs transformers; exit 1 above --tolerance
                                           (no --megatron-dir: each rank loads D's files directly)
"""

from __future__ import annotations

import argparse
import math
import re
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_fr.convert.checkpoint import ConversionReport
    from megatron_fr.models.hf_config import HFModelSpec

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]?B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def parse_size(text: str) -> int:
    """'5GB', '500MB', '1024' -> bytes (decimal units, as save_pretrained's max_shard_size)."""
    match = _SIZE.match(text)
    size = int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()]) if match else 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 5GB, 500MB)")
    return size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="direction", required=True, metavar="ACTION")
    to_megatron = commands.add_parser(
        "hf-to-megatron", help="HF safetensors directory -> megatron torch_dist checkpoint"
    )
    to_megatron.add_argument("--hf-dir", required=True, help="directory with config.json")
    to_megatron.add_argument("--out", required=True, help="new directory (must not exist)")
    to_megatron.set_defaults(action=_hf_to_megatron)

    to_hf = commands.add_parser(
        "megatron-to-hf", help="megatron torch_dist checkpoint -> HF sharded safetensors"
    )
    to_hf.add_argument("--megatron-dir", required=True)
    to_hf.add_argument("--out", required=True, help="new directory (must not exist)")
    to_hf.add_argument(
        "--hf-config-dir",
        help="take config.json (and tokenizer files) from here instead of the checkpoint's "
        "own hf_config.json",
    )
    to_hf.add_argument(
        "--max-shard-size", type=parse_size, default="5GB", help="per file (default 5GB)"
    )
    to_hf.set_defaults(action=_megatron_to_hf)

    verify = commands.add_parser(
        "verify", help="run both models on the same tokens, print max |dlogit|"
    )
    verify.add_argument("--hf-dir", required=True)
    verify.add_argument(
        "--megatron-dir",
        help="the converted checkpoint; omit it to check the direct load: every rank reads its "
        "own slices of --hf-dir, as a run started from an HF directory does",
    )
    for flag, what in (("tp", "tensor"), ("ep", "expert"), ("pp", "pipeline")):
        verify.add_argument(f"--{flag}", type=int, default=1, help=f"{what} parallel size")
    verify.add_argument("--etp", type=int, default=None, help="expert tensor parallel (= tp)")
    verify.add_argument("--seq", type=int, default=16, help="tokens per sequence (default 16)")
    verify.add_argument(
        "--tolerance", type=float, default=1e-4, help="max |dlogit| allowed (default 1e-4)"
    )
    verify.set_defaults(action=_verify)


def _summary(what: str, report: ConversionReport, started: float) -> None:
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"{what}: {report.tensors} tensors, {report.bytes / 2**30:.3f} GiB {report.dtype}, "
        f"{time.monotonic() - started:.1f} s, peak RSS {peak_gib:.2f} GiB"
    )


def _hf_to_megatron(args: argparse.Namespace) -> int:
    from megatron_fr.convert.checkpoint import hf_to_megatron_checkpoint

    started = time.monotonic()
    report = hf_to_megatron_checkpoint(args.hf_dir, args.out)
    _summary(f"wrote {args.out}", report, started)
    return 0


def _megatron_to_hf(args: argparse.Namespace) -> int:
    from megatron_fr.convert.checkpoint import megatron_to_hf_checkpoint

    started = time.monotonic()
    report = megatron_to_hf_checkpoint(
        args.megatron_dir,
        args.out,
        hf_config_dir=args.hf_config_dir,
        max_shard_bytes=args.max_shard_size,
    )
    _summary(f"wrote {args.out}", report, started)
    return 0


def _verify(args: argparse.Namespace) -> int:
    from megatron_fr.convert.checkpoint import read_hf_config
    from megatron_fr.convert.dcp_files import megatron_checkpoint_problem
    from megatron_fr.convert.verify import verify_checkpoint, verify_layout

    _check_verify_arguments(args)
    spec = read_hf_config(Path(args.hf_dir) / "config.json")
    if not args.seq <= spec.max_position_embeddings:
        raise ValueError(
            f"--seq {args.seq}: over the model's context "
            f"({spec.max_position_embeddings}, max_position_embeddings)"
        )
    parallel = verify_layout(spec, args.tp, args.ep, args.etp, args.pp)
    if args.megatron_dir is not None:
        problem = megatron_checkpoint_problem(Path(args.megatron_dir))
        if problem is not None:
            raise ValueError(f"--megatron-dir: {problem}")
        _check_same_model(Path(args.megatron_dir), spec, args.hf_dir)
    error = verify_checkpoint(args.hf_dir, args.megatron_dir, parallel, seq=args.seq)
    verdict = "OK" if error <= args.tolerance else "FAIL"
    layout = f"tp{args.tp} ep{args.ep} etp{parallel.effective_expert_tensor} pp{args.pp}"
    print(f"max |dlogit| = {error:.3e} at {layout} (tolerance {args.tolerance:g}): {verdict}")
    return 0 if verdict == "OK" else 1


def _check_same_model(megatron_dir: Path, spec: HFModelSpec, hf_dir: str) -> None:
    """The checkpoint is of the model --hf-dir describes (the HF config it was converted
    from, kept beside it): a checkpoint of another model is refused before any rank loads
    it, naming the settings that differ."""
    import dataclasses

    from megatron_fr.convert.checkpoint import HF_CONFIG_NAME, read_hf_config

    stored = megatron_dir / HF_CONFIG_NAME
    if not stored.is_file():
        return
    theirs = read_hf_config(stored)
    differ = [
        f"{field.name} {getattr(theirs, field.name)!r} vs {getattr(spec, field.name)!r}"
        for field in dataclasses.fields(spec)
        if getattr(theirs, field.name) != getattr(spec, field.name)
    ]
    if differ:
        raise ValueError(
            f"--megatron-dir {megatron_dir} is a checkpoint of another model than --hf-dir "
            f"{hf_dir} ({stored.name} vs config.json: {'; '.join(differ[:4])})"
        )


def _check_verify_arguments(args: argparse.Namespace) -> None:
    etp = 1 if args.etp is None else args.etp
    sizes = {"--tp": args.tp, "--ep": args.ep, "--pp": args.pp, "--etp": etp}
    for flag, size in {**sizes, "--seq": args.seq}.items():
        if size < 1:
            raise ValueError(f"{flag} {size}: must be at least 1")
    if not (math.isfinite(args.tolerance) and args.tolerance >= 0):
        raise ValueError(f"--tolerance {args.tolerance}: must be a finite number >= 0")


def run(args: argparse.Namespace) -> int:
    """Run the chosen action; bad input is one line on stderr and exit status 2."""
    try:
        return args.action(args)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="convert_checkpoint",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
