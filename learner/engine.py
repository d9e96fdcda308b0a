"""The training engine: base model + peft LoRA inside DeepSpeed ZeRO-2. The only module that imports
deepspeed. Launch with N processes (`deepspeed`/`torchrun`); gloo on CPU, nccl on GPU.

The reference policy is the same module with the adapter disabled (no second copy of the model).
"""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from shared.config import ConfigError, TandemConfig
from shared.config import LoraConfig as LoraSettings


def deepspeed_config(cfg: TandemConfig, world_size: int, on_cpu: bool, num_trainable: int) -> dict[str, Any]:
    ds, lc = cfg.deepspeed, cfg.learner
    # Buckets sized to the LoRA parameter count: the defaults (5e8 elements, with overlap_comm) reserve
    # GBs for a model whose trainable part is a few MB (docs/design.md §8).
    bucket = int(max(num_trainable, 1_000_000))
    zero: dict[str, Any] = {
        "stage": ds.zero_stage,
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
        "overlap_comm": False,
        "contiguous_gradients": True,
    }
    if ds.offload_optimizer and not on_cpu:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config = {
        "train_micro_batch_size_per_gpu": lc.micro_batch_size,
        "gradient_accumulation_steps": lc.grad_accum,
        "train_batch_size": lc.micro_batch_size * lc.grad_accum * world_size,
        "gradient_clipping": ds.gradient_clipping,
        "bf16": {"enabled": cfg.model.dtype == "bfloat16"},
        "fp16": {"enabled": cfg.model.dtype == "float16"},
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            # torch's AdamW on CPU: DeepSpeed's CPU Adam would be JIT-compiled first (docs/design.md §7).
            "params": {"lr": lc.lr, "weight_decay": lc.weight_decay, "torch_adam": on_cpu},
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    config = _merge(config, ds.overrides)
    if str(config["optimizer"].get("type", "")).lower() not in ("adam", "adamw"):
        # another optimizer named in deepspeed.overrides (a torch.optim class) takes no torch_adam
        config["optimizer"].get("params", {}).pop("torch_adam", None)
    return config


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def init_distributed() -> tuple[int, int, bool]:
    """(rank, world_size, on_cpu). Single-process runs need no launcher: the env vars get defaults."""
    for key, default in [
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
    ]:
        os.environ.setdefault(key, default)
    if "MASTER_PORT" not in os.environ:  # no launcher: a lone process, and any free port will do
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops as ds_ops

    if on_cpu:
        # The CPU accelerator JIT-builds a shared-memory comm op at init (30-55 s, needs a compiler);
        # gloo does the job without it.
        ds_ops.__compatible_ops__["deepspeed_shm_comm"] = False
    else:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend="gloo" if on_cpu else "nccl")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), on_cpu


