"""Errors of the bidbrain package."""

from __future__ import annotations

from orchestrator.errors import OrchestratorError, UserError


class BidBrainError(OrchestratorError):
    """Base of bidbrain errors that are not the user's doing."""


class UnknownPolicyError(UserError):
    """A policy or strategy name that is not registered."""


class BudgetError(UserError):
    """A budget that cannot be used (zero, negative, or below the reliable tier's cost)."""


class DeadlineError(UserError):
    """A deadline that cannot be met, or a policy that needs one and has none."""
