import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.config import (
    ConfigError,
    TandemConfig,
    check_batch_size,
    check_exposure,
    check_server_urls,
    load_config,
    native_dtype,
    split_overrides,
)
from tests.conftest import REPO


def test_defaults_match_design():
    cfg = TandemConfig()
    assert (cfg.grpo.std, cfg.grpo.scale_rewards, cfg.grpo.baseline) == ("population", "group", "mean")
    assert (cfg.grpo.epsilon_low, cfg.grpo.epsilon_high, cfg.grpo.beta) == (0.2, 0.2, 0.04)
    assert (cfg.grpo.kl_estimator, cfg.grpo.aggregation) == ("k3", "seq_mean_token_mean")
    assert (cfg.lora.r, cfg.lora.alpha, cfg.lora.target_modules) == (
        16,
        32.0,
        ["q_proj", "k_proj", "v_proj", "o_proj"],
    )
    assert cfg.server.host == "127.0.0.1"


def test_auto_dtype_is_bf16_only_where_the_cpu_computes_in_it(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert native_dtype("flags\t: fpu sse2 avx2 fma avx512f avx512bw") == "float32"  # AVX2/AVX-512 alone
    assert native_dtype("flags\t: avx512f avx512_bf16 avx512_vnni") == "bfloat16"
    assert native_dtype("flags\t: avx512f amx_bf16 amx_tile") == "bfloat16"
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else None
    resolved = load_config(None, ["model.dtype=auto"]).model.dtype  # resolved once, never stored as "auto"
    assert resolved == native_dtype(cpuinfo) and resolved in ("bfloat16", "float32")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert native_dtype("flags\t: avx2") == "bfloat16"  # a GPU with bf16 wins over the host CPU


def test_toml_then_overrides(tmp_path):
    f = tmp_path / "x.toml"
    f.write_text("[sampling]\ngroup_size = 8\nmax_new_tokens = 64\n[lora]\nr = 8\n[learner]\nlr = 1e-4\n")
    cfg = load_config(f, ["sampling.group_size=6", "lora.target_modules=['q_proj']", "model.name=my/model"])
    assert cfg.sampling.group_size == 6  # CLI beats TOML
    assert cfg.sampling.max_new_tokens == 64  # TOML beats default
    assert cfg.lora.r == 8 and cfg.lora.target_modules == ["q_proj"]
    assert cfg.learner.lr == 1e-4
    assert cfg.model.name == "my/model"  # a bare string is taken as a string


def test_one_server_or_several_is_one_field():
    one = "http://10.0.0.1:8000"
    assert load_config(None, [f"learner.server_urls={one}"]).learner.server_urls == [one]
    two = ["http://a:1", "http://b:2"]
    assert load_config(None, ['learner.server_urls=["http://a:1", "http://b:2"]']).learner.server_urls == two
    assert load_config(None, ["learner.server_urls=http://a:1, http://b:2"]).learner.server_urls == two
    with pytest.raises(ConfigError, match="learner.server_urls lists a server twice"):
        load_config(None, ["learner.server_urls=http://a:1,http://a:1"])
    with pytest.raises(ConfigError, match="learner.server_urls"):
        load_config(None, ["learner.server_urls=[]"])


def test_a_table_override_is_toml_or_json():
    task = ["data.task=reasoning_gym", "data.reasoning_gym.task=basic_arithmetic"]
    for raw in ("{min_terms = 2, max_digits = 1}", '{"min_terms": 2, "max_digits": 1}'):
        assert load_config(None, [*task, f"data.reasoning_gym.config={raw}"]).data.reasoning_gym.config == {
            "min_terms": 2,
            "max_digits": 1,
        }
    with pytest.raises(ConfigError, match="data.reasoning_gym.config"):
        load_config(None, [*task, "data.reasoning_gym.config={min_terms: 2"])


def test_unknown_key_names_the_field(tmp_path):
    f = tmp_path / "x.toml"
    f.write_text("[sampling]\ngroup_sise = 8\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(e.value) == "invalid config: sampling.group_sise: unknown key"
    with pytest.raises(ConfigError, match="^invalid config: grpo.bogus: unknown key$"):
        load_config(None, ["grpo.bogus=1"])


def test_out_of_range_value_names_the_field():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["sampling.group_size=1"])
    assert str(e.value) == (
        "invalid config: sampling.group_size: Input should be greater than or equal to 2 (got 1)"
    )
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="grpo.std: Input should be 'population' or 'bessel'"):
        load_config(None, ["grpo.std=sample"])


