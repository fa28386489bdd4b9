"""Prometheus metrics, named like vLLM's spec-decode counters, on a registry of our own
(no process-global state, so several orchestrators can live in one process, as in tests)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from mirrorspec.config import InvalidRequest

# request latencies on CPU run to minutes (the library's default buckets end at 10 s)
LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, float("inf"))


class SpecDecodeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._http = None  # the /metrics HTTP server, once ``serve`` runs
        r = self.registry
        self.num_drafts = Counter("mirrorspec_spec_decode_num_drafts", "Windows verified with at least one draft "
                                  "(as vLLM counts drafts: target-only windows are not among them)", registry=r)
        self.num_draft_tokens = Counter("mirrorspec_spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.num_accepted_tokens = Counter("mirrorspec_spec_decode_num_accepted_tokens", "Draft tokens accepted "
                                           "(runner-up wins not among them: see num_runner_up_hits)", registry=r)
        self.num_windows = Counter("mirrorspec_spec_decode_num_windows", "Windows verified, target-only ones too: "
                                   "generation tokens / windows is the mean accepted length (bonus and runner-up "
                                   "wins included), as a request's stats give it", registry=r)
        self.num_runner_up_hits = Counter("mirrorspec_spec_decode_num_runner_up_hits",
                                          "Windows whose first slot went to the draft's runner-up", registry=r)
        self.accepted_per_pos = Counter("mirrorspec_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each window position", ["position"], registry=r)
        self.requests = Counter("mirrorspec_requests", "Requests that ran, by how they ended (cancelled: the "
                                "client left; deadline_exceeded: its deadline passed)", ["finish_reason"], registry=r)
        self.refused = Counter("mirrorspec_requests_refused", "Requests refused before they ran, by gRPC status "
                               "(bad input, a front door that is stopping)", ["code"], registry=r)
        self.errors = Counter("mirrorspec_request_errors", "Requests that ran and ended in an error (finish_reason "
                              "error), by the gRPC status they got: RESOURCE_EXHAUSTED is replicas at their "
                              "session limit, UNAVAILABLE no replica that could take it, INTERNAL a model that "
                              "failed on it (NaN logits, out of memory)", ["code"], registry=r)
        self.drafter_fallbacks = Counter("mirrorspec_drafter_fallbacks", "Requests that lost their drafter",
                                         registry=r)
        self.mirror_windows = Counter("mirrorspec_mirror_windows", "Windows verified while branches were drafted",
                                      registry=r)
        self.branch_hits = Counter("mirrorspec_mirror_branch_hits",
                                   "Mirror windows whose next window was drafted before the verdict came", registry=r)
        self.paused_windows = Counter("mirrorspec_speculation_paused_windows",
                                      "Windows sent without drafts because too many requests were in flight",
                                      registry=r)
        self.adaptive_off_windows = Counter("mirrorspec_adaptive_off_windows",
                                            "Windows adaptive K sent without drafts: speculation did not pay",
                                            registry=r)
        self.generation_tokens = Counter("mirrorspec_generation_tokens", "Tokens generated", registry=r)
        # vLLM's num_requests_running / num_requests_waiting: past the front door's
        # max_concurrent_requests, requests wait their turn unseen (a load review)
        self.running = Gauge("mirrorspec_requests_running", "Requests in their window loop now", registry=r)
        self.waiting = Gauge("mirrorspec_requests_waiting", "Requests admitted and waiting for one of the front "
                             "door's max_concurrent_requests request threads", registry=r)
        self.ttft = Histogram("mirrorspec_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=LATENCY_BUCKETS_S)
        self.inter_token = Histogram("mirrorspec_inter_token_latency_seconds", "Mean time per output token",
                                     registry=r)
        self.e2e = Histogram("mirrorspec_e2e_request_latency_seconds", "Request latency", registry=r,
                             buckets=LATENCY_BUCKETS_S)

    def observe(self, outcome) -> None:
        s = outcome.stats
        self.num_drafts.inc(s.drafted_per_position[0] if s.drafted_per_position else 0)
        self.num_draft_tokens.inc(s.drafted)
        self.num_accepted_tokens.inc(s.accepted)
        self.num_windows.inc(s.windows)
        self.num_runner_up_hits.inc(s.runner_up_hits)
        for position, count in enumerate(s.accepted_per_position):
            self.accepted_per_pos.labels(position=str(position)).inc(count)
        self.requests.labels(finish_reason=outcome.finish_reason).inc()
        self.drafter_fallbacks.inc(int(outcome.drafter_fallback))
        self.mirror_windows.inc(s.mirror_windows)
        self.branch_hits.inc(s.branch_hits)
        self.paused_windows.inc(outcome.paused_windows)
        self.adaptive_off_windows.inc(s.adaptive_off_windows)
        self.generation_tokens.inc(len(outcome.tokens))
        total = time.perf_counter() - outcome.started
        self.e2e.observe(total)
        if outcome.first_token_at is not None:
            self.ttft.observe(outcome.first_token_at - outcome.started)
            if len(outcome.tokens) > 1:
                self.inter_token.observe((total - (outcome.first_token_at - outcome.started)) / (len(outcome.tokens) - 1))

    def refuse(self, code: str) -> None:
        self.refused.labels(code=code).inc()

    def fail(self, code: str) -> None:
        self.errors.labels(code=code).inc()

    def summary(self) -> dict:
        """The headline figures, for ``mirrorspec status``."""
        drafted, accepted = self.num_draft_tokens._value.get(), self.num_accepted_tokens._value.get()
        requests = sum(sample.value for metric in self.requests.collect() for sample in metric.samples
                       if sample.name.endswith("_total"))
        return {"requests": int(requests), "draft_tokens": int(drafted), "accepted_tokens": int(accepted),
                "acceptance_rate": accepted / drafted if drafted else None}  # `status`: "-", not "every draft rejected"

    def text(self) -> str:
        return generate_latest(self.registry).decode()

    def serve(self, host: str, port: int) -> None:
        """Serves ``/metrics`` over HTTP until ``close``."""
        try:
            self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as err:
            raise InvalidRequest(f"cannot serve metrics on {host}:{port}: {err.strerror or err}; pick another "
                                 f"metrics port, or 0 for a free one", field="metrics_port") from None

    @property
    def port(self) -> int | None:
        """Where ``/metrics`` is served, the port chosen where the metrics port was 0 (which was told
        to no one: a review's find); None while it is not served."""
        return self._http.server_port if self._http is not None else None

    def close(self) -> None:
        http, self._http = self._http, None
        if http is not None:
            http.shutdown()
            http.server_close()
