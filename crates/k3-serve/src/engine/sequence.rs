//! One job in flight ([`Sequence`]): its session and sampler, the output parser, stop strings
//! matched on reasoning and content as they stream ([`Channel`]), its events and its one log
//! line.

use std::sync::atomic::Ordering;
use std::time::Instant;

use k3_model::chat::{Delta, OutputParser, take_text};
use k3_model::model::{Model, Session};
use k3_model::sampling::{Sampler, StopStrings};
use k3_model::tokenizer::Tokenizer;
use k3_structured::{ANSWER_TRAILER, JsonCloser, Spec};
use tokio::sync::mpsc::UnboundedSender;

use super::constrain::Constrained;
use super::job::{Event, Job, TokenLogprob, TopLogprob};
use super::metrics::Metrics;
use super::speculate::Drafting;
use super::state::StateFiles;
use crate::api::valid::Prompt;
use crate::prompt_cache::Namespace;

/// Visible text of one kind (reasoning or content) on its way out: stop strings are matched
/// in it as it comes, and a tail that may begin one is held back.
struct Channel {
    stops: StopStrings,
    held: String,
}

impl Channel {
    /// Adds `text`, moving what may be sent to `out`; true when a stop string ended the
    /// text (it and everything after it are dropped).
    fn push(&mut self, text: &str, out: &mut String) -> bool {
        let base = self.held.len();
        self.held.push_str(text);
        if let Some((end, len)) = self.stops.scan(text) {
            // `held` keeps every byte a stop in progress may have begun at.
            self.held.truncate(base + end - len);
            out.push_str(&std::mem::take(&mut self.held));
            return true;
        }
        let send = self.held.len() - self.stops.pending().min(self.held.len());
        out.push_str(&self.held[..send]);
        self.held.drain(..send);
        false
    }

    /// Sends what is held: this text is over (the other kind began, or the output ended), so
    /// no stop can complete it any more.
    fn flush(&mut self, out: &mut String) {
        out.push_str(&std::mem::take(&mut self.held));
        self.stops.reset();
    }
}

/// One job in flight.
pub(super) struct Sequence {
    pub(super) session: Session,
    sampler: Sampler,
    parser: Option<OutputParser>,
    reasoning: Channel,
    content: Channel,
    pub(super) prompt: Vec<u32>,
    /// How many first prompt tokens are a chat's system block (0: none known).
    pub(super) system_tokens: usize,
    /// Where its snapshots go in the prompt cache, and where it resumes from.
    pub(super) cache_namespace: Namespace,
    /// Prompt tokens restored from the prompt cache.
    pub(super) cached_tokens: usize,
    /// Prompt tokens its session has consumed (restored or prefilled): below the prompt's
    /// length while it is being prefilled, chunk by chunk.
    pub(super) fed_prompt: usize,
    /// The tokens sampled so far (all but the last have been fed to the session).
    pub(super) output: Vec<u32>,
    /// Ended with a `Done` event (not an error or a cancel): its session is whole.
    pub(super) completed: bool,
    pub(super) events: UnboundedSender<Event>,
    ends: Vec<u32>,
    max_tokens: usize,
    logprobs: bool,
    generated: usize,
    pub(super) last: u32,
    /// Output bytes not yet whole characters (plain completions).
    pending: Vec<u8>,
    /// In a verify pass ([`Sequence::begin_verify`]), and how it ended there if it did.
    verifying: bool,
    held_finish: Option<&'static str>,
    pub(super) finished: bool,
    log_id: Option<String>,
    submitted: Instant,
    admitted: Instant,
    prefilled: Option<Instant>,
    /// When its last token was sampled (for the inter-token latency).
    last_token_at: Option<Instant>,
    /// Fault injection (tests): panic in sampling once this many tokens are generated.
    pub(super) panic_at: Option<usize>,
    /// Test hook ([`super::config::EngineConfig::scripted_answers`]): tokens forced before sampling.
    pub(super) script: std::collections::VecDeque<u32>,
    /// `--load-state` / `--save-state` of the one-shot run.
    pub(super) state: StateFiles,
    /// Its output constraint (structured outputs), if any.
    constraint: Option<Constrained>,
    /// A JSON answer's text so far, for closing it when `max_tokens` is about to cut it.
    closer: Option<JsonCloser>,
    /// Whether the request lets drafted tokens be verified for it (`"speculative"`); an
    /// output constraint rules it out (its masks are made one token at a time).
    pub(super) speculative: bool,
    /// Its drafting state, when it speculates.
    pub(super) drafting: Option<Drafting>,
    /// Forward passes that gave it tokens after the first (decode steps, verify passes).
    passes: usize,
}

