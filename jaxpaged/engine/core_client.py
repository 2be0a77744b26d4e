"""The engine core in its own process, and the API process's end of the connection.

Two ZeroMQ PUSH/PULL pipes over Unix sockets (ipc), messages in msgpack (messages.py):

    API process  --[Command, payload]-->  core process     ADD list[EngineCoreRequest], ABORT list[str], SHUTDOWN
    API process  <--CoreMessage--------   core process     CoreInfo once ready, EngineCoreOutputs per step,
                                                            CoreFailure on an error

The core's loop takes every queued command between steps (blocking only when it has nothing to run), so it
never waits on the API process, whose event loop it does not share a GIL with. The process is spawned
(never forked: a forked JAX runtime is unusable), ignores SIGINT (the API process owns shutdown), and exits
when its parent is gone, so it is never left behind.
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

import msgspec
import zmq
import zmq.asyncio

from jaxpaged.config import EngineArgs
from jaxpaged.engine.messages import (Command, CoreFailure, CoreInfo, EngineCoreOutputs, EngineCoreRequest,
                                      abort_decoder, add_decoder, core_message_decoder)

logger = logging.getLogger("jaxpaged.core")

# How often an idle core looks up from its input socket to check that its parent is alive.
IDLE_POLL_MS = 500
# How long shutdown waits for the core to exit after SHUTDOWN, then after SIGTERM, before SIGKILL.
SHUTDOWN_WAIT_S = 5.0


class EngineDeadError(RuntimeError):
    """The engine core is gone: requests in flight fail, and no new one is taken."""


# ---- the core process ----------------------------------------------------------------------------
def run_core_process(args: EngineArgs, input_addr: str, output_addr: str, parent_pid: int) -> None:
    """The core process's entry point: build the engine, announce it, then loop until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if logging.getLogger().handlers == []:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    ctx = zmq.Context()
    inp, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inp.connect(input_addr)
    out.connect(output_addr)
    encode = msgspec.msgpack.Encoder().encode
    code = 0
    try:
        from jaxpaged.engine.core import EngineCore
        core = EngineCore(args)
        out.send(encode(core.info()))
        _core_loop(core, inp, out, encode, parent_pid)
    except BaseException as e:
        logger.exception("engine core failed")           # the traceback: here, in the log
        out.send(encode(CoreFailure(f"{type(e).__name__}: {e}")))
        code = 1
    finally:
        inp.close(linger=0)
        out.close(linger=2000)       # let the last message (a failure) leave
        ctx.term()
    sys.exit(code)


def _core_loop(core, inp: zmq.Socket, out: zmq.Socket, encode, parent_pid: int) -> None:
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
                for r in decode_add(payload):
                    core.add_request(r)
            else:
                core.abort_requests(decode_abort(payload))
            touched = True
            timeout = 0
        if os.getppid() != parent_pid:
            logger.error("the API process is gone: the engine core exits")
            return
        if core.has_unfinished_requests():
            outputs = core.step()
            out.send(encode(EngineCoreOutputs(outputs, core.core_stats())))
        elif touched:             # aborts emptied the core: the gauges (running, KV usage) moved anyway
            out.send(encode(EngineCoreOutputs([], core.core_stats())))


# ---- the API process's end ---------------------------------------------------------------------
class CoreProcClient:
    """Starts the core process and talks to it. `start()` returns at once (the core loads and compiles in
    the background); `wait_ready()` returns its CoreInfo."""

    def __init__(self, args: EngineArgs, target=run_core_process):
        """target: the core process's entry point, (args, input_addr, output_addr, parent_pid) -> None
        (bench/api_capacity.py swaps in a core without a model to measure the API process alone)."""
        self._dir = tempfile.mkdtemp(prefix="jaxpaged-core-")
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)            # never block the event loop on a slow core
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        input_addr, output_addr = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self._input.bind(input_addr)
        self._output.bind(output_addr)
        self._encode = msgspec.msgpack.Encoder().encode
        self._decoder = core_message_decoder()
        self.shutting_down = False
        spawn = multiprocessing.get_context("spawn")
        self.proc = spawn.Process(target=target, name="jaxpaged-engine-core", daemon=True,
                                  args=(args, input_addr, output_addr, os.getpid()))
        self.proc.start()

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
            elif not self.proc.is_alive():
                code = self.proc.exitcode
                self.shutdown()
                raise EngineDeadError(f"the engine core process exited during start-up (exit code {code})")
            if deadline is not None and time.monotonic() > deadline:
                self.shutdown()
                raise EngineDeadError(f"the engine core was not ready within {timeout_s} s")

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

    def wait_for_exit(self) -> int | None:
        """Block until the core process exits (a thread of the caller's waits here); its exit code."""
        multiprocessing.connection.wait([self.proc.sentinel])
        self.proc.join(SHUTDOWN_WAIT_S)               # reap it, so the exit code is known
        return self.proc.exitcode

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
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
