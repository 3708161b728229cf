"""Host-staged collectives inside vLLM's tensor-parallel communicator (switch: GLMCTL_COLLECTIVES).

The seam in vLLM 0.30 (read in `vllm/distributed/`): every TP all-reduce runs
`GroupCoordinator.all_reduce` -> `torch.ops.vllm.all_reduce` -> `CudaCommunicator.all_reduce`,
which offers the tensor to `ca_comm` (vLLM's P2P custom all-reduce, only for the group named "tp")
through `should_custom_ar` / `custom_all_reduce`; `GroupCoordinator.graph_capture` (entered once
around all of vLLM's CUDA-graph capture) enters `ca_comm.capture()`; the logits gather
(`LogitsProcessor._gather_logits`: `use_all_gather()` is true on CUDA) and sequence-parallel
gathers reach `CudaCommunicator.all_gather` / `all_gatherv` / `custom_all_gather`.

So the plugin wraps `CudaCommunicator.__init__` (the only class-level change), and for a "tp" group
of two or more ranks on one node builds a `HostStagedCommunicator` and installs
`HostStagedCustomAllreduce` as that instance's `ca_comm` (vLLM's own duck interface, capture
included). On the same instance only, it puts host staging first in `all_reduce` (vLLM's order
tries FlashInfer and NCCL symmetric memory before `ca_comm`, and VLLM_ALLREDUCE_USE_FLASHINFER is
on by default), and routes `all_gather`, uniform `all_gatherv` and `destroy`. Tensors the host path
does not take (an unsupported dtype, another device) go to vLLM's code unchanged.

Why not a platform plugin returning a CudaCommunicator subclass from `get_device_communicator_cls`:
a platform plugin replaces vLLM's CUDA platform detection for the whole process (one out-of-tree
platform at a time) for the sake of one class, and `StatelessGroupCoordinator` asserts the class
*is* `CudaCommunicator`. The wrapper changes nothing unless switched on, and only on CUDA.

Switches (every TP rank inherits the same environment and config, so every decision below is the
same on every rank; the INT8 choice is a pure function of the message size):
  GLMCTL_COLLECTIVES       vllm (default: install nothing) | host-staged | auto (host-staged when
                           some GPU pair of the group reports no peer access and vLLM's own custom
                           all-reduce is not running; a VM with false P2P needs host-staged)
  GLMCTL_COLLECTIVES_INT8  off (default) | prefill: INT8 payloads for all-reduce messages of at
                           least GLMCTL_COLLECTIVES_INT8_MIN_MIB (default 4) and always above the
                           largest CUDA-graph capture size, so captured decode steps stay exact |
                           all: INT8 for every all-reduce, captured decode steps included (those
                           within the direct path's reach as INT8 records in two shots: about half
                           the bytes through host memory, ~0.9% relative RMS error on random data)
  GLMCTL_COLLECTIVES_MAX_MIB  largest message per call (default: the config's largest all-reduce,
                           1..32 MiB); the communicator sends larger messages in several calls.
                           Each rank holds (world + 1) x this in GPU memory, the group the same in
                           /dev/shm.
  GLMCTL_COLLECTIVES_TIMEOUT_S  how long a wait may make no progress (default: vLLM's distributed
                           timeout, else 600 s: ranks legitimately drift apart by tens of seconds
                           while torch.compile / Triton compile; a dead peer is caught at once).
`--disable-custom-all-reduce` switches off vLLM's P2P kernel only; host staging uses no P2P, so
host-staged installs either way (the GPU profiles pass both), and auto never displaces a running
vLLM custom all-reduce.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from glmctl import switches
from glmctl.errors import ConfigError

logger = logging.getLogger("vllm.glmctl")

MiB = 1 << 20
# INT8 from 4 MiB (GLMCTL_COLLECTIVES_INT8_MIN_MIB's default): measured on 1x H200
# (bench/results/collectives-h200.md, 2 ranks) INT8 gave 1.09x at 4 MiB and 1.39x at 8 MiB; a
# slower link (L40, ~half the H200's) gains more at the same size.
DEFAULT_INT8_MIN_BYTES = int(switches.parse("GLMCTL_COLLECTIVES_INT8_MIN_MIB", None) * MiB)
MAX_BYTES_CAP = 32 * MiB
MIN_MAX_BYTES = int(switches.switch("GLMCTL_COLLECTIVES_MAX_MIB").minimum * MiB)
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class CollectivesSettings:
    mode: str = "vllm"
    int8_prefill: bool = False  # INT8 for prefill-size all-reduces (`prefill` or `all`)
    int8_decode: bool = False  # INT8 for every all-reduce, decode sizes included (`all`)
    int8_min_bytes: int = DEFAULT_INT8_MIN_BYTES
    max_bytes: int | None = None  # None: sized from vLLM's config
    timeout_s: float | None = None  # None: vLLM's distributed timeout, else DEFAULT_TIMEOUT_S


def settings_from_env(env: Mapping[str, str] | None = None) -> CollectivesSettings:
    """Parse the switches; ConfigError names the variable and the values it takes."""
    max_mib = switches.read("GLMCTL_COLLECTIVES_MAX_MIB", env)
    int8 = switches.read("GLMCTL_COLLECTIVES_INT8", env)
    return CollectivesSettings(
        mode=switches.read("GLMCTL_COLLECTIVES", env),
        int8_prefill=int8 in ("prefill", "all"), int8_decode=int8 == "all",
        int8_min_bytes=int(switches.read("GLMCTL_COLLECTIVES_INT8_MIN_MIB", env) * MiB),
        max_bytes=None if max_mib is None else int(max_mib * MiB),
        timeout_s=switches.read("GLMCTL_COLLECTIVES_TIMEOUT_S", env))


@dataclass(frozen=True)
class ModelFacts:
    """What sizing needs from vLLM's config: one all-reduce message is [tokens, hidden] in dtype."""

    hidden_size: int
    elem_bytes: int
    max_batched_tokens: int
    dtype: str = "bfloat16"  # the model's activation dtype (torch attribute name)
    capture_sizes: tuple[int, ...] = ()  # token counts vLLM captures CUDA graphs for
    timeout_s: float | None = None  # vLLM's distributed timeout, when set