impl Sequence {
    /// A job in flight; `mask_limit` bounds each token's mask when its output is constrained.
    pub(super) fn new(
        job: Job,
        model: &Model<'_>,
        tokenizer: &Tokenizer,
        ends: &[u32],
        mask_limit: std::time::Duration,
    ) -> Self {
        let Job {
            request,
            prompt_ids,
            system_tokens,
            cache_namespace,
            events,
            log_id,
            submitted,
            state,
            grammar,
        } = job;
        let parser = match &request.prompt {
            Prompt::Chat {
                thinking,
                tool_calls,
                ..
            } => OutputParser::new(tokenizer, *thinking).map(|parser| {
                if *tool_calls {
                    parser
                } else {
                    parser.calls_as_text()
                }
            }),
            Prompt::Text(_) | Prompt::Tokens(_) => None,
        };
        Self {
            session: model.session(),
            sampler: Sampler::new(request.sampling.clone(), &prompt_ids),
            parser,
            reasoning: Channel {
                stops: StopStrings::new(request.stop.clone()),
                held: String::new(),
            },
            content: Channel {
                stops: StopStrings::new(request.stop.clone()),
                held: String::new(),
            },
            prompt: prompt_ids,
            system_tokens,
            cache_namespace,
            cached_tokens: 0,
            fed_prompt: 0,
            output: Vec::new(),
            completed: false,
            events,
            ends: ends.iter().chain(&request.stop_tokens).copied().collect(),
            max_tokens: request.max_tokens,
            logprobs: request.logprobs,
            generated: 0,
            last: 0,
            pending: Vec::new(),
            verifying: false,
            held_finish: None,
            finished: false,
            log_id,
            submitted,
            admitted: Instant::now(),
            prefilled: None,
            last_token_at: None,
            panic_at: None,
            script: Default::default(),
            state,
            constraint: grammar.map(|g| Constrained::new(&g, mask_limit)),
            closer: request
                .constraint
                .as_ref()
                .filter(|c| matches!(c.spec, Spec::JsonObject | Spec::JsonSchema(_)))
                .map(|_| JsonCloser::default()),
            speculative: request.speculative && request.constraint.is_none(),
            drafting: None,
            passes: 0,
        }
    }

    pub(super) fn fail(&mut self, message: &str) {
        // An error ends it, whatever end a verify pass held: not a complete answer.
        (self.verifying, self.held_finish, self.completed) = (false, None, false);
        let _ = self.events.send(Event::Error(message.to_owned()));
        self.log_end("error");
        self.finished = true;
    }

    /// The request's one log line (see [`Job::log_id`]).
    fn log_end(&self, how: &str) {
        let Some(id) = &self.log_id else { return };
        let ttft = self.prefilled.map_or("none".to_owned(), |t| {
            format!("{:.3} s", (t - self.submitted).as_secs_f64())
        });
        let rate = match self.prefilled {
            // The first token comes with the prefill; the rest are decode steps.
            Some(t) if self.generated > 1 => format!(
                "{:.2} tokens/s",
                (self.generated - 1) as f64 / t.elapsed().as_secs_f64().max(1e-9)
            ),
            _ => "no decode steps".to_owned(),
        };
        let speculation = match &self.drafting {
            Some(d) => format!(
                ", speculation: {}/{} drafted tokens accepted in {} verify passes",
                d.accepted, d.drafted, d.passes
            ),
            None => String::new(),
        };
        let constrained = match &self.constraint {
            Some(c) => format!(
                ", constrained: {:.3} ms of mask per token ({:.3} ms waited in steps)",
                c.mask_time().unwrap_or_default().as_secs_f64() * 1e3 / c.masks.max(1) as f64,
                c.waited.as_secs_f64() * 1e3 / c.masks.max(1) as f64,
            ),
            None => String::new(),
        };
        log::info!(
            "{id}: {how}; {} prompt tokens ({} cached), {} output tokens, time to first token {ttft}, {rate}{constrained}{speculation}",
            self.prompt.len(),
            self.cached_tokens,
            self.generated,
        );
    }

    fn finish(&mut self, reason: &'static str) {
        self.finished = true;
        self.completed = true;
        // Inside a verify pass the pass's drafts are not counted yet: the end (its log line
        // and its `Done`) waits for [`Sequence::end_verify`], so both include them.
        if self.verifying {
            self.held_finish = Some(reason);
        } else {
            self.send_finish(reason);
        }
    }

    /// The request's end: its log line, then its `Done` event.
    fn send_finish(&mut self, reason: &'static str) {
        self.log_end(reason);
        let prefilled = self.prefilled.unwrap_or(self.admitted);
        let _ = self.events.send(Event::Done {
            finish_reason: reason,
            prompt_tokens: self.prompt.len(),
            completion_tokens: self.generated,
            cached_tokens: self.cached_tokens,
            prefill: prefilled - self.admitted,
            decode: prefilled.elapsed(),
            passes: self.passes,
        });
    }

