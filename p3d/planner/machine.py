"""The machine the planner times a step on: its rates, as the device table gives them or as a calibration measured.

``machine_of(cfg)`` is the one place the step-time model gets a rate from:

- ``DeviceTable``: the device preset's nominal figures: each GEMM timed from its shape (p3d.planner.gemms: tiles and
  waves over the SMs at the generation's fitted constants, which ``plan.efficiency`` and ``plan.gemm_k_overhead``
  override, or its bytes at the HBM rate; a device without SMs, cpu: ``cluster.peak_tflops`` x one flat
  efficiency), the HBM datasheet x 0.8, the links x 0.8 plus a
  latency, 32 bytes per optimizer element through HBM. Without ``calibration=`` every prediction is this arithmetic.
- ``Calibrated``: a file of ``p3d-plan calibrate`` (p3d.planner.calibration). A block or head probed at the layout's
  shape gives its measured fwd / bwd seconds; any other shape is FLOPs and bytes at the measured GEMM and memory
  rates (every GEMM at the one measured rate). Collectives inside a node use the fit of their (op, n); the optimizer its
  seconds per parameter. On a cpu file ``cores`` is set: the step cannot be shorter than all ranks' work over the
  cores (p3d.planner.predict).
  When the layout has at least as many ranks as cores, the times measured with ``cores`` copies at once are used.
"""

from __future__ import annotations

import functools
from typing import Protocol, cast

from p3d.config.devices import DEVICES
from p3d.config.schema import Config
from p3d.layout.geometry import padded_vocab
from p3d.planner import calibration, context, gemms
from p3d.planner.calibration import BlockKey, Calibration, Probed
from p3d.planner.gemms import Gemm, GemmDevice
from p3d.planner.memory import dtype_bytes
from p3d.planner.shapes import Layout

HBM_EFFICIENCY = 0.8  # memory-bound kernels reach about 80% of the datasheet bandwidth
COMM_EFFICIENCY = 0.8  # NCCL bus bandwidth / link bandwidth (nccl-tests on DGX A100 / H100: ~0.8)
LATENCY_S = {"intra": 10e-6, "inter": 25e-6}  # per collective or send
OPTIMIZER_BYTES_PER_ELEMENT = 32.0  # Adam step: grad, fp32 master, m, v read + written, param written


def efficiency(cfg: Config) -> float:
    """``plan.efficiency``, else the device's: a GPU's asymptotic GEMM efficiency (e of the GEMM model), cpu's flat
    one."""
    return cfg.plan.efficiency or DEVICES[cfg.cluster.device].matmul_efficiency


def gemm_device(cfg: Config) -> GemmDevice | None:
    """The GEMM model's view of the device (its constants, or ``plan.efficiency`` / ``plan.gemm_k_overhead``), or None
    where every matmul runs at one flat rate (a device without SMs: cpu)."""
    dev = DEVICES[cfg.cluster.device]
    if dev.sms is None:
        return None
    k_overhead = cfg.plan.gemm_k_overhead
    return GemmDevice(
        peak_flops=cast(float, cfg.cluster.peak_tflops) * 1e12,
        sms=dev.sms,
        efficiency=efficiency(cfg),
        k_overhead=dev.gemm_k_overhead if k_overhead is None else k_overhead,
        hbm_bytes_s=hbm_bytes_per_s(cfg),
        element_bytes=dtype_bytes(cfg),
        # the preset's float8 peak, scaled as cluster.peak_tflops scales its bf16 one
        float8_peak_flops=dev.float8_tflops / dev.peak_tflops * cast(float, cfg.cluster.peak_tflops) * 1e12
        if dev.float8_tflops
        else None,
    )


def hbm_bytes_per_s(cfg: Config) -> float:
    return (cfg.plan.hbm_gbps or DEVICES[cfg.cluster.device].hbm_gbps) * 1e9 * HBM_EFFICIENCY


def intra_node(cfg: Config, span: int) -> bool:
    """Whether a group of ``span`` consecutive ranks fits in a node (always on cpu)."""
    gpn = cfg.cluster.gpus_per_node
    return gpn is None or span <= gpn


