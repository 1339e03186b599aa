"""Attack: an upstream answer's usage that is absurdly large (a buggy or hostile model server)."""

import time

from modelyard.gateway.inference import json_response
from modelyard.protocols.openai import usage_tokens
from modelyard.state.quotas import MemoryQuotas, usage_day
from modelyard.tenancy import Limits, Scope


async def test_a_huge_usage_does_not_break_the_days_usage_report():
    tokens = usage_tokens(b'{"choices":[],"usage":{"total_tokens":18446744073709551615}}')
    assert tokens <= 1 << 40, f"usage taken at face value: {tokens}"


async def test_usage_report_survives_a_huge_settlement():
    store = MemoryQuotas()
    scopes = (Scope("key/k", Limits(tokens_per_minute=100)),)
    store.settle_now(scopes, "l1", "t", "k", 18446744073709551615, 0.0, False)
    rows = await store.usage(usage_day(time.time()))
    # GET /admin/usage writes the rows with json_response (orjson): a 500 for the rest of the day otherwise
    json_response({"tenants": [{"tokens": r.tokens} for r in rows]})
