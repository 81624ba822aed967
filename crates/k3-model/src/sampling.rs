//! Choosing the next token from logits: greedy, temperature, top-k, top-p, min-p, repetition /
//! presence / frequency penalties, logit bias, a seed (the same seed, logits and history give
//! the same token), log-probabilities with the top alternatives; and stop strings matched
//! incrementally over streamed text.
//!
//! Order: a mask of allowed tokens (a grammar's; the rest become -inf), penalties, then the
//! logit bias, on the logits; log-probabilities of that
//! distribution (temperature 1, as OpenAI reports them); then temperature, top-k, top-p,
//! min-p, and a draw. Arithmetic is f64 over the logits in id order, ties go to the lower id,
//! so nothing depends on threads.

use std::collections::HashMap;
use std::sync::Arc;

/// Sampling settings (OpenAI's names and neutral values).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0: greedy.
    pub temperature: f32,
    /// 0: off.
    pub top_k: usize,
    /// 1: off.
    pub top_p: f32,
    /// 0: off. Keeps tokens with probability >= `min_p` x the top token's.
    pub min_p: f32,
    /// 1: off. HF's form: a seen token's positive logit is divided by it, a negative one
    /// multiplied (prompt and output count as seen).
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token the output already holds.
    pub presence_penalty: f32,
    /// Subtracted per occurrence in the output.
    pub frequency_penalty: f32,
    /// Seed of the random draws: the same seed, logits and history give the same token.
    pub seed: u64,
    /// Log-probabilities of this many top alternatives (0: only the chosen token's).
    pub top_logprobs: usize,
    /// Added to the logits of these token ids (OpenAI's `logit_bias`, each in [-100, 100]);
    /// ids outside the logits are skipped (the server refuses them before they get here).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
            top_logprobs: 0,
            logit_bias: Vec::new(),
        }
    }
}

/// A value out of range, named.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{name} must be {range}, got {value}")]
pub struct ParamError {
    /// The parameter, as OpenAI names it.
    pub name: &'static str,
    /// The values it takes, in words (`in [0, 2]`).
    pub range: &'static str,
    /// The value given.
    pub value: f64,
}

impl SamplingParams {
    /// Checks every value against its range (what a server answers 400 for).
    pub fn validate(&self) -> Result<(), ParamError> {
        let check = |name, ok: bool, range, value: f32| {
            if ok {
                Ok(())
            } else {
                Err(ParamError {
                    name,
                    range,
                    value: f64::from(value),
                })
            }
        };
        let t = self.temperature;
        check(
            "temperature",
            t.is_finite() && (0.0..=2.0).contains(&t),
            "in [0, 2]",
            t,
        )?;
        let p = self.top_p;
        check(
            "top_p",
            p.is_finite() && p > 0.0 && p <= 1.0,
            "in (0, 1]",
            p,
        )?;
        let m = self.min_p;
        check(
            "min_p",
            m.is_finite() && (0.0..=1.0).contains(&m),
            "in [0, 1]",
            m,
        )?;
        let r = self.repetition_penalty;
        check(
            "repetition_penalty",
            r.is_finite() && r > 0.0,
            "positive",
            r,
        )?;
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            check(
                name,
                v.is_finite() && (-2.0..=2.0).contains(&v),
                "in [-2, 2]",
                v,
            )?;
        }
        for &(_, bias) in &self.logit_bias {
            check(
                "logit_bias",
                bias.is_finite() && (-100.0..=100.0).contains(&bias),
                "in [-100, 100]",
                bias,
            )?;
        }
        if self.top_logprobs > 20 {
            return Err(ParamError {
                name: "top_logprobs",
                range: "at most 20",
                value: self.top_logprobs as f64,
            });
        }
        Ok(())
    }
}

