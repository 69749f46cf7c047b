"""`pagedkv generate | chat | serve | kv-map | bench` -- the command line."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

from pagedkv.config import EngineConfig
from pagedkv.engine.chat_templates import ChatTemplateError
from pagedkv.entrypoints.replicas.replica_options import add_replica_arguments, replicas_requested
from pagedkv.entrypoints.server.connections import ConnectionLimits
from pagedkv.entrypoints.server.limits import ServerLimits
from pagedkv.entrypoints.server.reasoning import REASONING_PARSERS
from pagedkv.sampling_params import SamplingParams

BENCHMARKS = ("gather", "attention", "panel_linear", "throughput", "serving")


# Earlier, shorter spellings of some options; they stay as aliases of the generated ones.
FLAG_ALIASES = {"kv_cache_memory_gb": ("--kv-cache-gb",), "num_threads": ("--threads",)}
_TYPES = {"int": int, "float": float, "str": str}


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One option per EngineConfig field, generated from the field: its name, default, help and choices.

    ``--max-num-seqs`` sets ``max_num_seqs``; a bool field is ``--x / --no-x``; deprecated fields are
    accepted but hidden. So ``--help`` lists every engine setting and a new field needs no CLI code.
    ``skip``: fields a command has no option for (they keep their defaults).
    """
    group = parser.add_argument_group("engine")
    for f in fields(EngineConfig):
        if f.name in skip:
            continue
        flags = ("--" + f.name.replace("_", "-"), *FLAG_ALIASES.get(f.name, ()))
        help_text = argparse.SUPPRESS if f.metadata.get("deprecated") else f.metadata["help"]
        kind = str(f.type).split("|")[0].strip()
        options: dict = {"dest": f.name, "default": f.default, "help": help_text}
        if kind == "bool":
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = _TYPES[kind]
            if "choices" in f.metadata:
                options["choices"] = f.metadata["choices"]
        group.add_argument(*flags, **options)
    # kept from before the options were generated: the common way to turn the prefix cache off
    group.add_argument(
        "--no-prefix-caching", dest="enable_prefix_caching", action="store_false", help=argparse.SUPPRESS
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in fields(EngineConfig) if f.name in args}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--seed", type=int, default=None)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedkv import LLM

    llm = LLM(**engine_kwargs(args))
    params = sampling_params(args)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outputs = llm.generate(args.prompts, params)
    for output in outputs:
        print(output.text if len(outputs) == 1 else f"--- {output.prompt or ''}\n{output.text}")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """An interactive conversation that streams each answer as it is generated. Every turn resends the whole
    conversation; the prefix cache makes that cheap, since all earlier turns are already in the pool -- only
    the new message is computed."""
    from pagedkv.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(**engine_kwargs(args)))
    params = sampling_params(args)
    messages: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    print("pagedkv chat -- empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            user = input("> ").strip()
        except EOFError:
            break
        if not user:
            break
        messages.append({"role": "user", "content": user})
        start = time.perf_counter()
        try:
            request_id = engine.add_request(prompt_token_ids=engine.apply_chat_template(messages), params=params)
        except ValueError as exc:  # the conversation outgrew the context, say: the session goes on without it
            print(f"[{exc}]", file=sys.stderr)
            messages.pop()
            continue
        answer, cached = "", 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id == request_id:
                    sys.stdout.write(output.outputs[0].delta_text)
                    sys.stdout.flush()
                    answer, cached = output.text, output.num_cached_tokens
        elapsed = time.perf_counter() - start
        print(f"\n[{elapsed:.2f} s, {cached} prompt tokens from the prefix cache]", file=sys.stderr)
        messages.append({"role": "assistant", "content": answer})
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if replicas_requested(args):
        if args.reasoning_parser is not None:
            print("pagedkv: --reasoning-parser is not available with --replicas yet", file=sys.stderr)
            return 2
        from pagedkv.entrypoints.replicas.ray_serve import serve_replicas

        return serve_replicas(args, engine_kwargs(args))
    from pagedkv.entrypoints.server.openai_server import serve

    return serve(args, engine_kwargs(args))


def cmd_kv_map(args: argparse.Namespace) -> int:
    from pagedkv.kv_map import fetch_kv_json, save_kv_map

    try:
        data = fetch_kv_json(args.server, args.api_key)
    except OSError as exc:
        print(f"could not read {args.server.rstrip('/')}/kv.json: {exc}", file=sys.stderr)
        return 1
    print(save_kv_map(data, args.output))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    script = Path(__file__).resolve().parents[2] / "benchmarks" / f"{args.benchmark}.py"
    if not script.exists():
        print(
            f"benchmark script {script} not found: `pagedkv bench` runs from a source checkout",
            file=sys.stderr,
        )
        return 2
    return subprocess.call([sys.executable, str(script), *args.bench_args])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedkv", description="A small, fast LLM inference engine on a paged KV cache."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="complete one or more prompts and print the results")
    gen.add_argument("prompts", nargs="+", help="prompt text(s)")
    gen.add_argument(  # its name predates the engine's --chat-template FILE, which generate therefore lacks
        "--chat-template", dest="chat", action="store_true", help="wrap each prompt as a user chat message"
    )
    add_sampling_args(gen)
    add_engine_args(gen, skip=("chat_template",))
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="talk to the model interactively, streaming the answers")
    chat.add_argument("--system", default=None, help="system prompt")
    add_sampling_args(chat)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health (default: $PAGEDKV_API_KEY)",
    )
    serve.add_argument("--served-model-name", default=None, help="model name clients use (default: file name)")
    serve.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="split a thinking model's <think>...</think> from its chat answers as reasoning_content",
    )
    ServerLimits.add_arguments(serve)
    ConnectionLimits.add_arguments(serve)
    add_replica_arguments(serve)
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    kv_map = sub.add_parser("kv-map", help="draw a running server's KV cache (GET /kv.json) to a PNG")
    kv_map.add_argument("--server", default="http://127.0.0.1:8000", help="the server's base URL")
    kv_map.add_argument("--output", default="kv_map.png", help="PNG file to write")
    kv_map.add_argument("--api-key", default=None, help="the server's API key (default: $PAGEDKV_API_KEY)")
    kv_map.set_defaults(func=cmd_kv_map)

    bench = sub.add_parser("bench", help=f"run a benchmark script ({', '.join(BENCHMARKS)})")
    bench.add_argument("benchmark", choices=BENCHMARKS)
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="options passed to the script (try --help)")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if "api_key" in args:  # serve and kv-map: the option, else the environment
        args.api_key = args.api_key or os.environ.get("PAGEDKV_API_KEY") or None
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except ChatTemplateError as exc:  # a bad --chat-template file: say so, without a traceback
        print(f"pagedkv: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