def model_facts(vllm_config) -> ModelFacts | None:
    model = getattr(vllm_config, "model_config", None)
    if model is None:
        return None
    compilation = getattr(vllm_config, "compilation_config", None)
    timeout = getattr(getattr(vllm_config, "parallel_config", None), "distributed_timeout_seconds",
                      None)
    return ModelFacts(
        hidden_size=int(model.get_hidden_size()), elem_bytes=int(model.dtype.itemsize),
        max_batched_tokens=int(vllm_config.scheduler_config.max_num_batched_tokens),
        dtype=str(model.dtype).removeprefix("torch."),
        capture_sizes=tuple(sorted(getattr(compilation, "cudagraph_capture_sizes", None) or ())),
        timeout_s=float(timeout) if timeout else None)


def max_message_bytes(settings: CollectivesSettings, facts: ModelFacts | None) -> int:
    if settings.max_bytes is not None:
        return settings.max_bytes
    if facts is None:
        return MAX_BYTES_CAP
    largest = facts.max_batched_tokens * facts.hidden_size * facts.elem_bytes
    return min(MAX_BYTES_CAP, max(MIN_MAX_BYTES, largest))


def int8_threshold(settings: CollectivesSettings, facts: ModelFacts | None) -> int | None:
    """Smallest all-reduce message (bytes) sent as INT8, or None for never. `prefill`: above every
    message a captured CUDA graph holds, so decode (captured) stays bf16 whatever the configured
    minimum. `all`: every message (the call plan sends those the direct path takes as INT8
    records in two shots, `call_plan.DirectLimits.int8_algorithm`)."""
    if settings.int8_decode:
        return 0
    if not settings.int8_prefill:
        return None
    captured = 0
    if facts is not None and facts.capture_sizes:
        captured = max(facts.capture_sizes) * facts.hidden_size * facts.elem_bytes
    return max(settings.int8_min_bytes, captured + 1)


def timeout_s(settings: CollectivesSettings, facts: ModelFacts | None) -> float:
    if settings.timeout_s is not None:
        return settings.timeout_s
    return (facts.timeout_s if facts is not None else None) or DEFAULT_TIMEOUT_S