/// The chosen token and its log-probability, with the top alternatives when asked.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    /// The token id chosen.
    pub token: u32,
    /// Its natural-log probability under the penalised, biased logits at temperature 1.
    pub logprob: f32,
    /// The `top_logprobs` likeliest tokens with their log-probabilities, likeliest first (ties to
    /// the lower id); empty when none were asked for.
    pub top: Vec<(u32, f32)>,
}

/// One sequence's sampler: its settings, random state and token counts.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: u64,
    /// Occurrences in the output (presence and frequency penalties).
    output_counts: HashMap<u32, u32>,
    /// Tokens of prompt and output (repetition penalty).
    seen: std::collections::HashSet<u32>,
}

impl Sampler {
    /// A sampler with `params`, its random state from `params.seed`, counting `prompt` as seen for
    /// the repetition penalty.
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        Self {
            rng: params.seed,
            params,
            output_counts: HashMap::new(),
            seen: prompt.iter().copied().collect(),
        }
    }

    /// Chooses the next token and records it.
    ///
    /// # Panics
    /// If `logits` is empty (there is nothing to choose from: a caller bug, e.g. sampling
    /// after a prefill of no tokens).
    pub fn sample(&mut self, logits: &[f32]) -> Sampled {
        self.sample_masked(logits, None)
    }

    /// [`Self::sample`] among the tokens `allowed` permits (a bitset: bit `i % 32` of word
    /// `i / 32` set for an allowed id `i`; ids past its end are not allowed), e.g. a grammar's
    /// mask. The rest get -inf before the penalties, so neither greedy nor a draw can choose
    /// them, and the log-probabilities (and top alternatives) are over the allowed tokens.
    /// `None`, or a mask allowing every id, gives the same token, random stream and
    /// log-probabilities as [`Self::sample`] bit for bit.
    ///
    /// # Panics
    /// If `logits` is empty, or `allowed` allows none of its ids (a caller bug: a grammar's
    /// mask is never empty).
    pub fn sample_masked(&mut self, logits: &[f32], allowed: Option<&[u32]>) -> Sampled {
        assert!(!logits.is_empty(), "sampling from an empty set of logits");
        let p = self.params.clone();
        let mut z: Vec<f64> = logits.iter().map(|&l| f64::from(l)).collect();
        // The ids that may be chosen, in id order (all of them without a mask).
        let ids: Vec<usize> = match allowed {
            None => (0..z.len()).collect(),
            Some(words) => {
                let allows = |i: usize| words.get(i / 32).is_some_and(|w| w >> (i % 32) & 1 == 1);
                let mut ids = Vec::with_capacity(z.len());
                for (i, l) in z.iter_mut().enumerate() {
                    if allows(i) {
                        ids.push(i);
                    } else {
                        *l = f64::NEG_INFINITY;
                    }
                }
                assert!(!ids.is_empty(), "the mask allows none of the logits' ids");
                ids
            }
        };
        if p.repetition_penalty != 1.0 {
            let r = f64::from(p.repetition_penalty);
            for &t in &self.seen {
                if let Some(l) = z.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / r } else { *l * r };
                }
            }
        }
        for (&t, &n) in &self.output_counts {
            if let Some(l) = z.get_mut(t as usize) {
                *l -= f64::from(p.presence_penalty) + f64::from(p.frequency_penalty) * f64::from(n);
            }
        }
        for &(t, bias) in &p.logit_bias {
            if let Some(l) = z.get_mut(t as usize) {
                *l += f64::from(bias);
            }
        }
        // One pass for the log-sum-exp (a vocabulary of exps, so only one).
        let log_sum = log_sum_exp(&z);
        let token = if p.temperature == 0.0 {
            ids[argmax(&z, &ids)] as u32
        } else {
            self.draw(&z, ids.clone(), &p)
        };
        let mut top: Vec<(u32, f32)> = Vec::new();
        if p.top_logprobs > 0 {
            let mut order = ids;
            let n = p.top_logprobs.min(order.len());
            order.select_nth_unstable_by(n.saturating_sub(1), |&a, &b| by_value(&z, a, b));
            order.truncate(n);
            order.sort_by(|&a, &b| by_value(&z, a, b));
            top = order
                .into_iter()
                .map(|i| (i as u32, (z[i] - log_sum) as f32))
                .collect();
        }
        self.observe(token);
        Sampled {
            token,
            logprob: (z[token as usize] - log_sum) as f32,
            top,
        }
    }

    fn observe(&mut self, token: u32) {
        *self.output_counts.entry(token).or_default() += 1;
        self.seen.insert(token);
    }

    /// A draw among `order` (ids in id order).
    fn draw(&mut self, z: &[f64], mut order: Vec<usize>, p: &SamplingParams) -> u32 {
        let t = f64::from(p.temperature);
        if p.top_k > 0 && p.top_k < order.len() {
            // The k largest, then sorted: no full sort of the vocabulary.
            order.select_nth_unstable_by(p.top_k - 1, |&a, &b| by_value(z, a, b));
            order.truncate(p.top_k);
        }
        if p.top_k > 0 || p.top_p < 1.0 || p.min_p > 0.0 {
            order.sort_by(|&a, &b| by_value(z, a, b));
        } else {
            // No filter: draw over ids in order; only the maximum needs finding.
            let top = argmax(z, &order);
            order.swap(0, top);
        }
        let max = z[order[0]] / t;
        // f64's own `exp` on purpose: the sampler works in f64 (module docs) and `vmath::exp`
        // is the forward pass's f32 function; the logits are fixed bits by now, so this can
        // move a seeded draw across a probability boundary at most, never a logit.
        let mut probs: Vec<f64> = order.iter().map(|&i| (z[i] / t - max).exp()).collect();
        let sum: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= sum);
        // Nucleus: the shortest prefix (by probability) reaching top_p.
        if p.top_p < 1.0 {
            let mut cumulative = 0.0;
            let keep = probs
                .iter()
                .position(|&q| {
                    cumulative += q;
                    cumulative >= f64::from(p.top_p)
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
        }
        if p.min_p > 0.0 {
            let floor = probs[0] * f64::from(p.min_p);
            let keep = probs.iter().take_while(|&&q| q >= floor).count().max(1);
            probs.truncate(keep);
        }
        let total: f64 = probs.iter().sum();
        let u = self.uniform() * total;
        let mut acc = 0.0;
        for (k, &q) in probs.iter().enumerate() {
            acc += q;
            if u < acc {
                return order[k] as u32;
            }
        }
        order[probs.len() - 1] as u32
    }

    /// A uniform draw in [0, 1) from SplitMix64 (53 bits).
    fn uniform(&mut self) -> f64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut x = self.rng;
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^= x >> 31;
        (x >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Descending value, then ascending id (NaN last).
fn by_value(z: &[f64], a: usize, b: usize) -> std::cmp::Ordering {
    z[b].total_cmp(&z[a]).then(a.cmp(&b))
}

/// The position in `ids` of the largest value (the lower id on ties).
fn argmax(z: &[f64], ids: &[usize]) -> usize {
    (0..ids.len())
        .min_by(|&a, &b| by_value(z, ids[a], ids[b]))
        .unwrap_or(0)
}

fn log_sum_exp(z: &[f64]) -> f64 {
    let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    z.iter().map(|&l| (l - max).exp()).sum::<f64>().ln() + max
}

/// Stop strings matched incrementally over streamed text: an Aho–Corasick automaton over
/// the stops' bytes, fed each piece of text as it comes. A pushed byte costs amortised O(1)
/// whatever the stops' lengths, and the text that could still become a stop (to hold back from
/// the client) is the automaton's depth, so nothing is rescanned.
///
/// The stop found is the first to end; of those ending at the same byte, the longest (the one
/// that starts first). That does not depend on how the text was split into pieces.
#[derive(Debug, Clone)]
pub struct StopStrings {
    nodes: Arc<[StopNode]>,
    state: u32,
}

#[derive(Debug, Clone, Default)]
struct StopNode {
    /// Trie edges, sorted by byte.
    next: Vec<(u8, u32)>,
    /// The longest proper suffix of this node's string that is a trie node.
    fail: u32,
    /// This node's string's length.
    depth: u32,
    /// The length of the longest stop that is a suffix of this node's string (0: none).
    out: u32,
}

impl StopNode {
    fn edge(&self, byte: u8) -> Option<u32> {
        self.next
            .binary_search_by_key(&byte, |&(b, _)| b)
            .ok()
            .map(|i| self.next[i].1)
    }
}

impl Default for StopStrings {
    fn default() -> Self {
        Self::new(Vec::new())
    }
}

impl StopStrings {
    /// The automaton over `stops` (empty strings are ignored), at the start of the text.
    pub fn new(stops: Vec<String>) -> Self {
        let mut nodes = vec![StopNode::default()];
        for stop in stops.iter().filter(|s| !s.is_empty()) {
            let mut at = 0usize;
            for &byte in stop.as_bytes() {
                at = match nodes[at].edge(byte) {
                    Some(next) => next as usize,
                    None => {
                        let id = nodes.len() as u32;
                        let depth = nodes[at].depth + 1;
                        let slot = nodes[at].next.partition_point(|&(b, _)| b < byte);
                        nodes[at].next.insert(slot, (byte, id));
                        nodes.push(StopNode {
                            depth,
                            ..StopNode::default()
                        });
                        id as usize
                    }
                };
            }
            nodes[at].out = nodes[at].depth;
        }
        // Failure links breadth first: a node's parent is done before it.
        let mut queue = std::collections::VecDeque::from([0u32]);
        while let Some(parent) = queue.pop_front() {
            let edges = nodes[parent as usize].next.clone();
            for (byte, child) in edges {
                let fail = if parent == 0 {
                    0
                } else {
                    let mut f = nodes[parent as usize].fail;
                    loop {
                        if let Some(next) = nodes[f as usize].edge(byte) {
                            break next;
                        }
                        if f == 0 {
                            break 0;
                        }
                        f = nodes[f as usize].fail;
                    }
                };
                let c = child as usize;
                nodes[c].fail = fail;
                if nodes[c].out == 0 {
                    nodes[c].out = nodes[fail as usize].out;
                }
                queue.push_back(child);
            }
        }
        Self {
            nodes: nodes.into(),
            state: 0,
        }
    }

    /// Whether there are no stops.
    pub fn is_empty(&self) -> bool {
        self.nodes[0].next.is_empty()
    }

    /// Scans the next piece of the text. `Some((end, len))`: a stop of `len` bytes ends at
    /// byte `end` of `text` (exclusive); it may begin in earlier pieces, but never before the
    /// bytes [`Self::pending`] reported after them. The scan stops there.
    pub fn scan(&mut self, text: &str) -> Option<(usize, usize)> {
        if self.is_empty() {
            return None;
        }
        for (i, &byte) in text.as_bytes().iter().enumerate() {
            let mut state = self.state;
            self.state = loop {
                if let Some(next) = self.nodes[state as usize].edge(byte) {
                    break next;
                }
                if state == 0 {
                    break 0;
                }
                state = self.nodes[state as usize].fail;
            };
            let out = self.nodes[self.state as usize].out;
            if out > 0 {
                return Some((i + 1, out as usize));
            }
        }
        None
    }

    /// The length of the longest tail of the text scanned so far that is a proper prefix of
    /// a stop (so it must not be streamed yet). It begins on a character boundary, since a
    /// stop's first byte does.
    pub fn pending(&self) -> usize {
        self.nodes[self.state as usize].depth as usize
    }

    /// Forgets the text scanned so far (a new, separate stream).
    pub fn reset(&mut self) {
        self.state = 0;
    }
}

#[cfg(test)]
mod tests;
