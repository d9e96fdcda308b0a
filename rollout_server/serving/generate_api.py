"""tandem's own evaluation routes: POST /v1/generate (plain sampling of prompts or conversations, greedy by
default, or each sample played on as an episode in the server's environment) and POST /v1/score
(teacher-forced logprobs of a given completion under a version). Both take the models of
shared/protocol.py; neither runs while the server sleeps (409)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException

from rollout_server.serving.deps import server_of
from rollout_server.serving.traffic import bounded
from shared import protocol as P
from shared.datasets import render

router = APIRouter()


def _check_awake(s) -> None:
    if s.producer.sleeping:
        raise HTTPException(409, "the server is asleep; POST /v1/wake first")


@router.post("/v1/generate", response_model=P.GenerateResponse)
async def generate(req: P.GenerateRequest, s=Depends(server_of)):
    _check_awake(s)
    cfg = s.cfg
    if req.count * req.n > cfg.server.max_generate_sequences:
        raise HTTPException(
            422,
            f"{req.count} prompts x n={req.n} exceed server.max_generate_sequences="
            f"{cfg.server.max_generate_sequences}; split the request",
        )
    adapter = s.policy.lookup(req.version)
    if req.rows is not None and s.producer.env is None:
        raise HTTPException(
            422, "'rows' plays episodes in tandem's environment (env.kind 'multi_turn' or 'tools'); this "
            f"server's env.kind is '{cfg.env.kind}'",
        )  # fmt: skip
    if req.messages is not None:
        conversations = [[m.model_dump() for m in c] for c in req.messages]
        prompts = [s.producer.conversation_ids(c) for c in conversations]
    else:
        prompts = [s.prompt_ids(q) for q in req.prompts]  # a 422 when the template needs a row
        conversations = [render(cfg.data, q) for q in req.prompts]
    room = cfg.model.max_model_len - max(len(p) for p in prompts)
    if room < 1:
        raise HTTPException(
            422, f"a prompt leaves no room within model.max_model_len={cfg.model.max_model_len}"
        )
    max_tokens = min(req.max_tokens or cfg.sampling.max_new_tokens, room)
    chunk = cfg.server.prompts_per_batch * cfg.sampling.group_size
    if req.rows is not None:  # each sample played on as an episode, in chunks as production plays them
        work = _play_in_chunks(s, prompts, conversations, req, max_tokens, adapter, chunk)
        played = await bounded(s, work, cfg.server.generate_timeout_s)
        outputs = [[_episode_text(e) for e in row] for row in played]
    else:
        work = _generate_in_chunks(s.backend, prompts, req.n, req.temperature, max_tokens, adapter, chunk)
        samples = await bounded(s, work, cfg.server.generate_timeout_s)
        outputs = [
            [P.GeneratedText(text=x.text, token_ids=x.token_ids, finish_reason=x.finish_reason) for x in row]
            for row in samples
        ]
    version = adapter.version if adapter else 0
    return P.GenerateResponse(version=version, prompt_token_ids=prompts, outputs=outputs)


@router.post("/v1/score", response_model=P.ScoreResponse)
async def score(req: P.ScoreRequest, s=Depends(server_of)):
    _check_awake(s)
    ids = req.prompt_token_ids + req.completion_token_ids
    if len(ids) > s.cfg.model.max_model_len:
        raise HTTPException(422, f"{len(ids)} tokens exceed model.max_model_len={s.cfg.model.max_model_len}")
    if max(ids) >= s.vocab_size:
        raise HTTPException(422, f"token id {max(ids)} is outside the vocabulary ({s.vocab_size})")
    adapter = s.policy.lookup(req.version)
    logprobs = await s.backend.score(req.prompt_token_ids, req.completion_token_ids, adapter)
    return P.ScoreResponse(version=adapter.version if adapter else 0, logprobs=logprobs)


async def _play_in_chunks(s, prompts, conversations, req: P.GenerateRequest, max_tokens, adapter, chunk):
    """Episodes of each prompt's samples, a production batch's worth of prompts at a time."""
    played: list[list] = []
    per_call = max(1, chunk // req.n)
    for i in range(0, len(prompts), per_call):
        part = prompts[i : i + per_call]
        first = await _generate_in_chunks(s.backend, part, req.n, req.temperature, max_tokens, adapter, chunk)
        rows = [
            (ids, conv, r.answer, r.metadata)
            for ids, conv, r in zip(
                part, conversations[i : i + per_call], req.rows[i : i + per_call], strict=True
            )
        ]
        played += await s.producer.play(rows, first, adapter, req.temperature, max_tokens)
    return played


def _episode_text(e) -> P.GeneratedText:
    """An episode as an output: its text is the model's last turn (what reward functions score)."""
    messages = [P.ChatMessage(role=m["role"], content=m["content"]) for m in e.messages]
    return P.GeneratedText(
        text=e.last_text, token_ids=e.ids, finish_reason=e.finish_reason, turns=e.turns, messages=messages
    )


async def _generate_in_chunks(backend, prompts, n, temperature, max_tokens, adapter, chunk: int):
    """The backend called with at most `chunk` sequences at a time (the size of a production batch):
    one request's memory stays that of a batch, and a cancellation takes effect between chunks."""
    rows: list[list] = [[] for _ in prompts]
    per_call = max(1, chunk // n)  # whole prompts per call when n fits a chunk
    for i in range(0, len(prompts), per_call):
        part = prompts[i : i + per_call]
        for done in range(0, n, chunk):  # n beyond a chunk: the same prompt in several calls
            k = min(chunk, n - done)
            out = await backend.generate(
                part, n=k, temperature=temperature, max_tokens=max_tokens, adapter=adapter, logprobs=False
            )
            for j, samples in enumerate(out):
                rows[i + j].extend(samples)
    return rows
