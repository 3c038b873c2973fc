"""What a dead or wedged engine leaves the weight sync: the NCCL group is constructed so that a
failed collective aborts its communicator instead of the learner, and an engine that does not
leave its old groups in time is named as dead within weights.regroup_timeout_s, whatever the
others do. (A receiver killed in the middle of a broadcast, on gloo with SGLang's own receiving
code: tests/distributed/test_weight_group.py.)"""

from __future__ import annotations

import os
import time

import pytest
from stub_server import StubServer
from torch.distributed.distributed_c10d import _world

from megatron_fr.config import WeightSyncConfig
from megatron_fr.engine import group as group_module
from megatron_fr.engine.http import EngineRequestError
from megatron_fr.utils.net import free_port
from megatron_fr.weights.sync import WeightSync
from megatron_fr.weights.transports import Engine

ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
CLEAN_UP_ONLY = (
    "2"  # torch's ErrorHandlingMode (ProcessGroupNCCL.hpp): abort comms, keep the process
)


class Recorded:
    """Stands for the constructed group (hashable, as torch's registry needs)."""


CPU_ENGINE_INFO = {"tp_size": 1, "dp_size": 1, "pp_size": 1, "engine": "megatron-fr-cpu"}


@pytest.mark.parametrize("backend, during", [("nccl", CLEAN_UP_ONLY), ("gloo", "3")])
def test_only_the_weight_groups_nccl_communicator_is_built_to_abort_not_to_tear_down(
    monkeypatch, backend, during
):
    """torch reads TORCH_NCCL_ASYNC_ERROR_HANDLING when it constructs a ProcessGroupNCCL; its
    default (3) tears the process down on a timeout. The weight group is constructed under 2
    (CleanUpOnly) and the variable is restored after, so the learner's own groups keep what
    the user set (here 3); a gloo group is constructed under the user's value untouched."""
    seen = {}

    def construct(world_size, rank, ranks, backend_name, store, **options):
        seen.update(backend=str(backend_name), handling=os.environ.get(ERROR_HANDLING))
        seen.update(timeout=options["timeout"].total_seconds())
        return Recorded(), None

    monkeypatch.setenv(ERROR_HANDLING, "3")
    monkeypatch.setattr(group_module, "_new_process_group_helper", construct)
    made = group_module.create_weight_update_group(
        "127.0.0.1", free_port(), 2, "g", backend, timeout_s=42
    )
    try:
        # NCCL: the watchdog's timeout past the wait's bound, so the wait aborts first
        margin = group_module.WATCHDOG_MARGIN_S if backend == "nccl" else 0.0
        assert seen == {"backend": backend, "handling": during, "timeout": 42.0 + margin}
        assert os.environ[ERROR_HANDLING] == "3"
        assert made.timeout.total_seconds() == 42.0  # the broadcast's wait is bounded by it
    finally:
        del _world.pg_group_ranks[made.group]


def test_the_variable_is_removed_again_when_the_user_had_not_set_it(monkeypatch):
    monkeypatch.delenv(ERROR_HANDLING, raising=False)
    with group_module.construction_environment("nccl"):
        assert os.environ[ERROR_HANDLING] == CLEAN_UP_ONLY
    assert ERROR_HANDLING not in os.environ


def test_the_weight_group_arms_no_process_wide_dump_or_termination(monkeypatch):
    """Under construction: no monitoring, no dump, a heartbeat bound no sync reaches and a 1 s
    dump wait (4 s before the watchdog's abort); all restored after. The learner's process
    defaults TORCH_NCCL_DUMP_ON_TIMEOUT to 0 and keeps a value the user set
    (docs/weight-sync.md)."""
    names = [name for name in group_module.NCCL_GROUP_ENV if name != ERROR_HANDLING]
    for name in names:
        monkeypatch.delenv(name, raising=False)
    with group_module.construction_environment("nccl"):
        assert os.environ["TORCH_NCCL_ENABLE_MONITORING"] == "0"
        assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
        assert int(os.environ["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"]) >= 7 * 24 * 3600
        assert os.environ["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] == "1000"
    assert not any(name in os.environ for name in names)
    process: dict[str, str] = {}
    group_module.match_sglang_nccl_env(process)
    assert process["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    user = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    group_module.match_sglang_nccl_env(user)
    assert user["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


def test_an_engine_that_does_not_leave_its_old_groups_is_named_dead_within_the_bound(tmp_path):
    """A wedged SGLang scheduler answers /server_info (the HTTP process) but not a destroy of
    the group it is stuck in. The connect names it as dead after regroup_timeout_s, while the
    engine that answered is not held up, and the pool is told once."""
    groups_file = tmp_path / "weight_groups.json"
    groups_file.write_text('{"groups": ["weight_update_group_old_pp0"]}\n')
    answers = {
        "/server_info": [(200, CPU_ENGINE_INFO)],
        "/pause_generation": [(200, {})],  # before ending a session that may be open
        "/end_weight_update": [(400, {"error": "no update session open"})],
        "/destroy_weights_update_group": [(200, {"success": True})],
    }
    wedged_on = frozenset({"/destroy_weights_update_group"})
    with StubServer(answers) as alive, StubServer(answers, hang=wedged_on) as wedged:
        config = WeightSyncConfig(regroup_timeout_s=1.5, timeout_s=120)
        engines = [Engine(alive.url), Engine(wedged.url)]
        sync = WeightSync(config, engines, spec=None, groups_file=groups_file)  # type: ignore[arg-type]
        began = time.monotonic()
        with pytest.raises(EngineRequestError, match="treated as dead") as failure:
            sync._adopt()
        took = time.monotonic() - began
        assert wedged.url in str(failure.value) and alive.url not in str(failure.value)
        assert 1.5 <= took < 1.5 + 2.0, took  # the bound, not weights.timeout_s
        assert sync.take_unresponsive() == [wedged.url]
        assert sync.take_unresponsive() == []  # handed to the pool once
        assert alive.calls.count("/destroy_weights_update_group") == 1

        healthy = WeightSync(config, [Engine(alive.url)], spec=None, groups_file=groups_file)  # type: ignore[arg-type]
        assert [engine.url for engine in healthy._adopt()] == [alive.url]
        assert healthy.take_unresponsive() == []


def test_an_engine_that_answers_with_an_error_is_not_taken_for_dead():
    answers = {
        "/server_info": [(200, CPU_ENGINE_INFO)],
        "/pause_generation": [(200, {})],
        "/end_weight_update": [(500, {"error": "internal"})],
    }
    with StubServer(answers) as broken:
        sync = WeightSync(WeightSyncConfig(regroup_timeout_s=5), [Engine(broken.url)], spec=None)  # type: ignore[arg-type]
        with pytest.raises(EngineRequestError) as failure:
            sync._adopt()
        assert failure.value.status == 500
        assert sync.take_unresponsive() == []