def peft_lora(lora: LoraSettings):
    """peft's LoraConfig for the config's lora section: the one place its settings become peft's."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )


def build_engine(cfg: TandemConfig, model_path: str, world_size: int, on_cpu: bool):
    """DeepSpeed engine over a PeftModel whose LoRA B is zero: step 0 is exactly the base model."""
    import deepspeed
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, cfg.model.dtype))
    attention = base.config._attn_implementation
    if cfg.learner.shared_prompt and attention not in ("sdpa", "eager"):
        raise ConfigError(
            f"learner.shared_prompt packs a group's completions behind one prompt with a custom attention "
            f"mask, which {attention} attention cannot take: set learner.shared_prompt=false"
        )
    if cfg.learner.shared_prompt and attention == "sdpa" and cfg.learner.packed_attention == "segments":
        from learner.attention import NAME

        base.set_attn_implementation(NAME)
    model = get_peft_model(base, peft_lora(cfg.lora))
    if cfg.learner.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    trainable = [p for p in model.parameters() if p.requires_grad]
    config = deepspeed_config(cfg, world_size, on_cpu, sum(p.numel() for p in trainable))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
    # from_pretrained leaves the model in eval mode, where transformers skips gradient checkpointing
    # (it checkpoints only `if self.gradient_checkpointing and self.training`): learner.gradient_checkpointing
    # did nothing until this line. Training mode also applies lora.dropout, which is meant.
    engine.train()
    return engine


def move_frozen(module, device) -> int:
    """Move the frozen (base) weights to `device` in place, leaving the trainable (LoRA) ones, which
    DeepSpeed's optimizer holds, where they are. Time-sliced on one GPU, the base weights wait in host
    RAM while the server generates, so vLLM's share of the GPU is free (learner.preflight counts on it).
    A weight tied to another (embeddings and LM head) is one Parameter and moves once. Returns bytes
    moved."""
    import gc

    moved = 0
    for p in module.parameters():  # unique Parameters: a tied pair is yielded once
        if not p.requires_grad:
            old = p.data  # (each .data access makes a new alias: take one)
            data = old.to(device)  # the same tensor when it is there already
            if data is not old:
                moved += p.numel() * p.element_size()
                p.data = data  # in place: the Parameter objects (and their ties) stay what they were
    if moved and str(device) == "cpu" and torch.cuda.is_available():
        gc.collect()  # the old GPU tensors are only freed once nothing refers to them
        torch.cuda.empty_cache()  # and only then can the allocator give them back for vLLM to take
    return moved


@contextmanager
def reference_policy(engine):
    """The base model: the same weights with the adapter switched off, and no autograd. Takes the
    DeepSpeed engine or the PeftModel itself."""
    module = getattr(engine, "module", engine)
    with torch.no_grad(), module.disable_adapter():
        yield module


def save_checkpoint(engine, folder: Path, client_state: dict) -> None:
    """All ranks must call this. Only trainable (LoRA) weights and their optimizer state are saved."""
    # DeepSpeed's exclude_frozen_parameters drops frozen names that named_parameters() yields, and that
    # skips the second name of a tied weight: SmolLM2's frozen lm_head (108 of a 137 MB checkpoint) was
    # saved every time. Filter the state dict by what is trained instead.
    trained = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    engine.module_state_dict = lambda **kw: {
        k: v for k, v in type(engine).module_state_dict(engine, **kw).items() if k in trained
    }
    try:
        # exclude_frozen_parameters also keeps ZeRO-2 from saving the frozen weights' fragments (538 MB)
        engine.save_checkpoint(
            str(folder), tag="ds", client_state=client_state, exclude_frozen_parameters=True
        )
    finally:
        del engine.module_state_dict


def load_checkpoint(engine, folder: Path) -> dict:
    _, client_state = engine.load_checkpoint(str(folder), tag="ds", load_module_strict=False)
    if client_state is None:
        raise RuntimeError(f"no DeepSpeed checkpoint under {folder}")
    return client_state


def barrier() -> None:
    import deepspeed.comm as dist

    dist.barrier()


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s Python object on every rank (rank 0 talks to the server; the others follow)."""
    import deepspeed.comm as dist

    if dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def optimizer_state_numel(engine) -> int:
    """Elements of optimizer state this rank holds (ZeRO-2 partitions it across ranks)."""
    total = 0
    for state in engine.optimizer.optimizer.state.values() if hasattr(engine.optimizer, "optimizer") else []:
        total += sum(v.numel() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    return total


def gather_objects(obj) -> list:
    """Every rank's object, on every rank."""
    import deepspeed.comm as dist

    if dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def build_beside_server(client, cfg: TandemConfig, shares_gpu: bool, build, log):
    """Build the engine so that the two processes never peak together on a shared GPU: the server sleeps
    while the learner builds (sync_server wakes it), and then the learner's frozen weights go to host RAM,
    where they wait whenever the server is awake. Returns (engine, offload: whether they do)."""
    offload = client is not None and shares_gpu and cfg.learner.offload_weights_while_generating
    if client is not None and shares_gpu:
        client.sleep()
    engine = build()
    offload = broadcast_object(offload)
    if offload:
        moved = move_frozen(engine.module, "cpu")
        log(f"frozen weights ({moved / 2**30:.2f} GiB) in host RAM while the server generates")
    return engine, offload
