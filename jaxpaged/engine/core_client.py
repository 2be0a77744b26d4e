"""The engine core in its own process, and the API processes' ends of the connection.

A pair of ZeroMQ PUSH/PULL pipes over Unix sockets (ipc) per API process (one, or --api-server-count of
them), messages in msgpack (messages.py):

    API process i  --[Command, payload]-->  core process     ADD list[EngineCoreRequest], ABORT list[str], SHUTDOWN
    API process i  <--CoreMessage--------   core process     CoreInfo once ready, EngineCoreOutputs per step,
                                                              CoreFailure on an error

Each API process binds its pair and the core connects to all of them: it reads every API process's commands
(fair-queued) and sends each the outputs of its own requests (EngineCoreRequest.client_index), with the
core's counters to every one each step. The core's loop takes every queued command between steps (blocking
only when it has nothing to run), so it never waits on an API process, whose event loop it does not share a
GIL with. The process is spawned (never forked: a forked JAX runtime is unusable), ignores SIGINT (the first
API process, its parent, owns shutdown), and exits when its parent is gone, so it is never left behind.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import NamedTuple

import msgspec
import zmq
import zmq.asyncio

from jaxpaged import envs
from jaxpaged.config import EngineArgs
from jaxpaged.engine.messages import (Command, CoreFailure, CoreInfo, CoreStats, EngineCoreOutput, EngineCoreOutputs,
                                      EngineCoreRequest, abort_decoder, add_decoder, core_message_decoder)
from jaxpaged.engine.stats import write_core_step_log

logger = logging.getLogger("jaxpaged.core")

# How often an idle core looks up from its input sockets to check that its parent is alive.
IDLE_POLL_MS = 500
# How long shutdown waits for the core to exit after SHUTDOWN, then after SIGTERM, before SIGKILL.
SHUTDOWN_WAIT_S = 5.0


class EngineDeadError(RuntimeError):
    """The engine core is gone: requests in flight fail, and no new one is taken."""


class Channel(NamedTuple):
    """One API process's pipe pair: the addresses it binds, and the core connects to."""
    input_addr: str
    output_addr: str


# ---- the core process ----------------------------------------------------------------------------
def run_core_process(args: EngineArgs, channels: list[Channel], parent_pid: int) -> None:
    """The core process's entry point: build the engine, announce it, then loop until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if logging.getLogger().handlers == []:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    for ch in channels:
        inp.connect(ch.input_addr)
    out = CoreOutputs(ctx, channels)
    code = 0
    try:
        from jaxpaged.engine.core import EngineCore
        core = EngineCore(args)
        if envs.JAXPAGED_STEP_LOG:
            core.stats.step_log, core.stats.arrival_log = [], []
        out.broadcast(core.info())
        try:
            _core_loop(core, inp, out, parent_pid)
        finally:
            if envs.JAXPAGED_STEP_LOG:
                write_core_step_log(envs.JAXPAGED_STEP_LOG, core.stats)
    except BaseException as e:
        logger.exception("engine core failed")           # the traceback: here, in the log
        out.broadcast(CoreFailure(f"{type(e).__name__}: {e}"))
        code = 1
    finally:
        inp.close(linger=0)
        out.close(linger_ms=2000)       # let the last message (a failure) leave
        ctx.term()
    sys.exit(code)


class CoreOutputs:
    """The core's output pipes, one per API process, and which API process each request came from (kept
    for all but the first's, from ADD until the request finishes or is aborted)."""

    def __init__(self, ctx: zmq.Context, channels: list[Channel]):
        self.socks = []
        for ch in channels:
            sock = ctx.socket(zmq.PUSH)
            sock.connect(ch.output_addr)
            self.socks.append(sock)
        self.client_of: dict[str, int] = {}
        self._encode = msgspec.msgpack.Encoder().encode

    def add(self, requests: list[EngineCoreRequest]) -> None:
        for r in requests:
            if r.client_index:
                self.client_of[r.request_id] = r.client_index

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.client_of.pop(rid, None)

    def send(self, outputs: list[EngineCoreOutput], stats: CoreStats) -> None:
        """One step's outputs, each to its request's API process; the counters to every one."""
        if len(self.socks) == 1:
            self.socks[0].send(self._encode(EngineCoreOutputs(outputs, stats)))
            return
        per_client: list[list[EngineCoreOutput]] = [[] for _ in self.socks]
        client_of = self.client_of
        for o in outputs:
            i = client_of.get(o.request_id, 0) if o.finish_reason is None else client_of.pop(o.request_id, 0)
            per_client[i].append(o)
        for sock, outs in zip(self.socks, per_client):
            sock.send(self._encode(EngineCoreOutputs(outs, stats)))

    def broadcast(self, msg: CoreInfo | CoreFailure) -> None:
        frame = self._encode(msg)
        for sock in self.socks:
            sock.send(frame)

    def close(self, linger_ms: int) -> None:
        for sock in self.socks:
            sock.close(linger=linger_ms)


