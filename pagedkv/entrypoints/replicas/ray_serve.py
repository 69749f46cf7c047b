"""``pagedkv serve --replicas N``: N engines as Ray Serve replicas behind the same OpenAI routes.

What it sets up, and why:

- Ray's usage reporting is off (``RAY_USAGE_STATS_ENABLED=0``) and no dashboard runs.
- Without ``--ray-address``, a fresh local cluster (``address="local"``: never one that happens to run on
  the machine) whose every process listens on 127.0.0.1 only: Ray binds its servers to the node's address,
  and single-machine mode makes that the loopback one.
- Serve's HTTP proxy listens on ``--host``/``--port`` on the head node only (127.0.0.1:8000 by default):
  the one address the user gave. The ingress keeps the one-process server's checks (Host, API key).
- Each replica reserves ``--replica-cpus`` CPUs (fractions allowed) and runs an explicit thread count,
  which is also its process's ``OMP_NUM_THREADS``, so torch and OpenMP agree; it takes at most
  ``max_num_seqs`` requests at once (Ray's default cap is 5), the rest wait in the router.

On SIGINT / SIGTERM the application is deleted (replicas finish what they hold, up to Serve's graceful
shutdown timeout), then Ray is shut down; a local cluster goes with it.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import threading
from typing import Any

from pagedkv.entrypoints.replicas.replica_options import ROUTERS
from pagedkv.entrypoints.server.limits import ServerLimits
from pagedkv.entrypoints.server.openai_server import is_loopback

logger = logging.getLogger(__name__)

APP_NAME = "pagedkv"
ROUTING_STATS_PERIOD_S = 5.0


def default_replica_cpus(node_cpus: list[float], replicas: int) -> float:
    """CPUs per replica so that ``replicas`` fit on these nodes when spread evenly: the cluster's share,
    but no more than the smallest node can give each of the replicas it would get."""
    per_node = math.ceil(replicas / len(node_cpus))
    return min(sum(node_cpus) / replicas, min(node_cpus) / per_node)


def replica_threads(engine_kwargs: dict, replica_cpus: float) -> int:
    return engine_kwargs.get("num_threads") or max(1, math.floor(replica_cpus))


def build_replica_app(args: argparse.Namespace, engine_kwargs: dict, replica_cpus: float) -> Any:
    """The Serve application: the ingress bound to a handle of the engine deployment."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from pagedkv.entrypoints.replicas.ray_deployments import EngineReplica, Ingress

    router_class, routing_kind = ROUTERS[args.router]
    threads = replica_threads(engine_kwargs, replica_cpus)
    router = {"request_router_class": router_class} if router_class is not None else {}
    router_config = RequestRouterConfig(request_routing_stats_period_s=ROUTING_STATS_PERIOD_S, **router)
    limits = ServerLimits.from_args(args)
    engine = serve.deployment(
        EngineReplica,
        name="PagedKVEngine",
        num_replicas=args.replicas,
        max_ongoing_requests=engine_kwargs["max_num_seqs"],
        ray_actor_options={
            "num_cpus": replica_cpus,
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}},
        },
        request_router_config=router_config,
    ).bind({**engine_kwargs, "num_threads": threads}, args.served_model_name, limits)
    ingress = serve.deployment(
        serve.ingress()(Ingress),  # an ASGI ingress: each replica builds its app after __init__
        name="PagedKVIngress",
        num_replicas=1,
        # it only waits on replicas: let it hold every request they can run or queue
        max_ongoing_requests=args.replicas * (engine_kwargs["max_num_seqs"] + limits.max_queued_seqs),
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(
        engine,
        engine_kwargs["model"],
        engine_kwargs["block_size"],
        routing_kind,
        args.api_key,
        is_loopback(args.host),
        limits.stream_stall_timeout_s,
    )


def _import_ray() -> tuple[Any, Any]:
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise SystemExit(f"pagedkv serve --replicas needs Ray Serve: pip install 'pagedkv[ray]' ({exc})") from exc
    return ray, serve


class _Stop(BaseException):
    """SIGINT / SIGTERM: unwinds whatever the main thread is waiting on (start-up included) to the tear-down."""


def _stop(*_: object) -> None:
    raise _Stop


def serve_replicas(args: argparse.Namespace, engine_kwargs: dict) -> int:
    """Start (or join) a Ray cluster, deploy the app, serve until SIGINT / SIGTERM; the exit code."""
    from pagedkv.config import EngineConfig
    from pagedkv.model.loader import model_directory

    EngineConfig(**engine_kwargs)  # a bad option fails here, not N times in the replicas
    if (engine_kwargs.get("tensor_parallel_size") or 1) > 1:
        raise SystemExit("pagedkv serve: --replicas runs one-process engines; drop --tensor-parallel-size")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    if args.ray_address is None:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # single-machine mode: node address 127.0.0.1
    ray, serve = _import_ray()

    model_directory(engine_kwargs["model"])  # a GGUF is converted here once, not by N replicas at a time
    ray.init(address=args.ray_address or "local", include_dashboard=False, namespace=APP_NAME)
    # after ray.init, which installs its own SIGTERM handler (exit at once, leaving the cluster behind)
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        nodes = [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n["Alive"]]
        cpus = args.replica_cpus or default_replica_cpus([c for c in nodes if c > 0] or [1.0], args.replicas)
        serve.start(proxy_location="HeadOnly", http_options={"host": args.host, "port": args.port})
        serve.run(build_replica_app(args, engine_kwargs, cpus), name=APP_NAME, route_prefix="/")
        logger.warning(
            "pagedkv: %d replicas (%.2f CPUs, %d threads each, router %s) serving on http://%s:%d",
            args.replicas,
            cpus,
            replica_threads(engine_kwargs, cpus),
            args.router,
            args.host,
            args.port,
        )
        threading.Event().wait()
    except _Stop:
        logger.warning("pagedkv: shutting down")
    finally:
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)  # the tear-down runs to its end
        _tear_down(ray, serve, local=args.ray_address is None)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _tear_down(ray: Any, serve: Any, local: bool) -> None:
    """Our application goes; so does Serve, and the cluster, when we started them."""
    try:
        if local:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
    finally:
        ray.shutdown()
