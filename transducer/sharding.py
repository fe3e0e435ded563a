"""The fused loss's weight and bias when FSDP2 (``torch.distributed.fsdp.fully_shard``) has sharded them.

FSDP2 keeps each unit's parameters as sharded DTensors and gathers them in the unit's forward. The fused loss reads
the joiner's output Linear's weight without calling that Linear, so where the Linear is a unit of its own (or any
unit whose forward does not run the loss) it gets the sharded DTensor. Such a parameter is gathered here for the
step: the full copy is an input of the loss's autograd node (saved for backward, freed with the graph), and its
gradient is reduce-scattered back onto the shard as the mean over the mesh's ranks, FSDP2's default reduction.
A gradient divide factor set on the unit (``set_gradient_divide_factor``) does not apply to it, and it is reduced
at every backward, with or without ``set_requires_gradient_sync(False)`` (the accumulated gradient is the same).

torch.distributed is never imported here: a DTensor exists only once ``torch.distributed.tensor`` is imported.
"""

import sys

__all__ = ["full_parameters"]


def _dtensor_class():
    """DTensor's class, or None where torch.distributed.tensor is not imported (then no tensor is a DTensor)."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def full_parameters(weight, bias, **inputs):
    """``(weight, bias)``, each gathered in full for this step if it is a DTensor sharded along dim 0 or replicated
    over a 1-D device mesh (as FSDP2 and DDP-style replication leave it); a DTensor among ``inputs`` (name: tensor)
    is refused."""
    dtensor = _dtensor_class()
    if dtensor is None:
        return weight, bias
    for name, x in inputs.items():
        if isinstance(x, dtensor):
            raise TypeError(
                f"{name}: expected a plain torch.Tensor (each rank's own batch, as under DDP or FSDP), got "
                f"a DTensor with placements {x.placements} over a {x.device_mesh.ndim}-D device mesh: "
                f"sharded or replicated activations (tensor or sequence parallelism) are not supported; "
                f"pass {name}.full_tensor()"
            )
    return _full("weight", weight, dtensor), _full("bias", bias, dtensor)


def _full(name, x, dtensor):
    if not isinstance(x, dtensor):
        return x
    from torch.distributed.tensor import Partial, Replicate

    mesh, placements = x.device_mesh, x.placements
    if mesh.ndim != 1 or not (placements[0].is_shard(0) or placements[0].is_replicate()):
        raise ValueError(
            f"{name}: a DTensor with placements {placements} over a {mesh.ndim}-D device mesh is not "
            f"supported: the fused loss gathers a parameter sharded along dim 0 (FSDP2's fully_shard) "
            f"or replicated, over a 1-D mesh. For HSDP or tensor parallelism, make the module that "
            f"calls the loss (FusedJoinerLoss, or the model's joint) the unit holding this Linear, so "
            f"that its forward gathers the parameter, or pass {name}.full_tensor()"
        )
    # backward: the full gradient of each rank, a partial mean, reduce-scattered (Shard) or all-reduced (Replicate)
    return x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial("avg")])