def test_cross_field_rules():
    with pytest.raises(ConfigError, match="lora.r=32 exceeds server.max_lora_rank=16"):
        load_config(None, ["lora.r=32", "server.max_lora_rank=16"])
    with pytest.raises(
        ConfigError, match=r"server.max_loras=2 must be >= learner.max_staleness \+ 1 = 4 in split"
    ):
        load_config(None, ["learner.placement=split", "learner.max_staleness=3", "server.max_loras=2"])


@pytest.mark.parametrize(
    "template, task, message",
    [
        ("{prompt", "arith", r"data.prompt_template: expected '}' before end of string \(write {{ and }}"),
        ("{0} {prompt}", "arith", r"data.prompt_template: every {field} must name a column"),
        ("{level}: {prompt}", "gsm8k", r"{level}: data.task = 'gsm8k' fills {prompt} only"),
        ("{foo} {prompt}", "reasoning_gym", r"{foo}: data.task = 'reasoning_gym' fills {prompt} only"),
    ],
)
def test_a_prompt_template_that_cannot_be_filled_is_refused_with_the_config(template, task, message):
    overrides = [f"data.task={task}", f"data.prompt_template={template}"]
    if task == "reasoning_gym":
        overrides.append("data.reasoning_gym.task=chain_sum")
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
    # a custom task's template may name its columns: the rows are checked when they are read
    assert load_config(
        None, ["data.task=custom", "data.prompt_template={level}: {prompt}"]
    ).data.prompt_template


def test_the_servers_lora_slots_and_rank_are_derived_from_the_learners_settings():
    cfg = load_config(None, ["lora.r=32"])
    assert (cfg.server.max_lora_rank, cfg.server.max_loras) == (32, 2)  # the trained rank; timeslice: 2
    split = load_config(None, ["learner.placement=split", "learner.max_staleness=3"])
    assert split.server.max_loras == 4  # every version a group in flight may come from
    shipped = load_config(REPO / "deploy/configs/gpu-2x-split.toml", [])
    assert (shipped.server.max_lora_rank, shipped.server.max_loras) == (16, 3)  # as the file once set them


def test_production_is_continuous_where_the_engine_never_sleeps_unless_set():
    production = {
        (): "lockstep",  # time-sliced: the engine sleeps each step
        ("learner.placement=split",): "continuous",
        ("server.inflight_updates=continue", "server.adapter_mode=lora"): "continuous",
        ("learner.placement=split", "server.production=lockstep"): "lockstep",  # set: kept
        ("server.production=continuous",): "continuous",
    }
    for overrides, expected in production.items():
        assert load_config(None, list(overrides)).server.production == expected, overrides
    assert load_config(REPO / "deploy/configs/gpu-2x-split.toml", []).server.production == "continuous"
    assert load_config(REPO / "deploy/configs/cpu.toml", []).server.production == "lockstep"


def test_batch_size_invariant_names_all_three():
    cfg = load_config(None, ["learner.prompts_per_step=2", "sampling.group_size=4", "learner.grad_accum=4"])
    assert check_batch_size(cfg, world_size=2) == 8  # 2 x 4 = 1 x 4 x 2
    with pytest.raises(
        ConfigError, match=r"micro_batch_size x learner.grad_accum x world_size = 1 x 4 x 1 = 4 \(leave"
    ):
        check_batch_size(cfg, world_size=1)


@pytest.mark.parametrize(
    "micro, world, accumulation",
    [(1, 1, 8), (2, 1, 4), (8, 1, 1), (1, 2, 4), (2, 4, 1)],
)
def test_the_accumulation_is_derived_from_the_batch_the_micro_batch_and_the_processes(
    micro, world, accumulation
):
    cfg = load_config(
        None, ["learner.prompts_per_step=2", "sampling.group_size=4", f"learner.micro_batch_size={micro}"]
    )
    assert cfg.learner.grad_accum is None  # the default: derived
    assert check_batch_size(cfg, world_size=world) == 8
    assert cfg.learner.grad_accum == accumulation  # micro x accumulation x world = B x G


