"""One compiled program of a step, described before it is lowered: the jitted function and the arguments it
is called with. Lowered here (the engine's own process) or exported by a lowering worker and compiled here
(runner/lowering_workers.py): either way the same function, arguments and donations make the program."""
from __future__ import annotations

from typing import Any, NamedTuple

import jax

# Custom calls that jax.export does not promise to keep stable across JAX versions. An exported program
# here never outlives the process that compiles it, nor crosses a JAX version (the engine and its workers
# import the same JAX), so they are allowed.
_KERNEL_CUSTOM_CALLS = ("__gpu$xla.gpu.triton", "triton_kernel_call", "mosaic_gpu", "mosaic_gpu_v2")


class ProgramSpec(NamedTuple):
    jitted: Any               # a jax.jit function
    args: tuple               # its positional arguments: arrays, or jax.ShapeDtypeStruct for their shapes
    static: dict              # its static keyword arguments
    donate: tuple[int, ...]   # the positions of the donated arguments (as the jitted function donates)

    def lower(self) -> jax.stages.Lowered:
        """Trace and lower here."""
        return self.jitted.trace(*self.args, **self.static).lower()

    def export(self, platform: str) -> tuple[bytes, Any]:
        """Trace and lower for `platform` ("cuda", "cpu") -> (the serialized jax.export, the outputs' tree
        structure): what a lowering worker hands back. The program is exported over the flat leaves of its
        arguments and outputs (jax.export serializes only the tree nodes it knows)."""
        from jax import export
        in_tree = jax.tree.structure(self.args)
        out_tree = None

        def flat(*leaves):
            nonlocal out_tree
            outs, out_tree = jax.tree.flatten(self.jitted(*jax.tree.unflatten(in_tree, leaves), **self.static))
            return outs

        checks = [export.DisabledSafetyCheck.custom_call(name) for name in _KERNEL_CUSTOM_CALLS]
        exported = export.export(jax.jit(flat), platforms=[platform], disabled_checks=checks)(
            *jax.tree.leaves(self.args))
        return bytes(exported.serialize()), out_tree

    def lower_exported(self, blob: bytes, out_tree: Any) -> jax.stages.Lowered:
        """A worker's export of this program, lowered here for this spec's arguments with its donations:
        the program compiles to what lower() gives, without tracing the model in this process."""
        from jax import export
        exported = export.deserialize(bytearray(blob))

        def call(*args):
            return jax.tree.unflatten(out_tree, exported.call(*jax.tree.leaves(args)))
        return jax.jit(call, donate_argnums=self.donate).trace(*self.args).lower()


def abstract(tree: Any) -> Any:
    """Arrays -> jax.ShapeDtypeStruct of the same shape and dtype (what a worker is sent)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
