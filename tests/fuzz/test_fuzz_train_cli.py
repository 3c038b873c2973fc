"""Fuzz of `megatron-fr train` and its recipes: seeded bad values for every setting, broken
recipe files, bad arguments and run directories, a broken model directory, launcher variables
set by hand; and good inputs. Every bad one must be refused with one error naming what is
wrong (before any process starts: the command is stopped where it would start torchrun), never
a traceback, a hang or silent acceptance (tests/fuzz/fuzz_harness.py). `pytest -s` shows the
counts."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import string
from pathlib import Path

from fuzz_harness import Case, assert_sound, report, run_case

SEED = 30
INTS = [
    "steps",
    "learner_ranks",
    "task.max_prompt_tokens",
    "task.max_new_tokens",
    "parallel.tensor",
    "parallel.pipeline",
    "parallel.context",
    "parallel.expert",
    "parallel.timeout_minutes",
    "learner.micro_batch_tokens",
    "learner.max_nonfinite_steps",
    "buffer.batch_size",
    "buffer.capacity",
    "buffer.group_size",
    "rollout.max_attempts",
    "rollout.engine.threads",
    "weights.bucket_mib",
    "eval.problems",
    "eval.samples",
    "checkpoint.every_steps",
    "checkpoint.keep",
]
"""Positive integers."""
COUNTS = [
    "buffer.max_lag",
    "eval.every_steps",
    "learner.lr_warmup_steps",
    "task.overlong_buffer_tokens",
    "weights.spot_check",
]
"""Non-negative integers."""
RATES = [
    "learner.lr",
    "learner.adam_eps",
    "rollout.temperature",
    "rollout.request_timeout_s",
    "eval.temperature",
    "eval.timeout_s",
    "weights.timeout_s",
    "rollout.engine.start_timeout_s",
    "rollout.engine.watch_interval_s",
    "rollout.engine.unreachable_after_s",
    "rollout.engine.stalled_after_s",
]
"""Positive floats."""
AMOUNTS = [
    "learner.min_lr",
    "learner.weight_decay",
    "learner.clip_grad",
    "task.overlong_penalty",
    "learner.ppo_clip.eps_low",
    "learner.flash_reinforce.delta",
]
"""Non-negative floats."""
FRACTIONS = [
    "eval.top_p",
    "learner.flash_reinforce.negative_token_fraction",
    "learner.adam_beta1",
    "learner.adam_beta2",
]
CHOICES = [
    "task.truncated",
    "learner.estimator",
    "learner.params_dtype",
    "learner.lr_decay_style",
    "parallel.backend",
    "weights.transport",
    "weights.pause_mode",
    "weights.bucket_format",
]
SWITCHES = ["learner.pack_sequences", "rollout.seeded", "report.tensorboard", "weights.overlap"]
PORTS = ["rollout.engine.port", "weights.master_port"]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 9)))


def bad_values(key: str, rng: random.Random) -> list[str]:
    """Two values (as YAML) the setting `key` must refuse, drawn for its kind."""
    shapes = ['"' + _word(rng) + '"', "[1, 2]", "{a: 1}"]
    if key in INTS:
        pool = [str(-rng.randint(0, 10**6)), str(rng.choice([2**64, 10**30])), "1.5"]
    elif key in COUNTS:
        pool = [str(-rng.randint(1, 10**6)), "2.5", str(10**40)]
    elif key in RATES:
        pool = [
            "0",
            f"-{rng.uniform(0.001, 100):.3f}",
            rng.choice([".inf", ".nan", "-.inf"]),
            rng.choice(["1e300", "1e12"]),
        ]
    elif key in AMOUNTS:
        pool = [f"-{rng.uniform(0.001, 100):.3f}", ".nan", "1e200"]
    elif key in FRACTIONS:
        pool = [f"{rng.uniform(1.01, 9):.3f}", "-0.5", ".nan"]
    elif key in CHOICES:
        pool = ['"' + _word(rng) + '"', str(rng.randint(0, 9))]
    elif key in SWITCHES:
        pool = ['"' + _word(rng) + '"', "[true]"]
    else:  # PORTS
        pool = [str(rng.randint(65_536, 10**6)), "-1"]
    return rng.sample([*pool, rng.choice(shapes)], 2)


def setting_cases(ws: Path, rng: random.Random) -> list[Case]:
    keys = INTS + COUNTS + RATES + AMOUNTS + FRACTIONS + CHOICES + SWITCHES + PORTS + ["seed"]
    cases = []
    for key in keys:
        values = ['"abc"', str(2**70)] if key == "seed" else bad_values(key, rng)
        cases += [check(ws, f"{key}={value}", names=key) for value in values]
    return cases


def check(ws: Path, *overrides: str, names: str | None, recipe: Path | None = None) -> Case:
    argv = ["train", str(recipe or ws / "recipe.yaml"), "--check", *overrides]
    return Case(f"--check {' '.join(overrides)}"[:120], argv, names)


def start(ws: Path, run_dir: str | Path, *overrides: str, names: str | None, **kw) -> Case:
    argv = ["train", str(ws / "recipe.yaml"), "--run-dir", str(run_dir), *overrides]
    return Case(f"--run-dir {str(run_dir)[-40:]!r} {' '.join(overrides)}"[:120], argv, names, **kw)


def semantic_cases(ws: Path) -> list[Case]:
    """Values of the right type that cannot work together, the model or the data."""
    pairs = [
        ("learner_ranks=3", "world size 3"),
        ("parallel.expert=3", "expert"),
        ("parallel.tensor=2", "expert"),
        ("learner.micro_batch_tokens=8", "micro_batch_tokens"),
        ("task.max_new_tokens=100000", "task.max_new_tokens"),
        ("rollout.top_p=0.9", "top_p"),
        (
            ("task.max_new_tokens=100000", "learner.micro_batch_tokens=100127"),
            "max_position_embeddings",
        ),
        (("buffer.batch_size=63", "buffer.group_size=2"), "batch_size"),
        ("learner.estimator=grpo", "group_size"),
        ("weights.transport=disk", "directory"),
        ("task.name=nope", "task.name"),
        ("task.env={bogus: 1}", "task.env.bogus"),
        ("task.train.path=/nonexistent.jsonl", "task.train.path"),
        ("task.eval_sets=[a, b]", "task.eval_sets"),
        ("task.train.prompt_key=nope", "nope"),
        ("model.hf_dir=/nonexistent", "model.hf_dir"),
        ("model.hf_dir=''", "model.hf_dir"),
        ("bogus=1", "bogus"),
        ("learner.lrr=1", "lrr"),
        ("steps.x=1", "steps"),
        ("a..b=1", "a"),
        ("task=3", "task"),
        ("learner=null", "learner"),
        ("=5", "override"),
        ("steps", "steps"),
        ("task.max_prompt_tokens=1", "max_prompt_tokens"),
        ("learner.max_nonfinite_steps=0", "max_nonfinite_steps"),
        ("task.train.limit=0", "task.train.limit"),
        ("buffer.capacity=2", "capacity"),
        ("learner.min_lr=1", "min_lr"),
    ]
    return [check(ws, *(o if isinstance(o, tuple) else (o,)), names=names) for o, names in pairs]


def limit_cases(ws: Path) -> list[Case]:
    """Values of the right type past what the OS or a library takes (the run died of each),
    values of another type that lax parsing would take, and engine URLs that name no
    engine."""
    pairs = [
        ("rollout.engine.threads=2147483648", "rollout.engine.threads"),
        ("rollout.temperature=1e-320", "rollout.temperature"),
        ("eval.temperature=5e-324", "eval.temperature"),
        ("eval.timeout_s=1e-300", "eval.timeout_s"),
        ("rollout.engine.unreachable_after_s=1e-300", "rollout.engine.unreachable_after_s"),
        ("rollout.engine.watch_interval_s=5e-324", "rollout.engine.watch_interval_s"),
        ("rollout.engine.count=1000000", "rollout.engine.count"),
        (("rollout.engine.port=65535", "rollout.engine.count=2"), "rollout.engine.port"),
        ("rollout.engine.file_probes=100000", "rollout.engine.file_probes"),
        ("buffer.max_lag=1000000000000", "buffer.max_lag"),
        ("parallel.timeout_minutes=9223372036854775807", "parallel.timeout_minutes"),
        ("weights.bucket_mib=9007199254740993", "weights.bucket_mib"),
        ("weights.timeout_s=1e-9", "weights.timeout_s"),
        ("task.agent.max_turn_time_s=1e-12", "task.agent.max_turn_time_s"),
        ("steps=true", "steps"),
        ("steps='60'", "steps"),
        ("buffer.batch_size=false", "buffer.batch_size"),
        ("learner.lr='1e-5'", "learner.lr"),
        ("rollout.temperature=true", "rollout.temperature"),
        ("rollout.engine.gpu_ids=[true]", "rollout.engine.gpu_ids"),
        ("report.tensorboard=1", "report.tensorboard"),
        ("model.hf_dir=5", "model.hf_dir"),
    ]
    urls = [
        "file:///etc/passwd",
        "127.0.0.1:30000",
        "http://127.0.0.1:99999",
        "http://127.0.0.1:0",
        "''",
        '"http://127.0.0.1:30000\\n"',
        "http://127.0.0.1:30000/generate",
        "http://user@127.0.0.1:30000",
        "ftp://127.0.0.1:21",
        "http://:30000",
        "'http://[::1'",
        "[http://127.0.0.1:30000, 'http://127.0.0.1:30000/']",
    ]
    pairs += [(f"rollout.engine.urls=[{url.strip('[]')}]", "rollout.engine.urls") for url in urls]
    return [check(ws, *(o if isinstance(o, tuple) else (o,)), names=names) for o, names in pairs]


def recipe_file_cases(ws: Path) -> list[Case]:
    base = (ws / "recipe.yaml").read_text()
    texts = {
        "empty": ("", "steps"),
        "a list": ("- 1\n- 2\n", "mapping"),
        "a scalar": ("42\n", "mapping"),
        "unclosed flow": ("steps: 3\nbuffer: {batch_size: 4\n", "line"),
        "bad indent": ("steps: 3\n  learner: 1\n", "line"),
        "tab indent": ("steps: 3\nlearner:\n\tlr: 1\n", "line"),
        "duplicate top key": (base + "steps: 7\n", "steps"),
        "duplicate nested key": (base.replace("  lr: 3.0e-4", "  lr: 3.0e-4\n  lr: 1.0"), "lr"),
        "eval_sets as a list": (
            base.replace("  eval_sets:\n    heldout:", "  eval_sets:\n  - h:").replace(
                "{path: data/eval.jsonl}", "x"
            ),
            "eval_sets",
        ),
        "deeply nested": ("steps: " + "[" * 20_000 + "]" * 20_000 + "\n", "recipe"),
        "a list as a key": ("steps: 3\n[1, 2]: 4\n", "key"),
        "a number as a key": (base.replace("learner:\n", "learner:\n  7: 1\n"), "key"),
        "a mapping as a key": ("? {a: 1}\n: 2\n", "key"),
        "alias bomb": (
            "a: &a [x, x, x, x, x, x, x, x]\n"
            + "".join(
                f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 8)}]\n"
                for i in range(7)
            ),
            "a",
        ),
    }
    cases = []
    for name, (text, names) in texts.items():
        path = ws / f"broken_{name.replace(' ', '_')}.yaml"  # beside the model and data
        path.write_text(text)
        cases.append(Case(f"recipe: {name}", ["train", str(path), "--check"], names))
    garbage = ws / "garbage.yaml"
    garbage.write_bytes(random.Random(SEED).randbytes(300) + b"\xff\xfe")
    fifo = ws / "fifo.yaml"
    os.mkfifo(fifo)
    for path, names in [
        (garbage, str(garbage)),
        (fifo, str(fifo)),
        (ws, str(ws)),
        (ws / "missing.yaml", "missing.yaml"),
    ]:
        cases.append(Case(f"recipe: {path.name}", ["train", str(path), "--check"], names))
    return cases


def argument_cases(ws: Path) -> list[Case]:
    recipe = str(ws / "recipe.yaml")
    argvs = [
        (["train", recipe, "--check", "--world-size", "-3"], "world"),
        (["train", recipe, "--check", "--world-size", "abc"], "--world-size"),
        (["train", recipe, "--check", "--gpu-mem-gb", "nan"], "--gpu-mem-gb"),
        (["train", recipe, "--check", "--gpu-mem-gb", "-5"], "--gpu-mem-gb"),
        (["train", recipe, "--check", "--gpu-mem-gb", "inf"], "--gpu-mem-gb"),
        (["train", recipe, "--check", "--bogus"], "--bogus"),
        (["train"], "recipe"),
        (["train", recipe], "--run-dir"),
    ]
    return [Case(" ".join(argv[2:]) or "train", argv, names) for argv, names in argvs]


def model_cases(ws: Path) -> list[Case]:
    """A copy of the model directory with one file broken, checked as model.hf_dir."""
    config = json.loads((ws / "model" / "config.json").read_text())
    edits = {
        "config a list": ("config.json", json.dumps([config]), "config.json"),
        "no vocab_size": (
            "config.json",
            json.dumps({k: v for k, v in config.items() if k != "vocab_size"}),
            "vocab_size",
        ),
        "0 heads": (
            "config.json",
            json.dumps(config | {"num_attention_heads": 0}),
            "num_attention_heads",
        ),
        "negative heads": (
            "config.json",
            json.dumps(config | {"num_attention_heads": -4}),
            "num_attention_heads",
        ),
        "size as text": ("config.json", json.dumps(config | {"hidden_size": "64"}), "hidden_size"),
        "0 layers": (
            "config.json",
            json.dumps(config | {"num_hidden_layers": 0}),
            "num_hidden_layers",
        ),
        "vocab below the tokenizer's": (
            "config.json",
            json.dumps(config | {"vocab_size": 16}),
            "vocab_size",
        ),
        "top-k over experts": (
            "config.json",
            json.dumps(config | {"num_experts_per_tok": 9}),
            "num_experts_per_tok",
        ),
        "kv heads not dividing": (
            "config.json",
            json.dumps(config | {"num_attention_heads": 4, "num_key_value_heads": 3}),
            "num_key_value_heads",
        ),
        "eps as text": ("config.json", json.dumps(config | {"rms_norm_eps": "x"}), "rms_norm_eps"),
        "not JSON": ("config.json", '{"vocab_size": 640,', "config.json"),
        "empty config": ("config.json", "", "config.json"),
        "llama": ("config.json", json.dumps(config | {"model_type": "llama"}), "model_type"),
        "rope scaling": (
            "config.json",
            json.dumps(config | {"rope_scaling": {"factor": 4}}),
            "rope_scaling",
        ),
        "short context": (
            "config.json",
            json.dumps(config | {"max_position_embeddings": 10}),
            "max_position_embeddings",
        ),
        "tokenizer garbage": ("tokenizer.json", "{not json", "tokenizer"),
        "stop ids as text": (
            "generation_config.json",
            json.dumps({"eos_token_id": ["x"]}),
            "generation_config.json",
        ),
        "generation config not JSON": ("generation_config.json", "{", "generation_config.json"),
    }
    cases = []
    for name, (file, text, names) in edits.items():
        directory = ws / "models" / name.replace(" ", "_")
        shutil.copytree(ws / "model", directory)
        (directory / file).write_text(text)
        cases.append(check(ws, f"model.hf_dir={directory}", names=names))
    for name, file, names in [
        ("no tokenizer", "tokenizer.json", "tokenizer"),
        ("no chat template", "chat_template.jinja", "chat template"),
    ]:
        directory = ws / "models" / name.replace(" ", "_")
        shutil.copytree(ws / "model", directory)
        (directory / file).unlink()
        cases.append(check(ws, f"model.hf_dir={directory}", names=names))
    directory = ws / "models" / "config_a_directory"
    shutil.copytree(ws / "model", directory)
    (directory / "config.json").unlink()
    (directory / "config.json").mkdir()
    cases.append(check(ws, f"model.hf_dir={directory}", names="config.json"))
    return cases


def run_dir_cases(ws: Path) -> list[Case]:
    stopped = ws / "runs" / "stop_dir"
    (stopped / "STOP").mkdir(parents=True)
    blocked = ws / "runs" / "a_file"
    blocked.write_text("x")
    ruined = ws / "runs" / "ruined"
    (ruined / "checkpoints" / "step_00000002").mkdir(parents=True)
    (ruined / "checkpoints" / "latest").write_text("step_00000002\n")
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    return [
        *run_dir_shape_cases(ws),
        start(ws, "/proc/megatron-fr-run", names="--run-dir"),
        start(ws, blocked, names="--run-dir"),
        start(ws, blocked / "sub", names="--run-dir"),
        start(ws, "runs/a\x00b", names="--run-dir"),
        start(ws, ws / ("x" * 300), names="--run-dir"),
        start(ws, stopped, names="STOP"),
        start(ws, ruined, names="checkpoint"),
        start(
            ws,
            ws / "runs" / "fresh_1",
            f"rollout.engine.urls=[http://127.0.0.1:{port}]",
            "rollout.engine.start_timeout_s=2",
            names="rollout.engine.urls",
        ),
        start(
            ws,
            ws / "runs" / "fresh_2",
            "rollout.engine.urls=[not-a-url]",
            names="rollout.engine.urls",
        ),
        start(
            ws,
            ws / "runs" / "fresh_3",
            "learner.micro_batch_tokens=100",
            names="micro_batch_tokens",
        ),
    ]


def run_dir_shape_cases(ws: Path) -> list[Case]:
    """Run directories whose parts the run would die of at their first write."""
    shapes = ws / "runs" / "shapes"
    shapes.mkdir(parents=True)
    (shapes / "loop").symlink_to(shapes / "loop")
    parts = {
        "metrics_dir": ("metrics.jsonl", lambda part: part.mkdir()),
        "checkpoints_file": ("checkpoints", lambda part: part.write_text("x")),
        "checkpoints_loop": ("checkpoints", lambda part: part.symlink_to(part)),
        "logs_dangling": ("logs", lambda part: part.symlink_to(shapes / "gone")),
        "faults_fifo": ("faults.jsonl", os.mkfifo),
        "tensorboard_file": ("tensorboard", lambda part: part.write_text("x")),
    }
    cases = [start(ws, shapes / "loop", names="symlink loop")]
    for name, (part, make) in parts.items():
        (shapes / name).mkdir()
        make(shapes / name / part)
        cases.append(start(ws, shapes / name, names=part))
    return cases


def launcher_cases(ws: Path) -> list[Case]:
    """Launcher variables set by hand, outside torchrun: refused, never a wait for peers."""
    port = str(socket.create_server(("127.0.0.1", 0)).getsockname()[1])
    envs = [
        ({"WORLD_SIZE": "2", "RANK": "0"}, "WORLD_SIZE"),
        (
            {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
            "WORLD_SIZE",
        ),
        ({"WORLD_SIZE": "abc", "RANK": "0"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}, "RANK"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
    ]
    argv = ["train", str(ws / "recipe.yaml"), "--run-dir", str(ws / "runs" / "env")]
    return [Case(f"env {env}", argv, names, env=env, deadline_s=90) for env, names in envs]


def address_cases(ws: Path) -> list[Case]:
    """parallel.data_address: a host name or an IP address, no port, no whitespace; each of
    these was "recipe OK" and would have failed every node at the run's start."""
    bad = [
        "'garbage!!'",
        "999.1.1.1",
        "1.2.3",
        "''",
        "a" * 100_000,
        "127.0.0.1:80",
        '"a\\nb"',
        "'a b'",
        "'[::1]'",
        "-node",
        "node-.x",
        "'http://node1'",
        "'nöde'",
        "'10.0.0.1/24'",
        "." + "a" * 64,
        "5",
        "[node1]",
    ]
    cases = [check(ws, f"parallel.data_address={value}", names="data_address") for value in bad]
    good = ["10.0.0.5", "node001", "'::1'", "gpu-node-3.cluster.local", "localhost", "node_7"]
    return cases + [check(ws, f"parallel.data_address={value}", names=None) for value in good]