@pytest.mark.parametrize(
    "micro, world, message",
    [
        (
            3,
            1,
            "do not split into micro-batches of learner.micro_batch_size = 3 on each of 1 process(es): "
            "choose one that divides 8",
        ),
        (1, 3, "do not split over 3 processes"),
        (
            4,
            4,
            "do not split into micro-batches of learner.micro_batch_size = 4 on each of 4 process(es): "
            "choose one that divides 2",
        ),
    ],
)
def test_a_batch_that_cannot_be_split_is_refused_naming_the_fields(micro, world, message):
    cfg = load_config(
        None, ["learner.prompts_per_step=2", "sampling.group_size=4", f"learner.micro_batch_size={micro}"]
    )
    with pytest.raises(ConfigError) as e:
        check_batch_size(cfg, world_size=world)
    assert str(e.value) == (
        "batch size: learner.prompts_per_step x sampling.group_size = 2 x 4 = 8 completions per step "
        + message
    )


def test_split_overrides_both_spellings():
    rest, ov = split_overrides(["--config", "a.toml", "--x.y=1", "--a.b", "2", "--resume"])
    assert rest == ["--config", "a.toml", "--resume"] and ov == ["x.y=1", "a.b=2"]


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[sampling\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)


def test_dump_round_trips():
    cfg = load_config(None, ["sampling.group_size=8"])
    assert TandemConfig.model_validate_json(cfg.dump()) == cfg


