"""``/metrics`` of ``m3-serve``: Prometheus text, label ``model_name``.

Gauges ``m3_num_requests_running`` / ``_waiting`` / ``_unfinished`` (engine),
``m3_num_requests_in_flight`` (HTTP requests being answered),
``m3_kv_cache_used_pages`` / ``_total_pages`` / ``_usage_perc``,
``m3_kv_cache_cached_blocks`` / ``_evictable_blocks`` (prefix caching); counters
``m3_prompt_tokens_total``, ``m3_generation_tokens_total``, ``m3_engine_steps_total``,
``m3_engine_step_errors_total``, ``m3_request_success_total{finished_reason}``,
``m3_request_aborted_total``, ``m3_request_refused_total``,
``m3_prefix_cache_queries_total`` / ``_hits_total`` (tokens),
``m3_spec_decode_num_drafts_total`` / ``_num_draft_tokens_total`` /
``_num_accepted_tokens_total`` / ``_draft_seconds_total`` (speculative decoding);
histograms ``m3_time_to_first_token_seconds``, ``m3_time_per_output_token_seconds``
(between two tokens of a request; a step that brings several tokens counts each at its
share of the gap) and ``m3_e2e_request_latency_seconds``.

Every metric that vLLM also exports is written a second time under vLLM's name
(:data:`VLLM_NAMES`, e.g. ``vllm:num_requests_running``, ``vllm:generation_tokens_total``,
``vllm:time_to_first_token_seconds``), so a vLLM dashboard reads this server as it is.
"""

from __future__ import annotations

import threading

__all__ = ["Histogram", "Metrics", "render_metrics", "VLLM_NAMES"]

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0)

# our metric -> the names vLLM exports the same quantity under
VLLM_NAMES = {
    "m3_num_requests_running": ("vllm:num_requests_running",),
    "m3_num_requests_waiting": ("vllm:num_requests_waiting",),
    "m3_kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "m3_prefix_cache_queries_total": ("vllm:prefix_cache_queries_total",),
    "m3_prefix_cache_hits_total": ("vllm:prefix_cache_hits_total",),
    "m3_prompt_tokens_total": ("vllm:prompt_tokens_total",),
    "m3_generation_tokens_total": ("vllm:generation_tokens_total",),
    "m3_request_success_total": ("vllm:request_success_total",),
    "m3_spec_decode_num_drafts_total": ("vllm:spec_decode_num_drafts_total",),
    "m3_spec_decode_num_draft_tokens_total": ("vllm:spec_decode_num_draft_tokens_total",),
    "m3_spec_decode_num_accepted_tokens_total": ("vllm:spec_decode_num_accepted_tokens_total",),
    "m3_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "m3_time_per_output_token_seconds": ("vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds"),
    "m3_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
}


class Histogram:
    """A Prometheus histogram (cumulative buckets, ``_sum``, ``_count``); thread-safe."""

    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        value = max(float(value), 0.0)
        with self._lock:
            self.sum += value
            for i, b in enumerate(self.buckets):
                if value <= b:
                    self.counts[i] += 1
                    break
            else:
                self.counts[-1] += 1

    def lines(self, name: str, labels: str) -> list:
        with self._lock:
            counts, total = list(self.counts), self.sum
        out, cumulative = [], 0
        for b, c in zip(self.buckets + ("+Inf",), counts):
            cumulative += c
            out.append(f'{name}_bucket{{{labels},le="{b}"}} {cumulative}')
        out += [f"{name}_sum{{{labels}}} {total}", f"{name}_count{{{labels}}} {cumulative}"]
        return out


class Metrics:
    """What ``/metrics`` shows beyond the engine's own counters (written by the engine thread)."""

    def __init__(self):
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.finished = {"stop": 0, "length": 0}   # finish reason -> requests (the engine's)
        self.aborted = 0                            # requests aborted (client gone, shutdown, failed step)
        self.refused = 0                            # requests refused with a 503 (full queue)
        self.step_errors = 0


