"""The supervised warm start: a loadable Qwen3-MoE directory, a falling loss, reuse for the
same arguments, retraining for others, and generation/reward checked against an oracle; for
the text task, chat-rendered prompts checked against transformers' apply_chat_template, the
tokenizer saved with the model, and greedy decoding checked against transformers' generate."""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError
from token_arithmetic import EOS_ID, VOCAB_SIZE, TokenArithmetic, decode, encode, model_config

from megatron_fr.demo import warm_start as warm_start_module
from megatron_fr.demo.arithmetic import ArithmeticConfig
from megatron_fr.demo.config import WarmStartConfig
from megatron_fr.demo.text_math import TextMathConfig, TextMathTask, build_text_math_task
from megatron_fr.demo.tiny_models import tiny_chat_model_config
from megatron_fr.demo.warm_start import MARKER, generate, mean_reward, warm_start
from megatron_fr.rollout.chat import load_chat

SHORT = WarmStartConfig(steps=40, batch_size=16, lr=5e-3)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One short warm start shared by the tests that only read it."""
    out = tmp_path_factory.mktemp("warm") / "policy"
    report = warm_start(out, TokenArithmetic(), model_config(), SHORT, progress=False)
    return out, report


def test_writes_a_loadable_qwen3_moe_directory(trained):
    from transformers import AutoModelForCausalLM

    out, report = trained
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_moe"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == EOS_ID
    assert (out / "model.safetensors").is_file()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no partial left
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.get_input_embeddings().weight.shape[0] == VOCAB_SIZE
    # The saved weights are the evaluated ones: the same held-out score comes back.
    held_out = TokenArithmetic().problems("eval", report.eval_problems)
    assert mean_reward(model, TokenArithmetic(), held_out, temperature=0.0) == pytest.approx(
        report.greedy_accuracy
    )


def test_loss_goes_down(trained):
    _, report = trained
    assert report.initial_loss == pytest.approx(math.log(VOCAB_SIZE), abs=0.4)  # random init
    assert report.final_loss < 0.8 * report.initial_loss
    assert report.steps_run == SHORT.steps and report.eval_problems == 200
    assert 0.0 <= report.greedy_accuracy <= 1.0 and 0.0 <= report.sampled_reward <= 1.0


def test_same_arguments_reuse_the_directory(trained):
    out, report = trained
    weights = (out / "model.safetensors").stat().st_mtime_ns
    again = warm_start(out, TokenArithmetic(), model_config(), SHORT, progress=False)
    assert again.reused and not report.reused
    assert again.greedy_accuracy == report.greedy_accuracy and again.seconds == report.seconds
    assert (out / "model.safetensors").stat().st_mtime_ns == weights


def test_different_arguments_retrain_and_replace(tmp_path):
    out = tmp_path / "policy"
    first = warm_start(out, TokenArithmetic(), model_config(), SHORT, progress=False)
    weights = (out / "model.safetensors").read_bytes()
    reseeded = SHORT.model_copy(update={"seed": 1})
    other = warm_start(out, TokenArithmetic(), model_config(), reseeded, progress=False)
    assert not other.reused and other.initial_loss != first.initial_loss
    assert (out / "model.safetensors").read_bytes() != weights
    assert json.loads((out / MARKER).read_text())["identity"]["seed"] == 1
    task = TokenArithmetic(ArithmeticConfig(seed=5))  # a task change also retrains
    assert not warm_start(out, task, model_config(), reseeded, progress=False).reused


def test_refuses_a_directory_it_did_not_write(tmp_path):
    (tmp_path / "weights.bin").write_text("someone else's")
    with pytest.raises(FileExistsError, match=MARKER):
        warm_start(tmp_path, TokenArithmetic(), model_config(), SHORT)
    assert (tmp_path / "weights.bin").read_text() == "someone else's"


def test_slips_are_wrong_by_one_or_ten_and_end_with_eos():
    task = TokenArithmetic(ArithmeticConfig(operations=("+", "-")))
    rng = random.Random(0)
    offsets = set()
    for problem in task.problems("train", 400):
        slip = task.slip_target_ids(problem, rng)
        assert slip[-1] == EOS_ID and task.reward(problem, slip) == 0.0
        offsets.add(int(decode(slip[:-1])) - int(problem.answer))
    assert offsets == {-10, -1, 1, 10}


@pytest.mark.parametrize("label_noise", [0.0, 0.3, 1.0])
def test_label_noise_is_the_share_of_slipped_targets(monkeypatch, label_noise):
    """train() hands _step the batches it built: count the rows whose target is not the answer."""
    task = TokenArithmetic()
    wrong = []

    def counting_step(model, optimizer, tokens, loss_mask):
        for row, mask in zip(tokens.tolist(), loss_mask.tolist(), strict=True):
            start = mask.index(1.0) + 1
            target = row[start : start + int(sum(mask))]
            text = decode(row[:start]).removeprefix("<bos>").removesuffix("=")
            a, b = text.split("+")
            wrong.append(target != encode(str(int(a) + int(b)) + "<eos>"))
        return 0.0

    monkeypatch.setattr(warm_start_module, "_step", counting_step)
    config = WarmStartConfig(steps=25, batch_size=40, lr=1e-3, label_noise=label_noise)
    warm_start_module.train(torch.nn.Linear(1, 1), task, config, progress=False)
    assert len(wrong) == 1000
    # Binomial(1000, p): within 4.5 standard deviations (exact at p = 0 and 1).
    sigma = math.sqrt(label_noise * (1 - label_noise) / 1000)
    assert abs(sum(wrong) / 1000 - label_noise) <= 4.5 * sigma


def test_settings_are_validated_by_the_config():
    for bad in (dict(label_noise=1.5), dict(steps=0), dict(lr=0.0), dict(batch_size=-1)):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            WarmStartConfig(**bad)
    with pytest.raises(ValidationError, match="stepz"):
        WarmStartConfig(stepz=3)


class Oracle(torch.nn.Module):
    """Logits that put (almost) all mass on the correct next token of "<bos>aa+bb=answer<eos>",
    computed from the text of the ids so far."""

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        logits = torch.full((*input_ids.shape, VOCAB_SIZE), -30.0)
        for row, ids in enumerate(input_ids.tolist()):
            prompt, written = decode(ids).removeprefix("<bos>").split("=")
            a, b = prompt.split("+")
            target = encode(str(int(a) + int(b)) + "<eos>")
            next_id = target[len(written)] if len(written) < len(target) else EOS_ID
            logits[row, -1, next_id] = 30.0
        return SimpleNamespace(logits=logits)


def test_generation_stops_after_eos_and_an_oracle_scores_one():
    task = TokenArithmetic()
    problems = task.problems("eval", 30)
    greedy = generate(Oracle(), task, problems, temperature=0.0)
    assert greedy == [task.target_ids(problem) for problem in problems]
    assert mean_reward(Oracle(), task, problems, temperature=0.0) == 1.0
    assert mean_reward(Oracle(), task, problems, temperature=1.0, seed=3) == 1.0


# ---- the text task: chat-rendered prompts, a tokenizer saved with the model ---------------

TEXT = TextMathConfig(problems=ArithmeticConfig(digits=1, operations=("+", "-")))
TEXT_SHORT = WarmStartConfig(steps=30, batch_size=16, lr=5e-3, eval_problems=20)


@pytest.fixture(scope="module")
def text_task():
    with build_text_math_task(TEXT, vocab_size=300) as task:
        yield task


@pytest.fixture(scope="module")
def text_trained(tmp_path_factory, text_task):
    out = tmp_path_factory.mktemp("text-warm") / "policy"
    config = tiny_chat_model_config(text_task.tokenizer)
    report = warm_start(
        out, text_task, config, TEXT_SHORT, tokenizer=text_task.tokenizer, progress=False
    )
    return out, report


def test_text_warm_start_writes_a_chat_model_the_loaders_read(text_trained, text_task):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, report = text_trained
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {
        p.name for p in out.iterdir()
    }
    stops = text_task.tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert list(text_task.stop_token_ids) == stops
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == stops
    assert list(load_chat(out).stop_token_ids) == stops
    assert report.initial_loss > 2 * report.final_loss and report.cpu_seconds > 0
    # The saved model and tokenizer, loaded back, score what the report says.
    with TextMathTask(TEXT, AutoTokenizer.from_pretrained(out)) as reloaded:
        held_out = reloaded.problems("eval", report.eval_problems)
        assert [p.prompt_ids for p in held_out] == [
            p.prompt_ids for p in text_task.problems("eval", report.eval_problems)
        ]
        model = AutoModelForCausalLM.from_pretrained(out)
        assert mean_reward(model, reloaded, held_out, temperature=0.0) == report.greedy_accuracy


def test_text_batches_train_on_the_demonstration_only(text_task):
    problems = text_task.problems("train", 6)
    rng = random.Random(0)
    targets = [text_task.slip_target_ids(p, rng) for p in problems[:3]]
    targets += [text_task.target_ids(p) for p in problems[3:]]
    tokens, loss_mask = warm_start_module._batch(text_task, problems, targets)
    for row, mask, problem, target in zip(tokens, loss_mask, problems, targets, strict=True):
        messages = text_task.environment.start(text_task.sample(problem)).messages
        prompt = text_task.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )["input_ids"]
        assert row[: len(prompt)].tolist() == prompt
        assert row[1:][mask.bool()].tolist() == target  # the loss sees the target, all of it
        assert set(row[len(prompt) + len(target) :].tolist()) <= {text_task.pad_id}


def test_greedy_generation_equals_transformers_generate(text_trained, text_task):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(text_trained[0])
    problems = text_task.problems("eval", 8)
    ours = generate(model, text_task, problems, temperature=0.0)
    for problem, output in zip(problems, ours, strict=True):
        theirs = model.generate(
            torch.tensor([problem.prompt_ids]),
            do_sample=False,
            max_new_tokens=text_task.max_new_tokens,
            eos_token_id=list(text_task.stop_token_ids),
        )[0, len(problem.prompt_ids) :].tolist()
        assert output == theirs[: len(output)] and len(theirs) == len(output)


def test_a_different_tokenizer_retrains(tmp_path, text_task):
    quick = WarmStartConfig(steps=2, batch_size=4, eval_problems=4)
    out = tmp_path / "policy"
    config = tiny_chat_model_config(text_task.tokenizer)
    warm_start(out, text_task, config, quick, tokenizer=text_task.tokenizer, progress=False)
    with build_text_math_task(TEXT, vocab_size=290) as other:
        assert len(other.tokenizer) != len(text_task.tokenizer)
        assert tiny_chat_model_config(other.tokenizer) == config  # same padded vocabulary
        again = warm_start(out, other, config, quick, tokenizer=other.tokenizer, progress=False)
    assert not again.reused


def test_the_model_is_the_same_bits_whatever_the_callers_threads(tmp_path):
    """The warm start runs on its own `threads`: made from a caller on 1 thread and from one
    on 2, the weights are the same bits and warm_start.json carries their sha256 (checked
    here over the file with hashlib). The control: the warm start itself on 1 thread and on
    2 makes other weights, so the thread count is what the fixed setting holds still."""
    import hashlib

    config = SHORT.model_copy(update={"steps": 12, "batch_size": 64})
    before = torch.get_num_threads()
    made = {}
    try:
        for caller_threads, own_threads in ((1, 2), (2, 2), (2, 1)):
            torch.set_num_threads(caller_threads)
            out = tmp_path / f"caller{caller_threads}-own{own_threads}"
            own = config.model_copy(update={"threads": own_threads})
            report = warm_start(out, TokenArithmetic(), model_config(), own, progress=False)
            assert torch.get_num_threads() == caller_threads  # the caller's setting is back
            weights = (out / "model.safetensors").read_bytes()
            expected = hashlib.sha256(b"model.safetensors\0" + weights).hexdigest()
            assert report.model_sha256 == expected
            assert json.loads((out / MARKER).read_text())["report"]["model_sha256"] == expected
            made[caller_threads, own_threads] = expected
    finally:
        torch.set_num_threads(before)
    assert made[1, 2] == made[2, 2]
    assert made[2, 1] != made[2, 2]
