//! `/metrics`: the answers by status and the engine's counters in Prometheus text format.

use std::sync::atomic::Ordering;

use axum::extract::State;
use axum::response::{IntoResponse, Response};

use super::state::{AppState, check_engine};
use crate::engine::metrics::{BUCKETS, Histogram};

/// Prometheus text format.
pub(super) async fn metrics(State(state): State<AppState>) -> Response {
    let m = &state.engine.metrics;
    let generated = m.generated_tokens.load(Ordering::Relaxed);
    let decode_s = m.decode_ns.load(Ordering::Relaxed) as f64 / 1e9;
    let mut text = Text::default();
    text.metric(
        "k3_engine_up",
        "gauge",
        "1 while the engine serves; 0 while the model loads or after the engine stopped.",
        u8::from(check_engine(&state.engine).is_ok()).to_string(),
    );
    text.family(
        "k3_requests_total",
        "counter",
        "HTTP answers by status code (the router's 404 and 405, the API key check's 401 and the \
         connection layer's refusals included).",
    );
    for (status, answers) in state.responses.counts() {
        text.sample(
            "k3_requests_total",
            &format!("{{status=\"{status}\"}}"),
            answers.to_string(),
        );
    }
    text.metric(
        "k3_requests_admitted_total",
        "counter",
        "Requests admitted to the engine.",
        m.requests.load(Ordering::Relaxed).to_string(),
    );
    text.metric(
        "k3_requests_rejected_total",
        "counter",
        "Requests refused with 429 (queue full).",
        m.rejected.load(Ordering::Relaxed).to_string(),
    );
    text.metric(
        "k3_prompt_tokens_total",
        "counter",
        "Prompt tokens of admitted requests (cached ones included).",
        m.prompt_tokens.load(Ordering::Relaxed).to_string(),
    );
    text.metric(
        "k3_generated_tokens_total",
        "counter",
        "Tokens generated.",
        generated.to_string(),
    );
    text.metric(
        "k3_decode_tokens_per_second",
        "gauge",
        "Generated tokens per second of engine-step time (steps that prefill prompt chunks included).",
        format!(
            "{:.3}",
            if decode_s > 0.0 {
                generated as f64 / decode_s
            } else {
                0.0
            }
        ),
    );
    text.metric(
        "k3_steps_total",
        "counter",
        "Engine steps (forward passes over the running streams' tokens and prompt chunks).",
        m.steps.load(Ordering::Relaxed).to_string(),
    );
    text.family(
        "k3_step_tokens_total",
        "counter",
        "Tokens the engine steps fed, by kind: decode (a running stream's next token) or \
         prefill (a prompt chunk; cached prompt tokens are not fed).",
    );
    text.sample(
        "k3_step_tokens_total",
        "{kind=\"decode\"}",
        m.step_decode_tokens.load(Ordering::Relaxed).to_string(),
    );
    text.sample(
        "k3_step_tokens_total",
        "{kind=\"prefill\"}",
        m.step_prefill_tokens.load(Ordering::Relaxed).to_string(),
    );
    text.metric(
        "k3_constraint_masks_total",
        "counter",
        "Output-constraint masks computed (one per token of a structured-output request).",
        m.masks.load(Ordering::Relaxed).to_string(),
    );
    text.metric(
        "k3_constraint_mask_seconds_total",
        "counter",
        "Time spent computing output-constraint masks (mostly on threads of their own, \
         overlapping the steps' forward passes); divided by k3_constraint_masks_total, the mask \
         time per token.",
        format!("{:.6}", m.mask_ns.load(Ordering::Relaxed) as f64 / 1e9),
    );
    text.metric(
        "k3_spec_drafted_tokens_total",
        "counter",
        "Drafted tokens fed to verify passes (speculative decoding, --spec).",
        m.spec_drafted.load(Ordering::Relaxed).to_string(),
    );
    text.metric(
        "k3_spec_accepted_tokens_total",
        "counter",
        "Drafted tokens accepted: each was the token the sampler drew at its position.",
        m.spec_accepted.load(Ordering::Relaxed).to_string(),
    );
    text.metric(
        "k3_spec_passes_total",
        "counter",
        "Verify passes: steps of a sequence that fed drafted tokens after its last token.",
        m.spec_passes.load(Ordering::Relaxed).to_string(),
    );
    text.histogram(
        "k3_ttft_seconds",
        "Time from a request's arrival to its first token.",
        &m.ttft,
    );
    text.histogram(
        "k3_itl_seconds",
        "Time between a stream's successive tokens.",
        &m.itl,
    );
    text.histogram(
        "k3_queue_wait_seconds",
        "Time from a request's arrival to its admission to the running batch.",
        &m.queue_wait,
    );
    text.metric(
        "k3_queue_depth",
        "gauge",
        "Requests waiting for a batch slot.",
        state.engine.queue_depth().to_string(),
    );
    text.metric(
        "k3_active_sequences",
        "gauge",
        "Sequences in the running batch.",
        m.active.load(Ordering::Relaxed).to_string(),
    );
    let store = *m.store.lock().unwrap_or_else(|p| p.into_inner());
    let store = store.unwrap_or_default();
    text.metric(
        "k3_expert_cache_hits_total",
        "counter",
        "Routed-expert uses served from memory.",
        store.hits.to_string(),
    );
    text.metric(
        "k3_expert_cache_misses_total",
        "counter",
        "Routed-expert uses that needed a read.",
        store.misses.to_string(),
    );
    text.metric(
        "k3_expert_bytes_read_total",
        "counter",
        "Bytes of experts read from disk.",
        store.bytes_read.to_string(),
    );
    let cache = *m.prompt_cache.lock().unwrap_or_else(|p| p.into_inner());
    let cache = cache.unwrap_or_default();
    text.metric(
        "k3_prompt_cache_hits_total",
        "counter",
        "Requests that resumed from a cached prompt prefix.",
        cache.hits.to_string(),
    );
    text.metric(
        "k3_prompt_cache_misses_total",
        "counter",
        "Requests that found no cached prompt prefix.",
        cache.misses.to_string(),
    );
    text.metric(
        "k3_prompt_cache_cached_tokens_total",
        "counter",
        "Prompt tokens restored from the prompt cache instead of prefilled.",
        cache.cached_tokens_served.to_string(),
    );
    text.metric(
        "k3_prompt_cache_bytes",
        "gauge",
        "Bytes of session snapshots the prompt cache holds in memory.",
        cache.bytes_held.to_string(),
    );
    text.metric(
        "k3_prompt_cache_evictions_total",
        "counter",
        "Snapshots dropped from memory to stay within --prompt-cache-gb.",
        cache.evictions.to_string(),
    );
    ([("content-type", "text/plain; version=0.0.4")], text.0).into_response()
}

