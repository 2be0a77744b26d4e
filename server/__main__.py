"""`python -m jaxpaged.server [flags]`: the OpenAI-compatible server (flags as `vllm serve`; -h lists them)."""
from __future__ import annotations

import logging
import os
import sys


def main(argv: list[str] | None = None) -> None:
    from jaxpaged.server.cli import make_parser, validate_args
    from jaxpaged.server.serving import load_chat_template

    parser = make_parser()
    args = parser.parse_args(argv)
    validate_args(parser, args)
    try:
        load_chat_template(args.chat_template)
    except (OSError, ValueError) as e:
        parser.error(str(e))
    from jaxpaged.server.api_workers import multiprocess_metrics_dir
    with multiprocess_metrics_dir(args.api_server_count):       # (before prometheus_client is imported)
        from jaxpaged.server.api_server import run_server
        code = run_server(args)
    # Everything that needed stopping has stopped (streams, sockets, the engine core): skip the interpreter's
    # teardown of torch, JAX and transformers, seconds on a busy machine that a supervisor would wait for.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
