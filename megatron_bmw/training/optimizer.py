"""Adam with fp32 master weights, loss scaling, global grad-norm clipping and optional ZeRO-1 sharding.

Gradients come in as `p.main_grad` (fp32, summed over micro-batches, averaged over data parallel).
With `use_distributed_optimizer` the parameters are laid end to end in one flat index space cut into buckets
(training/param_gather.py: Megatron-core's layout; one bucket for a model under 40M parameters); DP rank r owns
the r-th 1/dp of every bucket and keeps fp32 master copies and Adam moments only for the pieces of parameters
inside it. After its update, the ranks all-gather the new values bucket by bucket so every DP rank holds the full
model again; with `overlap_param_gather` the gathers run during the next forward (each completed by a forward
pre-hook of the modules using the bucket) and `finish_param_sync()` completes them for anything else that reads
the parameters (checkpoints, logging, the end of training). Expert parameters (docs/moe.md) have a layout of
their own, sharded over the expert data-parallel group (param_gather.ShardDomain).

`state_dict()` has one layout for both modes (full per-parameter tensors), so a checkpoint saved with or
without ZeRO, or on another DP size, loads into either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.expert_params import counted_in_world, experts_anywhere
from ..parallel.counting import counted_once
from ..parallel.groups import group_size
from ..parallel.state import ParallelState
from ..config import OptimizerConfig
from .loss_scaler import ConstantLossScaler, DynamicLossScaler
from .param_gather import ParamGather, ShardLayout, shard_domains

try:
    from apex.optimizers import FusedAdam as _ApexFusedAdam
except Exception:  # noqa: BLE001 - apex missing or built for another torch: fall back to torch's Adam
    _ApexFusedAdam = None

STATE_FORMAT = 1
MOMENTS = _MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class StepResult:
    successful: bool  # False when the step was skipped (inf/nan gradients)
    grad_norm: float | None  # global norm before clipping; None on a skipped step
    loss_scale: float  # scale after this step's update
    weights_finite: bool = True  # False when finite gradients still made a weight inf/nan (e.g. fp16 overflow)


@dataclass(frozen=True)
class _Piece:
    """The part [start, end) of flattened parameter `index` that this rank updates."""

    index: int
    start: int
    end: int
    shard_offset: int  # where the piece sits in this rank's shard (ZeRO only)
    domain: int = 0  # the ShardDomain whose shard it is in (ZeRO only)


def uses_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron's rule: no decay on biases and norm weights (every 1-D parameter)."""
    return param.ndim >= 2 and not name.endswith(".bias")


def counts_in_grad_norm(param: torch.Tensor, tp_rank: int) -> bool:
    """Whether this rank adds the parameter's gradient to the global norm (each gradient counted once)."""
    counted = getattr(param, "counts_in_norm", None)  # hybrid strategies decide per unit (parallel/hybrid.py)
    if counted is not None:
        return counted
    return counted_once(param, tp_rank)


