//! `--profile`'s table: where the timed steps' wall time went, by bucket.

use std::time::Duration;

use k3_model::inventory::BytePlan;
use k3_model::profile::{Bucket, Profile};

/// `--profile`'s table: each bucket's wall time per token over `tokens` timed tokens (`total`)
/// and its share; with `roof` (the byte plan and the run's median read) also the weights the
/// bucket reads per token and that rate against the read (a bucket's own roofline).
pub(crate) fn print_profile(
    profile: &Profile,
    total: Duration,
    tokens: usize,
    title: &str,
    roof: Option<(&BytePlan, f64)>,
) {
    if tokens == 0 {
        println!("{title}: no timed tokens (needs more than one chunk)");
        return;
    }
    let per_token = |d: Duration| d.as_secs_f64() / tokens as f64;
    let step = per_token(total);
    print!(
        "{title} ({:.3} ms per token):\n| bucket | ms per token | share |",
        step * 1e3
    );
    match roof {
        Some((_, read)) => println!(
            " weight MB/token | GB/s | % of read ({:.1} GB/s) |\n|---|---|---|---|---|---|",
            read / 1e9
        ),
        None => println!("\n|---|---|---|"),
    }
    let mut accounted = 0.0;
    for (bucket, time) in Bucket::ALL.iter().zip(profile.totals()) {
        let t = per_token(time);
        let bytes = roof.map_or(0, |(plan, _)| bucket.bytes_per_token(plan));
        if t == 0.0 && bytes == 0 {
            continue;
        }
        accounted += t;
        print!(
            "| {} | {:.4} | {:.1}% |",
            bucket.name(),
            t * 1e3,
            100.0 * t / step
        );
        match roof {
            Some((_, read)) => {
                let rate = if t > 0.0 { bytes as f64 / t } else { 0.0 };
                println!(
                    " {:.1} | {:.2} | {:.0}% |",
                    bytes as f64 / 1e6,
                    rate / 1e9,
                    100.0 * rate / read
                );
            }
            None => println!(),
        }
    }
    let other = step - accounted;
    println!(
        "| other (embedding, norms, AttnRes mixes, expert sums) | {:.4} | {:.1}% |{}",
        other * 1e3,
        100.0 * other / step,
        if roof.is_some() { " | | |" } else { "" }
    );
}