@pytest.mark.parametrize("path", sorted((REPO / "deploy" / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_example_configs_load_and_start_with_their_command(path):
    """The first line is a comment with the command that runs this very config: `python -m ... --config
    deploy/configs/<it>`, or `docker compose [-f FILE ...] up` whose compose files name it."""
    first = path.read_text().splitlines()[0]
    assert first.startswith("# "), first
    if f"--config deploy/configs/{path.name}" not in first:
        assert first.startswith("# docker compose "), first
        words = first.split("(")[0].split()
        files = [words[i + 1] for i, w in enumerate(words) if w == "-f"] or ["docker-compose.yml"]
        assert any(path.name in (REPO / f).read_text() for f in files), (first, files)
    load_config(path)


def test_example_configs_exist():
    names = {p.name for p in (REPO / "deploy" / "configs").glob("*.toml")}
    assert {"cpu.toml", "gpu-8gb-timeslice.toml", "gpu-2x-split.toml"} <= names


def test_cli_error_is_one_line():
    # The learner's and server's entry points share this path: a bad override is one line on stderr, rc 2.
    out = subprocess.run(
        [sys.executable, "-m", "rollout_server", "--sampling.group_size=1", "--check-config"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "error: invalid config: sampling.group_size: Input should be greater than or equal to 2 (got 1)"
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["--data.custom.prompt_column=question"],
            "error: data.custom.prompt_column: no column 'question' in ",
        ),
        (
            ['--reward.functions=["gsm8k", "no_such_module:f"]'],
            "error: reward.functions[1]: 'no_such_module:f': ",
        ),
        (
            ['--reward.functions=["gsm8k", "r1_format"]', "--reward.weights=[1.0]"],
            "error: invalid config: reward.weights",
        ),
        (["--env.kind=multi_turn", "--env.step=no_such_env:step"], "error: env.step: 'no_such_env:step': "),
        (["--env.kind=multi_turn", "--env.step=json:dumps"], "error: env.step: 'json:dumps': must accept "),
        (["--env.kind=tools", '--env.tools=["json:nope"]'], "error: env.tools[0]: 'json:nope': json has no"),
        (["--env.kind=tools"], "error: invalid config: env.kind = 'tools' needs env.tools"),
    ],
)
@pytest.mark.parametrize("entry", ["rollout_server", "learner"])
def test_check_config_checks_the_task_in_one_line_before_any_model(tmp_path, overrides, message, entry):
    (tmp_path / "train.jsonl").write_text('{"problem": "2+2?", "final": 4}\n')
    task = [
        "--data.task=custom",
        f"--data.path={tmp_path}",
        "--data.custom.prompt_column=problem",
        "--data.custom.answer_column=final",
        "--model.name=/nonexistent/model",  # had anything tried to load a model, this would fail
    ]
    cmd = [sys.executable, "-m", entry, *task, "--check-config"]
    out = subprocess.run([*cmd, *overrides], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), out.stderr
    ok = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert ok.returncode == 0 and json.loads(ok.stdout)["data"]["custom"]["prompt_column"] == "problem", (
        ok.stderr
    )


def test_every_field_is_described_and_the_reference_page_is_current():
    """docs/configuration.md is generated from the fields: a field added, removed or re-described without
    running scripts/config_reference.py fails here."""
    from pydantic import BaseModel

    undescribed = []

    def walk(model, prefix):
        for name, f in model.model_fields.items():
            if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
                walk(f.annotation, f"{prefix}{name}.")
            elif not (f.description or "").strip():
                undescribed.append(prefix + name)

    walk(TandemConfig, "")
    assert undescribed == []
    out = subprocess.run(
        [sys.executable, "scripts/config_reference.py", "--check"], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["grpo.is_cap=3"], "invalid config: grpo.is_cap: renamed: use grpo.dual_clip"),
        (
            ["learner.checkpoint_every=5"],
            "invalid config: learner.checkpoint_every: renamed: use learner.keep_every",
        ),
        (
            ["server.vllm.adapter_mode=merge"],
            "invalid config: server.vllm.adapter_mode: renamed: use server.adapter_mode",
        ),
        (
            ["server.hf_merge_adapters=true"],
            "invalid config: server.hf_merge_adapters: renamed: use server.adapter_mode = 'merge' (true) or "
            "'lora' (false)",
        ),
        (
            ["learner.server_url=http://a:1"],
            "invalid config: learner.server_url: renamed: use learner.server_urls (one URL, or several)",
        ),
        (["data.rg_task=leg_counting"], "invalid config: data.rg_task: renamed: use data.reasoning_gym.task"),
        (
            ["data.arith_difficulty=3"],
            "invalid config: data.arith_difficulty: renamed: use data.arith.difficulty",
        ),
        (
            ["data.answer_column=final"],
            "invalid config: data.answer_column: renamed: use data.custom.answer_column",
        ),
        (["data.custom.id_column=uid"], "invalid config: data.custom applies to data.task = 'custom' only"),
        (
            ["learner.api_token_env=MY_TOKEN"],
            "invalid config: learner.api_token_env: renamed: use server.api_token_env",
        ),
        (["grpo.tis_cap=2"], "invalid config: grpo.tis_cap needs grpo.old_logprobs = 'recompute'"),
        (
            ["learner.lag_steps=2", "learner.replay_file=groups.jsonl"],
            "invalid config: learner.lag_steps does not apply to learner.replay_file",
        ),
        (
            ["grpo.loss=cispo", "grpo.dual_clip=3"],
            "invalid config: grpo.dual_clip does not apply to grpo.loss",
        ),
    ],
)
def test_off_policy_settings_that_cannot_go_together_name_both_fields(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith(message)


def test_stale_groups_get_truncated_importance_sampling_unless_told_otherwise():
    def grpo(*overrides):
        g = load_config(None, list(overrides)).grpo
        return g.old_logprobs, g.tis_cap

    assert grpo() == ("sampler", None)  # time-sliced: on-policy
    assert grpo("learner.placement=split") == ("recompute", 2.0)
    assert grpo("learner.lag_steps=2") == ("recompute", 2.0)
    assert grpo("learner.placement=split", "grpo.old_logprobs=sampler") == ("sampler", None)
    assert grpo("learner.placement=split", "grpo.old_logprobs=recompute", "grpo.tis_cap=5") == (
        "recompute",
        5.0,
    )
    assert load_config("deploy/configs/gpu-2x-split.toml").grpo.tis_cap == 2.0


def test_gspo_brings_its_own_clip_range_unless_one_is_set():
    g = load_config(None, ["grpo.ratio_level=sequence"]).grpo
    assert (g.epsilon_low, g.epsilon_high) == (3e-4, 4e-4)
    g = load_config(None, ["grpo.ratio_level=sequence", "grpo.epsilon_high=0.01"]).grpo
    assert (g.epsilon_low, g.epsilon_high) == (3e-4, 0.01)
    g = load_config(None, ["grpo.loss=cispo"]).grpo  # the default dual clip is simply not used there
    assert g.dual_clip == 2.0 and (g.epsilon_low, g.epsilon_high) == (0.2, 0.2)


def test_every_renamed_field_fails_in_one_line_naming_its_replacement(tmp_path):
    from shared.config import RENAMED

    for old, new in RENAMED.items():
        section, _, key = old.rpartition(".")
        config = tmp_path / "old.toml"
        config.write_text(f"[{section}]\n{key} = 1\n")  # as a config file from before the rename had it
        with pytest.raises(ConfigError) as e:
            load_config(config)
        assert str(e.value) == f"invalid config: {old}: renamed: use {new}"


def test_a_server_reachable_from_the_network_needs_a_token_or_a_trusted_network():
    def cfg(*overrides):
        return load_config(None, list(overrides))

    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):  # loopback: no token needed
        check_exposure(cfg(f"server.host={host!r}"), {})
    for host in ("0.0.0.0", "10.0.0.5", "::", "gpu-node-7"):
        with pytest.raises(ConfigError, match="TANDEM_API_TOKEN is unset.*open_without_token=true"):
            check_exposure(cfg(f"server.host={host!r}"), {})
        check_exposure(cfg(f"server.host={host!r}"), {"TANDEM_API_TOKEN": "s3cret"})
        check_exposure(cfg(f"server.host={host!r}", "server.open_without_token=true"), {})
    named = cfg("server.host='0.0.0.0'", "server.api_token_env='MY_TOKEN'")
    with pytest.raises(ConfigError, match="MY_TOKEN is unset"):
        check_exposure(named, {"TANDEM_API_TOKEN": "the wrong variable"})
    check_exposure(named, {"MY_TOKEN": "s3cret"})
    with pytest.raises(ConfigError):  # an empty token is no token
        check_exposure(cfg("server.host='0.0.0.0'"), {"TANDEM_API_TOKEN": ""})

    # The learner's side: it would send no token to a server across the network.
    check_server_urls(cfg("learner.server_urls='http://127.0.0.1:8000,http://localhost:8001'"), {})
    remote = cfg("learner.server_urls='http://127.0.0.1:8000,http://gpu-node-7:8000'")
    with pytest.raises(ConfigError, match="http://gpu-node-7:8000 is reached over the network"):
        check_server_urls(remote, {})
    check_server_urls(remote, {"TANDEM_API_TOKEN": "s3cret"})
    trusted = cfg("learner.server_urls='http://gpu-node-7:8000'", "server.open_without_token=true")
    check_server_urls(trusted, {})


