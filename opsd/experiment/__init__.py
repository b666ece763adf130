"""Experiments: recipes x seeds under the capped budget, scored alike, with a paired verdict.

`python -m opsd.experiment` (docs/experiments.md). Modules, each importing only those before it:

* `stats`: the statistics of the verdict (seed-paired t interval, hierarchical bootstrap, variance
  components); pure functions;
* `power`: planning (the t test's power, the minimum detectable difference, the seeds needed, each with the
  range the sd's chi-square interval gives it); pure functions;
* `spec`: an experiment's arms, seeds and shared settings (`DIR/experiment.json`), its directory layout and the
  commands of each cell;
* `cells`: where each cell stands, read (and checked) from its files; the disk a cell holds and its pruning;
* `schedule`: the jobs run on this machine's GPU slots (or its CPU), a live status table, resume and one retry;
* `report`: report.md, summary.json and the figures from whatever has finished;
* `cli`: the command line.
"""
