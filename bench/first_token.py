"""Measurement: how much the first completion token weighs in the loss when only the teacher thinks (CPU, ~1 min).

    python bench/first_token.py --out bench/results/first_token_cpu.json

With the published `teacher_thinking=true, student_thinking=false`, the teacher prompt ends at the assistant
header while the student's ends with the closed empty think block, so at completion token 0 a Qwen3-like
teacher expects `<think>`. This script scores student rollouts under the teacher and reports, per setting,
the per-token gradient norm of the loss with respect to the student's logits (and the per-token divergence)
at token 0 against the median of the other tokens:
- `open`: the published teacher prompt (`teacher_thinking=true`);
- `closed`: `teacher_thinking=false`, whose prompt ends with the student's closed block;
- `open_skip1`: the published prompt with `num_loss_tokens_to_skip=1`.

No Qwen3 weights can be loaded here and SmolLM2's chat template has no thinking switch (both prompts are the
same for it), so the model is the tests' tiny Qwen3 after a short supervised run on the built-in problems in
Qwen3's format: with thinking on the answer starts with `<think>` + reasoning + `</think>`, with thinking off
it starts right after the empty block. It stands in for a model that follows that protocol, nothing more.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time

import torch

from common import machine, write
from opsd.data.builtin import builtin_train_rows
from opsd.method.hidden import completion_hidden, left_pad, right_pad
from opsd.method.prompts import PromptBuilder
from opsd.testing.reference_loss import token_divergence
from opsd.testing.tiny import build_tiny_model

# The published loss (beta 0, temperature 1.1, clip 0.05) in each mode.
MODES = {
    "none": dict(clip_mode="none"),
    "element": dict(clip_mode="element"),
    "sampled_token": dict(loss_type="sampled_token"),
}


def loss_settings(mode: str):
    from opsd.configuration.config import OPSDConfig
    from opsd.method.loss import loss_settings as published_loss_settings

    return dataclasses.replace(published_loss_settings(OPSDConfig(report_to="none")), **MODES[mode])


def teach_think_protocol(model, tok, rows, steps: int, seed: int) -> list[float]:
    """Supervised steps on (prompt, answer) pairs in Qwen3's thinking format; returns the loss curve."""
    on, off = PromptBuilder(tok, teacher_thinking=True), PromptBuilder(tok, teacher_thinking=False)
    end = tok("<|im_end|>", add_special_tokens=False)["input_ids"]
    pairs = []
    for r in rows:
        think = tok(f"<think>\n{r['COT_Reason']}\n</think>\n\n{r['solution']}", add_special_tokens=False)
        plain = tok(r["solution"], add_special_tokens=False)
        # Both thinking states, on both prompt kinds, so the model learns the header -> `<think>` rule.
        pairs += [
            (on._render(on.student_text(r["problem"]), True), think["input_ids"] + end),
            (on.student_ids(r["problem"]), plain["input_ids"] + end),
            (on.teacher_ids(r["problem"], r["solution"]).ids, think["input_ids"] + end),
            (off.teacher_ids(r["problem"], r["solution"]).ids, plain["input_ids"] + end),
        ]
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    losses = []
    for _ in range(steps):
        batch = [pairs[i] for i in torch.randint(len(pairs), (16,), generator=gen).tolist()]
        ids, mask = right_pad([p + a for p, a in batch], tok.pad_token_id, "cpu")
        labels = torch.full_like(ids, -100)
        for i, (p, a) in enumerate(batch):
            labels[i, len(p) : len(p) + len(a)] = ids[i, len(p) : len(p) + len(a)]
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses


def sample_rollouts(model, tok, prompts: list[list[int]], max_new: int, seed: int) -> list[list[int]]:
    ids, mask = left_pad(prompts, tok.pad_token_id, "cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.1, top_p=0.95, top_k=20,
            max_new_tokens=max_new, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        )  # fmt: skip
    rollouts = []
    for row in out[:, ids.size(1) :].tolist():
        cut = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
        rollouts.append(row[:cut])
    return rollouts


