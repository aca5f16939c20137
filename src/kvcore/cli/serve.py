"""`kvcore serve [MODEL]`: the OpenAI-compatible HTTP server (the default model without MODEL)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import structlog

from kvcore.cli import CLIError
from kvcore.cli.tier_args import add_tier_arguments, tier_config
from kvcore.config import CacheConfig, EngineConfig, SchedulerConfig
from kvcore.config_speculative import SpeculativeConfig
from kvcore.device import resolve_device
from kvcore.engine import AsyncEngine
from kvcore.engine.kv_snapshot import planner_view
from kvcore.planner import format_size, parse_size, plan_for_model
from kvcore.service import make_app
from kvcore.service.app import DEFAULT_BODY_TIMEOUT_S
from kvcore.service.auth import keys_from_list, read_keys_file
from kvcore.service.edge import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS, Edge
from kvcore.service.serve import serve
from kvcore.service.state import DEFAULT_MAX_SEQUENCES_PER_REQUEST

log = structlog.get_logger("kvcore.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="HF-style model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free)")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="accept `Authorization: Bearer KEY` (repeatable; each key a tenant)")
    parser.add_argument("--api-keys-file", metavar="PATH",
                        help="keys and their tenants: JSON {key: tenant} or `KEY TENANT` lines "
                             "(`KEY TENANT admin` or {key: {tenant, admin: true}}: an admin key)")
    parser.add_argument("--admin-key", action="append", default=[], metavar="KEY",
                        help="a key that may also open /inspector and /debug/kv (repeatable; "
                             "without any key those are open)")
    parser.add_argument("--served-model-name", action="append", metavar="NAME",
                        help="name(s) clients use in `model` (default: the model directory's)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    parser.add_argument("--quantization", default="auto", choices=("auto", "none", "int8", "q4"),
                        help="weights in memory (CPU): int8, q4 or none (fp32); default auto: "
                        "a model converted from a GGUF keeps its own quantization, else fp32")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="cuda: run every step eagerly (no CUDA graphs for decode steps)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=None, help="schedule the next step while the device runs this "
                        "one (default: on for cuda, off for cpu; --no-async-scheduling: off)")
    parser.add_argument("--speculative-config", metavar="JSON",
                        help='speculative decoding, vLLM\'s shape: \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                        '"prompt_lookup_min": 2}\' or "method": "suffix"; outputs are '
                        'unchanged, only faster where drafts are accepted (default: off)')
    parser.add_argument("--max-model-len", type=int, metavar="TOKENS",
                        help="prompt + completion tokens at most (default: the model's)")
    parser.add_argument("--max-num-seqs", type=int, default=256, metavar="N",
                        help="running sequences at most (default 256)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="N",
                        help="token budget of one step (default 2048)")
    parser.add_argument("--block-size", type=int, default=16, metavar="TOKENS",
                        help="tokens per KV block (default 16)")
    pool = parser.add_mutually_exclusive_group()
    pool.add_argument("--num-blocks", type=int, metavar="N", help="KV blocks in the pool")
    pool.add_argument("--kv-cache-memory", metavar="SIZE",
                      help="KV cache budget, e.g. 2GiB (default: the device's default)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="auto (fp16), fp32, fp16, bf16, fp8 or int4 (4-bit blocks "
                             "beside an fp16 window of recent tokens)")
    parser.add_argument("--kv-int4-window", type=int, default=32, metavar="TOKENS",
                        help="int4: the fp16 window, rounded up to whole blocks: a query row "
                             "reads its own super-block of that many blocks in fp16, earlier "
                             "blocks sealed (default 32)")
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                        action="store_false", help="turn the prefix cache off")
    parser.add_argument("--max-waiting", type=int, metavar="N",
                        help="answer 429 to a call whose sequences would make more than N wait "
                             "(default: unbounded)")
    parser.add_argument("--max-sequences-per-request", type=int,
                        default=DEFAULT_MAX_SEQUENCES_PER_REQUEST, metavar="N",
                        help="400 for a call of more than N sequences, prompts x n (default "
                             f"{DEFAULT_MAX_SEQUENCES_PER_REQUEST})")
    parser.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                        metavar="N", help="503 and close beyond N open connections (default "
                                          f"{DEFAULT_MAX_CONNECTIONS})")
    parser.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                        metavar="SECONDS", help="close (408) a connection whose request header "
                        f"takes longer (default {DEFAULT_HEADER_TIMEOUT_S:g})")
    parser.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                        metavar="SECONDS", help="408 for a request body that takes longer "
                        f"(default {DEFAULT_BODY_TIMEOUT_S:g})")
    parser.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="on SIGTERM/SIGINT, let requests finish this long (default 30)")
    parser.add_argument("--max-body-size", default="4MiB", metavar="SIZE",
                        help="413 for request bodies over this (default 4MiB)")
    parser.add_argument("--seed", type=int, default=0, help="engine seed (default 0)")
    add_tier_arguments(parser)
    cluster = parser.add_argument_group(
        "cluster", "serve through N engine replicas on Ray Serve (needs the cluster extra: "
        "`pip install -e '.[cluster]'` from the checkout); without --replicas, one engine in "
        "this process")
    cluster.add_argument("--replicas", type=int, metavar="N",
                         help="engine replicas behind a routing ingress in this process")
    cluster.add_argument("--router", default="prefix",
                         choices=["prefix", "least-loaded", "round-robin"],
                         help="prefix: the replica holding the most of the prompt's cached "
                              "blocks, unless overloaded (default)")
    cluster.add_argument("--router-load-margin", type=int, default=4, metavar="N",
                         help="prefix router: fall back to the least-loaded replica when the "
                              "cached one has more than N more outstanding requests (default 4)")
    cluster.add_argument("--min-replicas", type=int, metavar="N",
                         help="autoscale between --min-replicas and --max-replicas on KV usage, "
                              "waiting sequences and preemptions (starts at --replicas)")
    cluster.add_argument("--max-replicas", type=int, metavar="N", help="see --min-replicas")
    cluster.add_argument("--ray-address", metavar="ADDR",
                         help="join this Ray cluster (default: start a local Ray instance)")
    cluster.add_argument("--cpus-per-replica", type=float, default=1.0, metavar="N",
                         help="Ray CPUs reserved per replica, also its BLAS threads (default 1)")
    cluster.add_argument("--gpus-per-replica", type=float, default=0.0, metavar="N",
                         help="Ray GPUs per replica (1 on a GPU cluster: one replica per GPU)")
    cluster.add_argument("--replica-resources", metavar="JSON",
                         help="custom Ray resources per replica, e.g. '{\"kvcore_replica\": 1}' "
                              "with `ray start --resources='{\"kvcore_replica\": 1}'` on each "
                              "node: one replica per node")


def configure_logging() -> None:
    """JSON lines on stderr: one per request, one per preemption, and the server's own events.
    Records of other libraries (aiohttp, asyncio) are JSON lines too; aiohttp's keep only the
    exception's class, since their messages and tracebacks can quote request bytes."""
    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.JSONRenderer()],
        foreign_pre_chain=[structlog.stdlib.add_logger_name, structlog.processors.add_log_level,
                           timestamper, structlog.processors.format_exc_info]))
    handler.addFilter(_scrub_aiohttp)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    structlog.configure(
        processors=[structlog.processors.add_log_level, timestamper,
                    structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True)


def _scrub_aiohttp(record: logging.LogRecord) -> bool:
    if record.name.startswith("aiohttp"):
        if record.exc_info and record.exc_info[0] is not None:
            record.msg = f"{record.msg} ({record.exc_info[0].__name__})"
        record.exc_info = None
        record.exc_text = None
    return True


def _config(args: argparse.Namespace, model_dir: str) -> EngineConfig:
    memory = parse_size(args.kv_cache_memory) if args.kv_cache_memory is not None else None
    return EngineConfig(
        model=model_dir, device=args.device, seed=args.seed, enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling, quantization=args.quantization,
        speculative=SpeculativeConfig.parse(args.speculative_config), tiers=tier_config(args),
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                          kv_cache_memory=memory, cache_dtype=args.kv_cache_dtype,
                          enable_prefix_caching=args.enable_prefix_caching,
                          int4_window_tokens=args.kv_int4_window),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs,
                                  max_model_len=args.max_model_len))


