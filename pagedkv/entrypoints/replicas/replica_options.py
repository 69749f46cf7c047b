"""The options of ``pagedkv serve --replicas N``, free of Ray so that the CLI and its ``--help`` need none."""

from __future__ import annotations

import argparse

# name -> (Ray Serve request router class, or None for Ray's default; what the ingress computes for it)
ROUTERS: dict[str, tuple[str | None, str]] = {
    "block-keys": ("pagedkv.entrypoints.replicas.prefix_router.BlockKeyRouter", "block_keys"),
    "ray-prefix": (
        "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter",
        "text",
    ),
    "pow2": (None, "none"),
    "random": ("pagedkv.entrypoints.replicas.prefix_router.RandomRouter", "none"),
}
ROUTER_HELP = (
    "block-keys: pagedkv's router on its own prefix-cache block keys (salted); ray-prefix: Ray Serve's "
    "PrefixCacheAffinityRouter on the prompt text; pow2: Ray's default (power of two choices, by load); "
    "random: a uniformly random replica"
)
RAY_ONLY = ("ray_address", "replica_cpus")


def add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("replicas on Ray Serve (needs: pip install 'pagedkv[ray]')")
    group.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="run N engines as Ray Serve replicas behind the same routes, sending requests that share a prompt "
        "prefix to the replica that holds it (default: one engine in this process, no Ray)",
    )
    group.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="join this Ray cluster (the address `ray start --head` prints) instead of starting a local one "
        "that listens on 127.0.0.1 only",
    )
    group.add_argument("--router", choices=tuple(ROUTERS), default="block-keys", help=ROUTER_HELP)
    group.add_argument(
        "--replica-cpus",
        type=float,
        default=None,
        metavar="X",
        help="CPUs Ray reserves for each replica, fractions allowed; the engine runs floor(X) threads (at least "
        "1) unless --threads says otherwise (default: the cluster's CPUs shared evenly)",
    )


def replicas_requested(args: argparse.Namespace) -> bool:
    """Whether ``serve`` runs on Ray; Ray-only options without ``--replicas`` are a mistake worth naming."""
    if args.replicas is None:
        given = [name for name in RAY_ONLY if getattr(args, name) is not None]
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise SystemExit(f"pagedkv serve: {flags} only apply with --replicas N")
        return False
    if args.replicas < 1:
        raise SystemExit(f"pagedkv serve: --replicas must be >= 1, got {args.replicas}")
    return True
