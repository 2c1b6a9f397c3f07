"""`ttserve up` hands each flag to the services that declare it."""
from __future__ import annotations

import pytest

from ttserve.up import READY_MARGIN_S, split_flags


def _flag(share: list[str], flag: str) -> str:
    """The value of `flag`'s last occurrence in a service's share."""
    return share[len(share) - 1 - share[::-1].index(flag) + 1]


def test_flags_go_to_their_services_and_ports_are_wired():
    args, shares = split_flags(["--port", "9000", "--max-num-seqs", "4", "--backend", "sim",
                                "--api-key", "k", "--model", "/m", "--additional-config.tt.trace_mode", "all"])
    assert args.port == 9000
    assert shares["control"][:2] == ["--max-num-seqs", "4"] and "--worker" in shares["control"]
    assert shares["worker"][:2] == ["--backend", "sim"] and "--model" in shares["worker"]
    assert "--additional-config.tt.trace_mode" in shares["worker"]
    assert "--api-key" in shares["gateway"] and "--model" not in shares["gateway"]
    assert _flag(shares["gateway"], "--control") == "127.0.0.1:50051"


def test_host_goes_to_every_service():
    _, shares = split_flags(["--host", "0.0.0.0"])
    assert all("0.0.0.0" in share for share in shares.values())
    assert "0=127.0.0.1:50061" in shares["control"]  # services reach each other on loopback; the worker is named 0


def test_a_flag_no_service_declares_is_refused(capsys):
    with pytest.raises(SystemExit):
        split_flags(["--no-such-flag", "1"])
    assert "--no-such-flag" in capsys.readouterr().err


def test_each_service_gets_its_own_metrics_port_and_every_service_the_shutdown_timeout(capsys):
    _, shares = split_flags(["--worker-metrics-port", "9500", "--shutdown-timeout", "5"])
    assert shares["worker"][-2:] == ["--metrics-port", "9500"]
    assert shares["control"][-2:] == ["--metrics-port", "9401"]
    assert all(share[share.index("--shutdown-timeout") + 1] == "5" for share in shares.values())
    with pytest.raises(SystemExit):
        split_flags(["--metrics-port", "9500"])
    assert "--control-metrics-port" in capsys.readouterr().err


def test_an_ipv6_host_is_bracketed_where_services_reach_each_other():
    args, shares = split_flags(["--host", "::1", "--port", "9000"])
    assert shares["control"][shares["control"].index("--worker") + 1] == "0=[::1]:50061"
    assert _flag(shares["gateway"], "--control") == "[::1]:50051"
    assert args.url == "http://[::1]:9000"


def test_certificates_go_to_every_service_and_keys_to_the_gateway_alone():
    tls = ["--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem", "--ssl-ca-certs", "ca.pem"]
    args, shares = split_flags([*tls, "--api-key-file", "keys", "--control-identity", "control", "--insecure"])
    assert all(share[:6] == tls and "--insecure" in share for share in shares.values())
    assert "--api-key-file" in shares["gateway"] and not any("--api-key-file" in shares[s] for s in ("worker", "control"))
    assert "--control-identity" in shares["worker"] and "--control-identity" not in shares["control"]
    assert args.url == "https://127.0.0.1:8000"  # up probes its gateway's /health over HTTPS


def test_check_reports_what_the_services_would_refuse(capsys, tmp_path):
    from ttserve.check import _parse, _security_problems

    _, shares = split_flags(["--host", "0.0.0.0", "--api-key-file", str(tmp_path / "missing")])
    problems = _security_problems(_parse("worker", shares["worker"]), _parse("gateway", shares["gateway"]))
    assert [fatal for fatal, _ in problems] == [True, True]
    assert "worker: refusing to serve" in problems[0][1] and "--api-key-file" in problems[1][1]


@pytest.mark.parametrize("flags, warmup", [([], 1800.0), (["--warmup-timeout", "5000"], 5000.0)])
def test_up_waits_longer_than_the_warmup_the_control_plane_is_given_and_so_does_its_gateway(flags, warmup):
    args, shares = split_flags(flags)
    assert args.ready_timeout == warmup + READY_MARGIN_S >= warmup
    assert float(_flag(shares["gateway"], "--ready-timeout")) == args.ready_timeout
    assert "--ready-timeout" not in shares["control"] and "--ready-timeout" not in shares["worker"]


def test_a_ready_timeout_given_to_up_is_its_own_and_its_gateways(caplog):
    args, shares = split_flags(["--ready-timeout", "60"])
    assert args.ready_timeout == 60 and _flag(shares["gateway"], "--ready-timeout") == "60"
    assert "below the control plane's --warmup-timeout 1800" in caplog.text
    args, shares = split_flags(["--ready-timeout", "0"])  # no limit, for both
    assert args.ready_timeout == 0 and _flag(shares["gateway"], "--ready-timeout") == "0"


def test_up_probes_its_gateways_ready_with_a_key_the_gateway_accepts(tmp_path):
    assert split_flags(["--api-key", "k1", "k2"])[0].probe_key == "k1"
    (tmp_path / "keys").write_text("# keys\nfile-key\n")
    assert split_flags(["--api-key-file", str(tmp_path / "keys")])[0].probe_key == "file-key"
    # A key file the gateway refuses (exit 2, which stops up) leaves up without one, not failed.
    assert split_flags(["--api-key-file", str(tmp_path / "missing")])[0].probe_key is None


def test_a_service_stops_when_up_dies_however_it_dies(tmp_path):
    """up's services run in sessions of their own; SIGKILL of up must still reach them (as
    SIGTERM), or a gateway left behind waits for its control plane forever."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child"
    parent = subprocess.Popen([sys.executable, "-c", f"""
import subprocess, sys, time
from ttserve.up import _stop_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                         preexec_fn=_stop_with_parent)
open({str(pid_file)!r}, "w").write(str(child.pid))
time.sleep(120)
"""])
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    raise AssertionError("the child outlived its SIGKILLed parent")


def test_speculative_config_goes_to_the_control_plane_alone():
    spec = '{"method": "ngram", "num_speculative_tokens": 4}'
    _, shares = split_flags(["--speculative-config", spec])
    assert _flag(shares["control"], "--speculative-config") == spec
    assert "--speculative-config" not in shares["gateway"] and "--speculative-config" not in shares["worker"]