    /// A verify pass begins: an end inside it is held until [`Sequence::end_verify`].
    pub(super) fn begin_verify(&mut self) {
        self.verifying = true;
    }

    /// The verify pass's drafts are counted: an end held during it goes out now.
    pub(super) fn end_verify(&mut self) {
        self.verifying = false;
        if let Some(reason) = self.held_finish.take() {
            self.send_finish(reason);
        }
    }

    /// Tokens it may still generate after its next one: drafts beyond would be wasted.
    pub(super) fn room(&self) -> usize {
        self.max_tokens.saturating_sub(self.generated + 1)
    }

    /// Counts a forward pass that gave it tokens after its first.
    pub(super) fn count_pass(&mut self) {
        if self.generated > 0 {
            self.passes += 1;
        }
    }

    /// How long it waited in the queue before admission.
    pub(super) fn queue_wait(&self) -> std::time::Duration {
        self.admitted - self.submitted
    }

    /// Ends it if its client has gone away (checked at each step boundary, so a prefill
    /// stops at the next one, and before sampling); true if it has ended.
    pub(super) fn cancel_if_gone(&mut self) -> bool {
        if !self.finished && self.events.is_closed() {
            self.log_end("cancelled (the client went away)");
            self.finished = true;
        }
        self.finished
    }

    /// The tokens fed to the session: the prompt and every output token but the last.
    pub(super) fn fed(&self) -> Vec<usize> {
        let output = &self.output[..self.output.len().saturating_sub(1)];
        self.prompt
            .iter()
            .chain(output)
            .map(|&t| t as usize)
            .collect()
    }

    /// Samples the next token from `logits` and sends what it adds.
    pub(super) fn advance(&mut self, logits: &[f32], tokenizer: &Tokenizer, metrics: &Metrics) {
        if self.cancel_if_gone() {
            return;
        }
        let now = Instant::now();
        match self.last_token_at {
            None => metrics.ttft.observe(now - self.submitted),
            Some(then) => metrics.itl.observe(now - then),
        }
        self.last_token_at = Some(now);
        self.prefilled.get_or_insert(now);
        if self.panic_at == Some(self.generated) {
            panic!("injected fault after {} tokens", self.generated);
        }
        // NaN logits sample as token 0, silently, token after token: broken weights or a
        // config that does not fit them. The request fails instead, saying so.
        if let Some(id) = logits.iter().position(|l| l.is_nan()) {
            return self.fail(&format!(
                "the model's logits are NaN (token {id} after {} output tokens): the weights \
                 or the config are broken (`--scan` reads every weight at startup)",
                self.generated
            ));
        }
        let mask = match self.constraint.as_mut().map(Constrained::mask).transpose() {
            Ok(mask) => mask,
            Err(e) => return self.fail(&e),
        };
        if let Some(mask) = &mask {
            metrics.masks.fetch_add(1, Ordering::Relaxed);
            let ns = u64::try_from(mask.took.as_nanos()).unwrap_or(u64::MAX);
            metrics.mask_ns.fetch_add(ns, Ordering::Relaxed);
        }
        let closing = mask.as_ref().and_then(|m| {
            let left = self.max_tokens.saturating_sub(self.generated);
            closing_token(self.closer.as_ref()?, left, m.words, tokenizer)
        });
        let sampled = match self.script.pop_front().or(closing) {
            Some(token) => forced(logits, token),
            None => self
                .sampler
                .sample_masked(logits, mask.as_ref().map(|m| m.words)),
        };
        if let Some(constraint) = &mut self.constraint {
            // No next mask after the last token this request may take.
            let more = !self.ends.contains(&sampled.token) && self.generated + 1 < self.max_tokens;
            if let Err(e) = constraint.commit(sampled.token, more) {
                return self.fail(&e);
            }
        }
        self.generated += 1;
        self.last = sampled.token;
        self.output.push(sampled.token);
        if let Some(drafting) = &mut self.drafting {
            drafting.push(sampled.token);
        }
        metrics.generated_tokens.fetch_add(1, Ordering::Relaxed);
        let logprobs = if self.logprobs {
            let of = |&(id, logprob): &(u32, f32)| TopLogprob::of(tokenizer, id, logprob);
            let chosen = of(&(sampled.token, sampled.logprob));
            vec![TokenLogprob {
                token: chosen.token,
                bytes: chosen.bytes,
                logprob: chosen.logprob,
                top: sampled.top.iter().map(of).collect(),
            }]
        } else {
            Vec::new()
        };
        if self.ends.contains(&sampled.token) {
            self.end_text(logprobs);
            return self.finish("stop");
        }
        let bytes = tokenizer.decode_bytes(&[sampled.token]);
        let deltas = match &mut self.parser {
            Some(parser) => parser.push(sampled.token, &bytes),
            None => {
                self.pending.extend_from_slice(&bytes);
                vec![Delta::Content(take_text(&mut self.pending, false))]
            }
        };
        if self.emit(deltas, logprobs) {
            self.finish("stop");
        } else if self.generated >= self.max_tokens {
            self.end_text(Vec::new());
            self.finish("length");
        }
    }

