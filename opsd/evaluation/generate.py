"""Sampling the missing samples of a run and saving each one as it finishes.

vLLM, streaming (the default). Every missing sample is its own engine request, seeded with
`sample_seed(seed, problem, index)`. `stream` feeds them to vLLM's engine loop (`LLMEngine.add_request`
and `step`, the loop `LLM.generate` runs internally) and keeps at most `window` requests in the engine:
whenever samples finish, they are graded and appended to the samples file, and as many new requests
take their place. The engine's batch stays full until the work runs out, instead of draining at the end
of every chunk while the longest sample of the chunk decodes alone. A run killed mid-stream loses only
the samples in flight.

The window bounds what a very large run holds in memory and what sits in vLLM's queue; it defaults to
the engine's `max_num_seqs` on a GPU (more would only wait inside vLLM). On vLLM's CPU backend it is the
number of prompts that prefill together in one scheduler step: a seeded request whose prefill is split
over steps makes the CPU engine rewind its generator, which it cannot do ("CPU Generator does not use
offset").

`--no-stream` runs chunks of `chunk_size` problems through the same loop, each drained before the next
starts; bench/eval_throughput.py compares the two schedules.
The transformers engine always works in chunks: one `generate` call per request (a run of a problem's
consecutive missing samples, seeded with its first sample's seed), records saved after each chunk.

Work comes from a source with `take(k)` (at most k requests, `opsd.evaluation.requests`) and
`finished(count)`: a list (`ListSource`), or a claim queue shared by the data-parallel workers
(`opsd.evaluation.workers`).
"""

from __future__ import annotations

import itertools
import logging
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from opsd.evaluation.engines import build_engine
from opsd.evaluation.eval_config import EngineDied, EvalConfig, EvalSettings
from opsd.evaluation.job import EvalJob, cuda_available
from opsd.evaluation.requests import ListSource, Request, Source
from opsd.evaluation.samples import ENGINE_ERROR_LOG, append_samples, read_samples

logger = logging.getLogger(__name__)

NO_TIMINGS = {"engine_start_s": 0.0, "generation_s": 0.0, "new_samples": 0, "new_tokens": 0}
_REQUEST_IDS = itertools.count()


# --- vLLM: the streaming loop -------------------------------------------------------------------------------


def request_sampling(settings: EvalSettings | EvalConfig, r: Request):
    """The sampling settings of one request: the run's temperature, top-p, top-k and min-p (`settings`, or
    the flags themselves), the request's seed and cap."""
    from opsd.evaluation.sampling import SamplingConfig

    return SamplingConfig(
        max_tokens=r.max_tokens, temperature=settings.temperature, top_p=settings.top_p,
        top_k=settings.top_k, min_p=settings.min_p, seed=r.seed,
    )  # fmt: skip


def vllm_params(settings: EvalSettings | EvalConfig, r: Request, **overrides: Any):
    """vLLM sampling parameters of one request (`request_sampling`), n samples, final outputs only."""
    from vllm.sampling_params import RequestOutputKind

    return request_sampling(settings, r).vllm(r.count, output_kind=RequestOutputKind.FINAL_ONLY, **overrides)


