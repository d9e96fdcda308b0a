"""The GPU proof kit: what the lent GPU machine's image lacks to run tandem, carried as wheels, and one
command that proves the time-sliced 8 GB path there within minutes.

    .venv/bin/python scripts/gpu_kit.py build           # here (the registries are reachable): -> .gpu-kit/
    .venv/bin/python scripts/gpu_kit.py check           # the kit against deploy/gpu_kit/{kit,image}.txt
    .venv/bin/python scripts/gpu_kit.py run --dry-run   # here, on CPU: every part but the CUDA ones
    python3 scripts/gpu_kit.py run                      # on the GPU machine (docs/gpu.md: the exact call)

The image (deploy/gpu_kit/image.txt, from the device tool's KINDS.md) has PyTorch (CUDA), transformers,
peft, httpx and safetensors, but no vLLM, DeepSpeed, FastAPI, uvicorn or pydantic, and no network. The kit
(deploy/gpu_kit/kit.txt) is exactly those missing packages and their missing dependencies, pinned to the
versions the CPU suite tests, for the image's Python 3.12 on x86-64 Linux: DeepSpeed as a pure-Python wheel
built here without prebuilt ops (they compile on first use), never torch nor anything CUDA. vLLM's CUDA
build is far over what a call carries (64 MiB), so on that machine the server runs its hf backend.

`run` installs the wheels into a virtual environment layered over the image's Python (its site-packages
after the kit's), then: checks that every module the server and learner import loads; runs tests/gpu;
compiles DeepSpeed's CPU Adam (the 8 GB config offloads the optimizer) while the tests run; runs
scripts/bench_gpu.py in the production shape (hf-backend server + DeepSpeed ZeRO-2 learner, time-sliced, a
random-init model of DeepSeek-R1-Distill-Qwen-1.5B's shapes, each process held to 8 GiB by PyTorch's memory
fraction as well as measured with nvidia-smi) for a few steps. Each stage's result goes into
$OUT/report.txt and $OUT/results.json as it ends, so a run cut short still reports what it reached.
`--dry-run` does all of it here on CPU but the CUDA parts: the wheels are installed for the image's Python
into a scratch folder; the imports, the test collection and the benchmark run in a venv of this machine's
stack holding only what the image and the kit have: the benchmark's dry run (the model on the meta device,
the preflight), then its CPU rehearsal (a tiny model, the same two processes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]

LISTS = REPO / "deploy/gpu_kit"
KIT = REPO / ".gpu-kit"  # ignored by git; name it in the device call's `carry`
MAX_MIB = 48  # the carry limit is 64 MiB for the whole tree: leave room for the repo itself
DEVICE_PY = "3.12"
# glibc tags pip may pick for the image (Ubuntu 24.04: glibc 2.39); pip matches each one exactly.
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)] + ["manylinux2014_x86_64"]
FOR_DEVICE = [  # pip's options for wheels that install there
    "--only-binary=:all:", "--python-version", DEVICE_PY, "--implementation", "cp",
    *(x for p in PLATFORMS for x in ("--platform", p)),
]  # fmt: skip
# PEP 508 markers as the image's interpreter evaluates them.
DEVICE_MARKERS = {
    "python_version": DEVICE_PY, "python_full_version": "3.12.3", "sys_platform": "linux",
    "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
    "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": "",
}  # fmt: skip
OWN = {"shared", "rollout_server", "learner", "harness", "tests", "scripts"}
# What the hf-backend server, the DeepSpeed learner, tests/gpu and the benchmark import, lazy imports
# included ("module:name" imports a name, which loads the lazy modules behind it).
RUN_IMPORTS = [
    "rollout_server.__main__", "rollout_server.serving.app", "rollout_server.engines.hf",
    "rollout_server.production.adapters",
    "uvicorn", "safetensors.torch", "learner.__main__", "learner.train", "learner.engine",
    "learner.preflight",
    "deepspeed", "deepspeed.comm", "deepspeed.ops.adam", "deepspeed.ops.op_builder:CPUAdamBuilder",
    "peft:LoraConfig", "peft:PeftModel", "peft:get_peft_model", "transformers:AutoModelForCausalLM",
    "transformers:AutoTokenizer", "transformers:StoppingCriteriaList", "transformers:Qwen2Config",
    "transformers:PreTrainedTokenizerFast", "tokenizers", "torch.utils.tensorboard:SummaryWriter",
    "harness.net", "harness.device_env", "httpx", "tests.gpu.test_hf_backend_cuda",
]  # fmt: skip
IMPORT_CHECK = r"""
import importlib, json, sys
failed = {}
for item in json.loads(sys.argv[1]):
    module, _, name = item.partition(":")
    try:
        m = importlib.import_module(module)
        if name:
            getattr(m, name)
    except Exception as e:
        failed[item] = f"{type(e).__name__}: {e}"
