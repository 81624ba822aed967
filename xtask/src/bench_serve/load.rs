//! The three measurements against one running server: the load (N clients and a long prompt
//! arriving mid-run), interference (decoding streams while a long prompt prefills) and pair
//! prefill (two long prompts together versus each alone). Each returns its numbers; the
//! caller starts the servers and prints.
//!
//! Every prompt is a different text (its seed), and the same seeds go to both engines, so
//! both see the same prompts and no request finds another's prefix in a cache. Lengths are
//! in the checkpoint's tokens (see [`Prompts`]).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use k3_model::tokenizer::Tokenizer;
use k3_testkit::Rng;

use super::client::{Progress, Trace, stream_chat};

/// The normal clients' prompt lengths in tokens, cycled.
pub(super) const PROMPT_TOKENS: [usize; 3] = [32, 128, 512];
/// Interference: each stream's tokens before the long prompt is sent,
const BEFORE_TOKENS: usize = 40;
/// and after its first token (then the streams are dropped).
const AFTER_TOKENS: usize = 10;
/// Tokens asked of a long prompt: its first is what is timed.
pub(super) const LONG_MAX_TOKENS: usize = 4;
/// How often a coordinating thread looks at the requests' progress.
const POLL: Duration = Duration::from_millis(2);

/// Seeds of the prompt texts by role, so no two requests of a run share one.
const SEED_NORMAL: u64 = 1 << 32;
const SEED_LONG: u64 = 2 << 32;
const SEED_STREAM: u64 = 3 << 32;

/// The load: `clients` clients each sending `requests` requests back to back.
#[derive(Debug, Clone, Copy)]
pub(super) struct LoadSpec {
    pub(super) clients: usize,
    pub(super) requests: usize,
    pub(super) max_tokens: usize,
    /// The long prompt's tokens; it is sent once half the normal requests have finished.
    pub(super) long_tokens: usize,
}

/// What one load run measured.
#[derive(Debug)]
pub(super) struct LoadResult {
    pub(super) wall: Duration,
    pub(super) normal: Vec<Trace>,
    pub(super) long: Trace,
}

/// Runs the load against `addr`.
pub(super) fn load(addr: SocketAddr, spec: LoadSpec, prompts: &Prompts) -> Result<LoadResult> {
    let finished = AtomicUsize::new(0);
    let half = (spec.clients * spec.requests).div_ceil(2);
    let started = Instant::now();
    let (normal, long) = thread::scope(|s| {
        let clients: Vec<_> = (0..spec.clients)
            .map(|client| {
                let finished = &finished;
                s.spawn(move || -> Result<Vec<Trace>> {
                    let mut traces = Vec::new();
                    for request in 0..spec.requests {
                        let tokens = PROMPT_TOKENS[(client + request) % PROMPT_TOKENS.len()];
                        let seed = SEED_NORMAL + (client * spec.requests + request) as u64;
                        let text = prompts.text(seed, tokens);
                        let trace = stream_chat(addr, &text, spec.max_tokens, &Progress::default());
                        // A failed client counts its remaining requests as finished, so that
                        // the long prompt is not left waiting for them.
                        let done = if trace.is_ok() {
                            1
                        } else {
                            spec.requests - request
                        };
                        finished.fetch_add(done, Ordering::AcqRel);
                        traces.push(trace?);
                    }
                    Ok(traces)
                })
            })
            .collect();
        let long = s.spawn(|| {
            while finished.load(Ordering::Acquire) < half {
                thread::sleep(POLL);
            }
            let text = prompts.text(SEED_LONG, spec.long_tokens);
            stream_chat(addr, &text, LONG_MAX_TOKENS, &Progress::default())
        });
        let mut normal = Vec::new();
        for client in clients {
            normal.extend(client.join().expect("a client thread panicked")?);
        }
        let long = long.join().expect("the long client panicked")?;
        anyhow::Ok((normal, long))
    })?;
    Ok(LoadResult {
        wall: started.elapsed(),
        normal,
        long,
    })
}

/// What one interference run measured.
#[derive(Debug)]
pub(super) struct InterferenceResult {
    /// The streams' gaps that ended before the long prompt was sent,
    pub(super) before: Vec<Duration>,
    /// and those overlapping its prefill (its send to its first token).
    pub(super) during: Vec<Duration>,
    /// The long prompt's TTFT with the streams running, and its prompt tokens.
    pub(super) loaded: Trace,
    /// A different prompt of the same length on the idle server.
    pub(super) idle: Trace,
    /// Streams that were still running when the long prompt was sent.
    pub(super) streams_alive: usize,
}

