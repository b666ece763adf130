"""Student and teacher prompts (docs/method.md §1, chat format).

Both prompts are one user turn rendered with the tokenizer's chat template; the student's thinking switch
and the teacher's are separate. They drive one variable of the template (`thinking_switch`: `enable_thinking` in
Qwen3's and Qwen3.5's templates), found among the variables the parsed template reads (`template_variables`);
`auto` takes `enable_thinking` where the template reads it and renders without a switch where it does not (with
a warning: both roles' prompts then render alike); a named switch the template does not read is refused.
The teacher turn holds the problem, the privileged reference between BEGIN/END markers, and an instruction to
reason independently.

Wording lives in two templates that a file can replace: the student template must contain `{problem}`,
the teacher template `{problem}` and `{reference}`. Placeholders are substituted literally (no
`str.format`), so templates may contain braces such as `\\boxed{}`.

A batch's teacher rows, `[teacher prompt ; completion]`, are `teacher_rows`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

from opsd.configuration.switches import REFERENCE_COLUMNS, REFERENCE_FRACTION_DECIMALS
from opsd.errors import InvalidValue, UnsupportedModel
from opsd.paths import PROMPT_FILE, read_text

logger = logging.getLogger(__name__)

STUDENT_TEMPLATE = (
    "Solve the following math problem. Think step by step, and put your final answer within \\boxed{}.\n\n"
    "{problem}"
)
TEACHER_TEMPLATE = (
    "Solve the following math problem. Think step by step, and put your final answer within \\boxed{}.\n\n"
    "{problem}\n\n"
    "A reference solution follows, for your eyes only.\n"
    "=== BEGIN REFERENCE ===\n{reference}\n=== END REFERENCE ===\n\n"
    "Use the reference only to check where you are heading. Write your own reasoning from scratch, as if "
    "you had never seen it, and reach the same final answer independently. Do not quote or mention the reference."
)
TRUNCATION_MARK = "\n[... reference truncated ...]"
AUTO_SWITCH, NO_SWITCH, DEFAULT_SWITCH = "auto", "none", "enable_thinking"


def template_variables(template: str) -> set[str]:
    """The variables a chat template reads (jinja2's parse: what `apply_chat_template` keyword arguments can set);
    names it only assigns, or mentions in a string or comment, are not variables."""
    import jinja2
    from jinja2 import meta
    from jinja2.ext import Extension, loopcontrols

    class Generation(Extension):  # transformers' `{% generation %}` block, for training templates
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    env = jinja2.Environment(extensions=[loopcontrols, Generation])
    try:
        return set(meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateSyntaxError as err:
        raise UnsupportedModel(
            f"the tokenizer's chat template does not parse ({err}); fix the template"
        ) from None


def resolve_thinking_switch(tokenizer, switch: str) -> str | None:
    """The template variable the thinking flags drive, or None when they drive none (module docstring)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # several named templates: the default one renders the prompts
        template = template.get("default", "")
    variables = template_variables(template) if template else set()
    if switch == NO_SWITCH:
        return None
    if switch == AUTO_SWITCH:
        if DEFAULT_SWITCH in variables:
            return DEFAULT_SWITCH
        logger.warning(
            "the chat template reads no %s variable, so student_thinking and teacher_thinking have no effect "
            "and both roles render alike; set thinking_switch to the template's own switch if it has one, or "
            "thinking_switch=none to say it has none",
            DEFAULT_SWITCH,
        )
        return None
    if switch not in variables:
        shown = ", ".join(sorted(variables)) or "none"
        raise UnsupportedModel(
            f"thinking_switch={switch!r}, but the chat template reads no such variable (it reads: {shown}); "
            "name one of its variables, or thinking_switch=none for a template without a thinking switch"
        )
    return switch


def _read_template(path: str, placeholders: tuple[str, ...], default: str) -> str:
    if not path:
        return default
    p = Path(path).expanduser()
    # A regular UTF-8 file of at most 1 MiB (opsd.paths): /dev/zero or a FIFO is refused, not read forever.
    text = read_text(p, PROMPT_FILE)
    missing = [ph for ph in placeholders if ph not in text]
    if missing:
        raise InvalidValue(
            f"prompt template {str(p)!r} lacks placeholder(s) {missing}; it must contain {list(placeholders)}"
        )
    return text


@dataclass
class TeacherPrompt:
    ids: list[int]
    truncated: bool


class PromptBuilder:
    """Renders and tokenizes the two roles' prompts. Without a tokenizer only the plain texts are available."""

    def __init__(
        self,
        tokenizer=None,
        *,
        student_template_file: str = "",
        teacher_template_file: str = "",
        student_thinking: bool = False,
        teacher_thinking: bool = True,
        thinking_switch: str = AUTO_SWITCH,
        max_teacher_prompt_tokens: int = 0,
        reference_fraction: float = 1.0,
    ):
        self.tokenizer = tokenizer
        self.reference_fraction = reference_fraction
        self._cut_logged = False
        self.student_template = _read_template(student_template_file, ("{problem}",), STUDENT_TEMPLATE)
        self.teacher_template = _read_template(
            teacher_template_file, ("{problem}", "{reference}"), TEACHER_TEMPLATE
        )
        self.student_thinking = student_thinking
        self.teacher_thinking = teacher_thinking
        self.max_teacher_prompt_tokens = max_teacher_prompt_tokens
        self.switch = None if tokenizer is None else resolve_thinking_switch(tokenizer, thinking_switch)

    @classmethod
    def from_config(cls, tokenizer, config) -> PromptBuilder:
        """The prompts an `OPSDConfig` asks for (its template files, thinking switches and teacher cap)."""
        return cls(
            tokenizer,
            student_template_file=config.student_prompt_file,
            teacher_template_file=config.teacher_prompt_file,
            student_thinking=config.student_thinking,
            teacher_thinking=config.teacher_thinking,
            thinking_switch=config.thinking_switch,
            max_teacher_prompt_tokens=config.max_teacher_prompt_length,
            reference_fraction=config.teacher_ref_fraction,
        )

    def student_text(self, problem: str) -> str:
        return self.student_template.replace("{problem}", problem)

    def teacher_text(self, problem: str, reference: str) -> str:
        # The reference is substituted last so that a `{problem}` inside it stays literal.
        return self.teacher_template.replace("{problem}", problem).replace("{reference}", reference)

    def _render(self, text: str, thinking: bool) -> list[int]:
        rendered = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            tokenize=False,
            add_generation_prompt=True,
            **({self.switch: thinking} if self.switch else {}),
        )
        # The rendered text already carries the template's special tokens; adding BOS again would change it.
        return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]

    def student_ids(self, problem: str) -> list[int]:
        return self._render(self.student_text(problem), self.student_thinking)

    def reference_prefix(self, reference: str) -> str:
        """The first ceil(f x n) of the reference's n tokens (f = `reference_fraction`), cut on a token boundary of
        the model's tokenizer and decoded; the whole reference when f = 1. The cut keeps at least one whole
        character: where the first tokens are only part of one (a CJK character or an emoji is several byte
        tokens), it takes as many more as that character needs. The first cut is logged with its example."""
        f = self.reference_fraction
        if f >= 1 or not reference:
            return reference
        ids = self.tokenizer(reference, add_special_tokens=False)["input_ids"]
        # round: 0.3 x 10 is 3.0000000000000004 in floating point (the range of f keeps f x n from rounding to 0).
        keep = max(math.ceil(round(f * len(ids), REFERENCE_FRACTION_DECIMALS)), 1)
        # A cut inside a multi-byte character decodes to U+FFFD; drop it so the text stays a prefix.
        cut = self.tokenizer.decode(ids[:keep]).rstrip("\ufffd")
        while not cut and keep < len(ids):  # a floor of one whole character
            keep += 1
            cut = self.tokenizer.decode(ids[:keep]).rstrip("\ufffd")
        if not self._cut_logged:
            self._cut_logged = True
            logger.info(
                "teacher_ref_fraction=%g: the teacher sees the first %d of the reference's %d tokens, e.g. ...%r "
                "(cut) of ...%r",
                f, keep, len(ids), cut[-80:], reference[-80:],
            )  # fmt: skip
        return cut

    def teacher_ids(self, problem: str, reference: str) -> TeacherPrompt:
        """Teacher prompt ids: the reference cut to `reference_fraction` of its tokens (`reference_prefix`); an
        over-long prompt is then cut inside the reference, never in the problem (an empty reference leaves
        nothing to cut: the prompt is kept whole)."""
        reference = self.reference_prefix(reference)
        ids = self._render(self.teacher_text(problem, reference), self.teacher_thinking)
        limit = self.max_teacher_prompt_tokens
        if not limit or len(ids) <= limit:
            return TeacherPrompt(ids, False)
        if not reference:  # an empty reference block (teacher_ref_pairing=empty): nothing to cut
            logger.warning(
                "teacher prompt has %d tokens with an empty reference (limit %d); kept whole", len(ids), limit
            )
            return TeacherPrompt(ids, False)
        ref_ids = self.tokenizer(reference, add_special_tokens=False)["input_ids"]
        keep = max(len(ref_ids) - (len(ids) - limit), 0)
        # Re-tokenising the cut text can shift a boundary token or two, so shrink until it fits.
        while True:
            # A cut inside a multi-byte character decodes to U+FFFD; drop it so the reference stays a prefix.
            cut = self.tokenizer.decode(ref_ids[:keep]).rstrip("\ufffd") + TRUNCATION_MARK
            ids = self._render(self.teacher_text(problem, cut), self.teacher_thinking)
            if len(ids) <= limit or keep == 0:
                break
            keep = max(keep - max(len(ids) - limit, 1), 0)
        if len(ids) > limit:
            logger.warning(
                "teacher prompt has %d tokens without its reference (limit %d); kept whole", len(ids), limit
            )
        return TeacherPrompt(ids, True)


