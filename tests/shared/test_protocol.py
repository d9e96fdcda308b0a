import json
import math
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from learner.client import ServerError
from shared import protocol as P


def _completion(**kw):
    base = dict(token_ids=[5, 6, 2], logprobs=[-0.5, -1.0, 0.0], text="hi", reward=1.0, finish_reason="stop")
    return P.Completion(**(base | kw))


def _group(**kw):
    base = dict(
        group_id="g1",
        prompt_id="gsm8k-train-0",
        prompt_token_ids=[1, 2, 3],
        answer="72",
        policy_version=3,
        completions=[_completion(), _completion(reward=0.0, finish_reason="length")],
    )
    return P.ScoredGroup(**(base | kw))


EPISODE = dict(  # model [5, 6], environment [7, 8, 9], model [10, 2]
    token_ids=[5, 6, 7, 8, 9, 10, 2], mask=[1, 1, 0, 0, 0, 1, 1], logprobs=[-0.5, -1.0, -0.25, 0.0]
)

# An episode whose model tokens 0-1 came from v3 and 2-3 (its second turn) from v4.
SPANNING = EPISODE | dict(versions=[(0, 3), (2, 4)])

EXAMPLES = [
    _completion(),
    _completion(**EPISODE),
    _completion(**SPANNING),
    _group(),
    _group(completions=[_completion(**SPANNING), _completion(versions=[(0, 3), (1, 5)])]),
    P.PullRequest(max_groups=4, wait_s=1.5),
    P.PullResponse(lease_id="abc", lease_s=30.0, groups=[_group()]),
    P.PullResponse(lease_id=None, lease_s=0.0, groups=[]),
    P.AckRequest(lease_id="abc"),
    P.AckResponse(acked=2),
    P.ReleaseRequest(lease_id="abc"),
    P.ReleaseResponse(released=2),
    P.Health(
        backend="vllm", model="m", policy_version=0, sleeping=False, group_size=4, queue_depth=0, leased=0
    ),
    P.AdapterPathRequest(version=2, path="v2"),
    P.AdapterPublished(version=2, name="policy-v2"),
    P.GenerateRequest(prompts=["q"], version=1, n=2, temperature=0.7, max_tokens=16),
    P.GeneratedText(text="a", token_ids=[1], finish_reason="stop"),
    P.GenerateResponse(
        version=1,
        prompt_token_ids=[[1]],
        outputs=[[P.GeneratedText(text="a", token_ids=[1], finish_reason="length")]],
    ),
    P.ScoreRequest(prompt_token_ids=[1], completion_token_ids=[2, 3], version=0),
    P.ScoreResponse(version=0, logprobs=[-1.0, -2.0]),
    P.SleepState(sleeping=True),
]


@pytest.mark.parametrize("obj", EXAMPLES, ids=lambda o: type(o).__name__)
def test_every_model_round_trips_through_json(obj):
    again = type(obj).model_validate_json(obj.model_dump_json())
    assert again == obj


def test_a_learner_refuses_a_server_of_another_protocol_version():
    from tests.learner.test_client import scripted

    health = next(e for e in EXAMPLES if isinstance(e, P.Health))
    other = json.loads(health.model_dump_json()) | {"protocol_version": "0"}
    c, _, _ = scripted([(200, json.dumps(other))])
    with pytest.raises(ServerError, match="protocol mismatch: server at http://server speaks v0"):
        c.wait_ready(5.0)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(logprobs=[-0.5, -1.0]), "2 values for 3 model tokens"),
        (EPISODE | dict(logprobs=[-0.5, -1.0, -0.25, 0.0, -0.1]), "5 values for 4 model tokens"),
        (EPISODE | dict(logprobs=[-0.5] * 7), "7 values for 4 model tokens"),  # one per token: refused
        (EPISODE | dict(mask=[1, 1, 0, 0, 0, 1]), "6 values for 7 token ids"),
        (EPISODE | dict(mask=[1, 1, 0, 0, 0, 1, 0], logprobs=[-0.5] * 3), "ends with the model's tokens"),
        (EPISODE | dict(mask=[0, 1, 0, 0, 0, 1, 1], logprobs=[-0.5] * 3), "starts and ends"),
        (EPISODE | dict(mask=[1, 1, 0, 2, 0, 1, 1]), "mask.3\\n.*0 or 1"),
        (dict(logprobs=[-0.5, 0.1, -1.0]), "logprobs\\[1\\] = 0.1"),
        (dict(logprobs=[-0.5, math.nan, -1.0]), "logprobs.1\\n.*finite number"),
        (dict(logprobs=[-0.5, -math.inf, -1.0]), "logprobs.1\\n.*finite number"),
        (dict(reward=math.inf), "reward\\n.*finite number"),
        (dict(reward=math.nan), "reward\\n.*finite number"),
        (dict(rewards={"judge": math.nan}), "rewards.judge\\n.*finite number"),
        (dict(token_ids=[]), "at least 1 item"),
        (dict(token_ids=[-1, 2, 3]), "greater than or equal to 0"),
        (dict(finish_reason="abort"), "'stop' or 'length'"),
        (dict(versions=[]), "start at model token 0"),
        (dict(versions=[(1, 3)]), "start at model token 0"),
        (dict(versions=[(0, 3), (3, 4)]), "stay below 3"),  # 3 model tokens: indices 0-2
        (EPISODE | dict(versions=[(0, 3), (4, 4)]), "stay below 4"),  # indices count model tokens only
        (dict(versions=[(0, 3), (2, 4), (1, 5)]), "indices must increase"),
        (dict(versions=[(0, 3), (1, 3)]), "versions must increase"),
        (dict(versions=[(0, 4), (1, 3)]), "versions must increase"),
        (dict(versions=[(0, -1)]), "greater than or equal to 0"),
    ],
)
def test_invalid_completion_is_rejected_with_a_message(kw, message):
    with pytest.raises(ValidationError, match=message):
        _completion(**kw)