def auto_window(llm, longest_prompt: int, cuda: bool) -> int:
    """The default bound on requests in flight (module docstring): max_num_seqs, or on the CPU backend the
    requests whose prompts prefill together in one step."""
    sched = llm.llm_engine.vllm_config.scheduler_config
    if cuda:
        return int(sched.max_num_seqs)
    return max(1, min(int(sched.max_num_seqs), int(sched.max_num_batched_tokens) // max(1, longest_prompt)))


def stream(
    llm,
    source: Source,
    *,
    window: int,
    params: Callable[[Request], Any],
    on_finished: Callable[[list[tuple[Request, list[Any]]]], None],
    lora_request: Any = None,
) -> None:
    """Run `source`'s requests through `llm` (a `vllm.LLM`) with at most `window` of them in the engine
    at once (one sample each when streaming, so `window` samples).

    After every engine step, the requests that finished are passed to `on_finished` as (request, its
    vLLM `CompletionOutput`s in sample order) and their places refilled. Returns when `source` has
    nothing left and the engine is empty. On any exception the requests still in flight are aborted, so
    the engine can serve other calls if it is still alive."""
    engine = llm.llm_engine
    in_flight: dict[str, Request] = {}
    try:
        while True:
            room = window - len(in_flight)
            if room > 0:
                for r in source.take(room):
                    rid = f"opsd-eval-{next(_REQUEST_IDS)}"
                    engine.add_request(
                        rid, {"prompt_token_ids": r.prompt_ids}, params(r), lora_request=lora_request
                    )
                    in_flight[rid] = r
            if not in_flight:
                return
            done = []
            for out in engine.step():
                if out.finished and out.request_id in in_flight:
                    done.append((in_flight.pop(out.request_id), sorted(out.outputs, key=lambda o: o.index)))
            if done:
                on_finished(done)
                source.finished(len(done))
    except BaseException:
        if in_flight:
            try:
                engine.abort_request(list(in_flight))
            except Exception:  # a dead engine cannot abort; nothing is left to clean up then
                pass
        raise


def stream_chunked(
    llm, source: Source, *, chunk: int, window: int, params, on_finished, lora_request: Any = None
) -> None:
    """The chunked schedule (--no-stream) through the same loop: take `chunk` requests, drain them, repeat."""
    while batch := source.take(chunk):
        stream(llm, ListSource(batch), window=window, params=params, on_finished=on_finished,
               lora_request=lora_request)  # fmt: skip
        source.finished(len(batch))


# --- records ----------------------------------------------------------------------------------------------


def sample_record(job: EvalJob, r: Request, idx: int, text: str, token_ids: Sequence[int], truncated: bool):
    """One line of samples.jsonl, graded."""
    from opsd.grading import grade

    graded = grade(text, r.problem["answer"])
    prompt = {"prompt": job.tokenizer.decode(r.prompt_ids)} if idx == 0 else {}
    return {
        "id": r.problem["id"],
        "idx": idx,
        "problem_index": r.problem["index"],
        "request_seed": r.seed,
        **prompt,
        "text": text,
        "extracted": graded["extracted"],
        "correct": graded["correct"],
        "has_box": graded["has_box"],
        "grader": graded["grader"],
        "n_tokens": len(token_ids),
        "truncated": truncated,
        "gold": r.problem["answer"],
    }


def window_size(job: EvalJob, llm, requests: Sequence[Request]) -> int:
    if job.settings.max_in_flight:
        return job.settings.max_in_flight
    longest = max((len(r.prompt_ids) for r in requests), default=1)
    window = auto_window(llm, longest, cuda_available())
    logger.info("at most %d samples in flight (--max-in-flight)", window)
    return window


class SampleProgress:
    """SampleProgress of one generation: samples finished of `total`, generated tokens/s and the ETA.

    Shown on a tqdm bar advanced per finished sample (tokens/s in its postfix), logged every `log_every_s`
    seconds (for logs that are not a terminal) and once more by `close` as the final line,
    ``N/N samples, T tokens in S s (R tokens/s)``. ETA = unfinished samples x elapsed / finished samples.
    `total` is None for a --num-gpus worker, which does not know how many samples it will draw."""

    def __init__(self, total: int | None, *, position: int = 0, clock: Callable[[], float] = time.monotonic,
                 log_every_s: float = 60.0, bar: bool = True):  # fmt: skip
        from tqdm import tqdm

        self.total, self.clock, self.log_every_s = total, clock, log_every_s
        self.start = self._last_log = clock()
        self.samples = self.tokens = 0
        self.bar = tqdm(total=total, desc="samples", unit="sample", position=position, dynamic_ncols=True,
                        disable=not bar)  # fmt: skip

    @property
    def elapsed_s(self) -> float:
        return self.clock() - self.start

    @property
    def tokens_per_s(self) -> float:
        elapsed = self.elapsed_s
        return self.tokens / elapsed if elapsed > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        if self.total is None or self.samples == 0:
            return None
        return (self.total - self.samples) * self.elapsed_s / self.samples

    def update(self, samples: int, tokens: int) -> None:
        self.samples += samples
        self.tokens += tokens
        self.bar.set_postfix_str(f"{self.tokens_per_s:.0f} tok/s", refresh=False)
        self.bar.update(samples)
        if self.clock() - self._last_log >= self.log_every_s:
            self._last_log = self.clock()
            logger.info("%s", self.line())

    def line(self) -> str:
        total = "" if self.total is None else f"/{self.total}"
        eta = self.eta_s
        eta_text = f", ETA {eta:.0f} s" if eta is not None and self.samples != self.total else ""
        return (f"{self.samples}{total} samples, {self.tokens} tokens in {self.elapsed_s:.1f} s "
                f"({self.tokens_per_s:.0f} tokens/s){eta_text}")  # fmt: skip

    def close(self) -> None:
        self.bar.close()
        logger.info("%s", self.line())


def generate_missing(
    job: EvalJob,
    requests: list[Request],
    source: Source,
    samples_path: Path,
    scratch: Path,
    position: int = 0,
    served: tuple[Any, Any] | None = None,
) -> dict[str, float]:
    """Sample what `source` hands out (drawn from `requests`), appending graded records to `samples_path`
    as samples finish (vLLM) or chunk by chunk (transformers); returns the timings.

    `served`: (a running `VLLMEngine` that already holds the job's weights, its `LoRARequest` or None),
    for a sweep; by default the engine is started here (`build_engine`)."""
    t0 = time.perf_counter()
    engine, lora = served if served is not None else _start_engine(job, scratch)
    start_s = time.perf_counter() - t0
    total = sum(r.count for r in requests) if isinstance(source, ListSource) else None  # a worker: unknown
    writer = _SampleWriter(samples_path, SampleProgress(total, position=position))
    t1 = time.perf_counter()
    if job.settings.engine_used == "vllm":
        _generate_vllm(job, engine, lora, requests, source, writer)
    else:
        _generate_transformers(job, engine, source, writer)
    writer.progress.close()
    return {"engine_start_s": start_s, "generation_s": time.perf_counter() - t1, **writer.totals}


def _start_engine(job: EvalJob, scratch: Path) -> tuple[Any, Any]:
    """(the job's engine, the `LoRARequest` vLLM serves its adapter under, or None): `build_engine` returns
    the adapter's path only when vLLM serves it unmerged."""
    lora = None
    engine, lora_path = build_engine(job, scratch)
    if lora_path:
        from vllm.lora.request import LoRARequest

        lora = LoRARequest("adapter", 1, lora_path)
    return engine, lora


class _SampleWriter:
    """Appends graded records to the samples file as they come (a killed run keeps them) and counts them: the
    timings' new samples and tokens, and the progress bar."""

    def __init__(self, samples_path: Path, progress: SampleProgress):
        self.samples_path, self.progress = samples_path, progress
        self.totals = {"new_samples": 0, "new_tokens": 0}

    def __call__(self, records: list[dict[str, Any]]) -> None:
        append_samples(self.samples_path, records)
        tokens = sum(rec["n_tokens"] for rec in records)
        self.totals["new_samples"] += len(records)
        self.totals["new_tokens"] += tokens
        self.progress.update(len(records), tokens)


def _generate_vllm(
    job: EvalJob, engine, lora, requests: list[Request], source: Source, save: _SampleWriter
) -> None:
    """vLLM: the streaming loop (or its chunked schedule), each sample saved as it finishes. Whatever vLLM
    raises, the engine is dead: `EngineDied` says what was kept and how to go on."""
    settings = job.settings

    def on_finished(done):
        save([
            sample_record(job, r, r.start + j, o.text, o.token_ids, o.finish_reason == "length")
            for r, outputs in done
            for j, o in enumerate(outputs)
        ])  # fmt: skip

    window = window_size(job, engine.llm, requests)
    kwargs = dict(window=window, params=lambda r: vllm_params(settings, r), on_finished=on_finished,
                  lora_request=lora)  # fmt: skip
    try:
        if settings.stream:
            stream(engine.llm, source, **kwargs)
        else:
            stream_chunked(engine.llm, source, chunk=settings.chunk_size * settings.n, **kwargs)
    except Exception as e:  # the engine is dead whatever vLLM raised; the finished samples are saved
        save.progress.close()
        raise EngineDied(_engine_died_message(job, e, save.samples_path)) from e


def _generate_transformers(job: EvalJob, engine, source: Source, save: _SampleWriter) -> None:
    """transformers: chunks of `chunk_size` requests, one `generate` call per request, saved after each
    chunk."""
    settings = job.settings
    while batch := source.take(settings.chunk_size):
        records = []
        for r in batch:
            (samples,) = engine.generate([r.prompt_ids], request_sampling(settings, r), n=r.count)
            records += [
                sample_record(job, r, r.start + j, s.text, s.token_ids, s.finish_reason == "length")
                for j, s in enumerate(samples)
            ]
        save(records)
        source.finished(len(batch))


# --- the engine dying ---------------------------------------------------------------------------------------


def _describe(e: BaseException, limit: int = 200) -> str:
    text = " ".join(str(e).split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _engine_died_message(job: EvalJob, e: Exception, samples_path: Path) -> str:
    """One line: what vLLM raised (and its root cause), what is kept, how to go on; traceback to a log."""
    cause, seen = e, {id(e)}
    while True:
        nxt = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
        if nxt is None or id(nxt) in seen:
            break
        cause = nxt
        seen.add(id(nxt))
    what = _describe(e) + (f", caused by {_describe(cause)}" if cause is not e else "")
    log = job.out / ENGINE_ERROR_LOG
    try:
        with log.open("a", encoding="utf-8") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {samples_path}\n")
            f.write("".join(traceback.format_exception(e)))
        where = f"; traceback in {log}"
    except OSError:
        where = ""
    kept = len(read_samples(samples_path, repair=False))
    mode = job.settings.adapter_mode
    if mode == "vllm-lora" and not cuda_available():
        advice = "on a CPU, serve adapters merged (the default): drop --no-merge-adapter and use a new --out"
    elif mode == "vllm-lora":
        advice = "if it dies again, --merge-adapter with a new --out serves the adapter merged"
    else:
        advice = "if it dies again, --engine transformers with a new --out avoids vLLM"
    return (
        f"the vLLM engine died during generation ({what}); the {kept} samples written so far are kept in "
        f"{samples_path} and a rerun of the same command resumes from them; {advice}{where}"
    )
