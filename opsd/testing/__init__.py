"""Test and benchmark support: small models built locally and the loss the reference code's way, imported by
tests/ and bench/ alike (no module of the package imports them).

* `tiny`: a byte-level BPE tokenizer trained on the built-in problems with a Qwen3-style chat template, and
  randomly initialised Qwen3 models of any shape (tiny, or Qwen3-1.7B's for the GPU benchmarks);
* `families`: tiny random float32 models of every architecture family the method trains, and random-weight
  models of their released shapes;
* `reference_loss`: the OPSD loss from full (B, T, V) logits through autograd, the benchmarks' baseline and the
  materialised path the chunked loss must equal;
* `step_trace`: which repo files one optimizer step visits and where control passes between the repo and TRL
  (`python -m opsd.testing.step_trace`).
"""