@pytest.mark.parametrize("check", [True, False])
def test_an_open_server_refuses_to_start_in_one_line(check):
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_API_TOKEN"}
    # /nonexistent/model: had the check not stopped it, the server would fail there, not serve
    args = ["--server.host=0.0.0.0", "--model.name=/nonexistent/model", *(["--check-config"] * check)]
    out = subprocess.run(
        [sys.executable, "-m", "rollout_server", *args], capture_output=True, text=True, cwd=REPO, env=env,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "error: server.host = '0.0.0.0' is reachable from the network and TANDEM_API_TOKEN is unset: set "
        "TANDEM_API_TOKEN to a random secret (the learner sends the same), or "
        "--server.open_without_token=true on a network you trust"
    ]
    learner = ["--learner.server_urls=http://server.invalid:8000", "--check-config"]
    out = subprocess.run(
        [sys.executable, "-m", "learner", *learner], capture_output=True, text=True, cwd=REPO, env=env,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and "TANDEM_API_TOKEN is unset" in out.stderr, out.stderr
    opted = ["--server.host=0.0.0.0", "--server.open_without_token=true", "--check-config"]
    out = subprocess.run(
        [sys.executable, "-m", "rollout_server", *opted], capture_output=True, text=True, cwd=REPO, env=env,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0 and json.loads(out.stdout)["server"]["open_without_token"], out.stderr