def salt_secret(config: EngineConfig) -> bytes | None:
    """With a disk tier, the tenants' cache salts come from the directory's secret, so a
    restarted server (or another replica) names a session's blocks as before and finds them;
    otherwise a secret of this process (None: make_app draws one)."""
    if config.tiers.kv_tier_dir is None:
        return None
    from kvcore.cache.tiers.disk import shared_secret

    return shared_secret(config.tiers.kv_tier_dir)


def _build_engine(config: EngineConfig) -> AsyncEngine:
    engine = AsyncEngine.from_config(config)
    stats = engine.stats()
    pool_bytes = int(planner_view(engine.engine)["pool_bytes"])  # blocks + an int4 window
    kv_plan = plan_for_model(engine.model_config, stats.cache_dtype,
                             context=engine.max_model_len, block_size=stats.block_size)
    log.info("engine ready", num_blocks=stats.num_blocks, block_size=stats.block_size,
             cache_dtype=stats.cache_dtype, pool_size=format_size(pool_bytes),
             bytes_per_token=kv_plan.bytes_per_token, max_model_len=engine.max_model_len,
             # sequences of max_model_len tokens the pool holds at once
             max_concurrency=stats.num_blocks // kv_plan.blocks_per_sequence)
    return engine


def run(args: argparse.Namespace) -> int:
    from kvcore.model.hub import resolve_model

    configure_logging()
    try:
        # before the model is fetched: --device cuda without a GPU is a one-line error
        resolve_device(args.device)
        keys = keys_from_list(args.api_key)
        admins = list(args.admin_key)
        if args.api_keys_file:
            file_keys, file_admins = read_keys_file(args.api_keys_file)
            keys |= file_keys
            admins += sorted(file_admins)
        model_dir = resolve_model(args.model)
        config = _config(args, str(model_dir))
        max_body = parse_size(args.max_body_size)
        if args.drain_timeout < 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
        edge = Edge(args.max_connections, args.header_timeout)
    except (OSError, ValueError, RuntimeError) as e:
        raise CLIError(str(e)) from e
    names = args.served_model_name or [args.model if args.model else model_dir.name]
    app_kwargs = dict(api_keys=keys, served_model_name=names, max_body_size=max_body,
                      max_waiting=args.max_waiting,
                      max_sequences_per_request=args.max_sequences_per_request,
                      body_timeout=args.body_timeout, admin_keys=admins,
                      cache_salt_secret=salt_secret(config))
    if args.replicas is not None:
        return _run_cluster(args, config, app_kwargs, edge)
    try:
        app = make_app(lambda: _build_engine(config), **app_kwargs)  # type: ignore[arg-type]
    except ValueError as e:
        raise CLIError(str(e)) from e
    return asyncio.run(serve(app, args.host, args.port, args.drain_timeout, edge))


def _run_cluster(args: argparse.Namespace, config: EngineConfig, app_kwargs: dict[str, object],
                 edge: Edge) -> int:
    """The cluster extra (Ray) is imported only when --replicas asks for it."""
    try:
        from kvcore.cluster import serve as cluster
    except ImportError as e:
        raise CLIError(f"--replicas needs the cluster extra (from the checkout: pip install "
                       f"-e '.[cluster]'): {e}") from e
    try:
        options = cluster.options_from_args(args)
    except ValueError as e:
        raise CLIError(str(e)) from e
    try:
        return int(cluster.run(args, config, app_kwargs, edge, options))
    except ConnectionError as e:  # the Ray cluster at --ray-address refused or never answered
        raise CLIError(str(e)) from e