class HostStagedCustomAllreduce:
    """vLLM's `ca_comm` duck interface (and the gathers) over one rank's `HostStagedCommunicator`.

    All-reduce is out of place (vLLM's op promises torch.compile to leave its input alone); INT8 is
    chosen by the message's size alone (the communicator cuts messages larger than its
    `max_bytes` into calls). All-gathers are exact (never INT8); dtypes the kernels do not add
    (integers, bool) travel bit for bit as 16-bit words.
    """

    def __init__(self, comm, *, int8_min_bytes: int | None = None,
                 warmup: Callable[[], None] | None = None) -> None:
        self.comm = comm
        self.int8_min_bytes = int8_min_bytes
        self._warmup = warmup

    @property
    def disabled(self) -> bool:
        return self.comm.disabled

    def use_int8(self, nbytes: int) -> bool:
        return self.int8_min_bytes is not None and nbytes >= self.int8_min_bytes

    # ---- all-reduce ------------------------------------------------------------------------------
    def should_custom_ar(self, inp) -> bool:
        import torch

        return (not self.disabled and inp.device == self.comm.device and inp.numel() > 0
                and inp.dtype in (torch.bfloat16, torch.float16, torch.float32))

    def custom_all_reduce(self, inp):
        import torch

        if not self.should_custom_ar(inp):
            return None
        x = inp.contiguous()
        out = torch.empty_like(x)
        return self.comm.all_reduce(x, out=out, int8=self.use_int8(x.numel() * x.element_size()))

    # ---- all-gather ------------------------------------------------------------------------------
    def should_all_gather(self, inp) -> bool:
        if self.disabled or inp.device != self.comm.device or inp.dim() == 0 or inp.numel() == 0:
            return False
        return (inp.shape[-1] * inp.element_size()) % 2 == 0  # whole 16-bit words per row

    def all_gather(self, inp, dim: int = -1):
        """torch.cat of every rank's `inp` along `dim`, in rank order (bitwise exact)."""
        import torch

        dim = dim + inp.dim() if dim < 0 else dim
        x = inp.contiguous()
        native = x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        words = x if native else x.view(torch.float16)  # bit-exact: the path only moves bytes
        out = self.comm.all_gather(words, dim, int8=False)
        return out if native else out.view(x.dtype)

    def should_custom_all_gather(self, inp) -> bool:
        return self.should_all_gather(inp)

    def custom_all_gather(self, inp):
        return self.all_gather(inp, 0) if self.should_all_gather(inp) else None

    def should_custom_reduce_scatter(self, inp) -> bool:
        return False

    def custom_reduce_scatter(self, inp):
        return None  # vLLM falls back to its own reduce-scatter

    # ---- capture and lifetime ------------------------------------------------------------------
    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """vLLM enters this around all CUDA-graph capture: compile every kernel the captured
        shapes use eagerly first, then let the communicator check that every rank captured the
        same collectives."""
        if self._warmup is not None:
            warmup, self._warmup = self._warmup, None
            warmup()
        with self.comm.capture():
            yield

    def close(self) -> None:
        self.comm.close()


# ---- installation ----------------------------------------------------------------------------------


def install_collectives(env: Mapping[str, str] | None = None) -> bool:
    """Called by `register()` in every vLLM process: wrap CudaCommunicator.__init__ when the
    switch asks for host staging and the platform is CUDA; otherwise touch nothing."""
    try:
        settings = settings_from_env(env)
    except ConfigError as exc:
        logger.error("glmctl collectives: not installed (%s)", exc)
        return False
    if settings.mode == "vllm" or switches.plugin_off(env):
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        logger.debug("glmctl collectives: GLMCTL_COLLECTIVES=%s ignored on platform %s", settings.mode,
                     current_platform.device_name)
        return False
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    patch_cuda_communicator(CudaCommunicator, settings)
    return True


def patch_cuda_communicator(cls, settings: CollectivesSettings) -> None:
    """Wrap `cls.__init__` once: after vLLM's own set-up, attach host staging where it applies."""
    stock = cls.__init__
    if getattr(stock, "_glmctl_collectives", False):
        return

    def __init__(self, *args, **kwargs):
        stock(self, *args, **kwargs)
        attach_host_staged(self, settings)

    __init__.__wrapped__ = stock
    __init__.__doc__ = stock.__doc__
    __init__._glmctl_collectives = True
    cls.__init__ = __init__


def attach_host_staged(dc, settings: CollectivesSettings) -> HostStagedCustomAllreduce | None:
    """Give the device communicator `dc` host-staged collectives, if its group wants them."""
    if dc.unique_name.split(":")[0] != "tp" or dc.world_size < 2:
        return None
    group = group_facts(dc)
    if group.stateless:
        logger.info("glmctl collectives: group %s is a stateless group; vLLM's communicator kept",
                    dc.unique_name)
        return None
    if not group.one_node:
        if settings.mode == "host-staged":
            raise ConfigError(f"GLMCTL_COLLECTIVES=host-staged needs every rank of {dc.unique_name} on one "
                              "node (they share /dev/shm)",
                              hint="run tensor parallelism within a node or set GLMCTL_COLLECTIVES=vllm")
        return None
    vllm_ca = getattr(dc, "ca_comm", None)
    if settings.mode == "auto" and not group.agree(
            group.lacks_p2p and (vllm_ca is None or vllm_ca.disabled)):
        logger.info("glmctl collectives: auto kept vLLM's communicator for %s (peer access works "
                    "or vLLM's custom all-reduce runs)", dc.unique_name)
        return None
    from vllm.config import get_current_vllm_config_or_none

    facts = model_facts(get_current_vllm_config_or_none())
    comm = make_communicator(
        rank=dc.rank_in_group, world_size=dc.world_size, group_id=f"vllm-{dc.unique_name}",
        max_bytes=max_message_bytes(settings, facts), device=dc.device, cpu_group=dc.cpu_group,
        timeout_s=timeout_s(settings, facts), on_error=stop_this_worker)
    threshold = int8_threshold(settings, facts)
    ca = HostStagedCustomAllreduce(comm, int8_min_bytes=threshold,
                                   warmup=capture_warmup(comm, facts, threshold))
    if vllm_ca is not None and hasattr(vllm_ca, "close"):
        vllm_ca.close()
    _route(dc, ca)
    int8 = ("INT8 for every all-reduce" if threshold == 0 else
            f"INT8 for all-reduce >= {threshold / MiB:.2f} MiB" if threshold else "INT8 off")
    logger.info("glmctl collectives: host-staged all-reduce and all-gather installed for group %s "
                "(GLMCTL_COLLECTIVES=%s, rank %d of %d, up to %d MiB per call and larger messages in "
                "pieces, %s, copy engines %s, direct path %s)", dc.unique_name, settings.mode,
                dc.rank_in_group, dc.world_size, comm.max_bytes // MiB, int8,
                getattr(comm, "copy_engines", "-"), getattr(getattr(comm, "options", None), "direct", "-"))
    return ca


