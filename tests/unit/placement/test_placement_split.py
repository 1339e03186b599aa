"""The rollout traffic split (compat §6.2 step 3): Seldon's formula and its test table."""

from __future__ import annotations

import pytest

from modelyard.placement import traffic_split


@pytest.mark.parametrize(
    ("n_old", "n_new", "expected"),
    [
        (1, 1, (50, 50)),  # 1:1 -> 50/50
        (1, 2, (33, 67)),  # 2 new : 1 old -> 67/33 new/old
        (2, 1, (66, 34)),  # 1 new : 2 old -> 34/66 new/old (the old share is floored)
        (0, 1, (0, 100)),  # old has nothing routable -> all to the new version
        (0, 3, (0, 100)),
        (3, 0, (100, 0)),
        (0, 0, None),  # Seldon divides by zero here; there is simply no split, and no endpoint
    ],
)
def test_old_and_new_shares_by_routable_replicas(n_old, n_new, expected):
    assert traffic_split(n_old, n_new) == expected


def test_negative_counts_are_refused():
    with pytest.raises(ValueError, match="negative"):
        traffic_split(-1, 1)
