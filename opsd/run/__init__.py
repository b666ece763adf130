"""A training run's bookkeeping: its logs, checkpoints, resume, budget and held-out probe (its directory's layout
is `opsd.rundir`).

* `provenance`: package versions and the git revision saved beside the checkpoints;
* `resume`: a run directory belongs to one configuration; resuming checks it;
* `callbacks`: metrics.jsonl, step timing, tail weight averaging, non-finite steps;
* `probe`: the held-out probe (is the student moving towards its teacher?);
* `microbatch`: how a process splits its share of a step into micro-batches (memory, not method);
* `compiled_layers`: the decoder layers compiled for the passes without a KV cache (time, not method);
* `preflight`: every input of a run checked before any model loads, and the dry run (opsd_train.py, train_capped.sh);
* `capped`: the 100-step budget's launch plan (`train_capped.sh`);
* `curves`: the training curves of a run as one PNG (`python -m opsd.run.curves DIR`).
"""
