//! Prometheus text exposition for `/metrics`: the server's own counters and histograms plus
//! the engine's `Stats`.

use quiver_engine::serve::Stats;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

/// A cumulative histogram with fixed upper bounds (seconds).
#[derive(Clone, Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        for (b, c) in self.bounds.iter().zip(self.counts.iter_mut()) {
            if v <= *b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        self.render_labeled(out, name, help, "");
    }

    /// With `labels` (`key="value",`…, each followed by a comma) on every series.
    fn render_labeled(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{{labels}le=\"{b}\"}} {c}");
        }
        let plain = braces(labels.trim_end_matches(','));
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}le=\"+Inf\"}} {}\n{name}_sum{plain} {}\n{name}_count{plain} {}",
            self.count, self.sum, self.count
        );
    }
}

/// `{labels}`, or nothing without labels.
fn braces(labels: &str) -> String {
    if labels.is_empty() {
        String::new()
    } else {
        format!("{{{labels}}}")
    }
}

const TTFT_BOUNDS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const ITL_BOUNDS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5];
const E2E_BOUNDS: &[f64] = &[
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

struct Inner {
    requests: BTreeMap<(String, u16), u64>,
    finished: BTreeMap<&'static str, u64>,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
}

pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            inner: Mutex::new(Inner {
                requests: BTreeMap::new(),
                finished: BTreeMap::new(),
                ttft: Histogram::new(TTFT_BOUNDS),
                itl: Histogram::new(ITL_BOUNDS),
                e2e: Histogram::new(E2E_BOUNDS),
            }),
        }
    }
}

impl Metrics {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One HTTP response, by route and status.
    pub fn request(&self, route: &str, status: u16) {
        *self
            .lock()
            .requests
            .entry((route.to_string(), status))
            .or_default() += 1;
    }

    pub fn finished(&self, reason: &'static str) {
        *self.lock().finished.entry(reason).or_default() += 1;
    }

    pub fn ttft(&self, secs: f64) {
        self.lock().ttft.observe(secs);
    }

    pub fn itl(&self, secs: f64) {
        self.lock().itl.observe(secs);
    }

    pub fn e2e(&self, secs: f64) {
        self.lock().e2e.observe(secs);
    }

    pub fn render(&self, s: &Stats) -> String {
        let mut out = String::new();
        let g = self.lock();
        let _ = writeln!(out, "# HELP quiver_http_requests_total HTTP responses by route and status code.\n# TYPE quiver_http_requests_total counter");
        for ((route, status), n) in &g.requests {
            let _ = writeln!(
                out,
                "quiver_http_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}"
            );
        }
        let _ = writeln!(out, "# HELP quiver_request_finished_total Generation requests by finish reason.\n# TYPE quiver_request_finished_total counter");
        for (reason, n) in &g.finished {
            let _ = writeln!(
                out,
                "quiver_request_finished_total{{finish_reason=\"{reason}\"}} {n}"
            );
        }
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: usize| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        counter(
            &mut out,
            "quiver_prompt_tokens_total",
            "Prompt tokens of scheduled requests.",
            s.prompt_tokens_total,
        );
        counter(
            &mut out,
            "quiver_generation_tokens_total",
            "Generated tokens.",
            s.generated_tokens_total,
        );
        counter(
            &mut out,
            "quiver_prefix_cache_hit_tokens_total",
            "Prompt tokens reused from the prefix cache.",
            s.prefix_cache_hit_tokens_total,
        );
        counter(
            &mut out,
            "quiver_preemptions_total",
            "Requests preempted for lack of KV blocks.",
            s.preemptions_total,
        );
        counter(
            &mut out,
            "quiver_engine_steps_total",
            "Forward steps of the engine.",
            s.steps_total,
        );
        counter(
            &mut out,
            "quiver_spec_proposed_tokens_total",
            "Tokens proposed by speculative decoding.",
            s.spec_proposed_tokens_total,
        );
        counter(
            &mut out,
            "quiver_spec_accepted_tokens_total",
            "Proposed tokens accepted.",
            s.spec_accepted_tokens_total,
        );
        gauge(
            &mut out,
            "quiver_requests_running",
            "Requests running.",
            s.running,
        );
        gauge(
            &mut out,
            "quiver_requests_waiting",
            "Requests waiting to be scheduled.",
            s.waiting,
        );
        gauge(
            &mut out,
            "quiver_kv_blocks_total",
            "KV blocks in the pool.",
            s.kv_blocks_total,
        );
        gauge(
            &mut out,
            "quiver_kv_blocks_used",
            "KV blocks held by requests.",
            s.kv_blocks_used,
        );
        gauge(
            &mut out,
            "quiver_kv_blocks_free",
            "KV blocks free (including cached ones that can be evicted).",
            s.kv_blocks_total.saturating_sub(s.kv_blocks_used),
        );
        g.ttft.render(
            &mut out,
            "quiver_time_to_first_token_seconds",
            "Time from submission to the first generated token.",
        );
        g.itl.render(
            &mut out,
            "quiver_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.",
        );
        g.e2e.render(
            &mut out,
            "quiver_request_duration_seconds",
            "Time from submission to the end of a generation request.",
        );
        out
    }