def rehearse_cases(ws: Path) -> list[Case]:
    """--rehearse and the flags only it reads: the world and the layout refused before
    anything is built (a world of 10**9 grew to 20 GB), a skew out of range, and the
    rehearsal's flags given to --check or to a run, where they mean nothing."""
    recipe = str(ws / "recipe.yaml")
    rehearse = ["train", recipe, "--rehearse"]
    argvs = [
        ([*rehearse, "--world-size", "1000000000"], "--world-size"),
        ([*rehearse, "--world-size", "65537"], "--world-size"),
        (["train", recipe, "--check", "--world-size", "1000000000"], "--world-size"),
        ([*rehearse, "--world-size", "3"], "--world-size"),
        ([*rehearse, "--skew", "-5"], "--skew"),
        ([*rehearse, "--skew", "inf"], "--skew"),
        ([*rehearse, "--skew", "nan"], "--skew"),
        ([*rehearse, "--skew", "1e9"], "--skew"),
        ([*rehearse, "--skew", "x"], "--skew"),
        ([*rehearse, "--rank", "5"], "--rank"),
        ([*rehearse, "--rank", "-1"], "--rank"),
        ([*rehearse, "--rank", "2", "--world-size", "2"], "--rank"),
        ([*rehearse, "--rank", "1", "--stages"], "--stages"),
        ([*rehearse, "--layers", "-1"], "--layers"),
        ([*rehearse, "--layers", "99"], "--layers"),
        ([*rehearse, "parallel.expert=3"], "expert"),
        (["train", recipe, "--check", "--rank", "5"], "--rank"),
        (["train", recipe, "--check", "--rank", "0"], "--rank"),
        (["train", recipe, "--check", "--skew", "1"], "--skew"),
        (["train", recipe, "--check", "--layers", "2"], "--layers"),
        (["train", recipe, "--check", "--cpu-kernels"], "--cpu-kernels"),
        (["train", recipe, "--check", "--stages"], "--stages"),
        (["train", recipe, "--run-dir", str(ws / "runs" / "r_rank"), "--rank", "1"], "--rank"),
    ]
    return [Case(" ".join(argv[2:])[:120], argv, names) for argv, names in argvs]


