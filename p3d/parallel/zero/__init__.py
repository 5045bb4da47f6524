"""ZeRO-2 and ZeRO-3 with pipeline and tensor parallelism (the ZeRO-2/3 issue): gradients, and then parameters,
sharded over the dp group with torch's FSDP2 (``fully_shard``) on the torch executor's chunks. Today the ``zero``
group runs stage 0 (replicated) and stage 1 (optimizer states sharded: DeepSpeed's ZeRO-1 under ``1f1b``, torch's
``ZeroRedundancyOptimizer`` under the torch schedules); p3d.layout.run_plan refuses 2 and 3."""
