"""Membership diffing and the other pure pieces around it (no Ray, no router)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fornax.cluster.membership import diff_membership
from fornax.cluster.process import parse_load

A, B, C = "http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"
TAGS = {"replica": "r0"}


def test_new_replicas_are_added_with_their_tags() -> None:
    diff = diff_membership({A: TAGS, B: {"replica": "r1"}}, [A], managed={A})
    assert diff.add == {B: {"replica": "r1"}} and diff.remove == ()


def test_a_restart_swaps_the_url() -> None:
    diff = diff_membership({C: TAGS}, [A, B], managed={A, B})
    assert diff.add == {C: TAGS} and diff.remove == (A, B)


def test_only_managed_urls_are_removed() -> None:
    manual = "http://10.0.0.5:8000"  # added by an operator: not ours to take away
    diff = diff_membership({}, [A, manual], managed={A})
    assert diff.remove == (A,) and not diff.add


def test_in_sync_is_an_empty_diff_and_slashes_do_not_matter() -> None:
    diff = diff_membership({A + "/": TAGS}, [A], managed={A})
    assert not diff
    assert not diff_membership({A: TAGS}, [A + "/"], managed={A})


def test_parse_load_sums_the_engine_gauges() -> None:
    text = (
        "# HELP fornax:num_requests_waiting Sequences waiting to be scheduled.\n"
        "# TYPE fornax:num_requests_waiting gauge\n"
        'fornax:num_requests_waiting{model_name="m one"} 3.0\n'
        "# TYPE fornax:num_requests_running gauge\n"
        'fornax:num_requests_running{model_name="a"} 2.0\n'
        'fornax:num_requests_running{model_name="b"} 1.0\n'
        "# TYPE fornax:num_requests_waiting_other gauge\n"
        'fornax:num_requests_waiting_other{model_name="a"} 99.0\n'
    )
    load = parse_load(text)
    assert (load.waiting, load.running) == (3.0, 3.0)


def test_fornax_and_the_cluster_cli_import_without_ray() -> None:
    code = (
        "import sys; sys.modules['ray'] = None\n"  # importing ray now fails, as if absent
        "import fornax, fornax.cli, fornax.cluster, fornax.cluster.cli, fornax.cluster.controller\n"
        "from fornax.cli import build_parser; build_parser()\n"
        "from fornax.cli import main; sys.exit(main(['cluster', 'up', '--replicas', '2']))"
    )
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert (
        r.stderr.strip().splitlines()[-1]
        == "fornax: error: `fornax cluster` needs Ray: pip install 'fornax[cluster]'"
    )


def test_serve_flags_pass_through_to_each_replica() -> None:
    from fornax.cli import build_parser
    from fornax.cluster.cli import cluster_config

    args = build_parser().parse_args(
        [
            "cluster",
            "up",
            "m",
            "--replicas",
            "2",
            "--max-replicas",
            "4",
            "--threads-per-replica",
            "2",
            "--max-model-len",
            "256",
            "--quantization",
            "auto",
            "--no-access-log",
            "--shutdown-timeout",
            "7",
            "--port",
            "9100",
        ]
    )
    config = cluster_config(args)
    assert config.replica.serve_args == ("--quantization=auto", "--max-model-len=256", "--no-access-log")
    assert (config.replica.model, config.replica.num_threads, config.replica.shutdown_timeout_s) == (
        "m",
        2,
        7.0,
    )
    assert (config.replicas, config.scaling.min_replicas, config.scaling.max_replicas) == (2, 2, 4)
    assert (config.router_port, config.replica.metrics_key) == (9100, None)


def test_replicas_with_keys_get_a_key_for_their_metrics() -> None:
    from fornax.cli import build_parser
    from fornax.cluster.cli import cluster_config

    config = cluster_config(build_parser().parse_args(["serve", "m", "--replicas", "3", "--api-key", "sk-a"]))
    key = config.replica.metrics_key
    assert key and config.replica.serve_args[-2:] == ("--admin-key", f"fornax-cluster:{key}")
    assert config.router_args == ("--api-key=sk-a",) and config.router_port == 8000 and config.router_auth
    assert (config.scaling.min_replicas, config.scaling.max_replicas) == (3, 3)


def test_the_router_polls_keyed_replicas_with_their_generated_key() -> None:
    """The replicas' generated admin key is the router's poll key, not a replacement for
    the clients' keys (--replica-api-key): those still reach the replicas."""
    from fornax.cli import build_parser, router_parser
    from fornax.cluster.cli import cluster_config
    from fornax.cluster.controller import ClusterController
    from fornax.router.cli import router_config

    keyed = cluster_config(build_parser().parse_args(["serve", "m", "--replicas", "2", "--api-key", "sk-a"]))
    args = ClusterController(keyed).router_args("ctl-key")
    router = router_config(router_parser().parse_args(["router", *args]))
    assert router.replica_poll_key == keyed.replica.metrics_key and router.replica_api_key is None
    assert router.poll_key == keyed.replica.metrics_key
    assert ("fornax-cluster", "ctl-key") in router.admin_keys and "sk-a" in {k for _, k in router.api_keys}
    open_ = cluster_config(build_parser().parse_args(["serve", "m", "--replicas", "2"]))
    assert not any(a.startswith("--replica-poll-key") for a in ClusterController(open_).router_args(None))


def test_keys_starting_with_a_dash_survive_the_hand_off() -> None:
    """Generated keys (secrets.token_urlsafe) start with "-" one time in 64: passed as
    `FLAG VALUE`, the next parser took such a key for a flag of its own and exited."""
    from dataclasses import replace

    from fornax.cli import build_parser, router_parser
    from fornax.cluster.cli import cluster_config
    from fornax.cluster.controller import ClusterController
    from fornax.router.cli import router_config

    config = cluster_config(
        build_parser().parse_args(["serve", "m", "--replicas", "2", "--api-key=-user-key"])
    )
    config = replace(config, replica=replace(config.replica, metrics_key="-generated-key"))
    router = router_config(
        router_parser().parse_args(["router", *ClusterController(config).router_args("-ctl")])
    )
    assert router.replica_poll_key == "-generated-key"
    assert "-user-key" in {k for _, k in router.api_keys} and ("fornax-cluster", "-ctl") in router.admin_keys


def test_bad_sizes_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from fornax.cli import main

    assert main(["cluster", "up", "--replicas", "3", "--max-replicas", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "fornax: error: --max-replicas must be at least --min-replicas", err