/// Prometheus text, one metric family at a time.
#[derive(Default)]
struct Text(String);

impl Text {
    /// A family's `# HELP` and `# TYPE` lines.
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        self.0
            .push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
    }

    /// One sample: `name{labels} value` (`labels` empty, or `{key="value"}`).
    fn sample(&mut self, name: &str, labels: &str, value: String) {
        self.0.push_str(&format!("{name}{labels} {value}\n"));
    }

    /// A family of one unlabelled sample.
    fn metric(&mut self, name: &str, kind: &str, help: &str, value: String) {
        self.family(name, kind, help);
        self.sample(name, "", value);
    }

    /// A histogram: its cumulative `_bucket{le=...}` samples, `_sum` and `_count`.
    fn histogram(&mut self, name: &str, help: &str, histogram: &Histogram) {
        self.family(name, "histogram", help);
        let (cumulative, count, sum) = histogram.snapshot();
        let bounds = BUCKETS.iter().map(|le| le.to_string());
        for (le, n) in bounds.chain(["+Inf".to_owned()]).zip(cumulative) {
            self.sample(
                &format!("{name}_bucket"),
                &format!("{{le=\"{le}\"}}"),
                n.to_string(),
            );
        }
        self.sample(&format!("{name}_sum"), "", format!("{sum:.6}"));
        self.sample(&format!("{name}_count"), "", count.to_string());
    }
}