print(json.dumps(failed))
"""


# -- the lists -------------------------------------------------------------------------------------------
def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_list(path: Path) -> dict[str, str | None]:
    """{canonical name: version or None} of a `name[==version]` per line list (# comments)."""
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonical(name)] = version.strip() or None
    return out


def image_packages() -> dict[str, str | None]:
    return read_list(LISTS / "image.txt")


def kit_packages() -> dict[str, str]:
    kit = read_list(LISTS / "kit.txt")
    unpinned = [n for n, v in kit.items() if v is None]
    if unpinned:
        raise SystemExit(f"deploy/gpu_kit/kit.txt: pin every package (name==version): {', '.join(unpinned)}")
    return kit  # type: ignore[return-value]


def unmet(requires: dict[str, list[str]], have: dict[str, str | None]) -> list[str]:
    """'dist needs req' for each requirement of each dist (markers evaluated as on the image, extras
    dropped) that `have` lacks, or holds at a known version outside the specifier."""
    out = []
    for dist, lines in requires.items():
        for line in lines:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(DEVICE_MARKERS):
                continue
            name = canonical(req.name)
            if name not in have:
                out.append(f"{dist} needs {req} (neither on the image nor in the kit)")
            elif have[name] is not None and not req.specifier.contains(have[name], prereleases=True):
                out.append(f"{dist} needs {req}, but {name} is {have[name]}")
    return out


def installed_requires(names) -> dict[str, list[str]]:
    """Requires-Dist of distributions installed here (the CPU stack the suite runs)."""
    return {n: metadata.requires(n) or [] for n in names}


def allowed_distributions() -> set[str]:
    """What the image has, what the kit carries, and, as installed here, everything the image's packages
    need (an image's packages come with their own needs, whatever our list of it omits)."""
    image, kit = image_packages(), kit_packages()
    allowed, todo = set(image) | set(kit), [n for n in image if n != "python"]
    while todo:
        name = todo.pop()
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(DEVICE_MARKERS):
                dep = canonical(req.name)
                if dep not in allowed:
                    allowed.add(dep)
                    todo.append(dep)
    return allowed


