"""torchrun, in one line when a rank fails.

`python -m megatron_fr.orchestrator.torchrun ARGS` takes torchrun's own arguments and runs its
launcher (torch.distributed.run's parse_args and run) in this process. When a learner rank
ends non-zero, torchrun's entry point re-raises ChildFailedError through its `@record`
wrapper: a traceback of the launcher's own frames and a failure table, under the rank's own
error, which already said what went wrong (train_cli.py prints it in a line). Here that
ending is one line naming the rank and its exit code, and the exit code is torchrun's (1)."""

from __future__ import annotations

import signal
import sys


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        code = failure.exitcode
        how = f"code {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"
        print(f"megatron-fr train: learner rank {rank} ended with {how}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