    /// The output ends (not by a stop string): the text held back for whole characters goes
    /// out (an incomplete character as U+FFFD) with `logprobs` (the last token's), then the
    /// text held for a stop string that can no longer complete.
    fn end_text(&mut self, logprobs: Vec<TokenLogprob>) {
        let tail = self.text_tail();
        if !self.emit(tail, logprobs) {
            self.flush_held();
        }
    }

    /// What the output parser (or, without one, the plain text) still holds when generation
    /// ends: a character cut by the last token as U+FFFD, a marker's text left open.
    fn text_tail(&mut self) -> Vec<Delta> {
        match &mut self.parser {
            Some(parser) => parser.finish(),
            None if self.pending.is_empty() => Vec::new(),
            None => vec![Delta::Content(take_text(&mut self.pending, true))],
        }
    }

    /// Sends `deltas` (with `logprobs`) through the stop strings as one event; true when a
    /// stop string ended the output.
    fn emit(&mut self, deltas: Vec<Delta>, logprobs: Vec<TokenLogprob>) -> bool {
        // Stop strings apply to reasoning and content alike, each on its own (a stop does not
        // span the switch from one to the other): cut at the first, hold back a possible start.
        let (mut reasoning, mut content, mut tool_calls) =
            (String::new(), String::new(), Vec::new());
        let mut stop = false;
        for delta in deltas {
            stop = match delta {
                Delta::Reasoning(t) => {
                    self.content.flush(&mut content);
                    self.reasoning.push(&t, &mut reasoning)
                }
                Delta::Content(t) => {
                    if let Some(closer) = &mut self.closer {
                        closer.push(&t);
                    }
                    self.reasoning.flush(&mut reasoning);
                    self.content.push(&t, &mut content)
                }
                Delta::ToolCall(c) => {
                    tool_calls.push(c);
                    false
                }
            };
            if stop {
                break;
            }
        }
        if !(reasoning.is_empty()
            && content.is_empty()
            && tool_calls.is_empty()
            && logprobs.is_empty())
        {
            let _ = self.events.send(Event::Delta {
                reasoning,
                content,
                tool_calls,
                logprobs,
            });
        }
        stop
    }

    fn flush_held(&mut self) {
        let (mut reasoning, mut content) = (String::new(), String::new());
        self.reasoning.flush(&mut reasoning);
        self.content.flush(&mut content);
        if !reasoning.is_empty() || !content.is_empty() {
            let _ = self.events.send(Event::Delta {
                reasoning,
                content,
                tool_calls: Vec::new(),
                logprobs: Vec::new(),
            });
        }
    }
}

/// More tokens than [`ANSWER_TRAILER`] and the end token take with any tokenizer whose
/// markers are special tokens (the words may be split into letters).
const CLOSING_TRAILER_MAX: usize = 24;

/// With `left` tokens of `max_tokens` left, inside a JSON answer: the first token of the
/// shortest text that completes the JSON ([`JsonCloser`]) when the constraint allows it, so
/// the answer closes instead of being cut, with room kept for the markup after the answer
/// and the end token.
fn closing_token(
    closer: &JsonCloser,
    left: usize,
    allowed: &[u32],
    tokenizer: &Tokenizer,
) -> Option<u32> {
    let suffix = closer.suffix()?;
    // Each byte of the suffix is a token at most; the markup after the answer is what it
    // encodes to, and the end token one more.
    if suffix.is_empty() || left > suffix.len() + CLOSING_TRAILER_MAX {
        return None;
    }
    let trailer = tokenizer.encode(ANSWER_TRAILER, true).len() + 1;
    if left > suffix.len() + trailer {
        return None;
    }
    let token = *tokenizer.encode(&suffix, false).first()?;
    let word = allowed.get(token as usize / 32)?;
    (word >> (token % 32) & 1 == 1).then_some(token)
}

/// `token` as if sampled from `logits`: its log-probability under them (log-softmax), no
/// alternatives.
fn forced(logits: &[f32], token: u32) -> k3_model::sampling::Sampled {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let logit = logits
        .get(token as usize)
        .copied()
        .unwrap_or(f32::NEG_INFINITY);
    k3_model::sampling::Sampled {
        token,
        logprob: (f64::from(logit - max) - sum.ln()) as f32,
        top: Vec::new(),
    }
}