/// `streams` streams decode (`stream_tokens` asked of each); after [`BEFORE_TOKENS`] each, a
/// prompt of `long_tokens` arrives; the streams are dropped [`AFTER_TOKENS`] after its first
/// token, and a second long prompt is timed on the idle server.
pub(super) fn interference(
    addr: SocketAddr,
    streams: usize,
    stream_tokens: usize,
    long_tokens: usize,
    prompts: &Prompts,
) -> Result<InterferenceResult> {
    let progress: Vec<Progress> = (0..streams).map(|_| Progress::default()).collect();
    let long_progress = Progress::default();
    let (traces, loaded, long_sent) = thread::scope(|s| {
        let handles: Vec<_> = progress
            .iter()
            .enumerate()
            .map(|(i, progress)| {
                let text = prompts.text(SEED_STREAM + i as u64, PROMPT_TOKENS[0]);
                s.spawn(move || stream_chat(addr, &text, stream_tokens, progress))
            })
            .collect();
        // Until each stream has read its target's tokens, or ended.
        let all_reach = |targets: &[usize]| {
            while progress
                .iter()
                .zip(targets)
                .any(|(p, &n)| p.tokens_or_end() < n)
            {
                thread::sleep(POLL);
            }
        };
        all_reach(&vec![BEFORE_TOKENS; streams]);
        let long_sent = Instant::now();
        let long = s.spawn(|| {
            let text = prompts.text(SEED_LONG, long_tokens);
            stream_chat(addr, &text, LONG_MAX_TOKENS, &long_progress)
        });
        while long_progress.tokens_or_end() < 1 {
            thread::sleep(POLL);
        }
        let targets: Vec<usize> = progress
            .iter()
            .map(|p| p.tokens.load(Ordering::Acquire) + AFTER_TOKENS)
            .collect();
        all_reach(&targets);
        for p in &progress {
            p.stop.store(true, Ordering::Release);
        }
        let traces = handles
            .into_iter()
            .map(|h| h.join().expect("a stream thread panicked"))
            .collect::<Result<Vec<Trace>>>()?;
        let loaded = long.join().expect("the long client panicked")?;
        anyhow::Ok((traces, loaded, long_sent))
    })?;
    let first = loaded
        .first_token()
        .context("the long prompt streamed no token")?;
    // "Before" is the streams' steady decoding: from the moment every stream has its first
    // token (until then a stream's gaps include the others' prefills) to the long prompt.
    let all_decoding = traces
        .iter()
        .filter_map(|t| t.first_token())
        .max()
        .context("a stream streamed no token")?;
    let (mut before, mut during) = (Vec::new(), Vec::new());
    for trace in &traces {
        for (gap, end) in trace.gaps() {
            if end <= long_sent {
                if end - gap >= all_decoding {
                    before.push(gap);
                }
            } else if end - gap < first {
                during.push(gap);
            }
        }
    }
    let streams_alive = traces
        .iter()
        .filter(|t| t.tokens.last().is_some_and(|&t| t > long_sent))
        .count();
    // The dropped streams' cancellation reaches the engine at its next step.
    thread::sleep(Duration::from_secs(1));
    let text = prompts.text(SEED_LONG + 1, long_tokens);
    let idle = stream_chat(addr, &text, LONG_MAX_TOKENS, &Progress::default())?;
    Ok(InterferenceResult {
        before,
        during,
        loaded,
        idle,
        streams_alive,
    })
}

/// What one pair-prefill run measured.
#[derive(Debug)]
pub(super) struct PairResult {
    /// From sending both prompts together until both have their first token.
    pub(super) together: Duration,
    /// Each of two other prompts' TTFT, sent alone on the idle server.
    pub(super) alone: [Duration; 2],
    /// The prompts' tokens (the first's usage).
    pub(super) prompt_tokens: Option<u64>,
}

