"""The CPU demos, beside the production path: the models they train and how they are made.

On a CPU machine no pretrained model can be downloaded, so the demo recipes (examples/cpu_*.yaml)
start from tiny models made here, once, by

    megatron-fr demo prepare examples/cpu_demo.yaml      # writes the recipe's model.hf_dir

after which `megatron-fr train` runs them like any recipe: from a model directory.

    arithmetic.py       integer problems with a hash-decided train/eval split
    text_math.py        those problems asked in words and graded by the math environment;
                        `python -m megatron_fr.demo.text_math DIR` writes the prompt files
    chat_tokenizer.py   a byte-level BPE tokenizer with a Qwen-style chat template, trained on
                        a task's own text
    tiny_models.py      a tiny Qwen3-MoE-shaped HF model for such a tokenizer
    tool_demos.py       two-turn Python-tool demonstrations (the python_tool twin)
    warm_start.py       supervised warm start on noisy demonstrations (the Task protocol)
    config.py           the warm start's settings and each environment's demo defaults
    prepare.py, cli.py  `megatron-fr demo prepare`

Nothing in the production packages imports this one (an import contract checks it).
"""
