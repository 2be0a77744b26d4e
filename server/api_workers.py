"""Several API server processes over one engine core (--api-server-count, as vLLM's): each parses, tokenizes,
detokenizes and streams its own requests, so admitting a burst of requests, and streaming them, is spread
over several GILs.

The first API process (the one started) binds the listening socket, starts the engine core with a pipe
pair per API process (core_client.py), and spawns the others, handing each the socket, its pipe pair and
its number. Every process runs the same app and accepts connections from the one socket, so the kernel
gives each connection to whichever process is ready first. An extra process loads the tokenizer, waits for
the core's CoreInfo on its own pipe and serves.

How they stay tied:
- SIGTERM or SIGINT to the first process is passed on to the others; each ends its open streams (finish
  reason "abort") and exits 0, and the first stops the engine core once they are gone.
- The engine core's death reaches every process (the first tells the others when the core was killed
  without a word): each fails its streams, answers /health with 503, and exits 1.
- An extra process that exits on its own ends the server (status 1) as the core's death does; one whose
  first process is gone fails its streams and exits 1.

/metrics sums every process's counters through prometheus_client's multiprocess mode (metrics.py), whose
folder must be set before prometheus_client is imported: `multiprocess_metrics_dir` does that.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

logger = logging.getLogger("jaxpaged.server")

# How long the first process waits for the others to drain and exit before it kills them.
STOP_WAIT_S = 10.0


@contextlib.contextmanager
def multiprocess_metrics_dir(api_server_count: int) -> Iterator[None]:
    """With several API processes, PROMETHEUS_MULTIPROC_DIR for the server's life (a fresh temporary folder
    unless the environment names one), set before prometheus_client is imported; nothing with one."""
    if api_server_count == 1 or os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        yield
        return
    path = tempfile.mkdtemp(prefix="jaxpaged-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    try:
        yield
    finally:
        shutil.rmtree(path, ignore_errors=True)


def listen_socket(host: str, port: int) -> socket.socket:
    """The socket every API process accepts from, bound before the engine core starts (so a port in use is
    reported at once, not after the model has loaded)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"cannot listen on {host}:{port}: {e}") from None
    sock.set_inheritable(True)
    return sock


class APIServerProcesses:
    """The extra API processes, numbered 1 .. len(channels) - 1, spawned at once (they load their tokenizer
    while the core loads the model). target(args, index, sock, channel, ready): each one's entry point
    (api_server.run_api_server_process; passed in, since the server imports this module)."""

    def __init__(self, args, sock: socket.socket, channels: list, target: Callable):
        spawn = multiprocessing.get_context("spawn")
        pipes = [spawn.Pipe(duplex=False) for _ in channels[1:]]     # (receiving end, sending end)
        self.ready = [r for r, _ in pipes]
        self.procs = [spawn.Process(target=target, name=f"jaxpaged-api-server-{i}", daemon=True,
                                    args=(args, i, sock, channels[i], pipes[i - 1][1]))
                      for i in range(1, len(channels))]
        for p in self.procs:
            p.start()
        for _, w in pipes:
            w.close()               # (the children hold their own copies)
        self.stopping = False

    def wait_ready(self) -> None:
        """Block until each has its engine connection and app (so /health's first 200 means every process
        serves); raises RuntimeError if one exits first."""
        for p, ready in zip(self.procs, self.ready):
            try:
                ready.recv_bytes()          # (EOFError: it exited without a word)
            except EOFError:
                p.join(1.0)
                raise RuntimeError(f"API server process {p.name} exited during start-up (exit code "
                                   f"{p.exitcode}); its log above says why") from None
            finally:
                ready.close()

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """on_lost(why), from a thread of its own, when one of them exits before stop() was called."""
        def wait() -> None:
            by_sentinel = {p.sentinel: p for p in self.procs}
            ready = multiprocessing.connection.wait(list(by_sentinel))
            gone = [by_sentinel[s] for s in ready if isinstance(s, int)]
            if not self.stopping:
                for p in gone:
                    p.join(1.0)                 # (its sentinel closes a moment before its exit status is known)
                on_lost(", ".join(f"API server process {p.name} exited (exit code {p.exitcode})" for p in gone))
        threading.Thread(target=wait, name="jaxpaged-api-servers-watch", daemon=True).start()

    def drain(self) -> None:
        """Pass a shutdown on: each ends its streams and exits (stop() then waits for them)."""
        self.stopping = True
        self._signal(signal.SIGTERM)

    def _signal(self, sig: int) -> None:
        for p in self.procs:
            if p.is_alive() and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, sig)

    def stop(self) -> None:
        """SIGTERM each (it drains and exits); wait up to STOP_WAIT_S in all, then SIGKILL what is left."""
        self.drain()
        deadline = time.monotonic() + STOP_WAIT_S
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                logger.error("API server process %s did not exit within %.0f s: killed", p.name, STOP_WAIT_S)
                p.kill()
                p.join()
