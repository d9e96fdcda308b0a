"""Prometheus metrics of the rollout server, one registry per server instance."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shared.protocol import is_degenerate

RATE_WINDOW_S = 30.0  # continuous production's tokens/s: over the groups that ended this recently


class ServerMetrics:
    """Counters the producer feeds batch by batch; gauges read from the queue and the policy when scraped;
    `sleeping` set by the producer."""

    def __init__(self, queue, policy):
        r = self.registry = CollectorRegistry()
        self.groups = Counter("tandem_groups_produced", "scored groups put on the queue", registry=r)
        self.degenerate = Counter(
            "tandem_groups_degenerate", "produced groups with all rewards equal", registry=r
        )
        self.completions = Counter("tandem_completions", "completions generated", registry=r)
        self.tokens = Counter("tandem_completion_tokens", "completion tokens generated", registry=r)
        self.reward = Gauge(  # a gauge: length shaping makes rewards negative, and a counter cannot go down
            "tandem_reward_sum", "sum of completion rewards", registry=r
        )
        self.function_reward = Gauge(  # a gauge: a reward may be negative, and a counter cannot go down
            "tandem_reward_function_sum", "sum of each reward function's values", ["function"], registry=r
        )
        self.reward_failures = Counter(
            "tandem_reward_failures",
            "reward function calls that gave 0 by failing, by function and kind: raised, timeout (killed "
            "past reward.timeout_s), non_finite, bad_type (not a number), crashed (its process died)",
            ["function", "kind"],
            registry=r,
        )
        self.prompts_too_long = Counter(
            "tandem_prompts_too_long",
            "prompts skipped: no room within max_model_len (problems left out at start, then any found when "
            "generating)",
            registry=r,
        )
        self.groups_invalid = Counter("tandem_groups_invalid", "groups dropped: unusable sample", registry=r)
        self.curriculum_skipped = Gauge(
            "tandem_curriculum_skipped", "problems sitting out this epoch (data.curriculum)", registry=r
        )
        self.samples_continued = Counter(
            "tandem_samples_continued",
            "samples interrupted by a publish and continued under the new version (server.inflight_updates)",
            registry=r,
        )
        self.generate_s = Histogram(
            "tandem_generate_seconds",
            "wall time of one generation batch",
            registry=r,
            buckets=(0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320),
        )
        self.tok_s = Gauge(
            "tandem_rollout_tokens_per_second",
            "completion tokens/s of the last batch (continuous production: of the groups that ended in the "
            f"last {RATE_WINDOW_S:.0f} s, over the time since the first of them started)",
            registry=r,
        )
        self._recent: deque[tuple[float, float, int]] = deque()  # (start, end, tokens) of recent groups
        self.last_group = Gauge(
            "tandem_last_group_timestamp_seconds", "unix time of the last group", registry=r
        )
        Gauge("tandem_queue_depth", "groups waiting", registry=r).set_function(lambda: queue.depth)
        Gauge("tandem_pulls_waiting", "pulls waiting for groups", registry=r).set_function(
            lambda: queue.waiting
        )
        Gauge("tandem_groups_leased", "groups leased, not yet acked", registry=r).set_function(
            lambda: queue.leased
        )
        Gauge("tandem_groups_acked", "groups acked since start", registry=r).set_function(
            lambda: queue.acked_total
        )
        Gauge("tandem_groups_expired", "leased groups returned by expiry", registry=r).set_function(
            lambda: queue.expired_total
        )
        Gauge("tandem_policy_version", "adapter version served", registry=r).set_function(
            lambda: policy.version
        )
        self.sleeping = Gauge("tandem_sleeping", "1 while asleep", registry=r)
        self.publish_s = Counter(
            "tandem_publish_phase_seconds",
            "time spent in each phase of adapter publishes: receive (the request body, until the route "
            "runs), validate, store (to server.state_dir), load (into the engine), total",
            ["phase"],
            registry=r,
        )

    def observe_batch(self, groups, elapsed_s: float, overlapping: bool = False) -> None:
        """`overlapping`: this batch ran beside others (continuous production's groups), so its own
        tokens/elapsed is not the engine's rate."""
        tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
        self.groups.inc(len(groups))
        self.degenerate.inc(sum(is_degenerate(g.rewards) for g in groups))
        self.completions.inc(sum(len(g.completions) for g in groups))
        self.tokens.inc(tokens)
        self.reward.inc(sum(sum(g.rewards) for g in groups))
        for c in (c for g in groups for c in g.completions):
            for name, value in c.rewards.items():
                self.function_reward.labels(name).inc(value)
        self.generate_s.observe(elapsed_s)
        if overlapping:
            now = time.monotonic()
            self._recent.append((now - elapsed_s, now, tokens))
            while self._recent[0][1] < now - RATE_WINDOW_S:
                self._recent.popleft()
            span = now - min(start for start, _, _ in self._recent)
            if span > 0:
                self.tok_s.set(sum(t for *_, t in self._recent) / span)
        elif elapsed_s > 0:
            self.tok_s.set(tokens / elapsed_s)
        if groups:
            self.last_group.set(time.time())

    def render(self) -> bytes:
        return generate_latest(self.registry)
