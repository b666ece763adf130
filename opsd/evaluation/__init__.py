r"""AIME-style evaluation (docs/method.md §4): sample n completions per problem, grade the last \boxed{}, summarize.

Modules, in the order a run uses them (each imports only those before it; the grader is `opsd.grading`, which
training uses too):

* `metrics`: avg@n, pass@k (and its curve over k = 1..n), maj@n with standard errors, paired comparisons,
  aggregates across runs, the macro average over benchmarks and its paired difference;
* `benchmarks`: the benchmark table of `--benchmarks` (dataset, pinned revision, columns, answer kind, preset
  protocol) and the loading of a benchmark from the Hub's cache or a local copy;
* `figures`: the per-problem accuracy and accuracy-vs-step PNGs;
* `sampling`: the vLLM and transformers sampling engines, also used by bench/; `SamplingConfig.vllm` is the
  one builder of vLLM `SamplingParams`;
* `eval_config`: `EvalConfig` (eval_aime.py's flags; their ranges:
  `opsd.configuration.checks.EVAL_RANGES`), `parse_eval_args`, `EvalSettings` (one evaluation's
  resolved settings, generated from `EvalConfig`'s fields and `Resolved`'s, saved as eval_config.json), the
  errors the entry point reports;
* `samples`: the result directory's files: samples.jsonl (read, repaired, appended), shard merging,
  eval_config.json and the resume check, per-sample seeds;
* `job`: the inputs checked before any engine starts (`resolve_job` → `EvalJob`, which holds the
  `EvalSettings`);
* `engines`: the vLLM or transformers engine, the adapter served, merged or loaded with peft;
* `requests`: requests built whole (seed, prompt, token cap), those of the missing samples, and where an engine
  loop takes them from;
* `generate`: the missing samples streamed through vLLM (or chunked) and saved as they finish;
* `workers`: data parallel over GPUs, workers pulling from a shared claim queue;
* `summary`: summary.json and per_problem.csv; `report`: --compare, --aggregate, --plot-steps;
* `plan`: what an evaluation still has to generate (resume checked) and the lines that report it;
* `sweep`: `--checkpoints`, the base model and many checkpoints scored with one engine start; the reported step,
  declared before scoring (`--step`);
* `suite`: `--benchmarks`, every benchmark for one model or a sweep with one engine start, the table per benchmark
  and the macro average, and `--compare` of two such results;
* `evaluate`: one run start to finish, or a sweep, a benchmark suite or a report mode (eval_aime.py calls
  `evaluate.run_evaluation`).

Output directory (`--out DIR`):

* ``samples.jsonl``: one JSON line per sample, appended and flushed as samples finish (in the order they
  finish), with ``id`` (problem id), ``idx`` (sample index), ``problem_index`` (row in the dataset),
  ``request_seed`` (the seed of the engine request that drew it), ``text``, ``extracted`` (the graded
  answer or null), ``correct``, ``has_box``, ``n_tokens``, ``truncated`` (stopped by the length cap) and
  ``gold``; sample 0 of a problem also holds ``prompt`` (the rendered prompt, special tokens included).
* ``eval_config.json``: the resolved settings (`EvalSettings`, one key per field); a rerun into DIR must
  match it in `RESUME_KEYS`. Its ``adapter_mode`` says how an adapter was applied: ``merged`` (peft merge,
  then plain vLLM or transformers), ``vllm-lora`` (vLLM's LoRA support), ``peft`` (transformers with a
  PeftModel), or null.
* ``summary.json``: config (as in eval_config.json), versions, engine, timing and `metrics.summarize`
  under ``metrics``; ``per_problem.csv``: the per-problem table; ``per_problem.png`` with ``--plot``.
* With ``--benchmarks``: one such directory per benchmark (DIR/NAME; eval_config.json names the benchmark, its
  pinned ``dataset_revision`` and the ``dataset_commit`` loaded), and ``benchmarks.json``/``.md`` (the table and the
  macro average) and ``pass_at_k.png`` beside them (`suite`).

Resume. A rerun with the same ``--out`` drops a trailing partial line (a run killed mid-write), keeps
every complete line byte for byte, and generates only the samples (problem id, sample index) that are
missing. Seeds: sample i of the problem at dataset index p is drawn with seed ``sample_seed(seed, p, i)``.
With vLLM every sample is its own request with that seed. With transformers one request covers a run of
consecutive missing indices starting at m and seeds the whole request with ``sample_seed(seed, p, m)``.
Resumed samples come from their own seeds, never repeats of the samples already on disk, and a rerun is
deterministic up to the engine's numerics; the number of workers, the order and the in-flight bound change
no seed.

Adapters (``--merge-adapter auto|true|false``, ``--merge-adapter`` = true, ``--no-merge-adapter`` = false).
auto, the default, merges the adapter on vLLM's CPU backend (vLLM chosen, no CUDA GPU) and serves it with
vLLM's LoRA support on a GPU; the transformers engine loads it with peft. LoRA serving on the CPU backend is
slow (vLLM turns torch.compile off for LoRA there) and fails on seeded requests: vLLM rewinds a seeded
request's generator when it drops a partially prefilled step, which a CPU generator cannot do
(docs/decisions.md, Evaluation). The resolved ``adapter_mode`` is a resume key: merged and LoRA samples
differ numerically, so a rerun that would switch paths (e.g. a GPU run resumed on a CPU) is refused with
the flag that matches.

Engine failures. An exception out of vLLM's engine loop (EngineDeadError, a sampler RuntimeError, ...)
ends the run with `EngineDied` (one line, exit 2); the samples finished before it are in ``samples.jsonl``
and a rerun resumes from them; the traceback is appended to ``DIR/engine_error.log``.
"""
