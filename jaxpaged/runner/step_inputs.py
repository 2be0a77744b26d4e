"""A step's host inputs on their way to the device: packed into two flat buffers (pack / unpack), written
in place into persistent pinned host buffers (HostInputs), and cut apart and moved to the device by the step
itself (unpack), which also fills in the tokens the previous step sampled (fill_input_tokens)."""
from __future__ import annotations

import ctypes
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.runner.buckets import _round_up_pow2


class HostInputs:
    """Persistent pinned host buffers that each step's packed inputs are written into, in place.

    Why: handing a step new host arrays makes JAX transfer them (a host-to-device copy through PjRt per
    array), and each such transfer holds the host about as long as a small model's whole device step. Here
    numpy writes the inputs straight into pinned host memory that JAX already owns (through a view of the
    buffer's address), and the step program copies them to the device as its first operation, in stream
    order: no transfer call on the host at all, and the same addresses every step.

    The step must not read a buffer while the host rewrites it: each packed size has `depth` slots used in
    turn, and a slot is rewritten only once the step that last read it has finished (its results are
    ready; with at most one step in flight ahead of the host that never waits in practice). JAX arrays are
    immutable to JAX, so nothing else may hold these: only the runner passes them, only to the step."""

    DEPTH = 3

    def __init__(self, depth: int = DEPTH):
        self.depth = depth
        dev = jax.devices()[0]
        self._sharding = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
        self._slots: dict[tuple[int, int], list[HostInputSlot]] = {}   # packed sizes -> their slots
        self._turn: dict[tuple[int, int], int] = {}

    @property
    def sharding(self) -> jax.sharding.Sharding:
        """Where the slots' arrays live (the device's pinned host memory): the placement of a step's inputs."""
        return self._sharding

    def write(self, ints, floats) -> HostInputSlot:
        """Copy the packed inputs into the next free slot of their size; the caller passes slot.arrays to
        the step and sets slot.fence to the step's results. ints / floats: packed arrays (pack), or their
        unpadded pieces (flatten), which are concatenated straight into the slot: the padding past them is
        never read, so it is not written."""
        ints, floats = _pieces(ints), _pieces(floats)
        n_ints, n_floats = sum(map(len, ints)), sum(map(len, floats))
        key = (padded_len(n_ints), padded_len(n_floats))
        slots = self._slots.get(key)
        if slots is None:
            slots = self._slots[key] = [self._new_slot(key) for _ in range(self.depth)]
            self._turn[key] = 0
        slot = slots[self._turn[key]]
        self._turn[key] = (self._turn[key] + 1) % self.depth
        if slot.fence is not None:
            try:
                jax.block_until_ready(slot.fence)
            except jax.errors.JaxRuntimeError:
                pass    # that step failed (its caller got the error), and a failed step reads nothing more
            slot.fence = None
        for pieces, n, view in ((ints, n_ints, slot.views[0]), (floats, n_floats, slot.views[1])):
            if pieces:
                np.concatenate(pieces, out=view[:n])
        return slot

    def _new_slot(self, sizes: tuple[int, int]) -> HostInputSlot:
        arrays, views = [], []
        for size, dtype, ctype in zip(sizes, (np.int32, np.float32), (ctypes.c_int32, ctypes.c_float)):
            # a private zero array: on the CPU, device_put may alias the numpy memory it is given
            a = jax.device_put(np.zeros(size, dtype), self._sharding)
            ptr = a.addressable_data(0).unsafe_buffer_pointer()
            arrays.append(a)
            views.append(np.ctypeslib.as_array((ctype * size).from_address(ptr)))
        return HostInputSlot(tuple(arrays), tuple(views))


@dataclasses.dataclass
class HostInputSlot:
    """One pair of pinned input buffers of HostInputs."""
    arrays: tuple[jax.Array, jax.Array]      # i32[n], f32[m] in pinned host memory: what the step is given
    views: tuple[np.ndarray, np.ndarray]     # numpy views of the same memory: what the host writes
    fence: object = None                     # results of the last step that read the slot (None: free)


