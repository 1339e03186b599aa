"""Tenants' limits: what a key or a tenant may spend, and the window arithmetic every quota store
shares (pure: no I/O, no clock reads)."""

from modelyard.tenancy.limits import (
    NO_LIMITS,
    PERIODS,
    Limits,
    Scope,
    Usage,
    Verdict,
    budget_period,
    parse_limits,
    reset_text,
)

__all__ = [
    "NO_LIMITS",
    "PERIODS",
    "Limits",
    "Scope",
    "Usage",
    "Verdict",
    "budget_period",
    "parse_limits",
    "reset_text",
]
