"""Whose reference each problem's teacher reads: `teacher_ref_pairing` (docs/method.md §1.8).

- `matched` (published): its own. The training table is left exactly as it is.
- `shuffled`: another problem's, by a fixed derangement of the training table drawn from the run's `seed`
  (`derangement`): no row keeps its own reference, and no row gets the reference of a row whose `Answer` has the
  same value by the grader's equivalence (`answer_groups`: `3.5` is `3.50`, `0.5` is `1/2`), so no teacher is
  handed its own problem's answer. It is drawn once, over the whole training table after the data filter and
  before the probe hold-out and any split over processes, so it depends on (seed, table) only: every process
  and every resume of a run draws the same one.
- `empty`: an empty reference. The teacher prompt keeps its instruction and the BEGIN/END markers, so it
  differs from the student prompt only in that framing.

The rewrite is one column of the trainer's table (`privileged_context`), made at load time: the trainer,
the probe and the completions log read it as they read a matched reference.

A shuffled run saves its pairing as `<output_dir>/teacher_pairing.json` (opsd.run.resume): `reference_of[i]` is the row whose
reference row i's teacher reads (rows of the training table after the data filter, in order), with digests
of the problems and of the permutation. A resume draws the pairing again and refuses one that differs from
the saved file (other data under the same name, say).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opsd.configuration.checks import check_choice
from opsd.errors import InvalidValue
from opsd.grading import answer_keys

if TYPE_CHECKING:
    from datasets import Dataset

# The column of a contrastive teacher's wrong hints (opsd.method.contrast, which imports this module).
CONTRAST_COLUMN = "contrast_context"
# Random draws tried for a repair swap before scanning every position (one always exists).
_RANDOM_TRIES = 64
RULE = (
    "row i's teacher reads the reference of row reference_of[i]; rows are the training table after the data "
    "filter, in order, before the probe hold-out; a derangement that never pairs two rows whose Answer has the "
    "same value (opsd.grading.answer_key), drawn by opsd.method.pairing.derangement(rows, seed, "
    "answer_groups(answers))"
)


# The other way out of a refused derangement, by the switch that asked for it.
_INSTEAD = {
    "teacher_ref_pairing": "teacher_ref_pairing=empty",
    "teacher_contrast": "teacher_contrast=wrong_answer",
}


def derangement(
    n: int, seed: int, groups: Sequence[Any] | None = None, *, switch: str = "teacher_ref_pairing"
) -> list[int]:
    """A permutation `p` of range(n) with p[i] != i, and groups[p[i]] != groups[i] when `groups` is given.

    Deterministic in (n, seed, groups). A shuffle drawn from `seed`, then each row in order that breaks the
    rule swaps its entry with another row's such that both keep to it. Such a row exists whenever no group
    holds more than half the rows (with n - 2|G| + 1 >= 1 choices), so this never fails then. `switch` names
    the setting that asked (its own random stream, and the one its refusals name).
    """
    if n < 2:
        raise InvalidValue(
            f"{switch}=shuffled needs at least 2 training rows to pair each with another (got {n}); "
            f"add rows or use {_INSTEAD[switch]}"
        )
    key = list(range(n)) if groups is None else list(groups)
    if len(key) != n:
        raise ValueError(f"derangement: {len(key)} groups for {n} rows")
    group, size = Counter(key).most_common(1)[0]
    if 2 * size > n:
        raise InvalidValue(
            f"{switch}=shuffled cannot give every problem the reference of a problem with another "
            f"answer: answer {str(group)[:40]!r} is shared by {size} of {n} training rows, more than half; "
            f"use other data, a data_filter, or {_INSTEAD[switch]}"
        )
    # The pairing's stream keeps its historical name, so existing runs resume with the same permutation.
    rng = random.Random(f"{switch}:{seed}")
    perm = list(range(n))
    rng.shuffle(perm)
    for i in range(n):
        if key[perm[i]] != key[i]:
            continue
        j = next(j for j in _candidates(rng, n) if key[perm[j]] != key[i] and key[perm[i]] != key[j])
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def _candidates(rng: random.Random, n: int):
    """Positions to try for a repair swap: a few random ones, then every position in a random order."""
    for _ in range(_RANDOM_TRIES):
        yield rng.randrange(n)
    yield from rng.sample(range(n), n)


@dataclass(frozen=True)
class AnswerGroup:
    """The rows whose answers have one value (`opsd.grading.answer_key`); shown as the first such answer's text."""

    key: tuple
    text: str = field(compare=False)

    def __str__(self) -> str:
        return self.text


def answer_groups(answers: Sequence[Any]) -> list[Any]:
    """The pairing's group of each row: its answer's value by the grader's equivalence (`AnswerGroup`, so `3.5` and
    `3.50`, `0.5` and `1/2`, `1000` and `1,000` are one group), or the row alone (a tuple) when it has none.

    Each distinct answer text is keyed once (`opsd.grading.answer_keys`: exact arithmetic for numbers,
    math-verify's parse for the rest), so a table is grouped in one pass, never by comparing pairs."""
    groups: list[Any] = []
    for i, (answer, key) in enumerate(zip(answers, answer_keys(answers), strict=True)):
        groups.append(("row", i) if key is None else AnswerGroup(key, str(answer).strip()))
    return groups


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, ensure_ascii=False).encode("utf-8")).hexdigest()


def apply_pairing(
    ds: Dataset, pairing: str, *, seed: int, answers: Sequence[Any]
) -> tuple[Dataset, dict[str, Any] | None]:
    """The trainer's table (`prompt`, `privileged_context`, and any other column) with the references `pairing`
    gives (a contrastive teacher's wrong hints, `contrast_context`, move with their references), and the record to
    save for a shuffled run (None otherwise). `answers` are the rows' `Answer` values, in order."""
    check_choice("teacher_ref_pairing", pairing)
    if pairing == "matched":
        return ds, None
    if pairing == "empty":
        references = [""] * len(ds)
        record = None
    else:
        perm = derangement(len(ds), seed, answer_groups(answers))
        own = list(ds["privileged_context"])
        references = [own[j] for j in perm]
        record = {
            "teacher_ref_pairing": pairing,
            "seed": seed,
            "rows": len(ds),
            "rule": RULE,
            "problems_sha256": _digest(list(ds["prompt"])),
            "reference_of_sha256": _digest(perm),
            "reference_of": perm,
        }
    paired = ds.remove_columns("privileged_context").add_column("privileged_context", references)
    if pairing == "shuffled" and CONTRAST_COLUMN in ds.column_names:
        # A contrastive teacher's wrong hint belongs to the reference: it moves with it.
        own_wrong = list(ds[CONTRAST_COLUMN])
        paired = paired.remove_columns(CONTRAST_COLUMN).add_column(
            CONTRAST_COLUMN, [own_wrong[j] for j in perm]
        )
    return paired, record


def summary(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """The record without its permutation (what the dry run prints)."""
    return None if record is None else {k: v for k, v in record.items() if k != "reference_of"}
