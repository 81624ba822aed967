//! `--prefill N`: a timed prompt instead of a decode.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use k3_model::model::{Model, Session, fingerprint};
use k3_model::profile::Profile;

use crate::report::print_profile;

/// `--prefill N`: a prompt of the first N of `tokens` through `Model::prefill` in chunks of
/// `--prefill-chunk` (logits for the last token only), five times, each on a copy of `base`
/// (a fresh session, or one at `--depth`); prints the median time and tokens/s.
pub(crate) fn time_prefill(
    model: &Model<'_>,
    base: &Session,
    tokens: &[usize],
    n: usize,
    chunk: usize,
    profile: Option<&Profile>,
) -> Result<()> {
    if tokens.len() < n {
        bail!("--prefill {n} needs at least {n} tokens after --depth (--tokens)");
    }
    let mut times = Vec::new();
    let mut fp = 0;
    for run in 0..5 {
        if run == 1 {
            // The first run pays a mapped trunk's page faults.
            model.reset_profile();
        }
        let mut session = base.clone();
        let start = Instant::now();
        let last = model.prefill(&mut session, &tokens[..n], chunk)?;
        times.push(start.elapsed().as_secs_f64());
        fp = fingerprint(&last);
    }
    if let Some(p) = profile {
        let total = Duration::from_secs_f64(times[1..].iter().sum());
        print_profile(p, total, 4 * n, "prefill profile over runs 2-5", None);
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let depth = base.position();
    println!(
        "prefill: {n} tokens at depth {depth} in chunks of {chunk}: median {:.3} ms = {:.2} tokens/s; last logits fingerprint {fp:016x}",
        median * 1e3,
        n as f64 / median
    );
    Ok(())
}
