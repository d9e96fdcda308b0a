"""Checkpoints and the run's record files (the start-up handshake with the server is in learner/servers.py).

out_dir/
  adapters/v<N>/                 published adapters (peft format), what the server was sent: the newest
                                 keep_checkpoints and every keep_every-th version
  checkpoints/step-<k>/          ds/ (LoRA weights + optimizer state, per rank), rng-rank<r>.pt,
                                 state.json (step, policy version, leases not yet acked), config.json
  checkpoints/latest             name of the newest complete checkpoint
  inflight_leases.json           leases pulled and not yet covered by a checkpoint
  groups.jsonl, metrics.jsonl    one line per step: what it trained on, what it measured
  tensorboard/, config.json

A checkpoint is written after every step, before that step's groups are acked: an ack is never sent for
training that no checkpoint holds, so a learner killed at any point resumes without losing or repeating
a group. Only trainable weights and their optimizer state are saved (a few MB for LoRA). The newest
`learner.keep_checkpoints` are kept, and every `learner.keep_every`-th one for good.

Every file read back is checked; a bad one raises CheckpointError naming it and saying what to do.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import re
import shutil
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError

from learner.engine import barrier, broadcast_object, gather_objects, load_checkpoint, save_checkpoint
from shared.config import TandemConfig
from shared.files import write_atomic


@dataclass
class State:
    step: int = 0
    version: int = 0  # policy version served for this learner's weights; v0 is the base model
    pending_leases: list[str] = field(default_factory=list)  # trained on, maybe not yet acked
    # Groups made by versions below this are not of this run's lineage (see sync_server): stale.
    floor_version: int = 0


class CheckpointError(RuntimeError):
    pass


class OutDirError(CheckpointError):
    """learner.out_dir cannot take a write (disk full, read-only, permissions)."""


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
    if resume:
        latest_checkpoint(out)  # a damaged checkpoint is reported now, before the model is built


@contextlib.contextmanager
def writing(out: Path, what: str):
    """Turn a failed write under out_dir into one OutDirError line. torch.save reports a full disk as a
    RuntimeError ("[enforce fail at inline_container.cc] . unexpected pos"), safetensors (the adapter)
    as a SafetensorError ("I/O error: No space left on device"), hence the three types."""
    try:
        yield
    except (OSError, RuntimeError, SafetensorError) as e:
        if isinstance(e, OSError) and e.strerror:
            reason = e.strerror
        else:
            lines = str(e).strip().splitlines()
            reason = lines[0] if lines else type(e).__name__
        with contextlib.suppress(OSError):
            free_mb = shutil.disk_usage(out).free / 2**20
            if free_mb < 64:
                reason = f"No space left on device ({free_mb:.0f} MB free)"
        raise OutDirError(
            f"could not write {what} under learner.out_dir={out}: {reason}. Free space or fix the "
            "permissions, then run again with --resume"
        ) from None


def save_config(cfg: TandemConfig, out: Path) -> None:
    with writing(out, "config.json"):
        (out / "config.json").write_text(cfg.dump() + "\n")


def save_adapter(engine, out: Path, version: int) -> Path:
    folder = out / "adapters" / f"v{version}"
    with writing(out, f"adapters/v{version}"):
        engine.module.save_pretrained(str(folder))
    return folder


def record_groups(out: Path, step: int, groups) -> None:
    """Append the groups a step trained on: the audit trail for "trained exactly once", and the input
    of `learner.replay_file`. Lines past the checkpoint a run resumes from are cut (truncate_records)."""
    with writing(out, "groups.jsonl"), (out / "groups.jsonl").open("a") as f:
        f.write(json.dumps({"step": step, "groups": [g.model_dump() for g in groups]}) + "\n")


def truncate_records(out: Path, step: int, log) -> None:
    """Keep the lines of groups.jsonl and metrics.jsonl up to `step`, the checkpoint resumed from: steps
    after it are trained again (their groups were never acked), so their old lines would count twice. A
    line cut short by a crash is dropped too."""
    for name in ("groups.jsonl", "metrics.jsonl"):
        path = out / name
        if not path.is_file():
            continue
        kept, dropped = [], 0
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
                keep = isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step
            except json.JSONDecodeError:
                keep = False
            if keep:
                kept.append(line)
            elif line.strip():
                dropped += 1
        if dropped:
            with writing(out, name):
                write_atomic(path, "".join(f"{line}\n" for line in kept))
            log(f"{name}: dropped {dropped} line(s) after step {step}, the checkpoint resumed from")


def replay_groups(path: str, step: int):
    from pydantic import ValidationError

    from shared.protocol import ScoredGroup

    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                rec = json.loads(line)
                if rec["step"] == step:
                    return [ScoredGroup.model_validate(g) for g in rec["groups"]]
            except (json.JSONDecodeError, KeyError, TypeError, ValidationError) as e:
                raise CheckpointError(
                    f"learner.replay_file={path}, line {n}: not a groups.jsonl record ({type(e).__name__})"
                ) from None
    raise CheckpointError(f"learner.replay_file={path} holds no groups for step {step}")


def base_digest(engine) -> str:
    """sha256 over the frozen (base) parameters: must be identical before and after training."""
    h = hashlib.sha256()
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def check_finite(engine, step: int) -> None:
    """A diverged step (NaN/inf LoRA weights) must not be checkpointed or published."""
    bad = [n for n, p in engine.module.named_parameters() if p.requires_grad and not torch.isfinite(p).all()]
    if bad:
        raise CheckpointError(
            f"step {step} left non-finite LoRA weights ({len(bad)} tensors, e.g. {bad[0]}): the policy "
            "diverged. Lower learner.lr (or raise deepspeed.gradient_clipping), then --resume from the "
            "previous step's checkpoint"
        )


# -- checkpoints ------------------------------------------------------------------------------------------
_STEP_DIR = re.compile(r"step-(\d+)")


def _checkpoints(out: Path) -> dict[int, Path]:
    folder = out / "checkpoints"
    found = {}
    for p in folder.iterdir() if folder.is_dir() else []:
        m = _STEP_DIR.fullmatch(p.name)
        if m and p.is_dir():
            found[int(m.group(1))] = p
    return found


def save(engine, out: Path, state: State, rank: int, keep: int, every: int) -> None:
    """All ranks call this. `latest` moves only once every rank has written its part; then checkpoints
    beyond the newest `keep` are removed, except every `every`-th step's."""
    folder = out / "checkpoints" / f"step-{state.step}"
    with writing(out, f"checkpoints/{folder.name}"):
        save_checkpoint(engine, folder, client_state={"tandem": asdict(state)})
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        torch.save(rng, folder / f"rng-rank{rank}.pt")
    barrier()
    if rank == 0:
        with writing(out, f"checkpoints/{folder.name}"):
            (folder / "state.json").write_text(json.dumps(asdict(state)))
            shutil.copy(out / "config.json", folder / "config.json")
            write_atomic(out / "checkpoints" / "latest", folder.name)
        prune(out, state.step, keep, every)
        prune_adapters(out, state.version, keep, every)
    barrier()


