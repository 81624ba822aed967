//! The cost curve: the time of a verify pass of n = 1, 2, ... tokens (one group, logits after
//! every token) from one session position, each pass taken back afterwards so the next starts
//! where it did; the sizes alternate within rounds (ascending, then descending) so a swing of
//! the machine's bandwidth hits every size alike. Beside each time, what the pass read: the
//! trunk once and every distinct routed expert its tokens chose.

use std::time::Instant;

use anyhow::{Result, ensure};
use k3_model::model::{Model, Want};
use k3_model::profile::{Bucket, Profile};

use crate::stats::{median, range};

/// What one pass size cost over the rounds.
#[derive(Debug, Clone)]
pub(crate) struct PassCost {
    /// Tokens in the pass.
    pub(crate) tokens: usize,
    /// Every timed pass's wall time, seconds.
    pub(crate) seconds: Vec<f64>,
    /// The checkpoint taken before each pass, seconds (what a verify pass adds to a step).
    pub(crate) checkpoint_seconds: Vec<f64>,
    /// Routed (layer, distinct expert) pairs the pass asked of the expert source.
    pub(crate) experts: u64,
    /// Wall time by profile bucket, summed over the timed passes.
    pub(crate) buckets: [f64; Bucket::ALL.len()],
}

impl PassCost {
    /// The median pass, seconds.
    pub(crate) fn median(&self) -> f64 {
        median(&self.seconds)
    }
}

/// Times verify passes of 1 to `feed.len()` tokens (`feed[..n]`) from `session`'s position
/// (left there afterwards): an untimed round, then `reps` timed ones. `profile` must be the
/// one `model` charges; it is reset here.
pub(crate) fn measure(
    model: &Model<'_>,
    session: &mut k3_model::model::Session,
    feed: &[usize],
    reps: usize,
    profile: &Profile,
) -> Result<Vec<PassCost>> {
    let mut costs: Vec<PassCost> = (1..=feed.len())
        .map(|tokens| PassCost {
            tokens,
            seconds: Vec::with_capacity(reps),
            checkpoint_seconds: Vec::with_capacity(reps),
            experts: 0,
            buckets: [0.0; Bucket::ALL.len()],
        })
        .collect();
    let at = session.position();
    for round in 0..=reps {
        let order: Vec<usize> = if round % 2 == 0 {
            (0..feed.len()).collect()
        } else {
            (0..feed.len()).rev().collect()
        };
        for i in order {
            let tokens = &feed[..=i];
            let start = Instant::now();
            session.checkpoint();
            let armed = start.elapsed().as_secs_f64();
            profile.reset();
            let experts = model.experts_read();
            let start = Instant::now();
            let rows = model.step_rows(&mut [(&mut *session, tokens)], &[Want::All])?;
            let seconds = start.elapsed().as_secs_f64();
            let experts = model.experts_read() - experts;
            ensure!(
                rows[0].len() == tokens.len(),
                "a verify pass of {} tokens gave {} rows of logits",
                tokens.len(),
                rows[0].len()
            );
            model.rollback(session, at)?;
            // Round 0 warms the caches and the pages of a mapped trunk: not timed.
            if round == 0 {
                continue;
            }
            let cost = &mut costs[i];
            cost.seconds.push(seconds);
            cost.checkpoint_seconds.push(armed);
            cost.experts = experts;
            for (sum, time) in cost.buckets.iter_mut().zip(profile.totals()) {
                *sum += time.as_secs_f64();
            }
        }
    }
    Ok(costs)
}

/// Bytes a pass reads: the trunk once, and each routed (layer, expert) pair it asked for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PassBytes {
    /// Every weight a one-token step reads but the routed experts (one embedding row), as
    /// stored (as the decode bench counts them; a packed trunk holds fewer).
    pub(crate) trunk: u64,
    /// One routed expert's bytes.
    pub(crate) expert: u64,
}

/// Prints the curve: for each size its median time and range, the time relative to the
/// one-token pass, the checkpoint's median, the trunk and routed-expert bytes read and the
/// rate they were read at; then the profile of a few sizes, ms per pass by bucket.
pub(crate) fn print(costs: &[PassCost], bytes: PassBytes, reps: usize) {
    let one = costs[0].median();
    println!(
        "| n tokens | median ms | range ms | × 1-token step | checkpoint ms | trunk MB | routed experts (layer, expert) | routed MB | GB/s |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for cost in costs {
        let time = cost.median();
        let (low, high) = range(&cost.seconds);
        let routed = cost.experts * bytes.expert;
        println!(
            "| {} | {:.2} | {:.2}-{:.2} | {:.3} | {:.3} | {:.1} | {} | {:.1} | {:.2} |",
            cost.tokens,
            time * 1e3,
            low * 1e3,
            high * 1e3,
            time / one,
            median(&cost.checkpoint_seconds) * 1e3,
            bytes.trunk as f64 / 1e6,
            cost.experts,
            routed as f64 / 1e6,
            (bytes.trunk + routed) as f64 / time / 1e9,
        );
    }
    let shown: Vec<&PassCost> = costs
        .iter()
        .filter(|c| [1, 2, 3, 4, 5, 9, 16].contains(&c.tokens))
        .collect();
    println!(
        "\nprofile of the timed passes, ms per pass by bucket (mean of {reps}; 'other' is \
         embedding, norms, AttnRes mixes, expert sums, the KDA/MLA recurrences' bookkeeping):"
    );
    print!("| bucket |");
    for cost in &shown {
        print!(" n = {} |", cost.tokens);
    }
    println!();
    println!("|---|{}", "---:|".repeat(shown.len()));
    for (b, bucket) in Bucket::ALL.iter().enumerate() {
        if shown.iter().all(|c| c.buckets[b] == 0.0) {
            continue;
        }
        print!("| {} |", bucket.name());
        for cost in &shown {
            print!(" {:.2} |", cost.buckets[b] / reps as f64 * 1e3);
        }
        println!();
    }
    print!("| other |");
    for cost in &shown {
        let total: f64 = cost.seconds.iter().sum();
        let accounted: f64 = cost.buckets.iter().sum();
        print!(" {:.2} |", (total - accounted) / reps as f64 * 1e3);
    }
    println!();
}
