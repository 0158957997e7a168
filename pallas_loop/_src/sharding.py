"""Rows sharded over a device mesh: run the loop on each device's own rows.

Legend:  B: rows of the batch   n: devices the rows are split over   B/n: rows per shard

`iterate` treats rows independently, so a batch whose rows are split over a
mesh needs no communication at all in the forward: each device runs the
kernel (or the XLA loop) on its B/n rows. Left to XLA's partitioner that does
not happen: a Pallas kernel is an opaque custom call, so the partitioner
gathers the whole state onto every device, and row sorting is a global
permutation. So `per_shard` wraps the loop in `jax.shard_map` whenever the
row sharding is visible in the arrays' types (explicit sharding, the default
of `jax.make_mesh` in JAX 0.11), with

  in_specs   P(rows) for the leaves of h0 and x and the counts,
             P() (replicated) for params, the step's constants and the
             halting operands;
  out_specs  P(rows) for the final state and the per-row statistics.

The shard_map is manual over every axis of the mesh: devices that share a
slice of rows (other mesh axes, e.g. "model") compute the same thing. (Being
manual over the row axes only would spare the backward's sum over those
axes, but the Triton lowering of JAX 0.11 fails on a kernel traced with
explicit axes left in context.) `check_vma=False`: the user's step is
replayed from a jaxpr that knows nothing of varying manual axes.

Gradients come from differentiating that shard_map: the wrapped function is
`iterate`'s custom_vjp, so each device runs the backward on its own rows, and
JAX's transpose of the shard_map sums the cotangents of the replicated
operands (params, constants) over the mesh (one all-reduce of the parameter
gradients) while the cotangents of h0 and x stay sharded like h0 and x (on
a mesh with axes that do not split the rows, they are also summed over those
axes, whose devices repeated the work: an all-reduce, never a gather).

Rows sorted by count (`sort_rows=True`) are sorted within a shard: the order
is computed inside the shard_map, on the local counts.

With mesh axes of type Auto (a `jax.sharding.Mesh` built without
`axis_types`, or `jax.make_mesh(..., axis_types=(AxisType.Auto,))`) the row
sharding is not part of the types at trace time, so nothing here can act on
it; `per_shard` then warns once (the XLA implementation is partitioned by
rows by XLA itself; a Pallas kernel would have its state gathered). See
docs/sharding.md for the ways out (`jax.make_mesh`'s explicit axes, or
`jax.sharding.explicit_axes`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from jax import tree_util
from jax.sharding import AbstractMesh
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_loop._src import notices
from pallas_loop._src.operands import LoopOperands, LoopOutputs


def _sharding_of(a: Any) -> NamedSharding | None:
  """The `NamedSharding` in `a`'s type, or None (no mesh, or not an array)."""
  try:
    s = jax.typeof(a).sharding
  except TypeError:
    return None
  if not isinstance(s, NamedSharding) or s.mesh.empty:
    return None
  return s