def _route(dc, ca: HostStagedCustomAllreduce) -> None:
    """Instance overrides on `dc`: host staging first, vLLM's own methods for the rest."""
    import torch

    stock_all_reduce, stock_all_gather = dc.all_reduce, dc.all_gather
    stock_all_gatherv, stock_destroy = dc.all_gatherv, dc.destroy

    def all_reduce(input_):
        out = ca.custom_all_reduce(input_)
        return out if out is not None else stock_all_reduce(input_)

    def all_gather(input_, dim: int = -1):
        if ca.should_all_gather(input_):
            return ca.all_gather(input_, dim)
        return stock_all_gather(input_, dim)

    def all_gatherv(input_, dim: int = 0, sizes: list[int] | None = None):
        uniform = sizes is None or all(s == sizes[0] for s in sizes)
        if dim == 0 and uniform:
            if isinstance(input_, torch.Tensor) and ca.should_all_gather(input_):
                return ca.all_gather(input_, 0)
            if not isinstance(input_, torch.Tensor) and all(ca.should_all_gather(t) for t in input_):
                return [ca.all_gather(t, 0) for t in input_]
        return stock_all_gatherv(input_, dim, sizes)

    def destroy():
        try:
            ca.close()
        finally:
            stock_destroy()

    dc.ca_comm = ca
    dc.all_reduce, dc.all_gather, dc.all_gatherv, dc.destroy = (
        all_reduce, all_gather, all_gatherv, destroy)


def make_communicator(**kwargs):
    from glmctl.collectives.host_staged_communicator import HostStagedCommunicator

    return HostStagedCommunicator(**kwargs)


def capture_warmup(comm, facts: ModelFacts | None, int8_min_bytes: int | None = None,
                   ) -> Callable[[], None] | None:
    """Eager all-reduces of every captured token count at the model's width, with the payload the
    captured call will have (INT8 from `int8_min_bytes`, `int8_threshold`), so Triton compiles
    (and caches) each kernel variant a captured graph uses before capture starts."""
    if facts is None or not facts.capture_sizes:
        return None

    def warmup() -> None:
        import torch

        dtype = getattr(torch, facts.dtype)
        for tokens in facts.capture_sizes:
            x = torch.zeros((tokens, facts.hidden_size), dtype=dtype, device=comm.device)
            nbytes = x.numel() * x.element_size()
            comm.all_reduce(x, out=torch.empty_like(x),
                            int8=int8_min_bytes is not None and nbytes >= int8_min_bytes)

    return warmup


def stop_this_worker(error) -> None:
    """The group is broken (a peer died or stalled): graph replays would compute garbage, so stop
    this worker; vLLM's executor notices and shuts the engine down with the log naming the rank."""
    logger.error("glmctl collectives: %s; stopping this worker", error)
    os.kill(os.getpid(), signal.SIGTERM)


@dataclass
class GroupFacts:
    stateless: bool
    one_node: bool = True
    lacks_p2p: bool = False
    agree: Callable[[bool], bool] = bool  # every rank's verdict ANDed (collective)


def group_facts(dc) -> GroupFacts:
    """Where the group's ranks are (collective over the gloo `cpu_group`: every rank calls it)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    group = dc.cpu_group
    if _world.pg_map.get(group) is None:
        return GroupFacts(stateless=True)
    from vllm.distributed.parallel_state import in_the_same_node_as

    one_node = all(in_the_same_node_as(group, source_rank=0))
    devices: list = [None] * dc.world_size
    dist.all_gather_object(devices, dc.device.index, group=group)
    me = dc.device.index
    lacks = any(not torch.cuda.can_device_access_peer(me, d) for d in devices if d != me)

    def agree(flag: bool) -> bool:
        t = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return bool(t.item())

    return GroupFacts(stateless=False, one_node=one_node, lacks_p2p=lacks, agree=agree)