def link(cfg: Config, span: int) -> tuple[float, float]:
    """(bytes/s, latency) of a group whose ranks span ``span`` consecutive ranks (tp fastest, then dp, then pp)."""
    c = cfg.cluster
    intra = intra_node(cfg, span)
    gbps = cast(float, c.intra_node_gbps if intra else c.inter_node_gbps)
    return gbps * 1e9 * COMM_EFFICIENCY, LATENCY_S["intra" if intra else "inter"]


def ring_factor(op: str, n: int) -> float:
    """The share of the bytes a ring collective moves per rank: 2 (n-1)/n for an all-reduce, (n-1)/n otherwise."""
    return (2 if op == "all_reduce" else 1) * (n - 1) / n


class Machine(Protocol):
    cores: int | None  # cpu with a calibration: the cores all ranks share; else None (no contention)

    def flops_s(self, layout: Layout) -> float: ...
    def gemm(self, g: Gemm, layout: Layout) -> float: ...
    def mem_s(self, layout: Layout) -> float: ...
    def block(self, layout: Layout, moe: bool) -> dict[str, float] | None: ...
    def head(self, layout: Layout) -> tuple[float, float] | None: ...
    def embedding(self, layout: Layout) -> tuple[float, float] | None: ...
    def collective(self, op: str, nbytes: float, n: int, span: int) -> float: ...
    def optimizer_seconds(self, layout: Layout, elements: float) -> float: ...
    def engine_copies(self, layout: Layout, elements: float) -> float: ...
    def engine_reduce(self, layout: Layout, nbytes: float, n: int) -> float | None: ...
    def overhead(self, executor: str) -> tuple[float, float]: ...
    def notes(self, layout: Layout) -> list[str]: ...


class DeviceTable:
    """The device preset's nominal rates (today's arithmetic, bit for bit)."""

    cores: int | None = None

    def __init__(self, cfg: Config):
        self.cfg = cfg

    @functools.cached_property
    def gemm_device(self) -> GemmDevice | None:
        return gemm_device(self.cfg)

    def flops_s(self, layout: Layout) -> float:
        """The flat matmul rate: peak x ``efficiency`` (the GEMM model's asymptote on a GPU)."""
        return cast(float, self.cfg.cluster.peak_tflops) * 1e12 * efficiency(self.cfg)

    def gemm(self, g: Gemm, layout: Layout) -> float:
        """Seconds of one GEMM: from its shape (p3d.planner.gemms), or its FLOPs at the flat rate."""
        dev = self.gemm_device
        if dev is None:
            return g.flops / self.flops_s(layout)
        return gemms.seconds(g, dev)

    def mem_s(self, layout: Layout) -> float:
        return hbm_bytes_per_s(self.cfg)

    def block(self, layout: Layout, moe: bool) -> dict[str, float] | None:
        return None

    def head(self, layout: Layout) -> tuple[float, float] | None:
        return None

    def embedding(self, layout: Layout) -> tuple[float, float] | None:
        return None

    def collective(self, op: str, nbytes: float, n: int, span: int) -> float:
        """Seconds of one ring collective over n ranks (``send_recv``: one message to a neighbour)."""
        bw, lat = link(self.cfg, span)
        if op == "send_recv":
            return nbytes / bw + lat
        return ring_factor(op, n) * nbytes / bw + lat

    def optimizer_seconds(self, layout: Layout, elements: float) -> float:
        return elements * OPTIMIZER_BYTES_PER_ELEMENT / hbm_bytes_per_s(self.cfg)

    def engine_copies(self, layout: Layout, elements: float) -> float:
        """Seconds of DeepSpeed's gradient copies around its dp all-reduce (not in the device table's model)."""
        return 0.0

    def engine_reduce(self, layout: Layout, nbytes: float, n: int) -> float | None:
        """Seconds of DeepSpeed's whole ZeRO 0 reduce (copies and all-reduce) as probed on n real ranks, or None."""
        return None

    def overhead(self, executor: str) -> tuple[float, float]:
        return 0.0, 0.0

    def notes(self, layout: Layout) -> list[str]:
        return []


