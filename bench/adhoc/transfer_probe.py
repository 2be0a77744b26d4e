"""What holds the host when a step's inputs come from the host while the device is busy (seventh session).

A ~3 ms computation is launched, then one way of handing new inputs to a small program is timed on the
host (how long the call holds the Python thread); then everything is waited for. Prints one line per way.
"""
import ctypes
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

dev = jax.devices()[0]
pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
ondev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
N = int(sys.argv[1]) if len(sys.argv) > 1 else 65536


@jax.jit
def heavy(a):
    for _ in range(24):
        a = jnp.tanh(a @ a) * 0.01
    return a


@jax.jit
def small(x):             # several fusions: XLA makes it a CUDA graph
    y = x * 3 + 1
    z = jnp.cumsum(y)
    w = jnp.sort(z)
    return (w[::2].sum() + y.max()).astype(jnp.int32), y


@jax.jit
def small_from_host(x):   # x in pinned host memory, moved by the program
    x = jax.device_put(x, ondev)
    return small.__wrapped__(x)


M = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
a = jnp.ones((M, M), jnp.bfloat16)
host = np.arange(N, dtype=np.int32)
dev_x = jax.device_put(host, dev)
pin_x = jax.device_put(host, pinned)
jax.block_until_ready((heavy(a), small(dev_x), small(host), small_from_host(pin_x)))
t0 = time.perf_counter()
jax.block_until_ready(heavy(a))
heavy_us = (time.perf_counter() - t0) * 1e6

# in-place writes to a persistent pinned host buffer (behind JAX's back): does the program see them?
ptr = pin_x.addressable_data(0).unsafe_buffer_pointer()
view = np.ctypeslib.as_array((ctypes.c_int32 * N).from_address(ptr))
view[:] = host + 7
inplace_ok = bool(np.array_equal(np.asarray(small_from_host(pin_x)[1]), (host + 7) * 3 + 1))

ways = {
    "device_put": lambda: jax.device_put(np.array(host), dev),
    "device_put_pinned": lambda: jax.device_put(np.array(host), pinned),
    "jit_numpy": lambda: small(np.array(host)),
    "jit_device_same": lambda: small(dev_x),
    "put_then_jit": lambda: small(jax.device_put(np.array(host), dev)),
    "jit_pinned_same": lambda: small_from_host(pin_x),
    "write_pinned_then_jit": lambda: (view.__setitem__(slice(None), host), small_from_host(pin_x)),
    "jit_pinned_fresh": lambda: small_from_host(jax.device_put(np.array(host), pinned)),
}
res = {"N": N, "heavy_us": round(heavy_us), "inplace_pinned_write_seen": inplace_ok,
       "jax": jax.__version__}
for name, fn in ways.items():
    ts = []
    for _ in range(15):
        h = heavy(a)
        time.sleep(0.0005)       # the heavy program is running on the device
        t0 = time.perf_counter()
        r = fn()
        ts.append(time.perf_counter() - t0)
        jax.block_until_ready((h, r))
    res[name] = round(float(np.median(ts)) * 1e6)
print("TRANSFER", json.dumps(res), flush=True)
