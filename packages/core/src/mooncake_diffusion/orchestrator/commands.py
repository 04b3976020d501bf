"""The ``mooncake-diffusion orchestrator`` and ``mooncake-diffusion worker`` commands.

``add_commands(subparsers)`` adds both to the CLI; each runs until SIGTERM or
Ctrl-C. The orchestrator prints one ``ready`` line with its addresses once it
serves (scripts and tests wait for it); a worker prints one once welcomed, and
one ``stage change`` line each time the orchestrator moved it to other stages.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
from typing import Any

__all__ = ["add_commands"]

TOKEN_ENV = "MCD_ORCHESTRATOR_TOKEN"
#: ``store_watch_s`` of a stage worker when ``MOONCAKE_DIFFUSION_STORE_WATCH_S`` is unset
WORKER_STORE_WATCH_S = 1.0


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"labels are KEY=VALUE, got {text!r}")
    return key, value


def _planner_option(text: str) -> tuple[str, float | int]:
    key, sep, value = text.partition("=")
    try:
        number: float | int = int(value) if value.lstrip("-").isdigit() else float(value)
    except ValueError:
        number = float("nan")
    if not sep or not key.isidentifier() or number != number:
        raise argparse.ArgumentTypeError(
            f"--planner-option is NAME=NUMBER (e.g. interval=2), got {text!r}"
        )
    return key, number


def _cost(text: str) -> tuple[str, int]:
    key, sep, value = text.partition("=")
    if not sep or not key or not value.isdigit() or len(value) > 30:
        raise argparse.ArgumentTypeError(
            f"--max-cost is CLASS=N (N pixels x frames x steps), got {text!r}"
        )
    return key, int(value)


def _load_fn(spec: str) -> Any:
    mod, sep, name = spec.partition(":")
    if not sep:
        raise SystemExit(f"mooncake-diffusion: error: --fn must be module:function, got {spec!r}")
    try:
        return getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"mooncake-diffusion: error: cannot load --fn {spec}: {e}") from None


def _stage_fns(stages: list[str], fns: list[str]) -> tuple[dict[str, Any], Any]:
    """The function of each ``--stage``, and a loader for any stage (or None).

    ``--fn MODULE`` (one, no colon): every stage's function is ``MODULE:<stage>``,
    for the stages given and for any the orchestrator moves the worker to later
    (the loader calls ``MODULE.load(stage)`` first if there is one: it loads that
    stage's model). ``--fn MODULE:FUNCTION`` once per ``--stage``, in order: those
    stages only (a move to another stage is refused; the worker keeps its own).
    """
    if len(set(stages)) != len(stages):
        raise SystemExit(f"mooncake-diffusion: error: --stage repeats: {stages}")
    if len(fns) == 1 and ":" not in fns[0]:
        module = fns[0]

        def loader(stage: str) -> Any:
            fn = _load_fn(f"{module}:{stage}")
            load = getattr(importlib.import_module(module), "load", None)
            if callable(load):
                load(stage)
            return fn

        return {s: _load_fn(f"{module}:{s}") for s in stages}, loader
    if len(fns) != len(stages):
        raise SystemExit(
            "mooncake-diffusion: error: give --fn MODULE (MODULE:<stage> for each stage) "
            f"or one --fn MODULE:FUNCTION per --stage; got {len(fns)} for {len(stages)}"
        )
    return {s: _load_fn(f) for s, f in zip(stages, fns, strict=True)}, None


def _run_orchestrator(args: argparse.Namespace) -> int:
    from mooncake_diffusion.orchestrator.core.model import OrchestratorConfig
    from mooncake_diffusion.orchestrator.errors import OrchestratorConfigError, OrchestratorError
    from mooncake_diffusion.orchestrator.http.api import ApiServer
    from mooncake_diffusion.orchestrator.http.front import DEFAULT_MAX_COST, FrontConfig
    from mooncake_diffusion.orchestrator.http.process import FrontProcess
    from mooncake_diffusion.orchestrator.service.gc_tuning import settle_after_startup
    from mooncake_diffusion.orchestrator.service.service import OrchestratorService, ServiceConfig

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(message)s")
    token = args.token or os.environ.get(TOKEN_ENV) or None
    worker_bind = args.worker_bind or f"tcp://{args.host}:{args.worker_port}"
    cfg = OrchestratorConfig(
        policy=args.policy,
        heartbeat_timeout=args.heartbeat_timeout,
        max_attempts=args.max_attempts,
        preemption=args.preemption,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    front = FrontConfig(
        hosts=tuple(args.allowed_host),
        max_cost={**DEFAULT_MAX_COST, **dict(args.max_cost)},
        cancel_on_disconnect=not args.keep_on_disconnect,
    )

    def api_of(service: OrchestratorService, drive: bool = False) -> ApiServer:
        return ApiServer(
            service,
            args.host,
            args.port,
            token=token,
            outputs=args.outputs,
            front=front,
            drive=drive,
        )

    config = ServiceConfig(
        orchestrator=cfg,
        worker_bind=worker_bind,
        journal=None if args.etcd else args.journal,
        token=token,
        planner=args.planner,
        planner_options=dict(args.planner_option),
    )
    if args.etcd:
        if args.front_process:
            raise SystemExit(
                "mooncake-diffusion: error: --front-process and --etcd exclude each other"
            )
        return _run_candidate(args, config, api_of, stop)
    try:  # an unknown planner or option is the user's to fix: say so, no traceback
        service = OrchestratorService(config)
    except OrchestratorConfigError as e:
        raise SystemExit(f"mooncake-diffusion: error: {e}") from None
    try:
        api: ApiServer | FrontProcess
        if args.front_process:  # the driver is a thread; the HTTP front another process
            service.start()
            api = FrontProcess(
                service, args.host, args.port, token=token, outputs=args.outputs, front=front
            )
        else:  # the driver turns on the HTTP server's loop: one thread, no hand-off
            api = api_of(service, drive=True)
    except BaseException:
        service.close()
        raise
    try:
        settle_after_startup()  # this process is the service's own (service/gc_tuning.py)
        journal = args.journal or "off (accepted requests are lost on restart; --journal PATH)"
        print(
            f"orchestrator ready: api {api.url} workers {service.worker_address} "
            f"journal {journal} auth {'token' if token else 'none (loopback)'}",
            flush=True,
        )
        while not stop.wait(0.5):
            if service.stopped.is_set():  # the driver gave up (a journal write failed)
                print(f"orchestrator failed: {service.failure}", file=sys.stderr, flush=True)
                return 1
            if isinstance(api, FrontProcess):
                try:  # a front that exited is started again on the same socket
                    api.check()
                except OrchestratorError as e:  # it cannot start any more: say so, exit
                    print(f"orchestrator failed: {e}", file=sys.stderr, flush=True)
                    return 1
        print("orchestrator stopping", flush=True)
    finally:
        service.close()
        api.close()
    return 0


def _run_candidate(args: argparse.Namespace, config: Any, api_of: Any, stop: Any) -> int:
    """``orchestrator --etcd``: one of the orchestrator group (``ha.service.serve``)."""
    from mooncake_diffusion.orchestrator.ha.service import HaOptions, serve

    if args.journal:
        raise SystemExit("mooncake-diffusion: error: --journal and --etcd exclude each other")
    opts = HaOptions(
        [e for e in args.etcd.split(",") if e],
        prefix=args.etcd_prefix,
        name=args.name or f"{args.host}:{args.port}",
        lease_s=args.lease,
    )
    return serve(opts, config, api_of, stop, lambda line: print(line, flush=True))


def _run_worker(args: argparse.Namespace) -> int:
    from mooncake_diffusion.orchestrator.worker.runtime import StageWorker
    from mooncake_diffusion.platform import bindshim
    from mooncake_diffusion.platform.settings import MooncakeSettings

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(message)s")
    # its Transfer Engine listens on the configured host only under the bind shim
    bindshim.check(MooncakeSettings.from_env(master=args.master).local_hostname)
    fns, loader = _stage_fns(args.stage, args.fn)
    if args.outputs:  # where the stage function writes files (worker.reference: MCD_OUTPUTS)
        os.environ["MCD_OUTPUTS"] = args.outputs
    # a long-lived worker recycles its store clients when a store host goes away
    # (settings.store_watch_s), unless the environment says otherwise; set in the
    # environment so that every client of the process (connectors made from_env) does
    os.environ.setdefault("MOONCAKE_DIFFUSION_STORE_WATCH_S", str(WORKER_STORE_WATCH_S))
    if args.heartbeat_timeout is not None:  # a silent p2p producer is given up as soon
        os.environ.setdefault("MOONCAKE_DIFFUSION_PEER_TIMEOUT_S", str(args.heartbeat_timeout))
    settings = MooncakeSettings.from_env(master=args.master)
    first, *rest = args.stage

    def changed(stages: tuple[str, ...], load_s: float) -> None:
        print(
            f"stage change: {worker.worker_id} now holds {'+'.join(stages)} "
            f"(loaded in {load_s:.3f} s)",
            flush=True,
        )

    worker = StageWorker(
        first,
        fns[first],
        args.orchestrator,
        worker_id=args.worker_id,
        credits=args.credits,
        labels=dict(args.label),
        transfer_mode=args.transfer_mode,
        settings=settings,
        token=args.token or os.environ.get(TOKEN_ENV),
        heartbeat_timeout=args.heartbeat_timeout,
        connect_timeout_s=args.connect_timeout,
        extra_stages={s: fns[s] for s in rest},
        loader=loader,
        on_stage_change=changed,
    )
    announce = threading.Thread(target=_announce, args=(worker,), daemon=True)
    announce.start()
    worker.run()
    print(f"worker {worker.worker_id} stopped: {worker.items_done} done", flush=True)
    return 0


def _announce(worker: Any) -> None:
    if worker._welcomed.wait(worker.connect_timeout_s + 1):
        print(
            f"worker ready: {worker.worker_id} stage {'+'.join(worker.stages)} "
            f"credits {worker.credits} "
            f"orchestrator {worker.orchestrator}",
            flush=True,
        )


def add_commands(sub: Any) -> None:
    o = sub.add_parser(
        "orchestrator",
        help="run the orchestrator service (HTTP API for clients, ZeroMQ for workers)",
        description="Run the queue-based orchestrator: clients submit over HTTP JSON "
        "(/v1/requests, /v1/requests/ID[/cancel|/events], /v1/cluster, /metrics, /healthz); "
        "stage workers connect over ZeroMQ. Binds loopback by default; any other address "
        f"needs a token (--token or ${TOKEN_ENV}).",
    )
    o.add_argument("--host", default="127.0.0.1", help="API bind address (default 127.0.0.1)")
    o.add_argument("--port", type=int, default=7421, help="API port (default 7421; 0 = any)")
    o.add_argument(
        "--worker-port", type=int, default=7422, help="worker port on --host (default 7422)"
    )
    o.add_argument("--worker-bind", help="worker endpoint, overrides --worker-port")
    o.add_argument("--journal", help="SQLite journal path: survive restarts (default: none)")
    o.add_argument(
        "--etcd",
        metavar="HOST:PORT[,...]",
        help="run as one of a group of orchestrators on this etcd: one leads, the others "
        "stand by and take over (journal in etcd; workers and clients use "
        "etcd://HOST:PORT[,...][/PREFIX]); excludes --journal",
    )
    o.add_argument(
        "--etcd-prefix",
        default="/mooncake-diffusion/orchestrator",
        help="key prefix of the group's election and journal (default %(default)s)",
    )
    o.add_argument("--name", help="this candidate's name (default HOST:PORT)")
    o.add_argument(
        "--lease",
        type=int,
        default=2,
        help="leader lease in whole seconds (default 2, etcd's minimum): a standby takes "
        "over within about this after the leader is lost",
    )
    o.add_argument(
        "--outputs",
        help="folder for the OpenAI-style routes' images and videos, written by the decode "
        "workers and served from here (default: those routes answer 503)",
    )
    o.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a name clients reach the API by (the Host header); repeatable; default: "
        "the loopback names and --host",
    )
    o.add_argument(
        "--max-cost",
        type=_cost,
        action="append",
        default=[],
        metavar="CLASS=N",
        help="ceiling of height x width x frames x steps for an SLO class (class * for "
        "any other); repeatable; above it a request gets 400 too_costly",
    )
    o.add_argument(
        "--keep-on-disconnect",
        action="store_true",
        help="a client that hangs up while waiting for images does not cancel them",
    )
    o.add_argument(
        "--front-process",
        action="store_true",
        help="serve the HTTP API from a child process, so HTTP parsing and the scheduler "
        "do not share one interpreter lock (faster round trips at hundreds of submissions "
        "a second; docs/performance.md); not with --etcd",
    )
    o.add_argument("--token", help=f"shared secret for API and workers (or ${TOKEN_ENV})")
    o.add_argument("--policy", default="affinity", help="routing policy (default affinity)")
    o.add_argument(
        "--planner",
        default="static",
        help="moves workers between stages: static (never; the default), reactive, "
        "predictive, or one an installed package registers (docs/elastic.md)",
    )
    o.add_argument(
        "--planner-option",
        type=_planner_option,
        action="append",
        default=[],
        metavar="NAME=NUMBER",
        help="an option of the planner, e.g. interval=2 hold=3 cooldown=60; repeatable",
    )
    o.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=10.0,
        help="seconds of worker silence before its items are re-queued (default 10)",
    )
    o.add_argument("--max-attempts", type=int, default=3, help="tries per stage (default 3)")
    o.add_argument(
        "--preemption",
        action="store_true",
        help="let waiting interactive denoise jobs preempt batch ones at a step boundary "
        "(workers must checkpoint; the reference pipeline's stages do)",
    )
    o.add_argument("--log-level", default="warning", help="default warning")
    o.set_defaults(func=_run_orchestrator)

    w = sub.add_parser(
        "worker",
        help="serve a stage function to the orchestrator",
        description="Register with the orchestrator, take items of its stages, run the "
        "stage function (module:function, called as fn(item, ctx)), publish its output "
        "through the connector and acknowledge it. SIGTERM drains: running denoise jobs "
        "move to another worker at a step boundary (from their step checkpoint), other "
        "running items finish, nothing new is taken.",
    )
    w.add_argument(
        "--stage",
        required=True,
        action="append",
        choices=["encode", "denoise", "decode"],
        help="a stage it serves; repeat for a worker that holds several (one GPU, shared)",
    )
    w.add_argument(
        "--fn",
        required=True,
        action="append",
        help="MODULE (MODULE:<stage> for every stage, also for stage changes later) or "
        "MODULE:FUNCTION once per --stage",
    )
    w.add_argument(
        "--orchestrator",
        default="tcp://127.0.0.1:7422",
        help="the orchestrator's worker endpoint (default tcp://127.0.0.1:7422), or "
        "etcd://HOST:PORT[,...][/PREFIX] to follow the leader of an --etcd group",
    )
    w.add_argument("--worker-id", help="stable id (default: STAGE-HOST-PID)")
    w.add_argument("--credits", type=int, default=1, help="items held at once (default 1)")
    w.add_argument(
        "--label", type=_label, action="append", default=[], help="topology KEY=VALUE, repeatable"
    )
    w.add_argument(
        "--transfer-mode", default="store", choices=["store", "p2p", "auto"], help="default store"
    )
    w.add_argument(
        "--outputs",
        help="folder this worker saves output files into (sets MCD_OUTPUTS; requests only "
        'say "save": true, never where)',
    )
    w.add_argument("--master", help="Mooncake master host:port (default $MOONCAKE_MASTER)")
    w.add_argument("--token", help=f"the orchestrator's token (or ${TOKEN_ENV})")
    w.add_argument(
        "--heartbeat-timeout",
        type=float,
        help="ask for this heartbeat timeout (s); also how long a silent p2p producer is "
        "waited for, unless $MOONCAKE_DIFFUSION_PEER_TIMEOUT_S says",
    )
    w.add_argument(
        "--connect-timeout", type=float, default=30.0, help="wait for the orchestrator (s)"
    )
    w.add_argument("--log-level", default="warning", help="default warning")
    w.set_defaults(func=_run_worker)
