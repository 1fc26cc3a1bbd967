"""Scaling on paper: the block plan and the owner assignment on Llama-2 shapes, 8 to 4096 ranks.

``python -m shampoo_conformance scaling --out DIR`` (``nox -s scaling``)
plans the blocks of a real model's parameters (eqs. 4-5,
:func:`shampoo_spec.plan_parameter`), assigns owners with the load balancer
(:func:`shampoo_spec.assign_blocks` over :func:`shampoo_spec.block_cost`)
and tabulates, per rank, the root work, the per-step work, the factor
memory and the bytes the optimizer communicates per step, in four modes:

- ``ddp``: blocks of the full shapes, owners over all N ranks; one
  all-gather of every block's direction per step (each rank's segment padded
  to the longest, as ``shampoo_torch.distributed.DirectionExchange`` does).
- ``lossless``: FSDP2 ``fully_shard`` parameters (``Shard(0)``, chunks as
  ``torch.chunk`` cuts them: ``ceil(d0 / N)`` rows each, the last shorter or
  empty); blocks of the full shapes owned over the N ranks; per step every
  owner gathers its blocks' gradient pieces from the ranks holding them and
  sends each rank its slice of the direction (exact bytes from the overlap of
  blocks and shards).
- ``local``: every rank plans blocks on its own ``Shard(0)`` slice and owns
  them all; no optimizer communication, but other blocks than one process
  has, so other numerics.
- ``hsdp-S``: replicas of S-rank shard groups (R = N / S); inside a group as
  ``lossless`` over S ranks, the work repeated in every replica.

Nothing runs on a device: every number is a function of shapes, the config
and the cost model of :mod:`shampoo_spec.assignment` (root work = its
``root`` load, ``ROOT_FLOPS_PER_CUBE n^3`` per factor; step work = its
``step`` load; factor memory = its ``memory`` entries, float32 here).

The owners are :func:`shampoo_spec.assign_blocks`'s own: 67,080 blocks
(Llama-2-70B, block size 1024) over 4096 ranks take 0.4 s (its heap over
runs of equal blocks; scanning every rank for every block took 1.6 us per
block and rank, about 7 minutes there).
"""