def good_cases(ws: Path, rng: random.Random) -> list[Case]:
    overrides = [
        [],
        ["learner.flash_reinforce.delta=.inf"],
        ["eval.every_steps=0"],
        [f"learner.lr={rng.choice(['1e-5', '2.5e-4', '0.01'])}"],
        ["learner.estimator=grpo", "buffer.group_size=2"],
        ["report.tensorboard=false"],
        ["learner.pack_sequences=false"],
        ["rollout.seeded=true"],
        ["eval.top_p=0.95"],
        ["rollout.engine.urls=[]"],
        [f"seed={rng.randint(0, 2**40)}"],
        ["task.eval_sets={}"],
        ["weights.transport=disk", "weights.directory=/tmp/w"],
        ["learner.lr=1e-5", "rollout.temperature=1", "eval.timeout_s=60"],
        ["rollout.engine.urls=[http://localhost:30000/, 'https://[::1]:8443']"],
        ["rollout.engine.threads=2", "rollout.engine.count=2", "buffer.max_lag=3"],
    ]
    cases = [check(ws, *o, names=None) for o in overrides]
    cases.append(start(ws, ws / "runs" / "fresh_ok", names=None))
    return cases


def corpus(ws: Path, seed: int) -> list[Case]:
    rng = random.Random(seed)
    return [
        *setting_cases(ws, rng),
        *semantic_cases(ws),
        *limit_cases(ws),
        *recipe_file_cases(ws),
        *argument_cases(ws),
        *model_cases(ws),
        *run_dir_cases(ws),
        *launcher_cases(ws),
        *address_cases(ws),
        *rehearse_cases(ws),
        *good_cases(ws, rng),
    ]


def test_fuzz_train_cli_and_recipes(workspace, no_torchrun):
    from megatron_fr.cli import main

    seed = int(os.environ.get("FUZZ_SEED", SEED))
    results = [run_case(case, main) for case in corpus(workspace, seed)]
    assert_sound(report("train CLI + recipes", seed, results))
