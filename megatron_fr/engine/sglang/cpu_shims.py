"""What real SGLang 0.5.23 needs to start on a machine without CUDA, in SGLang's own
environment (.venv-sglang, tools/setup_sglang_cpu.sh), and nothing else.

Run as `python -m megatron_fr.engine.sglang.cpu_shims <sglang.launch_server flags>` (the
launcher does, engine/sglang/launch.py): the shims below are applied when this module is
imported, then what sglang/launch_server.py runs as a script runs in this process, this module
staying the main module. SGLang starts its scheduler and detokenizer with multiprocessing's
"spawn" (srt/entrypoints/engine.py), which imports the parent's main module again in each
child, so every SGLang process gets the shims before it imports any of SGLang (runpy would make
sglang.launch_server the main module, imported by the children before any shim). `--check`
imports SGLang's HTTP server and scheduler with the shims and exits (the setup script's last
step).

The two shims, each because an import fails, never to change what runs:

1. `sgl_kernel`. With SGLANG_USE_CPU_ENGINE=1 (without it `--device cpu` is not SGLang's CPU
   path: model construction imports vllm._custom_ops), SGLang imports CPU kernels of its
   kernel package by name at module load (srt/mem_cache/allocation.py,
   kernels/ops/kvcache/cache_move.py, the speculative-decoding modules, ...). No CPU build of
   that package exists on PyPI (sglang-kernel is the CUDA build). The stand-in has exactly the
   names imported (SGL_KERNEL_NAMES); calling any of them raises ShimCalled, so a code path
   that would need a real kernel fails at once, naming it, instead of computing something
   else. None is called by the project's use (a dense model, no speculative decoding: the
   tier passes with them). SGLang's compute kernels on CPU (rmsnorm, silu_and_mul, the
   packed GEMMs) are used only when `torch.ops.sgl_kernel.convert_weight_packed` exists
   (srt/utils/common.py: cpu_has_amx_support); the stand-in registers no operator, so every
   layer takes its torch-native path, on any processor.
2. torchvision's two operator schemas. SGLang imports torchvision unconditionally
   (srt/multimodal/internvl_utils.py, through srt/configs). PyPI's torchvision is built
   against CUDA torch: beside the CPU torch its compiled operators fail to load (quietly), and
   then torchvision/_meta_registrations.py registers fake kernels for `torchvision::nms` and
   `torchvision::qnms` on operators that do not exist and raises. Defining the two schemas
   (as torchvision's own C++ defines them) before torchvision is imported lets that import
   finish; no torchvision operator runs (text models only), and calling one raises (no
   kernel is registered for them).
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types
from collections.abc import Callable

SGL_KERNEL_NAMES = (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
)
"""The names SGLang 0.5.23 imports from sgl_kernel at module load on its CPU path (found by
starting the server: a name missing from here fails that import, naming it)."""

TORCHVISION_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_libraries: list[object] = []
"""The torch.library.Library objects defining the schemas: a schema lives as long as its
Library object."""


class ShimCalled(RuntimeError):
    """A stand-in for an SGLang kernel with no CPU build was called."""


def _stand_in(name: str) -> Callable[..., None]:
    def refuse(*args: object, **kwargs: object) -> None:
        raise ShimCalled(
            f"sgl_kernel.{name} was called, but it is a stand-in (megatron_fr/engine/sglang/"
            "cpu_shims.py): this SGLang code path needs a kernel with no CPU build"
        )

    refuse.__name__ = name
    return refuse


def _missing(name: str) -> object:
    raise AttributeError(
        f"sgl_kernel stand-in (megatron_fr/engine/sglang/cpu_shims.py) has no {name!r}: SGLang "
        "imports a kernel the shim does not know; add it to SGL_KERNEL_NAMES only if it is "
        "never called on the project's path"
    )


def install_sgl_kernel_stand_in() -> None:
    """Make `import sgl_kernel` give the stand-in (shim 1 of the module docstring)."""
    if "sgl_kernel" in sys.modules:
        return
    module = types.ModuleType("sgl_kernel", "stand-in: megatron_fr/engine/sglang/cpu_shims.py")
    module.__spec__ = importlib.machinery.ModuleSpec("sgl_kernel", None)
    for name in SGL_KERNEL_NAMES:
        setattr(module, name, _stand_in(name))
    setattr(module, "__getattr__", _missing)  # noqa: B010 (a module's PEP 562 hook)
    sys.modules["sgl_kernel"] = module


def define_torchvision_schemas() -> None:
    """Define torchvision::nms and ::qnms before torchvision loads (shim 2)."""
    import torch

    if _libraries or hasattr(torch.ops.torchvision, "nms"):
        return
    library = torch.library.Library("torchvision", "DEF")
    for schema in TORCHVISION_SCHEMAS:
        library.define(schema)
    _libraries.append(library)


def apply() -> None:
    """Both shims; only where there is no CUDA build of torch (a GPU machine needs none)."""
    import torch

    if torch.version.cuda:
        return
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    install_sgl_kernel_stand_in()
    define_torchvision_schemas()


apply()


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        import sglang.srt.entrypoints.http_server
        import sglang.srt.managers.scheduler  # noqa: F401

        print("cpu_shims: sglang imports on this CPU machine")
        return 0
    # What `python -m sglang.launch_server` runs, with this module kept as the main module:
    # SGLang's spawned processes import the main module again, and must get the shims first.
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