class MixedPrecisionOptimizer:
    """See the module doc. Build it with `build_optimizer`."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], cfg: OptimizerConfig, state: ParallelState,
                 modules: list[nn.Module] | None = None):
        named = [(n, p) for n, p in named_params if p.requires_grad]
        if not named:
            raise ValueError("build_optimizer: no trainable parameters")
        self.cfg = cfg
        self.state = state
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.distributed = cfg.use_distributed_optimizer
        self.device = self.params[0].device
        self.num_skipped_steps = 0
        self._lr = cfg.lr
        self._decoupled_lr = None  # --decoupled-lr's current value (LRScheduler sets it)
        self._step_count = 0
        self._reload_pending = False
        if cfg.fp16:
            self.scaler = (
                ConstantLossScaler(cfg.loss_scale)
                if cfg.loss_scale
                else DynamicLossScaler(
                    cfg.initial_loss_scale, cfg.min_loss_scale, cfg.loss_scale_window, cfg.hysteresis
                )
            )
        else:
            self.scaler = ConstantLossScaler(1.0)

        self._domains = shard_domains(self.params, state, cfg.param_bucket_size, cfg.overlap_param_gather) \
            if self.distributed else []
        self._pieces = self._make_pieces()
        if self.distributed and cfg.overlap_param_gather:
            if modules is None:
                raise ValueError("overlap_param_gather needs the modules that use the parameters")
            for d in self._domains:
                d.gather.hook_modules(modules)
        self._masters = [self._new_master(pc) for pc in self._pieces]
        # with experts each distinct gradient element is counted on one rank of the world (expert_params.py)
        experts = experts_anywhere(self.params, state)  # every rank agrees, stages without MoE units too
        self._norm_over_world = state.units.norms_over_world or experts
        self._counted = torch.tensor(
            [counted_in_world(self.params[pc.index], state, self.distributed) if experts
             else counts_in_grad_norm(self.params[pc.index], state.tp_rank) for pc in self._pieces],
            dtype=torch.bool,
            device=self.device,
        )
        decay = [uses_weight_decay(self.names[pc.index], self.params[pc.index]) for pc in self._pieces]
        outer = [getattr(self.params[pc.index], "embedding_or_output", False) for pc in self._pieces]
        groups = [  # the word embedding and output layer apart, for --decoupled-lr
            {"params": [m for m, d, o in zip(self._masters, decay, outer) if d == wd and o == out],
             "weight_decay": cfg.weight_decay if wd else 0.0, "decoupled": out}
            for out in (False, True) for wd in (True, False)
        ]
        groups = [g for g in groups if g["params"]]
        self._inner, self.backend = _make_adam(groups, cfg, self.device) if groups else (None, "none")

    # ---- layout -------------------------------------------------------------------------------------
    def _make_pieces(self) -> list[_Piece]:
        if not self.distributed:
            return [_Piece(i, 0, p.numel(), 0) for i, p in enumerate(self.params)]
        return [_Piece(*piece, domain=k) for k, d in enumerate(self._domains) for piece in d.pieces()]

    @property
    def _layout(self) -> ShardLayout | None:
        """The dense parameters' shard layout (ZeRO only)."""
        return self._domains[0].layout if self._domains else None

    @property
    def _gather(self) -> ParamGather | None:
        return self._domains[0].gather if self._domains else None

    def _param_slice(self, pc: _Piece, tensor: torch.Tensor) -> torch.Tensor:
        """The piece of a parameter-shaped tensor, shaped like the piece's master."""
        return tensor.reshape(-1)[pc.start : pc.end] if self.distributed else tensor

    def _new_master(self, pc: _Piece) -> torch.Tensor:
        p = self.params[pc.index]
        if not self.distributed and p.dtype == torch.float32:
            return p
        return self._param_slice(pc, p.detach()).to(torch.float32, copy=True)

    def _grad(self, pc: _Piece) -> torch.Tensor:
        p = self.params[pc.index]
        g = getattr(p, "main_grad", None)
        if g is None:
            g = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        elif g.dtype != torch.float32:
            g = g.float()
        return self._param_slice(pc, g)

    def state_bytes(self) -> int:
        """Bytes of fp32 master copies (where they are not the parameters) and Adam moments held by this rank."""
        params = {id(p) for p in self.params}
        masters = sum(m.numel() * m.element_size() for m in self._masters if id(m) not in params)
        moments = sum(t.numel() * t.element_size() for st in (self._inner.state.values() if self._inner else ())
                      for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
        return masters + moments

    # ---- training-loop API --------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.cfg.fp16 else loss

    def zero_grad(self) -> None:
        for p in self.params:
            g = getattr(p, "main_grad", None)
            if g is not None:
                g.zero_()

    def get_lr(self) -> float:
        return self._lr

    def set_lr(self, lr: float, decoupled_lr: float | None = None) -> None:
        """`lr` for every parameter, or `decoupled_lr` for the word embedding and output layer when given."""
        self._lr, self._decoupled_lr = lr, decoupled_lr
        if self._inner is not None:
            for group in self._inner.param_groups:
                group["lr"] = decoupled_lr if group["decoupled"] and decoupled_lr is not None else lr

    def reload_model_params(self) -> None:
        """Refresh the master weights from the model parameters at the next step (after loading weights only)."""
        self.finish_param_sync()
        self._reload_pending = True

    def finish_param_sync(self) -> None:
        """Complete the parameter all-gathers still running (--overlap-param-gather): afterwards every parameter
        holds the last step's value. Call it before anything reads or writes parameters outside a forward."""
        for d in self._domains:
            d.gather.finish()

    @torch.no_grad()
    def _reload_masters(self) -> None:
        if self._reload_pending:
            for pc, m in zip(self._pieces, self._masters):
                if m is not self.params[pc.index]:
                    m.copy_(self._param_slice(pc, self.params[pc.index].detach()))
            self._reload_pending = False

    @torch.no_grad()
    def step(self) -> StepResult:
        self._reload_masters()
        grads = [self._grad(pc) for pc in self._pieces]
        if grads and self.scaler.scale != 1.0:
            torch._foreach_mul_(grads, self.scaler.inv_scale)
        found_inf, grad_norm = self._check_and_norm(grads)
        self.scaler.update(found_inf)
        if found_inf:
            self.num_skipped_steps += 1
            return StepResult(False, None, self.scaler.scale)
        if self.cfg.clip_grad > 0 and grads:
            coeff = self.cfg.clip_grad / (grad_norm + 1e-6)
            if coeff < 1.0:
                torch._foreach_mul_(grads, coeff)
        if self._inner is not None:
            for m, g in zip(self._masters, grads):
                m.grad = g
            self._inner.step()
            for m in self._masters:
                m.grad = None
        self._step_count += 1
        shards = self._publish()
        return StepResult(True, grad_norm, self.scaler.scale, self._weights_finite(shards))

    def _weights_finite(self, shards: list[torch.Tensor] | None = None) -> bool:
        """Are this model's updated weights all finite, on every rank? (A step can overflow the 16-bit copies of
        finite masters; a model like that must never be saved.) Under ZeRO each rank checks the shard it
        published (the parameters are the shards end to end), so a pending gather is not waited for."""
        local = shards if shards is not None else [p.to_local() if hasattr(p, "to_local") else p for p in self.params]
        bad = torch.zeros(1, device=self.device)
        if local:
            peaks = torch._foreach_norm([p.detach() for p in local], ord=float("inf"))  # max |w|: inf/nan stay
            bad[0] = (~torch.isfinite(torch.stack(peaks))).any().float()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bad.item() == 0

    def _check_and_norm(self, grads: list[torch.Tensor]) -> tuple[bool, float]:
        """(any inf/nan anywhere, global grad norm), agreed by all model- and data-parallel ranks."""
        buf = torch.zeros(2, dtype=torch.float64, device=self.device)
        if grads:
            norms = torch.stack(torch._foreach_norm(grads)).double()
            buf[0] = norms[self._counted].square().sum()
            buf[1] = (~torch.isfinite(norms)).any().double()
        if self._norm_over_world:  # each distinct gradient element is counted on one rank of the world
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(buf)
            sq, inf = buf.tolist()
            return inf > 0, sq**0.5
        if self.state.grad_group is not None:
            # ZeRO: each DP rank saw only its shard; otherwise all DP ranks saw the same gradients.
            op = dist.ReduceOp.SUM if self.distributed else dist.ReduceOp.MAX
            dist.all_reduce(buf, op=op, group=self.state.grad_group)
        if self.state.mp_group is not None:
            dist.all_reduce(buf, group=self.state.mp_group)
        sq, inf = buf.tolist()
        return inf > 0, sq**0.5

    def _publish(self) -> list[torch.Tensor] | None:
        """Copy the updated master weights into the model parameters; under ZeRO all-gather them (or launch the
        gathers) from this rank's shards (one per ShardDomain) in the parameters' dtype, which are returned."""
        if not self.distributed:
            for pc, m in zip(self._pieces, self._masters):
                if m is not self.params[pc.index]:
                    self.params[pc.index].detach().copy_(m)
            return None
        shards = []
        for k, d in enumerate(self._domains):
            dtypes = {self.params[i].dtype for i in d.indices}
            dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
            shard = torch.zeros(d.layout.shard_size, dtype=dtype, device=self.device)
            for pc, m in zip(self._pieces, self._masters):
                if pc.domain == k:
                    own = self.params[pc.index].dtype
                    shard[pc.shard_offset : pc.shard_offset + m.numel()].copy_(m if own == dtype else m.to(own))
            d.gather.publish(shard)
            shards.append(shard)
        return shards

    # ---- checkpoint state ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Full per-parameter optimizer state (tensors may alias live state: save them right away).

        Under ZeRO this is collective over the DP group (and the expert DP group) and only their rank 0 gets the
        tensors ("params" is None on the others).
        """
        self._reload_masters()  # weights loaded without optimizer state: the masters are the loaded weights
        sd = {**self.state_meta(), "param_names": list(self.names)}
        local = [self._piece_state(m) for m in self._masters]
        if not self.distributed:
            sd["params"] = [
                {"master": None if m is self.params[pc.index] else m, **st}
                for pc, m, st in zip(self._pieces, self._masters, local)
            ]
            return sd
        entries: list[dict | None] = [None] * len(self.params)
        for k, d in enumerate(self._domains):
            flat = {}
            for key in ("master", *_MOMENTS):
                buf = torch.zeros(d.layout.shard_size, dtype=torch.float32, device=self.device)
                for pc, m, st in zip(self._pieces, self._masters, local):
                    src = m if key == "master" else st[key]
                    if src is not None and pc.domain == k:
                        buf[pc.shard_offset : pc.shard_offset + m.numel()].copy_(src.reshape(-1))
                shards = _gather_shards(buf, d.group)
                flat[key] = None if shards is None else d.layout.unshard(shards)
            if flat["master"] is None:
                continue
            for j, i in enumerate(d.indices):
                a, p = d.layout.offsets[j], self.params[i]
                entries[i] = {key: flat[key][a : a + p.numel()].view(p.shape).cpu() for key in flat}
                if self._step_count == 0:
                    entries[i].update(exp_avg=None, exp_avg_sq=None)
        sd["params"] = entries if all(e is not None for e in entries) else None
        return sd

    def _piece_state(self, master: torch.Tensor) -> dict:
        st = self._inner.state.get(master, {}) if self._inner is not None else {}
        return {k: st.get(k) for k in _MOMENTS}

    def load_state_dict(self, sd: dict) -> None:
        """Load a state saved by `state_dict()` in either mode, on any DP size (not collective)."""
        entries = sd.get("params")
        if sd.get("format") != STATE_FORMAT or entries is None:
            raise ValueError("optimizer state is not in megatron_bmw's format or has no parameter states")
        if len(entries) != len(self.params):
            raise ValueError(f"optimizer state has {len(entries)} parameters, the model has {len(self.params)}")
        for name, p, e in zip(self.names, self.params, entries):
            for key, t in e.items():
                if t is not None and t.shape != p.shape:
                    raise ValueError(f"{key} of {name} has shape {tuple(t.shape)}, not {tuple(p.shape)}")
        pieces = [{k: None if entries[pc.index].get(k) is None
                   else self._param_slice(pc, entries[pc.index][k].to(self.device)) for k in ("master", *_MOMENTS)}
                  for pc in self._pieces]
        self.load_piece_state(sd, pieces)

    # ---- this rank's pieces (torch_dist checkpoints read and write them without gathering) ---------------------
    def pieces(self) -> list[tuple[int, int, int]]:
        """(parameter index, start, end) of the flattened range each of this rank's masters covers; under ZeRO the
        masters are these flat ranges, otherwise whole parameters shaped as they are."""
        return [(pc.index, pc.start, pc.end) for pc in self._pieces]

    def piece_state(self) -> list[dict]:
        """Per piece: {"master": its fp32 master (None where the parameter is its own), "exp_avg", "exp_avg_sq"
        (None before the first step)}; tensors alias the live state."""
        self._reload_masters()  # weights loaded without optimizer state: the masters are the loaded weights
        return [{"master": None if m is self.params[pc.index] else m, **self._piece_state(m)}
                for pc, m in zip(self._pieces, self._masters)]

    def state_meta(self) -> dict:
        """The state besides the tensors (not collective)."""
        return {"format": STATE_FORMAT, "step": self._step_count, "lr": self._lr,
                "num_skipped_steps": self.num_skipped_steps, "grad_scaler": self.scaler.state_dict()}

    def load_piece_state(self, meta: dict, pieces: list[dict]) -> None:
        """Load `state_meta()` and, per piece of `pieces()`, tensors shaped like the piece's master (a missing
        master is re-read from the model's weights at the next step)."""
        self.finish_param_sync()  # a gather still running would overwrite what the caller loads next
        self._step_count = int(meta["step"])
        self.num_skipped_steps = int(meta.get("num_skipped_steps", 0))
        self.scaler.load_state_dict(meta["grad_scaler"])
        self.set_lr(float(meta.get("lr", self._lr)), self._decoupled_lr)
        with torch.no_grad():
            for pc, m, e in zip(self._pieces, self._masters, pieces):
                if m is self.params[pc.index]:
                    continue  # the model's own weights are the master; the caller loads them
                if e.get("master") is None:
                    self._reload_pending = True
                else:
                    m.copy_(e["master"].reshape(m.shape))
        if self._inner is None:
            return
        torch_sd = self._inner.state_dict()
        moments = {}
        index = 0
        piece_of = {id(m): i for i, m in enumerate(self._masters)}
        for group in self._inner.param_groups:
            for m in group["params"]:
                e = pieces[piece_of[id(m)]]
                if self._step_count > 0 and e.get("exp_avg") is not None:
                    st = {k: e[k].reshape(m.shape).to(m.device).clone() for k in _MOMENTS}
                    if self.backend == "torch":
                        st["step"] = torch.tensor(float(self._step_count))
                    moments[index] = st
                index += 1
        torch_sd["state"] = moments
        if self.backend == "apex":
            for group in torch_sd["param_groups"]:
                group["step"] = self._step_count
        self._inner.load_state_dict(torch_sd)
        self.set_lr(self._lr, self._decoupled_lr)


def _make_adam(groups: list[dict], cfg: OptimizerConfig, device: torch.device):
    kwargs = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    if device.type == "cuda" and _ApexFusedAdam is not None:
        return _ApexFusedAdam(groups, adam_w_mode=True, **kwargs), "apex"
    if device.type == "cuda":
        return torch.optim.AdamW(groups, fused=True, **kwargs), "torch"
    return torch.optim.AdamW(groups, foreach=True, **kwargs), "torch"


def _gather_shards(shard: torch.Tensor, group) -> list[torch.Tensor] | None:
    """Every DP rank's shard, in rank order, on DP rank 0; None elsewhere."""
    n = group_size(group)
    if n == 1:
        return [shard]
    if dist.get_rank(group) == 0:
        parts = [torch.empty_like(shard) for _ in range(n)]
        dist.gather(shard, gather_list=parts, dst=dist.get_global_rank(group, 0), group=group)
        return parts
    dist.gather(shard, gather_list=None, dst=dist.get_global_rank(group, 0), group=group)
    return None


def build_optimizer(
    named_params: list[tuple[str, nn.Parameter]], cfg: OptimizerConfig, state: ParallelState,
    modules: list[nn.Module] | None = None,
) -> MixedPrecisionOptimizer:
    """Adam(W) over the trainable parameters, with the precision and sharding `cfg` asks for. `modules`: the
    model chunks whose forwards use the parameters (needed with `cfg.overlap_param_gather`)."""
    return MixedPrecisionOptimizer(named_params, cfg, state, modules)
