"""Issue 22's adversarial suite (tests/adversarial.py) against `ttserve up`, as an operator runs it:
one stack on loopback ports with API keys, the tiny vision model (so the image attacks run too), a
small queue (so a flood overflows it) and the control plane's metrics (so aborted requests are
checked for leaked KV blocks). Every attack must meet its expectation; the table is printed
(`pytest -s` shows it, with a progress line per attack).

The image URLs: the suite's media host (127.0.0.1) is an allowed domain and an allowed network, so
its redirect is really fetched (and must not be followed); 127.0.0.2 is an allowed domain but no
allowed network, so the private-address guard alone must refuse it. The third key has its own
request rate (rpm= in the keys file)."""
from __future__ import annotations

import urllib.error
import urllib.request

import pytest

import adversarial
from stack import Service, Stack, free_port, wait_until

pytestmark = pytest.mark.e2e

# The gateway's keys: the suite's own, a second tenant's, and one to rate-limit.
KEYS = ("adversary-key-0123456789", "second-tenant-key-abcdefgh", "rate-limited-key-ijklmnop")
RPM = 30
FLOOD = 24  # three times what 4 rows and a queue of 4 hold
MEDIA_HOST, OTHER_PRIVATE = "127.0.0.1", "127.0.0.2"
MEDIA_NETWORKS = (f"{MEDIA_HOST}/32",)
UP_FLAGS = ("--model", "tiny-vlm", "--max-num-seqs", "4", "--max-num-queued-reqs", "4",
            "--limit-images-per-prompt", "2", "--allowed-media-domains", MEDIA_HOST, OTHER_PRIVATE,
            "--allowed-media-networks", *MEDIA_NETWORKS)
KEYS_FILE = f"""# the adversarial suite's keys: NAME: KEY [rpm=N]
adversary: {KEYS[0]}
tenant-2: {KEYS[1]}
limited: {KEYS[2]} rpm={RPM}
"""


def ready(url: str, key: str) -> bool:
    """/ready with a key (stack.http_ok sends none, and with keys /ready needs one)."""
    request = urllib.request.Request(f"{url}/ready", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture(scope="module")
def keyed_up(tmp_path_factory, smollm2):  # smollm2: tiny-vlm is built from its tokenizer
    tmp = tmp_path_factory.mktemp("adversarial")
    key_file = tmp / "api-keys"
    key_file.write_text(KEYS_FILE)
    key_file.chmod(0o600)
    ports = [free_port() for _ in range(5)]
    up = Service("up", ["ttserve.cli", "up", "--port", str(ports[0]), "--control-port", str(ports[1]),
                        "--worker-port", str(ports[2]), "--control-metrics-port", str(ports[3]),
                        "--worker-metrics-port", str(ports[4]), *UP_FLAGS, "--api-key-file", str(key_file)],
                 tmp / "up.log").start()
    stack = Stack(services=[up], http_url=f"http://127.0.0.1:{ports[0]}",
                  control_metrics_url=f"http://127.0.0.1:{ports[3]}")
    try:
        wait_until(lambda: ready(stack.http_url, KEYS[0]), 300, "ttserve up to serve", stack)
        yield stack
    finally:
        up.stop(timeout=60)


def test_every_attack_meets_its_expectation(keyed_up):
    config = adversarial.Config(
        base_url=keyed_up.http_url, api_key=KEYS[0], second_api_key=KEYS[1], rate_limited_key=KEYS[2],
        control_metrics_url=keyed_up.control_metrics_url, flood=FLOOD, streams=6, limit_images_per_prompt=2,
        media_host_ip=MEDIA_HOST, allowed_media_networks=MEDIA_NETWORKS,
        slowloris_connections=50, slowloris_seconds=10, rate_limit_attempts=200)
    outcomes = adversarial.run(config, progress=print)
    print("\n" + adversarial.table(outcomes))
    assert len(outcomes) == len(adversarial.ATTACKS) + 1
    # This stack has everything every attack needs: a skip would be an attack that did not run.
    skipped = [o for o in outcomes if o.verdict == "skipped"]
    failed = [o for o in outcomes if o.verdict == "FAIL"]
    assert not failed and not skipped, (
        "\n".join(f"{o.verdict} {o.name}: {o.observed}" for o in failed + skipped)
        + f"\n--- ttserve up (last lines) ---\n{keyed_up.services[0].output()[-6000:]}")
    assert keyed_up.services[0].alive()