def prune(out: Path, newest: int, keep: int, every: int) -> list[int]:
    """Remove checkpoints older than the newest `keep` unless their step is a multiple of `every`, and any
    past `newest` (partial ones a crash left behind). Returns the steps removed."""
    return _prune(_checkpoints(out), newest, keep, every)


def prune_adapters(out: Path, newest: int, keep: int, every: int) -> list[int]:
    """The published adapters, kept as checkpoints are: the newest `keep` versions up to `newest` and every
    `every`-th. (One per step otherwise: 7 MB a step for SmolLM2-135M at r = 16.)"""
    folder = out / "adapters"
    found = {int(p.name[1:]): p for p in folder.glob("v*") if p.name[1:].isdigit()} if folder.is_dir() else {}
    return _prune({v: p for v, p in found.items() if v <= newest}, newest, keep, every)


def _prune(found: dict[int, Path], newest: int, keep: int, every: int) -> list[int]:
    recent = sorted(s for s in found if s <= newest)[-keep:]
    gone = [s for s in sorted(found) if s > newest or (s not in recent and s % every)]
    for s in gone:
        shutil.rmtree(found[s], ignore_errors=True)
    return gone


def latest_checkpoint(out: Path) -> tuple[Path, State] | None:
    """The checkpoint `checkpoints/latest` names, checked without loading it; None on a fresh out_dir."""
    latest = out / "checkpoints" / "latest"
    if not latest.is_file():
        return None
    others = sorted(_checkpoints(out))
    fix = (
        f"Point it at an older checkpoint (echo step-N > {latest}; present: "
        f"{', '.join(f'step-{s}' for s in others) or 'none'}), or start over in a new learner.out_dir"
    )
    name = latest.read_text(errors="replace").strip()
    if not _STEP_DIR.fullmatch(name):
        raise CheckpointError(f"{latest} does not name a checkpoint (it holds {name[:40]!r}). {fix}")
    folder = out / "checkpoints" / name
    state_file = folder / "state.json"
    try:
        raw = json.loads(state_file.read_text())
        state = State(**raw)
        counts = (state.step, state.version, state.floor_version)
        leases = state.pending_leases
        ok = all(isinstance(n, int) and n >= 0 for n in counts)
        ok = ok and isinstance(leases, list) and all(isinstance(x, str) for x in leases)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError):
        ok = False
    if not ok:
        raise CheckpointError(f"{state_file} (named by {latest}) is missing or damaged. {fix}")
    parts = list((folder / "ds").glob("*.pt")) + list(folder.glob("rng-rank*.pt"))
    broken = [p for p in parts if not zipfile.is_zipfile(p)]
    if not parts or broken:
        what = broken[0] if broken else folder / "ds"
        raise CheckpointError(f"{what} (named by {latest}) is not a complete checkpoint file. {fix}")
    return folder, state