def _axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
  """Mesh axis names of one PartitionSpec entry (None, a name or a tuple)."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _row_entry(s: NamedSharding) -> str | tuple[str, ...] | None:
  """The explicit mesh axes that axis 0 is split over, as a spec entry, or None."""
  if not s.spec or s.spec[0] is None or s.spec[0] == P.UNCONSTRAINED:
    return None
  axes = _axes(s.spec[0])
  if not all(s.mesh._name_to_type[a] == AxisType.Explicit for a in axes):
    return None
  return s.spec[0]


def row_sharding(*row_trees: Any) -> tuple[Mesh | AbstractMesh, Any] | None:
  """Where the rows of `row_trees` live: (mesh, spec entry) or None.

  The first leaf (h0's first, then x's, then the counts') whose type shows
  its row axis split over explicit mesh axes decides; other leaves are
  resharded to match it.

  Args:
    *row_trees: pytrees of arrays with a leading row axis (h0, x, counts).

  Returns:
    None when no leaf's row axis is sharded over explicit mesh axes, else
    `(mesh, entry)` with `entry` the PartitionSpec entry of axis 0
    (e.g. "rows" or ("data", "fsdp")) and `mesh` the abstract mesh of the
    types under a trace, the concrete mesh of the arrays outside one.
  """
  for leaf in tree_util.tree_leaves(row_trees):
    s = _sharding_of(leaf)
    if s is not None and _row_entry(s) is not None:
      concrete = getattr(leaf, "sharding", None)
      if isinstance(concrete, NamedSharding) and not isinstance(leaf, jax.core.Tracer):
        # Called outside jit: resharding and shard_map need the real devices.
        return concrete.mesh, _row_entry(s)
      return s.mesh, _row_entry(s)
  return None


def _warn_auto_axes(row_trees: Any) -> None:
  """Warns once if the rows sit on a multi-device mesh with Auto axes."""
  for leaf in tree_util.tree_leaves(row_trees):
    s = _sharding_of(leaf)
    if s is None or s.mesh.size < 2:
      continue
    auto = tuple(n for n, t in zip(s.mesh.axis_names, s.mesh.axis_types)
                 if t == AxisType.Auto)
    if not auto:
      continue
    message = (
        f"pallas_loop.iterate: the rows live on a mesh with Auto axes {auto}, "
        "so how they are sharded is not visible while tracing and iterate "
        "cannot run the loop per shard: a Pallas kernel would get the whole "
        "state gathered onto every device, and the XLA implementation, which "
        "orders rows by count across the whole batch, runs every row on every "
        "device. Use a mesh with Explicit axes "
        "(jax.make_mesh's default) or wrap the call in "
        "jax.sharding.explicit_axes(..., axes=..., in_sharding=...); see "
        "docs/sharding.md.")
    notices.warn_once(message, stacklevel=4)
    return


def _reshard(tree: Any, mesh: Mesh | AbstractMesh, spec_of: Callable[..., P]) -> Any:
  """Reshards every leaf of `tree` to `spec_of(leaf)` where it differs."""

  def one(a: Any) -> Any:
    want = spec_of(a)
    s = _sharding_of(a)
    have = s.spec._normalized_spec_for_aval(a.ndim) if s is not None else None
    if have == want._normalized_spec_for_aval(a.ndim):
      return a
    return jax.sharding.reshard(a, NamedSharding(mesh, want))

  return tree_util.tree_map(one, tree)


def _output_spec(h0_leaf: Any, entry: str | tuple[str, ...]) -> P:
  """How a final-state leaf leaves `per_shard`: rows split over `entry`, the
  trailing axes split as in its h0 leaf (the loop needed them whole).

  Rows stay split even where the h0 leaf was replicated (the rows being
  sharded through x or the counts): gathering them back would be exactly the
  all-gather of the state that running per shard avoids.
  """
  s = _sharding_of(h0_leaf)
  ndim = np.ndim(h0_leaf)
  trailing = s.spec._normalized_spec_for_aval(ndim)[1:] if s is not None else (None,) * (ndim - 1)
  taken = set(_axes(entry))
  trailing = tuple(None if set(_axes(t)) & taken else t for t in trailing)
  return P(entry, *trailing)


def per_shard(fn: Callable[[LoopOperands], LoopOutputs], *,
              warn_auto: bool = True) -> Callable[[LoopOperands], LoopOutputs]:
  """`fn(ops)` run on each shard's rows.

  `fn` is the (differentiable) loop over a batch. When the row axis of
  `ops.h0`, `ops.x` or `ops.counts` is sharded over explicit mesh axes, the
  returned function runs `fn` under `jax.shard_map` on each device's B/n rows
  (see the module doc) and returns outputs sharded like the inputs (rows over
  the same mesh axes; each leaf of `h` with the trailing-axis sharding of its
  `h0` leaf); otherwise it is `fn` itself. It is differentiable wherever `fn`
  is: the cotangents of params/consts are summed over the mesh, those of
  h0/x stay sharded.

  Args:
    fn: LoopOperands -> LoopOutputs, row independent (every output row
      depends only on the same row of h0, x, counts and row_ids, which are
      sharded with the rows).
    warn_auto: warn (once) when the rows live on a multi-device mesh with
      Auto axes, where the sharding cannot be seen (neither implementation
      then runs per shard).

  Returns:
    A function with `fn`'s signature and results.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from pallas_loop._src import sharding
    >>> from pallas_loop._src.operands import LoopOperands, LoopOutputs
    >>> loop = lambda ops: LoopOutputs(ops.h0 * ops.params, ops.h0[:, 0], ops.counts,
    ...                                ops.counts > 0)
    >>> ops = LoopOperands(2.0, [], jnp.ones((4, 3)), None, jnp.ones(4, jnp.int32),
    ...                    jnp.arange(4, dtype=jnp.int32), None)
    >>> sharding.per_shard(loop)(ops).h.shape
    (4, 3)
  """

  def run(ops: LoopOperands) -> LoopOutputs:
    found = row_sharding(ops.h0, ops.x, ops.counts)
    if found is None:
      if warn_auto:
        _warn_auto_axes((ops.h0, ops.x, ops.counts))
      return fn(ops)
    mesh, entry = found
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context != mesh.abstract_mesh:
      raise ValueError(
          f"pallas_loop.iterate: the rows of h0 are sharded over {mesh}, but "
          f"the context mesh is {context}; run iterate under the mesh that "
          "its inputs are sharded over (jax.set_mesh).")
    shards = 1
    for name in _axes(entry):
      shards *= mesh.shape[name]
    batch = ops.counts.shape[0]
    if batch % shards:
      raise ValueError(
          f"pallas_loop.iterate: {batch} rows cannot be split evenly over the "
          f"{shards} devices of mesh axes {entry!r}; pad the batch to a "
          f"multiple of {shards} rows (e.g. with iters=0 for the padding).")

    rows = lambda a: P(entry, *(None,) * (a.ndim - 1))
    everywhere = lambda a: P()
    h_specs = [_output_spec(a, entry) for a in tree_util.tree_leaves(ops.h0)]
    # row_ids travel with their rows: a shard's rows keep their indices in
    # the caller's batch (their random keys depend on them).
    h0, x, counts, row_ids = _reshard((ops.h0, ops.x, ops.counts, ops.row_ids), mesh, rows)
    params, consts, halting = _reshard((ops.params, ops.consts, ops.halting), mesh, everywhere)

    sharded = jax.shard_map(
        fn, mesh=mesh,
        in_specs=(LoopOperands(P(), P(), P(entry), P(entry), P(entry), P(entry), P()),),
        out_specs=P(entry), check_vma=False)
    out = sharded(LoopOperands(params, consts, h0, x, counts, row_ids, halting))
    h_leaves, h_tree = tree_util.tree_flatten(out.h)
    return out._replace(h=tree_util.tree_unflatten(h_tree, [
        _reshard(a, mesh, lambda _, spec=spec: spec) for a, spec in zip(h_leaves, h_specs)]))

  return run
