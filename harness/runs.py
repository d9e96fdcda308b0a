"""The small runs of deploy/configs/cpu.toml that the end-to-end tests and the benchmarks start: the
server's and the learner's overrides."""

# G = 4, two prompts per step in one micro-batch each, no dynamic sampling (so a step's groups are exactly
# the first two pulled). Later overrides win.
SMALL_RUN = [
    "--sampling.group_size=4",
    "--server.prompts_per_batch=2",
    "--data.arith.difficulty=2",  # ~35 % greedy accuracy: most groups carry a learning signal
    # cpu.toml zeroes completions cut at max_new_tokens; these runs' short limits cut most of them, which
    # made whole groups all-zero (no gradient: the shared-prompt gradient test once had nothing to compare)
    "--reward.truncated=score",
]
SMALL_LEARNER = [
    "--learner.prompts_per_step=2",
    "--learner.micro_batch_size=4",
    "--learner.grad_accum=2",
    "--learner.dynamic_sampling=false",
    "--learner.pull_wait_s=120",
    "--learner.lr=2e-4",
]
