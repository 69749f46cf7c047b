"""``pagedkv serve --replicas``: the options, the CPU share per replica, and a plain install that never
imports Ray (no Ray cluster is started here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedkv.entrypoints.cli import build_parser, engine_kwargs
from pagedkv.entrypoints.replicas import ray_serve
from pagedkv.entrypoints.replicas.replica_options import ROUTERS, replicas_requested


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_replicas_are_opt_in_and_ray_only_options_need_them():
    assert not replicas_requested(parse())
    args = parse("--replicas", "2", "--ray-address", "10.0.0.1:6379", "--replica-cpus", "0.5")
    assert replicas_requested(args) and args.router == "block-keys" and args.replica_cpus == 0.5
    with pytest.raises(SystemExit, match="--ray-address only apply with --replicas"):
        replicas_requested(parse("--ray-address", "10.0.0.1:6379"))
    with pytest.raises(SystemExit, match="--replicas must be >= 1"):
        replicas_requested(parse("--replicas", "0"))
    with pytest.raises(SystemExit):
        parse("--replicas", "2", "--router", "round-robin")  # argparse: not a choice


def test_every_router_names_a_class_and_what_the_ingress_computes_for_it():
    kinds = {kind for _, kind in ROUTERS.values()}
    assert kinds <= {"block_keys", "text", "none"} and ROUTERS["block-keys"][1] == "block_keys"
    assert ROUTERS["pow2"][0] is None  # Ray's default router


@pytest.mark.parametrize(
    ("nodes", "replicas", "share"),
    [
        ([2.0], 2, 1.0),  # this machine: a core each
        ([2.0], 3, 2 / 3),  # fractions: three replicas share two cores
        ([16.0, 16.0], 3, 8.0),  # two per node on one of them: half a node each
        ([2.0, 16.0], 2, 2.0),  # no more than the small node can hold
        ([8.0, 8.0], 2, 8.0),
    ],
)
def test_the_default_cpu_share_fits_the_replicas_on_the_nodes(nodes, replicas, share):
    assert ray_serve.default_replica_cpus(nodes, replicas) == pytest.approx(share)


def test_the_thread_count_is_explicit():
    assert ray_serve.replica_threads({"num_threads": None}, 2 / 3) == 1
    assert ray_serve.replica_threads({"num_threads": None}, 8.0) == 8
    assert ray_serve.replica_threads({"num_threads": 3}, 8.0) == 3


def test_replicas_of_tensor_parallel_engines_are_refused():
    args = parse("--replicas", "2", "--tensor-parallel-size", "2")
    with pytest.raises(SystemExit, match="drop --tensor-parallel-size"):
        ray_serve.serve_replicas(args, engine_kwargs(args))


def test_without_ray_the_error_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` sees when it is not installed
    with pytest.raises(SystemExit, match=r"pip install 'pagedkv\[ray\]'"):
        ray_serve._import_ray()


def test_the_command_line_does_not_import_ray():
    code = "import sys, pagedkv.entrypoints.cli as c; c.build_parser(); print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