def test_group_needs_two_completions_and_a_nonnegative_version():
    with pytest.raises(ValidationError, match="at least 2 items"):
        _group(completions=[_completion()])
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        _group(policy_version=-1)


def test_no_token_is_older_than_its_group_s_policy_version():
    with pytest.raises(
        ValidationError, match="completion 1's first token is from v2, older than the group's"
    ):
        _group(completions=[_completion(), _completion(versions=[(0, 2), (1, 3)])])
    # a completion that the next version sampled whole (interrupted before its first token)
    assert _group(completions=[_completion(), _completion(versions=[(0, 4)])]).token_lags(4)[3:] == [0, 0, 0]


def test_each_model_token_knows_its_version_and_its_lag():
    spanning = _completion(**SPANNING)
    assert spanning.token_versions(3) == [3, 3, 4, 4]  # the environment's 3 tokens have none
    assert _completion(versions=[(0, 3), (1, 5)]).token_versions(3) == [3, 5, 5]
    assert _completion().token_versions(3) == [3, 3, 3]  # no boundaries: all the group's
    group = _group(completions=[spanning, _completion()])
    assert group.token_lags(5) == [2, 2, 1, 1, 2, 2, 2]


def test_invalid_json_payloads_are_rejected():
    with pytest.raises(ValidationError, match="Invalid JSON"):
        P.PullRequest.model_validate_json("{max_groups: 1")
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        P.PullRequest.model_validate_json('{"max_groups": 1, "surprise": 2}')
    with pytest.raises(ValidationError, match="max_groups"):
        P.PullRequest.model_validate_json('{"max_groups": "many"}')
    with pytest.raises(ValidationError, match="less than or equal to 600"):
        P.PullRequest.model_validate_json('{"max_groups": 1, "wait_s": 1e9}')


def test_an_episode_counts_only_the_model_tokens():
    c = _completion(**EPISODE)
    assert (c.num_model_tokens, c.model_mask) == (4, [1, 1, 0, 0, 0, 1, 1])
    single = _completion()  # no mask: every token is the model's
    assert (single.num_model_tokens, single.model_mask) == (3, [1, 1, 1])


def test_group_rewards_property():
    assert _group().rewards == [1.0, 0.0]


SNAPSHOT = Path(__file__).parent / "protocol_snapshot.json"


def wire_schema() -> dict:
    """Everything that crosses the wire: each model's JSON schema, the multipart upload's fields and file
    names, the adapter naming and the version bound."""
    models = {
        name: obj.model_json_schema()
        for name, obj in vars(P).items()
        if isinstance(obj, type) and issubclass(obj, BaseModel) and obj.__module__ == P.__name__
        and not name.startswith("_")
    }  # fmt: skip
    upload = {
        "version": P.UPLOAD_VERSION_FIELD, "config": P.UPLOAD_CONFIG_FIELD, "weights": P.UPLOAD_WEIGHTS_FIELD,
        "config_file": P.ADAPTER_CONFIG_FILE, "weights_file": P.ADAPTER_WEIGHTS_FILE,
    }  # fmt: skip
    return {
        "models": models,
        "upload": upload,
        "adapter_name": P.adapter_name(7),
        "max_version": P.MAX_VERSION,
    }


def test_the_wire_format_changes_only_with_a_new_protocol_version():
    """Regenerate after a deliberate change, with PROTOCOL_VERSION bumped:
    .venv/bin/python -m tests.shared.test_protocol"""
    saved = json.loads(SNAPSHOT.read_text())
    if wire_schema() != saved["schema"]:
        assert saved["protocol_version"] != P.PROTOCOL_VERSION, (
            "the wire format changed but PROTOCOL_VERSION did not: bump it in shared/protocol.py (a learner "
            "and a server of different versions must refuse each other), then regenerate the snapshot with "
            "`.venv/bin/python -m tests.shared.test_protocol`"
        )
        pytest.fail(
            "PROTOCOL_VERSION was bumped: regenerate the snapshot (`python -m tests.shared.test_protocol`)"
        )
    assert saved["protocol_version"] == P.PROTOCOL_VERSION, "the snapshot is of another protocol version"


if __name__ == "__main__":
    SNAPSHOT.write_text(
        json.dumps(
            {"protocol_version": P.PROTOCOL_VERSION, "schema": wire_schema()}, indent=1, sort_keys=True
        )
        + "\n"
    )
    print(f"wrote {SNAPSHOT} for protocol v{P.PROTOCOL_VERSION}")