def reference_text(row: dict, teacher_ref: str, max_chars: int) -> str:
    """The privileged context of a training row: its `solution`, `COT_Reason` or `Answer` (the final answer alone,
    in the same template: docs/method.md §1.10), cut to `max_chars` characters."""
    column = REFERENCE_COLUMNS.get(teacher_ref)
    if column is None:
        raise ValueError(f"teacher_ref={teacher_ref!r}; choose one of {list(REFERENCE_COLUMNS)}")
    value = row[column]
    text = "" if value is None else str(value).strip() if column == "Answer" else str(value)
    if max_chars and len(text) > max_chars:
        text = text[:max_chars] + TRUNCATION_MARK
    return text


def teacher_rows(
    builder: PromptBuilder | None, problems, references, completion_ids_BC, completion_mask_BC, pad_id: int
):
    """The `[teacher prompt ; completion]` rows of a batch (left-padded teacher prompts, then the completions as
    they are) and how many teacher prompts were cut to their cap: (rows dict in TRL's batch keys, cut).

    Without a builder (a loss that reads no teacher: `loss_type=fixed_advantage`) no teacher prompt is rendered:
    the rows are the completions alone, which nothing scores."""
    import torch

    from opsd.method.hidden import left_pad

    if builder is None:
        return {"teacher_input_ids": completion_ids_BC, "teacher_attention_mask": completion_mask_BC}, 0
    built = [builder.teacher_ids(p, r) for p, r in zip(problems, references, strict=True)]
    ids, mask = left_pad([t.ids for t in built], pad_id, completion_ids_BC.device)
    rows = {
        "teacher_input_ids": torch.cat([ids, completion_ids_BC], dim=1),
        "teacher_attention_mask": torch.cat([mask, completion_mask_BC], dim=1),
    }
    return rows, sum(t.truncated for t in built)
