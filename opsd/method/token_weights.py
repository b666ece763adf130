"""Per-token weights of the loss (`token_weight`, docs/method.md §1.12): the field's four opposite prescriptions,
each by its source's formula and parameters. Off (`none`) by default, as OPSD publishes.

With A_t = log p_target(y_t) - log p_S(y_t) the sampled token's advantage (p_target: the teacher, or the
contrastive target q), every weight is a detached constant w_t that multiplies token t's loss (and so its
gradient). The loss keeps its normalisation (the step's valid tokens), so arms with different weights differ only
in the weights, not in a denominator.

- `position_early` (IW-OPD, arXiv 2606.22600; TRL's `IWOPDTrainer`): w_t = 1 + γ (1 - C_<t / max(C, ε)), with
  C_<t = Σ_{s<t} |A_s| and C = Σ_s |A_s| over the row's tokens; γ = 0.5, ε = 1e-8. Early tokens, before the
  discrepancy has accumulated, weigh up to 1 + γ.
- `position_late` (position-weighted OPSD, arXiv 2605.21606): w_t = w_min + (1 - w_min) σ((f_t - τ) / s),
  f_t = (k_t - 0.5) / L with k_t the token's 1-based place among its row's L loss tokens; w_min = 0.25, τ = 0.30,
  s = 0.10 (the paper's schedule for every model).
- `entropy_gate` (EGRSD, arXiv 2605.13255, a teacher-entropy gate with a floor): w_t = g + (1 - g) exp(-H_t / h),
  H_t the teacher's entropy at the loss temperature (nats, full vocabulary); g = 0.1, h = 1 nat. The paper's
  gate shape and constants are not published with code: this form and both constants are this project's reading.
- `positive_only` (practitioners' "positive pressure"): w_t = 1[A_t > 0], only tokens the target makes likelier.
"""

from __future__ import annotations

import torch

# The choices (`token_weight`) are declared with the switch, in opsd.configuration.switches.
# Weights that read a row's tokens in order (the loss is given each token's row); the others are per token.
ROW_WEIGHTS = ("position_early", "position_late")

IW_OPD_GAMMA = 0.5
IW_OPD_EPSILON = 1e-8
PW_OPSD_W_MIN = 0.25
PW_OPSD_TAU = 0.30
PW_OPSD_S = 0.10
ENTROPY_GATE_FLOOR = 0.1
ENTROPY_GATE_SCALE = 1.0


def _row_starts(rows_N: torch.Tensor) -> torch.Tensor:
    """(N,) index of the first token of each token's row; rows_N holds each token's row id, rows contiguous."""
    n = rows_N.shape[0]
    first_N = torch.ones(n, dtype=torch.bool, device=rows_N.device)
    if n > 1:
        first_N[1:] = rows_N[1:] != rows_N[:-1]
    idx_N = torch.arange(n, device=rows_N.device)
    return torch.cummax(torch.where(first_N, idx_N, torch.zeros_like(idx_N)), 0).values


def _row_sums(values_N: torch.Tensor, rows_N: torch.Tensor) -> torch.Tensor:
    """(N,) the sum of `values_N` over each token's row."""
    _, inverse_N = torch.unique_consecutive(rows_N, return_inverse=True)
    sums = torch.zeros(
        int(inverse_N.max()) + 1 if len(rows_N) else 0, dtype=values_N.dtype, device=values_N.device
    )
    return sums.index_add_(0, inverse_N, values_N)[inverse_N]


def position_late(rows_N: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """PW-OPSD's weights (N,) from each token's row id (tokens in order, rows contiguous)."""
    idx_N = torch.arange(rows_N.shape[0], device=rows_N.device)
    k_N = (idx_N - _row_starts(rows_N) + 1).to(dtype)
    length_N = _row_sums(torch.ones_like(k_N), rows_N)
    frac_N = (k_N - 0.5) / length_N
    return PW_OPSD_W_MIN + (1 - PW_OPSD_W_MIN) * torch.sigmoid((frac_N - PW_OPSD_TAU) / PW_OPSD_S)


def position_early(advantage_N: torch.Tensor, rows_N: torch.Tensor) -> torch.Tensor:
    """IW-OPD's weights (N,) from each token's advantage A and row id (tokens in order, rows contiguous)."""
    magnitude_N = (
        advantage_N.abs().double()
    )  # a running sum over a whole batch: float64 keeps it exact enough
    inclusive_N = magnitude_N.cumsum(0)
    start_N = _row_starts(rows_N)
    before_row_N = inclusive_N[start_N] - magnitude_N[start_N]
    accumulated_N = inclusive_N - magnitude_N - before_row_N  # Σ_{s<t} |A_s| within the row
    total_N = _row_sums(magnitude_N, rows_N).clamp(min=IW_OPD_EPSILON)
    return (1 + IW_OPD_GAMMA * (1 - accumulated_N / total_N)).to(advantage_N.dtype)


def entropy_gate(logp_t_NV: torch.Tensor) -> torch.Tensor:
    """EGRSD-style gate (N,) from the teacher's log-probabilities (N, V)."""
    entropy_N = -(logp_t_NV.exp() * logp_t_NV).sum(-1)
    return ENTROPY_GATE_FLOOR + (1 - ENTROPY_GATE_FLOOR) * torch.exp(-entropy_N / ENTROPY_GATE_SCALE)


def positive_only(advantage_N: torch.Tensor) -> torch.Tensor:
    """1 where the target makes the sampled token likelier than the student does (A > 0), else 0 (N,)."""
    return (advantage_N > 0).to(advantage_N.dtype)
