//! The read-bandwidth reference, measured in the same run with the same number of pinned
//! threads: the STREAM-like sum of the kernel benchmarks (`benches::read_all`) over 512 MiB
//! (`--probe-mb`), after every [`PROBE_EVERY`] timed steps (or the chunk that reaches them),
//! so each step is paired with the bandwidth the machine gave at that moment (a shared host
//! drifts by tens of percent within a minute). A probe flushes the caches and the next step
//! pays for it, so probing after every step would understate the decode.

use k3_model::plan::Plan;

/// Timed steps between two read-bandwidth probes.
pub(crate) const PROBE_EVERY: usize = 4;

/// The read probe's buffer: `requested` bytes (`--probe-mb`), or why there is none. Under a
/// memory limit (a cgroup's, `--memory-gb`) the plan may fill the limit, and the buffer's
/// pages count against it: allocated outside the plan it got the bench OOM-killed in a cgroup
/// of 0.9x the model. So there it runs only if it fits what the plan leaves of the limit
/// (its safety margin kept).
pub(crate) fn probe_bytes(requested: u64, plan: &Plan) -> Result<u64, String> {
    if requested == 0 {
        return Err("--probe-mb 0".into());
    }
    let Some(limit) = plan.budget.as_ref().filter(|b| b.limit) else {
        return Ok(requested);
    };
    let left = limit
        .bytes
        .saturating_sub(plan.margin)
        .saturating_sub(plan.memory.total());
    if requested <= left {
        return Ok(requested);
    }
    Err(format!(
        "off: its {} MiB do not fit the {:.3} GB the memory plan leaves of the {:.3} GB limit \
         ({})",
        requested >> 20,
        left as f64 / 1e9,
        limit.bytes as f64 / 1e9,
        limit.source
    ))
}

/// The probe: its own pool of as many pinned workers as the engine's, and its buffer, or why
/// it has none.
pub(crate) struct ReadProbe {
    pool: benches::Pool,
    buffer: Result<benches::HugeBuf, String>,
}

impl ReadProbe {
    /// A probe of `requested` bytes on `threads` workers, as far as `plan` leaves room for
    /// it ([`probe_bytes`]); says on stderr why it is off unless `--probe-mb 0` turned it off.
    pub(crate) fn new(threads: usize, requested: u64, plan: &Plan) -> anyhow::Result<Self> {
        let pool = benches::Pool::new(threads)?;
        let size = probe_bytes(requested, plan);
        if let Err(why) = &size
            && requested > 0
        {
            eprintln!("read probe {why}");
        }
        let buffer = size.map(|bytes| benches::bandwidth_buffer(bytes as usize));
        Ok(Self { pool, buffer })
    }

    /// One read of the whole buffer: bytes per second, or `None` without a buffer.
    pub(crate) fn read(&self) -> Option<f64> {
        self.buffer
            .as_ref()
            .ok()
            .map(|b| benches::read_rate(&self.pool, b))
    }

    /// Why there is no buffer (empty when there is one).
    pub(crate) fn why_off(&self) -> &str {
        self.buffer.as_ref().err().map_or("", String::as_str)
    }
}

#[cfg(test)]
mod tests;