def render_metrics(snapshot: dict, m: Metrics, *, in_flight: int, model_name: str) -> str:
    """The Prometheus text of the engine's ``snapshot`` (``EngineClient.snapshot``), the server's
    ``Metrics`` and the HTTP requests being answered."""
    s = snapshot
    labels = 'model_name="' + model_name.replace("\\", "\\\\").replace('"', '\\"') + '"'
    lines = []

    def metric(name, kind, help_, value=None, *, samples=(), histogram=None):
        """``name`` (and its vLLM names): one sample ``value``, or ``samples`` of ``(extra labels,
        value)``, or a ``histogram``."""
        for n in (name, *VLLM_NAMES.get(name, ())):
            lines.append(f"# HELP {n} {help_}")
            lines.append(f"# TYPE {n} {kind}")
            if value is not None:
                lines.append(f"{n}{{{labels}}} {value}")
            lines.extend(f"{n}{{{labels},{extra}}} {v}" for extra, v in samples)
            if histogram is not None:
                lines.extend(histogram.lines(n, labels))

    metric("m3_num_requests_running", "gauge", "Requests in the running batch.", s["running"])
    metric("m3_num_requests_waiting", "gauge", "Requests waiting to be scheduled.", s["waiting"])
    metric("m3_num_requests_unfinished", "gauge", "Requests the engine holds (running + waiting).",
           s["unfinished"])
    metric("m3_num_requests_in_flight", "gauge", "HTTP requests being answered.", in_flight)
    metric("m3_kv_cache_used_pages", "gauge", "KV pool pages (128 tokens) reserved by requests.",
           s["kv_pages_used"])
    metric("m3_kv_cache_total_pages", "gauge", "KV pool pages (128 tokens) in all.", s["kv_pages_total"])
    metric("m3_kv_cache_usage_perc", "gauge", "Fraction of the KV pool in use (1 = full).",
           s["kv_pages_used"] / max(s["kv_pages_total"], 1))
    metric("m3_kv_cache_cached_blocks", "gauge", "Pool pages holding a prefix-cached block (held or not).",
           s.get("cached_blocks", 0))
    metric("m3_kv_cache_evictable_blocks", "gauge", "Prefix-cached pages no request holds (reusable, or "
           "handed out when the pool needs them).", s.get("evictable_blocks", 0))
    metric("m3_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
           s.get("prefix_cache_query_tokens", 0))
    metric("m3_prefix_cache_hits_total", "counter", "Prompt tokens served by the prefix cache.",
           s.get("prefix_cache_hit_tokens", 0))
    metric("m3_prompt_tokens_total", "counter", "Prompt tokens prefilled.", s.get("prompt_tokens", 0))
    metric("m3_generation_tokens_total", "counter", "Tokens generated and handed to requests.",
           s.get("generation_tokens", 0))
    metric("m3_engine_steps_total", "counter", "Engine steps run.", s.get("steps", 0))
    metric("m3_engine_step_errors_total", "counter", "Engine steps that failed.", m.step_errors)
    metric("m3_spec_decode_num_drafts_total", "counter", "Speculative decoding: request rows that verified drafts.",
           s.get("spec_drafts", 0))
    metric("m3_spec_decode_num_draft_tokens_total", "counter", "Speculative decoding: draft tokens proposed.",
           s.get("spec_draft_tokens", 0))
    metric("m3_spec_decode_num_accepted_tokens_total", "counter", "Speculative decoding: draft tokens accepted.",
           s.get("spec_accepted_tokens", 0))
    metric("m3_spec_decode_draft_seconds_total", "counter", "Speculative decoding: seconds spent proposing drafts.",
           s.get("spec_draft_time_s", 0.0))
    metric("m3_request_success_total", "counter", "Requests finished, by finish reason.",
           samples=[(f'finished_reason="{reason}"', count) for reason, count in sorted(m.finished.items())])
    metric("m3_request_aborted_total", "counter", "Requests aborted (client gone, shutdown, failed step).",
           m.aborted)
    metric("m3_request_refused_total", "counter", "Requests refused because the queue was full (503).",
           m.refused)
    metric("m3_time_to_first_token_seconds", "histogram", "Time to the first token.", histogram=m.ttft)
    metric("m3_time_per_output_token_seconds", "histogram", "Time between two output tokens.", histogram=m.tpot)
    metric("m3_e2e_request_latency_seconds", "histogram", "Arrival to finish of a request.", histogram=m.e2e)
    return "\n".join(lines) + "\n"
