"""The traffic split between a model's old and new version during a rollout (compat §6.2 step 3).

While the model's last ModelAvailable version is not its latest and both have routable replicas,
Seldon's Envoy sends each version a share proportional to its routable replicas:

    old_share = floor(n_old * 100 / (n_old + n_new))
    new_share = 100 - old_share

Seldon divides by zero when neither version has a routable replica (the relocation of a model whose
only replicas disappeared, compat §6.2 step 7); here that case has no split at all (None): the
model has nowhere to send traffic.
"""

from __future__ import annotations


def traffic_split(n_old: int, n_new: int) -> tuple[int, int] | None:
    """(old share, new share) in percent from each version's routable replicas; None if both are 0."""
    if n_old < 0 or n_new < 0:
        raise ValueError(f"replica counts must not be negative: old {n_old}, new {n_new}")
    if n_old + n_new == 0:
        return None
    old = n_old * 100 // (n_old + n_new)
    return old, 100 - old
