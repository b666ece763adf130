"""`LossSettings`: the loss's arguments as one value, which `OPSDConfig.loss_settings` builds and every caller of
`opsd.method.loss` passes on. It sits with the configuration because the config builds it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LossSettings:
    """The loss's arguments, built in one place from a checked config (`OPSDConfig.loss_settings`).

    beta: the divergence's interpolation in [0, 1]; temperature > 0 of both distributions; clip > 0 and
    clip_mode (opsd.configuration.choices.CLIP_MODES) the clip of the divergence; teacher_support_k: both
    distributions restricted to the teacher's top-k entries when 0 < k < V, else the full vocabulary;
    loss_type (LOSS_TYPES); chunk_size > 0: tokens whose (chunk, V) logits exist at a time;
    contrast_weight: None for OPSD's teacher, else lambda >= 0 of the contrastive target (a second teacher
    forward under a wrong hint, docs/method.md §1.10); fixed_advantage < 0: the constant advantage of
    loss_type="fixed_advantage" (no teacher). The config checks every value where it enters
    (opsd/configuration/ranges.py, choices.py); nothing here does again.
    """

    beta: float
    temperature: float
    clip: float
    clip_mode: str
    teacher_support_k: int
    loss_type: str
    chunk_size: int
    contrast_weight: float | None = None
    fixed_advantage: float = -0.25

    @property
    def needs_teacher(self) -> bool:
        """Whether the loss reads a teacher at all (fixed_advantage reads none)."""
        return self.loss_type != "fixed_advantage"
