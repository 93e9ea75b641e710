"""Prometheus metrics of the server (one registry per app, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("dflash_requests", "Requests by endpoint and outcome", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens received (raw)", registry=r)
        self.effective_prompt_tokens = Counter("dflash_effective_prompt_tokens",
                                               "Prompt tokens after compression (prefilled)", registry=r)
        self.completion_tokens = Counter("dflash_completion_tokens", "Completion tokens generated", registry=r)
        self.ttft = Histogram("dflash_ttft_seconds", "Time to first token", registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.tpot = Histogram("dflash_tpot_seconds", "Time per output token after the first", registry=r,
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1))
        self.accept_len = Histogram("dflash_acceptance_length",
                                    "Tokens emitted per speculative step (one observation per request: its mean)",
                                    registry=r, buckets=(1, 2, 3, 4, 5, 6, 8, 10, 12, 16))
        self.draft_steps = Counter("dflash_spec_draft_steps", "Speculative (DDTree) rounds of finished requests",
                                   registry=r)
        self.accepted_tokens = Counter("dflash_spec_accepted_tokens",
                                       "Drafted tokens the target accepted (finished requests)", registry=r)
        self.cohort_yield = Counter("dflash_cohort_yield_events", "Cohorts switched to AR by the yield guard",
                                    registry=r)
        self.cohort_reprobes = Counter("dflash_cohort_reprobes", "Yielded requests that probed DDTree again",
                                       registry=r)
        self.kv_pages_in = Counter("dflash_kv_pages_in", "KV pages brought back to the device", registry=r)
        self.kv_pages_out = Counter("dflash_kv_pages_out", "KV pages moved to host memory", registry=r)
        self.queue_depth = Gauge("dflash_queue_depth", "Requests waiting for admission", registry=r)
        self.running = Gauge("dflash_running_requests", "Requests admitted (prefill or decode)", registry=r)
        self.free_pages = Gauge("dflash_kv_free_pages", "Free KV pages in the pool", registry=r)
        self.total_pages = Gauge("dflash_kv_total_pages", "Usable KV pages in the pool", registry=r)
        self.free_slots = Gauge("dflash_free_slots", "Free recurrent-state slots", registry=r)
        self.engine_faults = Counter("dflash_engine_faults", "Engine steps that raised", registry=r)
        self.scorer_turn_waits = Counter("dflash_pflash_scorer_turn_waits",
                                         "PFlash scorer dispatches that waited for an engine step", registry=r)
        self.scorer_turn_wait_seconds = Counter("dflash_pflash_scorer_turn_wait_seconds",
                                                "Seconds the PFlash scorer waited for engine steps", registry=r)
        self.prefix_hits = Counter("dflash_prefix_cache_hits", "Requests admitted over a cached prompt prefix",
                                   registry=r)
        self.prefix_tokens = Counter("dflash_prefix_cache_tokens", "Prompt tokens the prefix cache supplied (not "
                                     "prefilled)", registry=r)
        self.prefix_entries = Gauge("dflash_prefix_cache_entries", "Cached prompt prefixes", registry=r)
        self.prefix_pages = Gauge("dflash_prefix_cache_pages", "KV pages only the prefix cache holds (freed on "
                                  "demand)", registry=r)
        self._seen: dict[int, float] = {}

    def sync(self, counter: Counter, total: float) -> None:
        """Advance ``counter`` to ``total``, a running count kept elsewhere (the engine's counters)."""
        delta = total - self._seen.get(id(counter), 0.0)
        if delta > 0:
            counter.inc(delta)
            self._seen[id(counter)] = total