def _core_loop(core, inp: zmq.Socket, out: CoreOutputs, parent_pid: int) -> None:
    poller = zmq.Poller()
    poller.register(inp, zmq.POLLIN)
    decode_add, decode_abort = add_decoder().decode, abort_decoder().decode
    while True:
        timeout = 0 if core.has_unfinished_requests() else IDLE_POLL_MS
        touched = False
        while poller.poll(timeout):                  # every command queued by now, in order
            cmd, payload = inp.recv_multipart()
            command = Command(cmd[0])
            if command == Command.SHUTDOWN:
                return
            if command == Command.ADD:
                requests = decode_add(payload)
                out.add(requests)
                for r in requests:
                    core.add_request(r)
            else:
                request_ids = decode_abort(payload)
                core.abort_requests(request_ids)
                out.forget(request_ids)
            touched = True
            timeout = 0
        if os.getppid() != parent_pid:
            logger.error("the API process is gone: the engine core exits")
            return
        if core.has_unfinished_requests():
            outputs = core.step()
            out.send(outputs, core.core_stats())
        elif touched:             # aborts emptied the core: the gauges (running, KV usage) moved anyway
            out.send([], core.core_stats())


# ---- the API processes' end ----------------------------------------------------------------------
class CoreChannel:
    """An API process's end of its pipe pair to the core: commands out, the core's messages in. This is
    what an extra API process (--api-server-count) holds; the first holds a CoreProcClient, which also
    runs the core. `watch`: the process whose end ends this API process's core connection (an extra API
    process watches the first, which owns the core)."""

    def __init__(self, channel: Channel, client_index: int = 0,
                 watch: multiprocessing.process.BaseProcess | None = None):
        self.client_index = client_index
        self._watch = watch
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)            # never block the event loop on a slow core
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._input.bind(channel.input_addr)
        self._output.bind(channel.output_addr)
        self._encode = msgspec.msgpack.Encoder().encode
        self._decoder = core_message_decoder()
        self.shutting_down = False

    def lost(self) -> str | None:
        """Why this end can no longer reach a core (what exited), or None while it can."""
        if self._watch is not None and not self._watch.is_alive():
            return "the API server's first process (which runs the engine core) exited"
        return None

    def wait_ready(self, timeout_s: float | None = None) -> CoreInfo:
        """Block until the core announces itself; raises EngineDeadError if it fails or exits first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self._output.poll(200):
                msg = self._decoder.decode(self._output.recv())
                if isinstance(msg, CoreInfo):
                    return msg
                if isinstance(msg, CoreFailure):
                    self.shutdown()
                    raise EngineDeadError(f"the engine core failed to start: {msg.error}")
            elif (why := self.lost()) is not None:
                self.shutdown()
                raise EngineDeadError(f"{why} during start-up")
            if deadline is not None and time.monotonic() > deadline:
                self.shutdown()
                raise EngineDeadError(f"the engine core was not ready within {timeout_s} s")

    def wait_lost(self) -> str:
        """Block until the core can no longer be reached (a thread of the caller's waits here); why."""
        if self._watch is None:
            raise RuntimeError("this channel watches no process")
        multiprocessing.connection.wait([self._watch.sentinel])
        return self.lost() or "the engine core is gone"

    def output_socket(self) -> zmq.asyncio.Socket:
        """The output pipe for the calling event loop (a new view of the one socket per loop)."""
        return zmq.asyncio.Socket.from_socket(self._output)

    def decode(self, frame: bytes):
        return self._decoder.decode(frame)

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        if not self._send(Command.ADD, self._encode(requests)):
            raise EngineDeadError("the engine core is not connected")

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.shutting_down:
            self._send(Command.ABORT, self._encode(request_ids))

    def _send(self, command: Command, payload: bytes) -> bool:
        """Queue a command without ever blocking (no high-water mark): False when the core is not
        connected (a PUSH socket without a peer would block the event loop until one connects)."""
        try:
            self._input.send_multipart([bytes([command]), payload], flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def shutdown(self) -> None:
        if self.shutting_down:
            return
        self.shutting_down = True
        self._close()

    def _close(self) -> None:
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()


class CoreProcClient(CoreChannel):
    """The first API process's end: starts the core process, with a pipe pair for each of num_clients API
    processes (its own is the first; `channels[i]` is the i-th's to bind). It returns at once (the core loads
    and compiles in the background); `wait_ready()` returns its CoreInfo."""

    def __init__(self, args: EngineArgs, target=run_core_process, num_clients: int = 1):
        """target: the core process's entry point, (args, channels, parent_pid) -> None (bench/api_capacity.py
        swaps in a core without a model to measure the API processes alone)."""
        self._dir = tempfile.mkdtemp(prefix="jaxpaged-core-")
        self.channels = [Channel(f"ipc://{self._dir}/input-{i}", f"ipc://{self._dir}/output-{i}")
                         for i in range(num_clients)]
        super().__init__(self.channels[0])
        spawn = multiprocessing.get_context("spawn")
        self.proc = spawn.Process(target=target, name="jaxpaged-engine-core", daemon=True,
                                  args=(args, self.channels, os.getpid()))
        self.proc.start()

    def lost(self) -> str | None:
        if self.proc.is_alive():
            return None
        return f"the engine core process exited (exit code {self.proc.exitcode})"

    def wait_lost(self) -> str:
        """Block until the core process exits; why. When it was not told to, the other API processes are told
        at once (a core killed outright says nothing to them itself)."""
        multiprocessing.connection.wait([self.proc.sentinel])
        self.proc.join(SHUTDOWN_WAIT_S)               # reap it, so the exit code is known
        why = self.lost() or "the engine core process exited"
        if not self.shutting_down and len(self.channels) > 1:
            self._tell_others(why)
        return why

    def _tell_others(self, why: str) -> None:
        """CoreFailure to every other API process, on sockets of this (the watching) thread's own."""
        frame = self._encode(CoreFailure(why))
        ctx = zmq.Context()
        try:
            for ch in self.channels[1:]:
                sock = ctx.socket(zmq.PUSH)
                sock.connect(ch.output_addr)
                sock.send(frame, flags=zmq.NOBLOCK)
                sock.close(linger=1000)
        except zmq.ZMQError:
            logger.exception("telling the other API processes that the engine core is gone failed")
        finally:
            ctx.term()

    def shutdown(self) -> None:
        """Stop the core: SHUTDOWN, then SIGTERM, then SIGKILL, each after SHUTDOWN_WAIT_S."""
        if self.shutting_down:
            return
        self.shutting_down = True
        if self.proc.is_alive():
            self._send(Command.SHUTDOWN, b"")
            self.proc.join(SHUTDOWN_WAIT_S)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(SHUTDOWN_WAIT_S)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self._close()
        shutil.rmtree(self._dir, ignore_errors=True)
