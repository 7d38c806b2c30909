"""Compute-optimal model size and token count for a FLOP budget (Hoffmann et al. 2022, "Training Compute-Optimal
Large Language Models", the Chinchilla paper).

Two estimates, both with the paper's budget C = 6ND (N parameters, embeddings included; D training tokens):

- `ParametricLoss.optimal`: Approach 3. The fitted loss L(N, D) = E + A / N^alpha + B / D^beta (their eq. 2, fit
  in eq. 10: E = 1.69, A = 406.4, B = 410.7, alpha = 0.34, beta = 0.28) minimised under C = 6ND gives eq. 4,
  N_opt = G (C/6)^a and D_opt = G^-1 (C/6)^b with G = (alpha A / (beta B))^(1 / (alpha + beta)),
  a = beta / (alpha + beta), b = alpha / (alpha + beta). The paper notes (section 3.4) that this approach predicts
  smaller models than Approaches 1 and 2; with the printed, rounded constants it gives about 32B parameters for
  Gopher's budget, where the paper's figure 4 says 40B.
- `tokens_per_param_optimal`: Approaches 1 and 2 scale N and D equally (a = b = 0.50 and 0.49/0.51, Table 2);
  their Table 3 is about 20 tokens per parameter, the usual rule of thumb.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

CHINCHILLA_TOKENS_PER_PARAM = 20.0


@dataclass(frozen=True)
class ComputeOptimal:
    """A model size and a token count; `flops` is the 6ND they cost."""

    params: float
    tokens: float

    @property
    def flops(self) -> float:
        """Training FLOPs as C = 6ND (Kaplan et al. 2020; Hoffmann et al. 2022)."""
        return 6 * self.params * self.tokens

    @property
    def tokens_per_param(self) -> float:
        """Training tokens per parameter."""
        return self.tokens / self.params


@dataclass(frozen=True)
class ParametricLoss:
    """L(N, D) = E + A / N^alpha + B / D^beta (Hoffmann et al. 2022 eq. 2); the defaults are their fit, eq. 10."""

    e: float = 1.69
    a: float = 406.4
    b: float = 410.7
    alpha: float = 0.34
    beta: float = 0.28

    def loss(self, params: float, tokens: float) -> float:
        """Predicted final training loss (nats per token) of `params` parameters trained on `tokens` tokens."""
        return self.e + self.a / params**self.alpha + self.b / tokens**self.beta

    @property
    def params_exponent(self) -> float:
        """The paper's `a` in N_opt ∝ C^a: beta / (alpha + beta)."""
        return self.beta / (self.alpha + self.beta)

    @property
    def tokens_exponent(self) -> float:
        """The paper's `b` in D_opt ∝ C^b: alpha / (alpha + beta)."""
        return self.alpha / (self.alpha + self.beta)

    @property
    def g(self) -> float:
        """The paper's G = (alpha A / (beta B))^(1 / (alpha + beta)) of eq. 4."""
        return (self.alpha * self.a / (self.beta * self.b)) ** (1 / (self.alpha + self.beta))

    def optimal(self, flops: float) -> ComputeOptimal:
        """N and D that minimise `loss` with 6ND = `flops` (Hoffmann et al. 2022 eq. 4, Approach 3)."""
        return ComputeOptimal(
            params=self.g * (flops / 6) ** self.params_exponent,
            tokens=(flops / 6) ** self.tokens_exponent / self.g,
        )


CHINCHILLA_FIT = ParametricLoss()


def tokens_per_param_optimal(flops: float, tokens_per_param: float = CHINCHILLA_TOKENS_PER_PARAM) -> ComputeOptimal:
    """N and D with D = `tokens_per_param` x N and 6ND = `flops`: N_opt ∝ C^0.5 (Hoffmann et al. 2022, Approach 1)."""
    params = math.sqrt(flops / (6 * tokens_per_param))
    return ComputeOptimal(params=params, tokens=tokens_per_param * params)