    /// The same figures under the names vLLM's and llama-server's dashboards query
    /// (`vllm:…` with its `model_name` label, `llamacpp:…`), so they work unchanged.
    pub fn render_peer_names(&self, s: &Stats, model: &str) -> String {
        let mut out = String::new();
        let g = self.lock();
        let m = model.replace('\\', "\\\\").replace('"', "\\\"");
        let l = format!("model_name=\"{m}\"");
        let one = |out: &mut String, name: &str, kind: &str, help: &str, labels: &str, v: f64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{} {v}",
                braces(labels)
            );
        };
        let usage = if s.kv_blocks_total > 0 {
            s.kv_blocks_used as f64 / s.kv_blocks_total as f64
        } else {
            0.0
        };
        one(
            &mut out,
            "vllm:num_requests_running",
            "gauge",
            "Requests running.",
            &l,
            s.running as f64,
        );
        one(
            &mut out,
            "vllm:num_requests_waiting",
            "gauge",
            "Requests waiting.",
            &l,
            s.waiting as f64,
        );
        one(
            &mut out,
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV cache usage (1 = full).",
            &l,
            usage,
        );
        one(
            &mut out,
            "vllm:gpu_cache_usage_perc",
            "gauge",
            "KV cache usage (1 = full; vLLM v0's name).",
            &l,
            usage,
        );
        one(
            &mut out,
            "vllm:prompt_tokens_total",
            "counter",
            "Prompt tokens.",
            &l,
            s.prompt_tokens_total as f64,
        );
        one(
            &mut out,
            "vllm:generation_tokens_total",
            "counter",
            "Generated tokens.",
            &l,
            s.generated_tokens_total as f64,
        );
        one(
            &mut out,
            "vllm:spec_decode_num_draft_tokens_total",
            "counter",
            "Tokens proposed by speculative decoding.",
            &l,
            s.spec_proposed_tokens_total as f64,
        );
        one(
            &mut out,
            "vllm:spec_decode_num_accepted_tokens_total",
            "counter",
            "Proposed tokens accepted.",
            &l,
            s.spec_accepted_tokens_total as f64,
        );
        one(
            &mut out,
            "vllm:num_preemptions_total",
            "counter",
            "Preemptions.",
            &l,
            s.preemptions_total as f64,
        );
        one(
            &mut out,
            "vllm:prefix_cache_hits_total",
            "counter",
            "Prompt tokens found in the prefix cache.",
            &l,
            s.prefix_cache_hit_tokens_total as f64,
        );
        one(
            &mut out,
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            &l,
            s.prompt_tokens_total as f64,
        );
        let _ = writeln!(out, "# HELP vllm:request_success_total Finished requests by finish reason.\n# TYPE vllm:request_success_total counter");
        for (reason, n) in &g.finished {
            let _ = writeln!(
                out,
                "vllm:request_success_total{{{l},finished_reason=\"{reason}\"}} {n}"
            );
        }
        let lc = format!("{l},");
        g.ttft.render_labeled(
            &mut out,
            "vllm:time_to_first_token_seconds",
            "Time to the first token.",
            &lc,
        );
        g.itl.render_labeled(
            &mut out,
            "vllm:inter_token_latency_seconds",
            "Time between tokens.",
            &lc,
        );
        g.itl.render_labeled(
            &mut out,
            "vllm:time_per_output_token_seconds",
            "Time between tokens (vLLM v0's name).",
            &lc,
        );
        g.e2e.render_labeled(
            &mut out,
            "vllm:e2e_request_latency_seconds",
            "Time from submission to the end.",
            &lc,
        );
        one(
            &mut out,
            "llamacpp:prompt_tokens_total",
            "counter",
            "Prompt tokens.",
            "",
            s.prompt_tokens_total as f64,
        );
        one(
            &mut out,
            "llamacpp:tokens_predicted_total",
            "counter",
            "Generated tokens.",
            "",
            s.generated_tokens_total as f64,
        );
        one(
            &mut out,
            "llamacpp:requests_processing",
            "gauge",
            "Requests running.",
            "",
            s.running as f64,
        );
        one(
            &mut out,
            "llamacpp:requests_deferred",
            "gauge",
            "Requests waiting.",
            "",
            s.waiting as f64,
        );
        one(
            &mut out,
            "llamacpp:n_decode_total",
            "counter",
            "Forward steps.",
            "",
            s.steps_total as f64,
        );
        one(
            &mut out,
            "llamacpp:kv_cache_usage_ratio",
            "gauge",
            "KV cache usage (1 = full).",
            "",
            usage,
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let m = Metrics::default();
        m.request("/v1/chat/completions", 200);
        m.request("/v1/chat/completions", 400);
        m.request("/v1/chat/completions", 200);
        m.ttft(0.03);
        m.itl(0.02);
        m.finished("stop");
        let s = Stats {
            kv_blocks_total: 10,
            kv_blocks_used: 3,
            running: 1,
            ..Stats::default()
        };
        let t = m.render(&s);
        assert!(
            t.contains(
                "quiver_http_requests_total{route=\"/v1/chat/completions\",status=\"200\"} 2"
            ),
            "{t}"
        );
        assert!(t.contains(
            "quiver_http_requests_total{route=\"/v1/chat/completions\",status=\"400\"} 1"
        ));
        assert!(t.contains("quiver_kv_blocks_used 3\n"));
        assert!(t.contains("quiver_kv_blocks_free 7\n"));
        assert!(t.contains("quiver_requests_running 1\n"));
        assert!(t.contains("quiver_time_to_first_token_seconds_bucket{le=\"0.05\"} 1"));
        assert!(t.contains("quiver_time_to_first_token_seconds_bucket{le=\"0.025\"} 0"));
        assert!(t.contains("quiver_inter_token_latency_seconds_count 1"));
        assert!(t.contains("quiver_request_finished_total{finish_reason=\"stop\"} 1"));
        let v = m.render_peer_names(&s, "my\"model");
        assert!(
            v.contains("vllm:num_requests_running{model_name=\"my\\\"model\"} 1\n"),
            "{v}"
        );
        assert!(
            v.contains("vllm:kv_cache_usage_perc{model_name=\"my\\\"model\"} 0.3\n"),
            "{v}"
        );
        assert!(v.contains("vllm:time_to_first_token_seconds_bucket{model_name=\"my\\\"model\",le=\"0.05\"} 1\n"), "{v}");
        assert!(
            v.contains("vllm:time_to_first_token_seconds_count{model_name=\"my\\\"model\"} 1\n"),
            "{v}"
        );
        assert!(v.contains("vllm:request_success_total{model_name=\"my\\\"model\",finished_reason=\"stop\"} 1\n"), "{v}");
        assert!(v.contains("llamacpp:requests_processing 1\n"), "{v}");
    }
}
