"""``jitckpt webhook serve`` and ``jitckpt webhook certs``.

Only the standard library is imported at module level (the CLI loads every
command module to build its help); FastAPI, uvicorn and the kubernetes client
are imported inside ``run``.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

log = logging.getLogger("webhook.serve")

DEFAULT_SERVICE = "jitckpt-webhook.jitckpt-system"
KEEP_ALIVE_SECONDS = 5
MAX_CONNECTIONS = 256


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="webhook_command", required=True, metavar="SUBCOMMAND")

    serve = sub.add_parser(
        "serve",
        help="run the admission server (POST /mutate) over TLS",
        description="Run the admission server. TLS files tls.crt and tls.key are read "
        "from --cert-dir and re-read whenever they change.",
    )
    serve.add_argument("--cert-dir", type=Path, required=True, help="directory of tls.crt/tls.key")
    serve.add_argument("--port", type=int, default=8443, help="HTTPS port (default 8443)")
    serve.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    serve.add_argument(
        "--config",
        type=Path,
        default=None,
        help="YAML config file: cluster-wide `defaults:` and injection options",
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--no-kube-api",
        action="store_true",
        help="do not look for a Kubernetes API; serve with the config file's defaults alone",
    )
    serve.add_argument(
        "--self-signed",
        action="store_true",
        help="create the serving certificate (shared through a Secret) and patch the "
        "MutatingWebhookConfiguration's caBundle at start",
    )
    serve.add_argument(
        "--webhook-config-name",
        default="jitckpt-webhook",
        help="the MutatingWebhookConfiguration whose caBundle --self-signed patches",
    )
    serve.add_argument("--service", default=DEFAULT_SERVICE, help="the webhook's Service, NAME.NS")
    serve.add_argument(
        "--tls-secret",
        default="jitckpt-webhook-tls",
        help="the Secret --self-signed keeps the shared certificate in",
    )
    serve.set_defaults(func=run_serve)

    certs = sub.add_parser(
        "certs",
        help="write a self-signed CA and serving certificate (ca.crt, tls.crt, tls.key)",
        description="Write a new self-signed CA and a serving certificate signed by it. "
        "Names that parse as IP addresses become IP SANs.",
    )
    certs.add_argument("--out", type=Path, required=True)
    certs.add_argument(
        "--dns",
        action="append",
        default=None,
        metavar="NAME",
        help=f"a name of the server (repeatable); default: the names of {DEFAULT_SERVICE}",
    )
    certs.set_defaults(func=run_certs)


def run_certs(args: argparse.Namespace) -> int:
    from webhook.certs import generate, write_bundle
    from webhook.selfsigned import service_dns_names

    names = args.dns or service_dns_names(DEFAULT_SERVICE)
    write_bundle(generate(names), args.out)
    print(f"wrote ca.crt, tls.crt, tls.key to {args.out} for {', '.join(names)}")
    return 0


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from webhook import gcpause
    from webhook.config import ConfigError
    from webhook.configfile import ConfigFile
    from webhook.events import AdmissionEvents
    from webhook.jsonlog import configure_logging
    from webhook.namespaces import NamespaceCache, NamespaceWatcher, kube_api_client
    from webhook.readdeadline import ReadDeadlineH11Protocol
    from webhook.selfsigned import install
    from webhook.server import create_app
    from webhook.tls import ReloadingTLS

    configure_logging(args.log_level)
    try:
        config = ConfigFile(args.config)
    except ConfigError as exc:
        log.error("invalid configuration: %s", exc)
        return 2
    api_client = None if args.no_kube_api else kube_api_client()
    if api_client is None:
        if args.self_signed:
            log.error("--self-signed needs a Kubernetes API (in-cluster or a kubeconfig)")
            return 2
        log.warning(
            "no Kubernetes API found (no in-cluster config, no kubeconfig): namespace "
            "annotations are not read; serving with the config file's defaults alone"
        )
    if args.self_signed:
        install(
            api_client,
            args.cert_dir,
            service=args.service,
            secret_name=args.tls_secret,
            webhook_config_name=args.webhook_config_name,
        )

    tls = ReloadingTLS(args.cert_dir)
    try:
        tls.load()
    except (OSError, ValueError) as exc:
        log.error("cannot load tls.crt/tls.key from %s: %s", args.cert_dir, exc)
        return 2

    cache: NamespaceCache | None = None
    watcher: NamespaceWatcher | None = None
    if api_client is not None:
        cache = NamespaceCache()
        watcher = NamespaceWatcher(api_client, cache)
        watcher.start()
    namespaces = cache

    def ready() -> bool:
        return tls.loaded and (namespaces is None or namespaces.synced)

    events = None
    if api_client is not None:
        from kubernetes import client

        events = AdmissionEvents(client.CoreV1Api(api_client))
    app = create_app(config, cache, ready=ready, events=events)
    server_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,
        access_log=False,
        ssl_context_factory=lambda _config, _default: tls.context,
        timeout_graceful_shutdown=10,
        # Slow clients: a request must arrive whole within REQUEST_READ_SECONDS, an
        # idle kept-alive connection is closed after KEEP_ALIVE_SECONDS, and past
        # MAX_CONNECTIONS connections (or tasks) uvicorn answers 503 at once.
        http=ReadDeadlineH11Protocol,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        limit_concurrency=MAX_CONNECTIONS,
    )
    log.info(
        "serving",
        extra={
            "fields": {"host": args.host, "port": args.port, "kube_api": api_client is not None}
        },
    )
    gcpause.settle()
    try:
        uvicorn.Server(server_config).run()
    finally:
        if watcher is not None:
            watcher.stop()
    return 0
