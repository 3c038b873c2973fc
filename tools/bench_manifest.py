"""What a checkpoint's manifest costs (orchestrator/manifest.py): the seconds to write it (every
file hashed and flushed, the manifest written and renamed) and to check it on resume (every
file hashed again), and the hash's throughput.

Given a checkpoint directory, it is measured on a copy in the system's temporary directory
(its own files are left as they are; the fsyncs cost what that file system charges); without
one, on a synthetic checkpoint of --synthetic-mib of random bytes in 64 MiB files.
Each figure is the median of --repeat runs; the page cache is warm after the first, as it is
when the first rank writes the manifest right after the ranks wrote their files.

    .venv/bin/python tools/bench_manifest.py RUN_DIR/checkpoints/step_00000020
    .venv/bin/python tools/bench_manifest.py --synthetic-mib 1024
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from megatron_fr.orchestrator.manifest import MANIFEST, manifest_problem, write_manifest

FILE_MIB = 64


def synthetic(directory: Path, mib: int) -> None:
    """`mib` MiB of random bytes under directory/learner, FILE_MIB per file."""
    (directory / "learner").mkdir(parents=True)
    for index in range(0, mib, FILE_MIB):
        size = min(FILE_MIB, mib - index) << 20
        (directory / "learner" / f"__{index // FILE_MIB}_0.distcp").write_bytes(os.urandom(size))


def timed(work, repeat: int) -> float:
    seconds = []
    for _ in range(repeat):
        began = time.perf_counter()
        work()
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", nargs="?", type=Path, help="a step directory to measure")
    parser.add_argument("--synthetic-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "step"
        if args.checkpoint is not None:
            shutil.copytree(args.checkpoint, copy, ignore=shutil.ignore_patterns(MANIFEST))
            what = str(args.checkpoint)
        else:
            synthetic(copy, args.synthetic_mib)
            what = f"synthetic, {args.synthetic_mib} MiB"
        files = [p for p in copy.rglob("*") if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        write_s = timed(lambda: write_manifest(copy), args.repeat)
        check_s = timed(lambda: manifest_problem(copy), args.repeat)
        assert manifest_problem(copy) is None
    mib = size / 2**20
    print(f"checkpoint: {what}: {len(files)} files, {mib:.2f} MiB")
    print(f"write manifest (hash + fsync each file, rename): {write_s * 1e3:.1f} ms")
    print(f"check on resume (hash each file):                {check_s * 1e3:.1f} ms")
    print(f"hash throughput (check):                         {mib / check_s:.0f} MiB/s")


if __name__ == "__main__":
    main()
