"""opsd: on-policy self-distillation on TRL. The floor plan:

* `method/`: one OPSD step, from the rollout to the loss;
* `rl/`: the methods beside OPSD, TRL's GRPO and the GRPO + OPSD hybrid, run by the same harness (`method`);
* `configuration/`: every switch, its default, its check and its sources (`recipe.env`, `OPSD_*`, older names);
* `run/`: a training run's logs, compute ledger, resume and probe;
* `launch/`: training's command line and YAML, a run's inputs checked before any model loads, the dry run and
  the capped budget's plan;
* `speed/`: how a step is split into micro-batches and compiled (memory and time, not method);
* `data/`: training and evaluation tables, and the built-in sets;
* `evaluation/`: AIME-style scoring of checkpoints (`eval_aime.py`);
* `experiment/`: recipes compared over seeds (`python -m opsd.experiment`);
* `testing/`: what tests and benchmarks share: small models built locally, the loss from full logits;
* `errors`, `paths`, `rundir`, `models`: user errors, the paths a user names, a run directory's layout
  (file names, checkpoints, step logs), model and tokenizer loading;
* `methods`: the method registry: what each `method` trains with, the switches it reads, its rollouts per problem;
* `grading`: a completion's answer (the last complete box) and whether it is correct: what evaluation
  scores and what training logs of its rollouts (`rollout/correct`).

The entry points stay at the repository root (`opsd_train.py`, `opsd_trainer.py`, `eval_aime.py`,
`train_capped.sh`); the package never imports them, and only tests and `bench/` import `testing/`.
"""

import textwrap

# The paper of the method trained here, cited by a trained model's card (`opsd_trainer.OPSDTrainer`).
PAPER = {
    "title": "Self-Distilled Reasoner: On-Policy Self-Distillation for Large Language Models",
    "id": "2601.18734",
    "citation": textwrap.dedent("""\
        @article{zhao2026selfdistilled,
            title        = {{Self-Distilled Reasoner: On-Policy Self-Distillation for Large Language Models}},
            author       = {Siyan Zhao and Zhihui Xie and Mengchen Liu and Jing Huang and Guan Pang and Feiyu Chen and Aditya Grover},
            year         = 2026,
            eprint       = {arXiv:2601.18734}
        }"""),
}
