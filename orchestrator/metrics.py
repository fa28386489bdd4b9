"""Prometheus metrics, named like vLLM's spec-decode counters, on a registry of our own
(no process-global state, so several orchestrators can live in one process, as in tests)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, start_http_server

from mirrorspec.config import InvalidRequest


class SpecDecodeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._http = None  # the /metrics HTTP server, once ``serve`` runs
        r = self.registry
        self.num_drafts = Counter("mirrorspec_spec_decode_num_drafts", "Windows verified with at least one draft "
                                  "(as vLLM counts drafts: target-only windows are not among them)", registry=r)
        self.num_draft_tokens = Counter("mirrorspec_spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.num_accepted_tokens = Counter("mirrorspec_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                           registry=r)
        self.accepted_per_pos = Counter("mirrorspec_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each window position", ["position"], registry=r)
        self.requests = Counter("mirrorspec_requests", "Finished requests", ["finish_reason"], registry=r)
        self.drafter_fallbacks = Counter("mirrorspec_drafter_fallbacks", "Requests that lost their drafter",
                                         registry=r)
        self.mirror_windows = Counter("mirrorspec_mirror_windows", "Windows verified while branches were drafted",
                                      registry=r)
        self.branch_hits = Counter("mirrorspec_mirror_branch_hits",
                                   "Mirror windows whose next window was drafted before the verdict came", registry=r)
        self.paused_windows = Counter("mirrorspec_speculation_paused_windows",
                                      "Windows sent without drafts because too many requests were in flight",
                                      registry=r)
        self.generation_tokens = Counter("mirrorspec_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("mirrorspec_time_to_first_token_seconds", "Time to first token", registry=r)
        self.inter_token = Histogram("mirrorspec_inter_token_latency_seconds", "Mean time per output token",
                                     registry=r)
        self.e2e = Histogram("mirrorspec_e2e_request_latency_seconds", "Request latency", registry=r)

    def observe(self, outcome) -> None:
        s = outcome.stats
        self.num_drafts.inc(s.drafted_per_position[0] if s.drafted_per_position else 0)
        self.num_draft_tokens.inc(s.drafted)
        self.num_accepted_tokens.inc(s.accepted)
        for position, count in enumerate(s.accepted_per_position):
            self.accepted_per_pos.labels(position=str(position)).inc(count)
        self.requests.labels(finish_reason=outcome.finish_reason).inc()
        self.drafter_fallbacks.inc(int(outcome.drafter_fallback))
        self.mirror_windows.inc(s.mirror_windows)
        self.branch_hits.inc(s.branch_hits)
        self.paused_windows.inc(outcome.paused_windows)
        self.generation_tokens.inc(len(outcome.tokens))
        total = time.perf_counter() - outcome.started
        self.e2e.observe(total)
        if outcome.first_token_at is not None:
            self.ttft.observe(outcome.first_token_at - outcome.started)
            if len(outcome.tokens) > 1:
                self.inter_token.observe((total - (outcome.first_token_at - outcome.started)) / (len(outcome.tokens) - 1))

    def summary(self) -> dict:
        """The headline figures, for ``mirrorspec status``."""
        drafted, accepted = self.num_draft_tokens._value.get(), self.num_accepted_tokens._value.get()
        requests = sum(sample.value for metric in self.requests.collect() for sample in metric.samples
                       if sample.name.endswith("_total"))
        return {"requests": int(requests), "draft_tokens": int(drafted), "accepted_tokens": int(accepted),
                "acceptance_rate": accepted / drafted if drafted else 0.0}

    def text(self) -> str:
        return generate_latest(self.registry).decode()

    def serve(self, host: str, port: int) -> None:
        """Serves ``/metrics`` over HTTP until ``close``."""
        try:
            self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as err:
            raise InvalidRequest(f"cannot serve metrics on {host}:{port}: {err.strerror or err}; pick another "
                                 f"metrics port, or 0 for a free one", field="metrics_port") from None

    def close(self) -> None:
        http, self._http = self._http, None
        if http is not None:
            http.shutdown()
            http.server_close()
