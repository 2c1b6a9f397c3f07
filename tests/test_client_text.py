"""Reasons as clients read them: worker names, never internal addresses (control/client_text.py)."""
from __future__ import annotations

from ttserve.control.client_text import WITHHELD, for_client

WORKERS = {"10.0.0.7:50061": "w0", "worker-1.ttserve-worker:50061": "w1"}


def test_worker_addresses_become_names_and_other_addresses_are_withheld():
    assert for_client("no worker is ready (worker w0 at 10.0.0.7:50061: worker at 10.0.0.7:50061 failed step 4: "
                      "ValueError: x)", WORKERS) == "no worker is ready (worker w0: worker w0 failed step 4: ValueError: x)"
    assert for_client("worker at worker-1.ttserve-worker:50061 went away", WORKERS) == "worker w1 went away"
    assert for_client("connect to 192.168.3.4:9000 and [fd00::1]:50061 failed", WORKERS) == \
        f"connect to {WITHHELD} and {WITHHELD} failed"
    assert for_client("max_tokens must be at least 1, got 0", WORKERS) == "max_tokens must be at least 1, got 0"


def test_regex_text_survives_and_the_longest_address_is_replaced_first():
    assert for_client("regex parse error: [abc]+ at prefixItems/[0]", WORKERS) == \
        "regex parse error: [abc]+ at prefixItems/[0]"
    assert for_client("worker at w1:50061 failed", {"w1:5006": "a", "w1:50061": "b"}) == "worker b failed"