/// Two different prompts of `long_tokens` sent together, then two more each alone.
pub(super) fn pair_prefill(
    addr: SocketAddr,
    long_tokens: usize,
    prompts: &Prompts,
) -> Result<PairResult> {
    let texts: Vec<String> = (0..4)
        .map(|i| prompts.text(SEED_LONG + 10 + i, long_tokens))
        .collect();
    let sent = Instant::now();
    let pair = thread::scope(|s| {
        let handles: Vec<_> = texts[..2]
            .iter()
            .map(|text| s.spawn(|| stream_chat(addr, text, 1, &Progress::default())))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a client thread panicked"))
            .collect::<Result<Vec<Trace>>>()
    })?;
    let firsts = pair
        .iter()
        .map(Trace::first_token)
        .collect::<Option<Vec<Instant>>>()
        .context("a prompt of the pair streamed no token")?;
    let together = *firsts.iter().max().expect("two prompts") - sent;
    let mut alone = [Duration::ZERO; 2];
    for (slot, text) in alone.iter_mut().zip(&texts[2..]) {
        let trace = stream_chat(addr, text, 1, &Progress::default())?;
        *slot = trace
            .ttft()
            .context("a prompt sent alone streamed no token")?;
    }
    Ok(PairResult {
        together,
        alone,
        prompt_tokens: pair[0].usage.map(|u| u.0),
    })
}

/// Everyday words, the texts' vocabulary.
const WORDS: [&str; 48] = [
    "the", "engine", "reads", "every", "weight", "once", "per", "token", "so", "speed", "of", "a",
    "step", "is", "memory", "kernel", "that", "waits", "on", "bytes", "we", "measure", "each",
    "one", "against", "plain", "sum", "over", "buffer", "far", "larger", "than", "cache", "and",
    "write", "ratio", "down", "experts", "are", "small", "matrices", "with", "scale", "for",
    "values", "routing", "picks", "layer",
];

/// Prompt texts of a given length in the checkpoint's tokens: words each with a leading space,
/// so that the pre-tokenizer splits the text word by word and its tokens are the sum of the
/// words' (a word costs one token in K3's vocabulary, several in a small synthetic one).
#[derive(Debug)]
pub(super) struct Prompts {
    /// Tokens of " word" for each of [`WORDS`].
    word_tokens: Vec<usize>,
}

impl Prompts {
    pub(super) fn new(tokenizer: &Tokenizer) -> Self {
        let word_tokens = WORDS
            .iter()
            .map(|w| tokenizer.encode(&format!(" {w}"), false).len())
            .collect();
        Self { word_tokens }
    }

    /// A text of `tokens` tokens (a few more when the last word overshoots) drawn from
    /// `seed`: a different seed gives a different text from its first words on.
    pub(super) fn text(&self, seed: u64, tokens: usize) -> String {
        let mut rng = Rng::new(seed);
        let mut text = String::with_capacity(tokens * 4);
        let mut count = 0;
        while count < tokens {
            let word = rng.below(WORDS.len());
            text.push(' ');
            text.push_str(WORDS[word]);
            count += self.word_tokens[word];
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_texts_have_their_token_length_and_differ_by_seed() {
        use k3_model::synth::tokenizer::{learn_bpe, tiktoken_model, tokenizer_config};
        let scratch = k3_testkit::Scratch::new("bench-serve-prompts");
        let vocab = learn_bpe(1024 - 256);
        std::fs::write(
            scratch.path().join("tiktoken.model"),
            tiktoken_model(&vocab),
        )
        .unwrap();
        let config = tokenizer_config(1024).to_string();
        std::fs::write(scratch.path().join("tokenizer_config.json"), config).unwrap();
        let tokenizer = Tokenizer::from_dir(scratch.path()).unwrap();
        let prompts = Prompts::new(&tokenizer);
        for (seed, tokens) in [(1, 32), (2, 512), (3, 2000)] {
            let text = prompts.text(seed, tokens);
            let encoded = tokenizer.encode(&text, false).len();
            // At most the last word's tokens past the target.
            assert!(
                (tokens..tokens + 8).contains(&encoded),
                "{encoded} for {tokens}"
            );
        }
        let (a, b) = (
            prompts.text(SEED_LONG, 100),
            prompts.text(SEED_LONG + 1, 100),
        );
        assert_eq!(a, prompts.text(SEED_LONG, 100));
        let shared = a
            .split_whitespace()
            .zip(b.split_whitespace())
            .take_while(|(x, y)| x == y)
            .count();
        assert!(shared < 4, "{shared} words in common at the start");
    }
}