def resume(engine, out: Path, rank: int) -> State:
    found = latest_checkpoint(out)
    if found is None:
        return State()  # --resume on a fresh out_dir starts from step 0
    folder, _ = found
    try:
        client_state = load_checkpoint(engine, folder)
        rng_file = folder / f"rng-rank{rank}.pt"
        rng = torch.load(rng_file, weights_only=False) if rng_file.is_file() else None
    except Exception as e:  # DeepSpeed and torch raise many types for a damaged file; name the folder
        raise CheckpointError(
            f"checkpoint {folder} does not load ({type(e).__name__}: {str(e).splitlines()[0][:200]}). "
            f"Point {out / 'checkpoints' / 'latest'} at an older step-N, or start over in a new "
            "learner.out_dir"
        ) from None
    state = State(**client_state["tandem"])
    if rng is not None:
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
    if rank == 0:
        print(f"[learner] resumed from {folder} at step {state.step}, policy v{state.version}", flush=True)
    return state


# -- leases and the handshake ---------------------------------------------------------------------------
def write_inflight(out: Path, lease_ids: list[str]) -> None:
    """Leases pulled and not yet acked, on disk the moment they exist: a learner killed mid-step
    leaves them here, and its successor gives their groups back (see sync_server)."""
    with writing(out, "inflight_leases.json"):
        write_atomic(out / "inflight_leases.json", json.dumps(lease_ids))


def read_inflight(out: Path) -> list[str]:
    path = out / "inflight_leases.json"
    if not path.is_file():
        return []
    try:
        ids = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError):
        ids = None
    if not isinstance(ids, list) or not all(isinstance(x, str) for x in ids):
        raise CheckpointError(
            f"{path} is damaged (not a JSON list of lease ids). Delete it: the groups it named return to "
            "the server's queue when their lease runs out (server.lease_s)"
        )
    return ids


def write_summary(
    out: Path, engine, state: State, world: int, digest_start: str | None, optimizer_numel: list[int]
) -> dict:
    """run_summary.json: where the run ended, and evidence that the base stayed frozen and that ZeRO-2
    split the optimizer state (`optimizer_numel`: each rank's; tests read both)."""
    summary = {
        "step": state.step, "policy_version": state.version, "world_size": world,
        "base_sha256_start": digest_start, "base_sha256_end": base_digest(engine),
        "optimizer_state_numel_per_rank": optimizer_numel,
    }  # fmt: skip
    with writing(out, "run_summary.json"):
        (out / "run_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def persist_step(engine, cfg: TandemConfig, out: Path, state: State, groups: list, rank: int):
    """Everything a step leaves on disk, in the order that makes a crash anywhere recoverable: adapter,
    groups record, then the checkpoint that covers both (`latest` moves last). Returns the adapter
    folder on rank 0, or the error message if a write failed on any rank."""
    error, adapter = None, None
    try:
        if rank == 0:
            check_finite(engine, state.step)
            adapter = save_adapter(engine, out, state.version)
            record_groups(out, state.step, groups)
    except CheckpointError as e:
        error = str(e)
    error = broadcast_object(error)  # every rank saves, or none does
    if error is None:
        try:
            save(engine, out, state, rank, cfg.learner.keep_checkpoints, cfg.learner.keep_every)
        except OutDirError as e:
            error = str(e)
        errors = [e for e in gather_objects(error) if e]
        error = errors[0] if errors else None
    return adapter, error