def view_venv(path: Path, allowed: set[str]) -> tuple[str, int]:
    """A venv on this machine's base Python holding only `allowed` of what is installed here (each
    package's files linked, with its metadata): this stack as the image plus the kit would have it.
    Returns its python and how many installed distributions it leaves out."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--clear", str(path)], check=True)
    python = str(path / "bin/python")
    purelib = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    left_out = 0
    for dist in metadata.distributions():
        name = canonical(dist.metadata["Name"] or "")
        if name not in allowed or name in {"tandem"}:
            left_out += name not in allowed
            continue
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            link, real = purelib / top, Path(str(dist.locate_file(top)))
            if real.exists() and not link.exists():
                link.symlink_to(real)
    return python, left_out


def check_imports(python: str, env: dict | None = None) -> dict[str, str]:
    """{import: error} of RUN_IMPORTS that fail under `python` (empty: all load)."""
    out = subprocess.run(
        [python, "-c", IMPORT_CHECK, json.dumps(RUN_IMPORTS)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if out.returncode != 0:
        return {"(the import check)": (out.stderr or out.stdout)[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- build and check ----------------------------------------------------------------------------------
def wheels(folder: Path = KIT / "wheels") -> dict[str, tuple[str, Path]]:
    """{canonical name: (version, path)} of the wheels in the kit folder."""
    from packaging.utils import parse_wheel_filename

    out = {}
    for path in sorted(folder.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(path.name)
        out[canonical(name)] = (str(version), path)
    return out


def wheel_requires(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def device_tags() -> set:
    from packaging.tags import compatible_tags, cpython_tags

    version = tuple(int(x) for x in DEVICE_PY.split("."))
    return {*cpython_tags(version, platforms=PLATFORMS), *compatible_tags(version, platforms=PLATFORMS)}


def check_kit(folder: Path = KIT / "wheels") -> tuple[list[str], float]:
    """(problems, size in MiB) of the kit folder against kit.txt and the image."""
    from packaging.utils import parse_wheel_filename

    kit, have = kit_packages(), wheels(folder)
    problems = [
        f"missing: {n}=={v} (run: python scripts/gpu_kit.py build)" for n, v in kit.items() if n not in have
    ]
    problems += [
        f"{n} is {have[n][0]} in the folder, kit.txt pins {v}"
        for n, v in kit.items()
        if n in have and have[n][0] != v
    ]
    problems += [f"not in kit.txt: {p.name}" for n, (_, p) in have.items() if n not in kit]  # fmt: skip
    tags = device_tags()
    problems += [
        f"{p.name} does not install on the image's Python {DEVICE_PY} (x86-64 Linux)"
        for _, p in have.values()
        if not (parse_wheel_filename(p.name)[3] & tags)
    ]
    present = {n: v for n, (v, _) in have.items()}
    problems += unmet({n: wheel_requires(p) for n, (_, p) in have.items()}, {**image_packages(), **present})
    size = sum(p.stat().st_size for _, p in have.values()) / 2**20
    if size > MAX_MIB:
        problems.append(f"the kit is {size:.1f} MiB, over its {MAX_MIB} MiB budget")
    return problems, size


def build(args) -> int:
    folder = KIT / "wheels"
    folder.mkdir(parents=True, exist_ok=True)
    kit, have = kit_packages(), wheels(folder)
    for name, (version, path) in have.items():
        if kit.get(name) != version:
            print(f"[kit] removing {path.name} (not pinned in kit.txt)")
            path.unlink()
    have = wheels(folder)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    for name, version in kit.items():
        if name in have:
            continue
        print(f"[kit] {name}=={version}", flush=True)
        if name == "deepspeed":
            # Only an sdist on PyPI: built here as a pure-Python wheel, ops left to compile on first use.
            cmd = [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(folder)]
            env = dict(os.environ, DS_BUILD_OPS="0")
        else:
            cmd, env = [*pip, "download", "-q", "--no-deps", *FOR_DEVICE, "-d", str(folder)], None
        done = subprocess.run([*cmd, f"{name}=={version}"], env=env)
        if done.returncode != 0:
            print(f"error: could not fetch {name}=={version} for Python {DEVICE_PY}", file=sys.stderr)
            return 1
    return check(args)


def check(args) -> int:
    problems, size = check_kit()
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    state = "ok" if not problems else "NOT ok"
    print(f"[kit] {state}: {len(wheels())} wheels, {size:.1f} MiB in .gpu-kit/wheels (budget {MAX_MIB} MiB)")
    return 1 if problems else 0


# -- run ------------------------------------------------------------------------------------------------
class Report:
    """Each stage's outcome, written to report.txt and results.json under `out` as soon as it is known."""

    def __init__(self, out: Path, dry: bool):
        self.out, self.dry, self.t0 = out, dry, time.time()
        self.stages: list[dict] = []
        self.facts: dict = {}
        out.mkdir(parents=True, exist_ok=True)
        self.log = (out / "stages.log").open("a")

    def stage(self, name: str, ok: bool | None, summary: str, **detail) -> None:
        row = {"stage": name, "ok": ok, "summary": summary, "at_s": round(time.time() - self.t0, 1), **detail}
        self.stages.append(row)
        mark = {True: "ok  ", False: "FAIL", None: "skip"}[ok]
        print(f"[kit {row['at_s']:6.1f} s] {mark} {name}: {summary}", flush=True)
        self.write()

    def write(self) -> None:
        (self.out / "results.json").write_text(
            json.dumps({"dry_run": self.dry, "facts": self.facts, "stages": self.stages}, indent=2) + "\n"
        )
        lines = [f"tandem GPU kit {'dry run (CPU)' if self.dry else 'run'}: {self.facts.get('machine', '?')}"]
        lines += [f"  {k}: {v}" for k, v in self.facts.items() if k != "machine"]
        for s in self.stages:
            mark = {True: "ok  ", False: "FAIL", None: "skip"}[s["ok"]]
            lines.append(f"[{s['at_s']:6.1f} s] {mark} {s['stage']}: {s['summary']}")
            lines += [f"      {line}" for line in s.get("lines", [])]
        lines.append(
            "not proven by this kit: vLLM on CUDA (its CUDA build cannot be carried), two GPUs (split "
            "placement), NCCL between GPUs or nodes"
        )
        (self.out / "report.txt").write_text("\n".join(lines) + "\n")

    def run(self, name: str, cmd: list[str], timeout: float, env=None) -> subprocess.CompletedProcess:
        """Runs a stage's command, its output appended to stages.log (and echoed)."""
        self.log.write(f"\n===== {name}: {' '.join(cmd)}\n")
        self.log.flush()
        try:
            done = subprocess.run(
                cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=max(timeout, 1)
            )
        except subprocess.TimeoutExpired as e:
            text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            done = subprocess.CompletedProcess(cmd, 124, text, f"timed out after {timeout:.0f} s")
        self.log.write(done.stdout + done.stderr)
        self.log.flush()
        sys.stdout.write(done.stdout[-3000:] + done.stderr[-3000:])
        return done