class Calibrated(DeviceTable):
    """The rates a calibration file measured on this machine (inter-node links stay the device table's)."""

    def __init__(self, cfg: Config, cal: Calibration):
        super().__init__(cfg)
        self.cal = cal
        self.cores = cal.cores if str(cfg.cluster.device) == "cpu" else None

    def loaded(self, layout: Layout) -> bool:
        """Whether the layout's ranks take every core (then the times measured with all cores busy apply)."""
        return layout.world_size >= self.cal.cores

    def flops_s(self, layout: Layout) -> float:
        return (self.cal.loaded_gemm_tflops if self.loaded(layout) else self.cal.gemm_tflops) * 1e12

    def gemm(self, g: Gemm, layout: Layout) -> float:
        """Every GEMM at the measured rate of the block's largest one (the probes time whole blocks where they can)."""
        return g.flops / self.flops_s(layout)

    def mem_s(self, layout: Layout) -> float:
        return (self.cal.loaded_memory_gbps if self.loaded(layout) else self.cal.memory_gbps) * 1e9

    def _tokens(self, layout: Layout) -> int:
        """s of the probe key: the rank's s / cp tokens of each sequence."""
        return round(context.local_tokens(self.cfg, layout))

    def _dtype(self) -> str:
        return "fp32" if dtype_bytes(self.cfg) == 4 else "bf16"

    def block(self, layout: Layout, moe: bool) -> dict[str, float] | None:
        """Probed seconds of one block per micro batch (fwd, bwd without recompute, rec: what the layout's recompute
        adds to the backward), or None where this shape was not probed. Where the block was probed on tp real ranks
        (``tp_blocks``) its all-reduces are in those times: ``tp`` is 0 then (the collective fits are not added)."""
        arch, s, dtype = self.cfg.model.arch.value, self._tokens(layout), self._dtype()
        key = (arch, moe, layout.tp, s)
        # DeepSpeed's full recompute where the file has it probed (a file before it: torch's checkpoint, "full")
        modes = (calibration.probe_mode(layout.recompute, layout.torch_executor), layout.recompute)

        def rows(table: dict[BlockKey, Probed]) -> tuple[Probed | None, Probed | None]:
            mode = next((table[k] for m in modes if (k := (*key, m, dtype)) in table), None)
            return table.get((*key, "none", dtype)), mode

        base, mode = rows(self.cal.tp_blocks)
        grouped = base is not None and mode is not None
        if not grouped:
            base, mode = rows(self.cal.blocks)
        if base is None or mode is None:
            return None
        loaded = self.loaded(layout) and not grouped  # tp real ranks: the cores busy already
        fwd, bwd = base.times(layout.micro_batch_size, loaded)
        _, bwd_mode = mode.times(layout.micro_batch_size, loaded)
        times = {"fwd": fwd, "bwd": bwd, "rec": max(0.0, bwd_mode - bwd)}
        return {**times, "tp": 0.0} if grouped else times

    def head(self, layout: Layout) -> tuple[float, float] | None:
        """Probed (fwd, bwd) seconds of the final norm, the head and the loss per micro batch, or None."""
        vpad = padded_vocab(self.cfg.model.vocab_size, layout.tp)
        probed = self.cal.heads.get((layout.tp, self._tokens(layout), vpad))
        return None if probed is None else probed.times(layout.micro_batch_size, self.loaded(layout))

    def embedding(self, layout: Layout) -> tuple[float, float] | None:
        """Probed (fwd, bwd) seconds of the vocab-parallel lookup per micro batch (its dense gradient), or None (the
        analytic model counts no embedding time)."""
        vpad = padded_vocab(self.cfg.model.vocab_size, layout.tp)
        probed = self.cal.embeddings.get((layout.tp, self._tokens(layout), vpad))
        return None if probed is None else probed.times(layout.micro_batch_size, self.loaded(layout))

    def collective(self, op: str, nbytes: float, n: int, span: int) -> float:
        """The fit of (op, n); for an unprobed n the nearest probed one at the bytes scaled by the ring
        factor (an all-to-all as an all-gather: (n-1)/n of the bytes leave each rank); across nodes the table's."""
        fit_op = "all_gather" if op == "all_to_all" else op
        ns = [k for o, k in self.cal.fits if o == fit_op]
        if not intra_node(self.cfg, span) or not ns:
            return super().collective(op, nbytes, n, span)
        if op == "send_recv":
            n = 2
        near = min(ns, key=lambda k: (abs(k - n), k))
        scale = 1.0 if near == n or op == "send_recv" else ring_factor(fit_op, n) / ring_factor(fit_op, near)
        return self.cal.fits[(fit_op, near)].seconds(nbytes * scale)  # another n: as many bytes as its ring moves

    def optimizer_seconds(self, layout: Layout, elements: float) -> float:
        """AdamW's step as probed; with every core busy, as probed in ``cores`` copies at once: the step streams its
        state through memory, which the ranks stepping together share (dp2 on 2 cores: about 1.6x alone)."""
        return elements * self.cal.optimizer_s_per_param[1 if self.loaded(layout) else 0]

    def engine_copies(self, layout: Layout, elements: float) -> float:
        """DeepSpeed's engine, fp32, ZeRO 0, dp > 1 (``buffered_allreduce_fallback``): the gradients flattened into
        a bucket, scaled by 1 / dp after the all-reduce and copied back: as probed (``engine_copy_s_per_param``), or
        three passes, each reading and writing 4 bytes per element, at the measured copy rate."""
        if layout.torch_executor or layout.zero != 0 or layout.dp_cp == 1 or dtype_bytes(self.cfg) != 4:
            return 0.0
        probed = self.cal.engine_copy_s_per_param
        if probed is not None:  # measured at the plan's largest message: the new buffer's page faults in
            return elements * probed[1 if self.loaded(layout) else 0]
        return 3 * 2 * 4.0 * elements / self.mem_s(layout)

    def engine_reduce(self, layout: Layout, nbytes: float, n: int) -> float | None:
        """DeepSpeed's engine, fp32, ZeRO 0, dp > 1, inside a node: the flatten, all-reduce, scale and copy back of
        ``nbytes`` of gradients as probed whole on n real ranks (``engine_reduce``); None where not probed. Timed
        apart, the all-reduce and the copies came to 0.48 s for model=small's 0.49 GB on 2 ranks here, and the
        whole to 0.65-1.3 s: the ranks copy at once, and the copies and the gloo transfers share the memory."""
        fit = self.cal.fits.get(("engine_reduce", n))
        deepspeed_zero0 = layout.ep == 1 and self.engine_copies(layout, 1.0) > 0
        if fit is None or not deepspeed_zero0 or not intra_node(self.cfg, layout.tp * n):
            return None
        if len(fit.points) == 1:  # probed at the plan's largest message only: a smaller stage's, pro rata
            (probed_bytes, seconds), *_ = fit.points
            return seconds * nbytes / probed_bytes
        return fit.seconds(nbytes)

    def overhead(self, executor: str) -> tuple[float, float]:
        return self.cal.overhead.get(executor, (0.0, 0.0))

    def notes(self, layout: Layout) -> list[str]:
        """What the calibration did not probe for this layout (its time comes from the measured rates)."""
        probes = (("blocks", self.block(layout, False)), ("head", self.head(layout)))
        missing = [name for name, got in probes if not got]
        if not missing:
            return []
        s = self._tokens(layout)
        return [
            f"calibrated rates, not probes, for the {' and '.join(missing)} at tp={layout.tp} s={s} "
            f"recompute={layout.recompute} (run p3d-plan calibrate with this layout to probe them)"
        ]


def machine_of(cfg: Config) -> Machine:
    """The calibrated machine when ``calibration=`` names a file (read once), else the device table."""
    if cfg.calibration:
        return Calibrated(cfg, calibration.load(cfg.calibration))
    return DeviceTable(cfg)


def executor_of(layout: Layout) -> str:
    """The executor whose overheads apply: DeepSpeed's engine, or torch's pipelining."""
    return "torch" if layout.torch_executor else "deepspeed"
