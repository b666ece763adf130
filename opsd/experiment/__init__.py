"""Experiments: recipes x seeds under the capped budget, scored alike, with a paired verdict.

`python -m opsd.experiment [run] ...` and `python -m opsd.experiment report DIR` (docs/experiments.md). Modules,
each importing only those before it:

* `stats`: the statistics of the verdict (seed-paired t interval, hierarchical bootstrap, variance
  components); pure functions;
* `power`: planning (the t test's power, the minimum detectable difference, the seeds needed, each with the
  range the sd's chi-square interval gives it); pure functions;
* `take_off`: whether each seed's training rollouts took off (reached 50% correct) and when, and the comparisons
  whose interval spans both outcomes of a bimodal arm; pure functions;
* `arms`: an arm, its recipe parsed from `--arm` and written for its cells;
* `spec`: an experiment's arms, seeds and shared settings (`DIR/experiment.json`, a frozen `Spec`), its directory
  layout and the commands of each cell;
* `cells`: where each cell stands, read (and checked) from its files; the disk a cell holds and its pruning; the
  typed key of a job (`JobKey`: `train-ARM-sSEED`, `eval-ARM-sSEED`, `base-SEED` on disk);
* `status`: the status of a running experiment as data, and its display (a rich table);
* `schedule`: the jobs run on this machine's GPU slots (or its CPU): fixed `RunSettings`, changing `Progress`,
  resume and one retry;
* `verdict`: summary.json's content from whatever has finished: each arm against the baseline and the base
  model, the macro average over benchmarks, the compute ledger, take-off and the training curves;
* `rendering`: report.md, summary.json and the figures written whole, and the lines the command prints;
* `commands`: the command line, its `run` and `report` commands.
"""