def per_token(model, tok, student_ids, teacher_ids, rollouts, mode: str):
    """Per-token gradient norm of the loss w.r.t. the student's logits, divergence, and teacher p(<think>)."""
    pad = tok.pad_token_id
    c_ids, c_mask = right_pad(rollouts, pad, "cpu")
    with torch.no_grad():
        w = model.get_output_embeddings().weight
        h_s = completion_hidden(
            model, *left_pad(student_ids, pad, "cpu"), c_ids, c_mask, fix_positions=True, pad_token_id=None
        )
        h_t = completion_hidden(
            model, *left_pad(teacher_ids, pad, "cpu"), c_ids, c_mask, fix_positions=True, pad_token_id=None
        )
    s_logits = (h_s @ w.T).detach().requires_grad_(True)
    t_logits = (h_t @ w.T).detach()
    settings = loss_settings(mode)
    loss_N, stats = token_divergence(s_logits, t_logits, settings=settings, target_ids_N=c_ids[c_mask.bool()])
    loss_N.sum().backward()
    first_N = (torch.arange(c_mask.size(1)).expand_as(c_mask) == 0)[c_mask.bool()]
    think = tok.convert_tokens_to_ids("<think>")
    p_think = (t_logits[first_N] / settings.temperature).softmax(-1)[:, think]
    return s_logits.grad.norm(dim=-1), stats["divergence"], first_N, p_think


def summarise(values_N: torch.Tensor, first_N: torch.Tensor) -> dict:
    first, rest = values_N[first_N].tolist(), values_N[~first_N].tolist()
    med_first, med_rest = statistics.median(first), statistics.median(rest)
    return {
        "token0_median": med_first,
        "other_tokens_median": med_rest,
        "ratio_token0_to_other": med_first / med_rest if med_rest else None,
        "token0_share_of_sum": sum(first) / (sum(first) + sum(rest)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/first_token_cpu.json")
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--rollouts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = builtin_train_rows(n=400 + args.rollouts, seed=1)
    train_rows, held_out = rows[:400], rows[400:]
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(tmp, seed=args.seed)
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    curve = teach_think_protocol(model, tok, train_rows, args.sft_steps, args.seed)

    student = PromptBuilder(tok)  # published: student thinking off, teacher thinking on
    student_ids = [student.student_ids(r["problem"]) for r in held_out]
    teachers = {
        "open": [student.teacher_ids(r["problem"], r["solution"]).ids for r in held_out],
        "closed": [
            PromptBuilder(tok, teacher_thinking=False).teacher_ids(r["problem"], r["solution"]).ids
            for r in held_out
        ],
    }
    rollouts = sample_rollouts(model, tok, student_ids, args.max_new_tokens, args.seed)
    results = {}
    for setting, teacher_ids in teachers.items():
        for mode in MODES:
            grad_N, div_N, first_N, p_think = per_token(model, tok, student_ids, teacher_ids, rollouts, mode)
            results[f"{setting}/{mode}"] = {
                "grad_norm": summarise(grad_N, first_N),
                "divergence": summarise(div_N, first_N),
                "teacher_p_think_at_token0_mean": float(p_think.mean()),
            }
            if setting == "open":
                # Skipping token 0 zeroes its gradient and leaves every other token's per-token gradient as is.
                skipped = grad_N.clone()
                skipped[first_N] = 0.0
                results[f"open_skip1/{mode}"] = {"grad_norm": summarise(skipped, first_N)}
    result = {
        "what": "per-token loss gradient norm (w.r.t. student logits) and divergence at completion token 0 "
        "vs the median of the other tokens; tiny Qwen3 taught Qwen3's thinking format",
        "machine": machine(),
        "config": {
            **vars(args),
            "loss": dataclasses.asdict(loss_settings("element")),
            "sft_final_loss": statistics.mean(curve[-20:]),
        },
        "rollout_tokens": sum(map(len, rollouts)),
        "results": results,
        "elapsed_s": round(time.perf_counter() - t0, 1),
    }
    print(write(result, args.out))
    for key, r in results.items():
        g = r["grad_norm"]
        extra = (
            f"  p_T(<think>)={r['teacher_p_think_at_token0_mean']:.3f}"
            if "teacher_p_think_at_token0_mean" in r
            else ""
        )
        print(
            f"{key:24s} grad token0 / median other = {g['token0_median']:.4f} / {g['other_tokens_median']:.4f}{extra}"
        )


if __name__ == "__main__":
    main()