_F32, _U32 = np.dtype(np.float32), np.dtype(np.uint32)
_PACK_MIN = 256      # packed buffers are at least this long, then powers of two (few distinct sizes)


def _align_up(n: int, align: int) -> int:
    return -(-n // align) * align


def flatten(tree, align: int = 1) -> tuple[list[np.ndarray], list[np.ndarray], tuple]:
    """All host inputs of a step as flat int32 and float32 pieces, and the `layout` (static, hashable) that
    says how to cut the concatenated buffers apart again (unpack). With align > 1, zero pieces between them
    start each input at a multiple of `align` elements of its buffer (RunConfig.input_align says where
    that is needed)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    ints, floats, spec = [], [], []
    for leaf in leaves:      # a hot path: dtype compares only (numpy's str(dtype) costs ~15 us in Python)
        a = leaf if type(leaf) is np.ndarray else np.asarray(leaf)
        dt = a.dtype
        if dt == _F32:
            floats.append(a.ravel())
            spec.append(("f", a.shape, "float32"))
        elif dt == _U32:     # uint32 seeds, reinterpreted bit for bit
            ints.append(a.view(np.int32).ravel())
            spec.append(("i", a.shape, "uint32"))
        else:
            ints.append(a.astype(np.int32, copy=False).ravel())
            spec.append(("i", a.shape, "int32"))
    if align > 1:
        ints, floats = _aligned(ints, align, np.int32), _aligned(floats, align, np.float32)
    return ints, floats, (treedef, tuple(spec), align)


def _aligned(pieces: list[np.ndarray], align: int, dtype) -> list[np.ndarray]:
    """The pieces with zero pieces between them, so that each starts at a multiple of `align`."""
    out, n = [], 0
    for piece in pieces:
        if n % align:
            out.append(np.zeros(align - n % align, dtype))
            n = _align_up(n, align)
        out.append(piece)
        n += len(piece)
    return out


def pack(tree, align: int = 1) -> tuple[np.ndarray, np.ndarray, tuple]:
    """All host inputs of a step in two flat buffers (int32, float32): two host-to-device copies per step
    instead of one per array, and `layout` (see flatten). Each buffer is zero-padded to padded_len: few
    distinct sizes, so few compiled shapes and HostInputs slots."""
    ints, floats, layout = flatten(tree, align)
    return _padded(ints, np.int32), _padded(floats, np.float32), layout


def padded_len(n: int) -> int:
    """A packed buffer's length for n values: a power of two, at least _PACK_MIN."""
    return _round_up_pow2(max(n, _PACK_MIN))


def _padded(pieces: list[np.ndarray], dtype) -> np.ndarray:
    n = sum(map(len, pieces))
    return np.concatenate(pieces + [np.zeros(padded_len(n) - n, dtype)])


def _pieces(x) -> list[np.ndarray]:
    return [x] if isinstance(x, np.ndarray) else x


def unpack(ints, floats, layout):
    """pack's inverse inside the step: the arrays cut out of the two flat buffers (i32[n], f32[m]), moved to
    the device first (the step's first copy when they come in pinned host memory, HostInputs; nothing when
    they are already there)."""
    ints, floats = (jax.device_put(x, jax.memory.Space.Device) for x in (ints, floats))
    treedef, spec, align = layout
    leaves, offsets = [], {"i": 0, "f": 0}
    for kind, shape, dtype in spec:
        size = int(np.prod(shape, dtype=np.int64))
        buf = ints if kind == "i" else floats
        start = _align_up(offsets[kind], align)   # as flatten laid the pieces out
        x = jax.lax.slice_in_dim(buf, start, start + size).reshape(shape)
        offsets[kind] = start + size
        if dtype == "uint32":
            x = jax.lax.bitcast_convert_type(x, jnp.uint32)
        leaves.append(x)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def fill_input_tokens(model_input, prev_sampled):
    """The step's input tokens (model_runner.ModelInput), with those the previous step sampled (still on the
    device) filled in."""
    return model_input.token_ids.at[model_input.fill_token_idx].set(
        prev_sampled[model_input.fill_src_row], mode="drop")
