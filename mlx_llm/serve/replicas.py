"""``mlx-llm serve --replicas N``: N engines behind Ray Serve's HTTP proxy, each replica its own Ray actor process
with its own engine and the same FastAPI app (``app.build_app``), so the endpoints and the log-prob contract are
the single server's. Ray routes each request to a replica (its power-of-two-choices router, by queue length);
every response names its replica in the ``x-mlx-llm-replica`` header (``host:pid``).

Without ``ray_address`` a local Ray instance is started for the server and shut down with it; with one (``auto``
or ``HOST:6379``, a cluster started with ``ray start``) the replicas are placed on the cluster's nodes, the run
directory must be at the same path on each, and on exit only this server's application is deleted.
"""


import os
import signal
import socket
import threading
import time

from mlx_llm.errors import ConfigError
from mlx_llm.kernels import Kernels
from mlx_llm.serve.app import REPLICA_HEADER, bound_socket, build_app, open_model, servable

APP_NAME = "mlx_llm"
__all__ = ["REPLICA_HEADER", "Replica", "serve_replicas"]


class Replica:
    """One engine replica (Ray Serve constructs it in its actor process; the app is built once it is loaded)."""

    def __init__(self, run_dir: str, model_options: dict, api_key, max_queue: int, jax_config: dict):
        import jax

        for name, value in jax_config.items():  # before the first compile: the CLI's compilation cache
            jax.config.update(name, value)
        kernels = Kernels(**{"attention_impl": "auto", "moe_impl": "auto", "loss_chunk": "auto",
                             **model_options.get("kernels", {})}).resolve()  # for this replica's backend
        self.model = open_model(run_dir, **{**model_options, "kernels": kernels})
        self.api_key, self.max_queue = api_key, max_queue
        self.name = f"{socket.gethostname()}:{os.getpid()}"

    def __serve_build_asgi_app__(self):
        return build_app(self.model, api_key=self.api_key, max_queue=self.max_queue, replica=self.name)


def free_port(host: str, port: int) -> int:
    """``port`` (0: one free now) after checking it can be bound on ``host``; Ray's proxy binds it itself, so it
    cannot be handed the socket."""
    with bound_socket(host, port) as sock:
        return sock.getsockname()[1]


def reach(address: str) -> None:
    """A ``HOST:PORT`` Ray address answers a TCP connect within 10 s (Ray itself retries a wrong one for
    minutes); ``auto`` and ``ray://`` addresses are left to Ray."""
    host, _, port = address.rpartition(":")
    if address == "auto" or "://" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
    except OSError as err:
        raise ConfigError(f"--ray-address {address}: no Ray cluster answers there ({err.strerror or err})") from None


def serve_replicas(run_dir, *, replicas: int, model_options: dict, host: str = "127.0.0.1", port: int = 8000,
                   api_key: str | None = None, max_queue: int = 256, grace: float = 30.0,
                   ray_address: str | None = None, replica_cpus: float = 1.0, replica_gpus: float = 0.0,
                   jax_config: dict | None = None, log=print) -> int:
    """Serve the run with ``replicas`` engines until SIGTERM or Ctrl-C; prints the URL once every replica is
    loaded (and, unless ``model_options`` says ``warm_up=False``, compiled). ``model_options`` are
    ``open_model``'s, with ``kernels`` the unresolved kernel settings (each replica resolves them);
    ``jax_config``: ``jax.config`` settings each replica applies before it compiles (the CLI passes its
    persistent compilation cache's; on a cluster, a directory every node shares). Returns 0."""
    import logging

    import ray
    from ray import serve

    servable(run_dir, model_options.get("step"))  # a run that cannot be served is refused before Ray starts
    if ray_address is None:
        cores = len(os.sched_getaffinity(0))
        if replicas * replica_cpus > cores:
            raise ConfigError(f"--replicas {replicas} × --replica-cpus {replica_cpus:g} needs "
                              f"{replicas * replica_cpus:g} CPUs; this machine has {cores} (lower --replica-cpus, "
                              "e.g. 0.5, to share them)")
        port = free_port(host, port)
    else:
        if port == 0:
            raise ConfigError("--port 0 needs a local Ray (the cluster's proxies bind on every node): give a port")
        reach(ray_address)
    started = time.perf_counter()
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # the driver's "application ready" chatter
    try:
        ray.init(address=ray_address, include_dashboard=False, logging_level=logging.WARNING, namespace="mlx_llm",
                 log_to_driver=False, **({"object_store_memory": 128 * 1024 ** 2} if ray_address is None else {}))
    except Exception as err:  # a cluster that is not there, or refuses this client (Ray's token authentication)
        what = f"join the Ray cluster at {ray_address}" if ray_address else "start a local Ray"
        why = (str(err).strip().strip("'\"").splitlines() or [repr(err)])[0]
        raise ConfigError(f"cannot {what}: {why}") from None
    try:
        have = ray.cluster_resources()
        for what, per, flag in (("CPU", replica_cpus, "--replica-cpus"), ("GPU", replica_gpus, "--replica-gpus")):
            if per and replicas * per > have.get(what, 0):
                raise ConfigError(f"--replicas {replicas} × {flag} {per:g} needs {replicas * per:g} {what}s; the "
                                  f"Ray cluster has {have.get(what, 0):g}")
        quiet = {"log_level": "WARNING", "enable_access_log": False}
        serve.start(http_options={"host": host, "port": port}, logging_config=quiet)
        options = dict(model_options, log=print)
        rows = model_options.get("max_seqs", 16)
        deployment = serve.deployment(
            serve.ingress()(Replica), name="engine", num_replicas=replicas,
            ray_actor_options={"num_cpus": replica_cpus, "num_gpus": replica_gpus},
            # a replica answers 429 itself once its own queue is full, before Ray's limits are reached
            max_ongoing_requests=rows + max_queue + 8, max_queued_requests=max_queue * replicas,
            graceful_shutdown_timeout_s=grace, graceful_shutdown_wait_loop_s=min(grace, 2.0),
            health_check_period_s=10, health_check_timeout_s=60)
        app = deployment.bind(str(run_dir), options, api_key, max_queue, dict(jax_config or {}))
        serve.run(app, name=APP_NAME, route_prefix="/", logging_config=quiet)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        shown = f"[{host}]" if ":" in host else host
        log(f"serving {options.get('name') or os.path.basename(os.path.normpath(run_dir))} at "
            f"http://{shown}:{port}/v1 with {replicas} replicas behind Ray Serve (ready in "
            f"{time.perf_counter() - started:.1f} s; SIGTERM or Ctrl-C stops)", flush=True)
        while not stop.wait(0.5):
            pass
        log("stopping: the replicas finish their requests (at most --grace seconds)", flush=True)
        serve.delete(APP_NAME)  # the replicas drain (Ray Serve's graceful shutdown); a local Ray then stops
    finally:
        ray.shutdown()
    return 0
