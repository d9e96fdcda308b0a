"""Checkpoints and the start-up handshake with the server.

out_dir/
  adapters/v<N>/                 every published adapter (peft format), what the server was sent
  checkpoints/step-<k>/          ds/ (LoRA weights + optimizer state, per rank), rng-rank<r>.pt,
                                 state.json (step, policy version, leases not yet acked), config.json
  checkpoints/latest             name of the newest complete checkpoint
  metrics.jsonl, tensorboard/, config.json
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from learner.client import RolloutClient, ServerError
from learner.engine import barrier, load_checkpoint, save_checkpoint
from shared.config import TandemConfig


@dataclass
class State:
    step: int = 0
    version: int = 0  # policy version = optimizer steps taken; v0 is the base model
    pending_leases: list[str] = field(default_factory=list)


class CheckpointError(RuntimeError):
    pass


def check_out_dir(out: Path, resume: bool, min_free_mb: float = 200.0) -> None:
    """Fail before any training if out_dir cannot take checkpoints, or would overwrite a run."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_bytes(b"x" * 4096)
        probe.unlink()
    except OSError as e:
        raise CheckpointError(f"learner.out_dir={out} is not writable: {e.strerror or e}") from None
    free_mb = shutil.disk_usage(out).free / 2**20
    if free_mb < min_free_mb:
        raise CheckpointError(
            f"learner.out_dir={out}: only {free_mb:.0f} MB free, need >= {min_free_mb:.0f} MB"
        )
    if not resume and (out / "checkpoints" / "latest").is_file():
        raise CheckpointError(
            f"learner.out_dir={out} already holds a run's checkpoints: pass --resume to continue it, "
            "or choose another learner.out_dir"
        )


def save_config(cfg: TandemConfig, out: Path) -> None:
    (out / "config.json").write_text(cfg.dump() + "\n")


def save_adapter(engine, out: Path, version: int) -> Path:
    folder = out / "adapters" / f"v{version}"
    engine.module.save_pretrained(str(folder))
    return folder


def record_groups(out: Path, step: int, groups) -> None:
    """Append the groups a step trained on: the audit trail for "trained exactly once", and the input
    of `learner.replay_file`."""
    with (out / "groups.jsonl").open("a") as f:
        f.write(json.dumps({"step": step, "groups": [g.model_dump() for g in groups]}) + "\n")


def replay_groups(path: str, step: int):
    from shared.protocol import ScoredGroup

    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec["step"] == step:
                return [ScoredGroup.model_validate(g) for g in rec["groups"]]
    raise CheckpointError(f"learner.replay_file={path} holds no groups for step {step}")


def base_digest(engine) -> str:
    """sha256 over the frozen (base) parameters: must be identical before and after training."""
    h = hashlib.sha256()
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save(engine, out: Path, state: State, rank: int) -> None:
    """All ranks call this. `latest` moves only once every rank has written its part."""
    folder = out / "checkpoints" / f"step-{state.step}"
    save_checkpoint(engine, folder, client_state={"tandem": asdict(state)})
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    torch.save(rng, folder / f"rng-rank{rank}.pt")
    barrier()
    if rank == 0:
        (folder / "state.json").write_text(json.dumps(asdict(state)))
        shutil.copy(out / "config.json", folder / "config.json")
        tmp = out / "checkpoints" / "latest.tmp"
        tmp.write_text(folder.name)
        tmp.replace(out / "checkpoints" / "latest")
    barrier()


def resume(engine, out: Path, rank: int) -> State:
    latest = out / "checkpoints" / "latest"
    if not latest.is_file():
        return State()  # --resume on a fresh out_dir starts from step 0
    folder = out / "checkpoints" / latest.read_text().strip()
    client_state = load_checkpoint(engine, folder)
    state = State(**client_state["tandem"])
    rng_file = folder / f"rng-rank{rank}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
    if rank == 0:
        print(f"[learner] resumed from {folder} at step {state.step}, policy v{state.version}", flush=True)
    return state


def write_inflight(out: Path, lease_ids: list[str]) -> None:
    """Leases pulled and not yet acked, on disk the moment they exist: a learner killed mid-step
    leaves them here, and its successor gives their groups back (see sync_server)."""
    tmp = out / "inflight_leases.json.tmp"
    tmp.write_text(json.dumps(lease_ids))
    tmp.replace(out / "inflight_leases.json")


def _settle_leases(client: RolloutClient, state: State, out: Path, log) -> None:
    """Ack what the checkpoint trained on; release what a killed predecessor pulled but never trained,
    so those groups are trained next (not whenever their lease would have expired)."""
    inflight_file = out / "inflight_leases.json"
    inflight = json.loads(inflight_file.read_text()) if inflight_file.is_file() else []
    for lease_id in dict.fromkeys([*state.pending_leases, *inflight]):
        trained = lease_id in state.pending_leases
        try:
            if trained:
                client.ack(lease_id)
            else:
                n = client.release(lease_id).released
                log(f"released {n} group(s) pulled before the restart but never trained")
        except ServerError as e:
            if e.status != 404:  # 404: already acked (after its checkpoint) or long expired
                log(f"WARNING: could not settle lease {lease_id} from before the restart: {e}")
    state.pending_leases = []
    write_inflight(out, [])


def sync_server(client: RolloutClient, engine, state: State, out: Path, log) -> None:
    """Settle leases left by a previous run, wake the server if it was left asleep, and make it serve
    exactly the learner's policy version before training starts."""
    _settle_leases(client, state, out, log)
    health = client.health()
    if health.sleeping:  # a previous learner may have died between sleep and wake
        client.wake()
    served = health.policy_version
    if served == state.version:
        return
    if served > state.version:
        raise CheckpointError(
            f"the server serves policy v{served}, newer than this learner's v{state.version}. Resume the run "
            f"that published it (--resume with its learner.out_dir), or start the server with an empty "
            f"server.state_dir"
        )
    folder = out / "adapters" / f"v{state.version}"
    if not folder.is_dir():
        folder = save_adapter(engine, out, state.version)
    client.publish(state.version, folder)
    log(f"published v{state.version} to the server (it served v{served})")