def layered_venv(path: Path, folder: Path) -> str:
    """A venv over the image's Python: the kit's wheels first, then the image's own site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--clear", str(path)], check=True)
    python = str(path / "bin/python")
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    # every package folder this interpreter sees (its own venv's, and the system's where it includes them)
    parents = [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]
    Path(purelib, "zz_image.pth").write_text(
        "import site; " + "; ".join(f"site.addsitedir({p!r})" for p in parents) + "\n"
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
         "--disable-pip-version-check", "--target", purelib, *map(str, sorted(folder.glob("*.whl")))],
        check=True,
    )  # fmt: skip
    return python


def facts(python: str) -> dict:
    code = (
        "import json, torch, transformers, peft, deepspeed, fastapi, pydantic;"
        "c = torch.cuda.is_available();"
        "print(json.dumps({'machine': torch.cuda.get_device_name(0) if c else 'CPU (no CUDA)',"
        "'gpu_gib': round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if c else None,"
        "'torch': torch.__version__, 'cuda': torch.version.cuda, 'transformers': transformers.__version__,"
        "'peft': peft.__version__, 'deepspeed': deepspeed.__version__, 'fastapi': fastapi.__version__,"
        "'pydantic': pydantic.__version__}))"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"machine": "?", "versions": (out.stderr or out.stdout)[-500:]}


MEASURES = """on the GPU, `run` measures (into $OUT/report.txt, results.json, bench.json):
  - tests/gpu: the hf backend asleep holds no GPU memory and answers as before after the wake
  - DeepSpeed's CPU Adam compiled on the machine (seconds), or the fallback it had to take
  - the 8 GB time-sliced production shape (hf-backend server + DeepSpeed ZeRO-2 learner, 1.78B random-init
    model, B=2 x G=4 x 512 new tokens, LoRA r16, CPU-offloaded optimizer) for a few steps, each process held
    to 8 GiB by PyTorch's memory fraction: every process's peak GPU memory per phase (nvidia-smi, 0.2 s)
    against the 8 GiB cap, the preflight's prediction beside each, the learner's PyTorch peak per step,
    step and training times, rollout tokens/s"""

CPU_ADAM = (
    "import time; t = time.time(); from deepspeed.ops.op_builder import CPUAdamBuilder; "
    "CPUAdamBuilder().load(); print(f'compiled in {time.time() - t:.0f} s')"
)


def run(args) -> int:
    out = Path(args.out or os.environ.get("OUT") or REPO / "runs/gpu-kit")
    rep = Report(out, args.dry_run)
    deadline = time.time() + args.budget_s
    left = lambda: deadline - time.time()  # noqa: E731

    problems, size = check_kit()
    rep.stage("kit", not problems, f"{len(wheels())} wheels, {size:.1f} MiB", lines=problems)
    if problems:
        return 1

    env = dict(os.environ, PYTHONUNBUFFERED="1", DS_ACCELERATOR="cpu" if args.dry_run else "cuda")
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"  # the image's ninja, for DeepSpeed
    env["PYTHONPATH"] = str(REPO)  # nothing of tandem is installed there: the scripts import it from here
    if args.dry_run:
        # The wheels as pip installs them for the image's Python, into a scratch folder; the run itself
        # uses this machine's stack, reduced to what the image and the kit have.
        scratch = Path(tempfile.mkdtemp(prefix="gpu-kit-"))
        whls = map(str, sorted((KIT / "wheels").glob("*.whl")))
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        done = rep.run("install", [*pip, *FOR_DEVICE, "--target", str(scratch), *whls], 300)
        shutil.rmtree(scratch, ignore_errors=True)
        python, left_out = view_venv(Path(tempfile.gettempdir()) / "tandem-kit-view", allowed_distributions())
        rep.stage(
            "install", done.returncode == 0,
            f"the wheels install for cp{DEVICE_PY.replace('.', '')} x86-64 Linux; from here on a venv of "
            f"this stack as the image + kit would have it ({left_out} packages installed here left out)",
        )  # fmt: skip
    else:
        try:
            python = layered_venv(Path(tempfile.gettempdir()) / "tandem-kit-venv", KIT / "wheels")
        except subprocess.CalledProcessError as e:
            rep.stage("install", False, f"the venv over the image's Python failed: {e}")
            return 1
        rep.stage("install", True, f"venv over {sys.executable} with the kit's wheels first")
    rep.facts.update(facts(python))
    if args.dry_run:
        rep.facts["machine"] = f"this CPU machine (Python {sys.version.split()[0]}), as a rehearsal"
    rep.write()

    missing = check_imports(python, env)
    rep.stage(
        "imports", not missing, f"{len(RUN_IMPORTS) - len(missing)}/{len(RUN_IMPORTS)} load",
        lines=[f"{k}: {v}" for k, v in missing.items()],
    )  # fmt: skip
    if missing:
        return 1

    adam = None
    if not args.dry_run:  # compile DeepSpeed's CPU Adam (16 cores) while the GPU tests run
        adam = subprocess.Popen([python, "-c", CPU_ADAM], cwd=REPO, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    tests = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu", "-m", "gpu"]
    done = rep.run("tests/gpu", tests + (["--collect-only"] if args.dry_run else []), min(240, left()), env)
    last = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    rep.stage("tests/gpu", done.returncode == 0, ("collected: " if args.dry_run else "") + last)

    extra = []
    if adam is not None:
        try:
            text, _ = adam.communicate(timeout=max(left() - 300, 30))
        except subprocess.TimeoutExpired:
            adam.kill()
            text, _ = adam.communicate()
            adam.returncode = 124
        ok = adam.returncode == 0
        rep.log.write("\n===== cpu_adam\n" + text)
        if not ok:
            # torch's AdamW on the offloaded (host) optimizer state: slower, but the memory is the same
            extra = ["--set", 'deepspeed.overrides={"optimizer": {"params": {"torch_adam": true}}}']
        rep.stage(
            "cpu_adam", ok,
            text.strip().splitlines()[-1] if ok and text.strip() else "could not compile DeepSpeed's CPU "
            "Adam: the benchmark falls back to torch's AdamW on the offloaded state (see stages.log)",
        )  # fmt: skip

    bench = [python, "scripts/bench_gpu.py", "--backend", "hf", "--gpu-gib", str(args.gpu_gib)]
    if args.dry_run:
        done = rep.run("bench dry run", [*bench, "--dry-run"], min(300, left()), env)
        rep.stage(
            "bench dry run", done.returncode == 0,
            "the 1.78B model on the meta device, the tokenizer, the 8 GB config's preflight",
            lines=done.stdout.strip().splitlines()[:1],
        )  # fmt: skip
        bench += ["--rehearse", "--max-tokens", "16", "--steps", "2"]
    else:
        bench += ["--cap", "--steps", str(args.steps), *extra]
    work = Path(tempfile.mkdtemp(prefix="gpu-kit-bench-"))
    done = rep.run("bench", [*bench, "--work", str(work), "--out", str(out / "bench.json")], left() - 5, env)
    for name in ("server", "learner"):
        log = work / f"{name}.log"
        if log.exists():
            (out / f"{name}.log").write_bytes(log.read_bytes()[-4_000_000:])
    table = [line for line in done.stdout.splitlines() if line and not line.startswith("[")]
    rep.stage(
        "bench (CPU rehearsal, tiny model)" if args.dry_run else "bench", done.returncode == 0,
        table[-1] if table else f"exit {done.returncode} (see stages.log, server.log, learner.log)",
        lines=table[:-1],
    )  # fmt: skip
    if args.dry_run:
        print("\n" + MEASURES)
    ok = all(s["ok"] is not False for s in rep.stages)
    print(f"\n[kit] {'all stages passed' if ok else 'a stage FAILED'}; report: {out / 'report.txt'}")
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="fetch and build the wheels into .gpu-kit/wheels (needs the registries)")
    sub.add_parser("check", help="check .gpu-kit/wheels against kit.txt, the image and the size budget")
    r = sub.add_parser("run", help="on the GPU machine: install, test, benchmark, report under $OUT")
    r.add_argument("--dry-run", action="store_true", help="here, on CPU: every part but the CUDA ones")
    r.add_argument("--out", default=None, help="the report's folder (default: $OUT, else runs/gpu-kit)")
    r.add_argument("--gpu-gib", type=float, default=8.0, help="the GPU size to hold the run to")
    r.add_argument("--steps", type=int, default=3, help="learner steps in the benchmark")
    r.add_argument("--budget-s", type=float, default=420, help="the whole run's time budget, seconds")
    args = p.parse_args(argv)
    return {"build": build, "check": check, "run": run}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
