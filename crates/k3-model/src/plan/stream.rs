//! Which trunk tensors stay resident and how the rest is streamed: the units a forward pass
//! reads in order (per layer the attention, then the dense MLP's gate, up and down or the MoE
//! block's router, latent and shared experts; last the lm_head), the splittable ones (a dense
//! MLP's matrices, the lm_head) cut into row blocks of at most the buffer size ("cap").
//!
//! For a cap, a unit that cannot be split and reads more than the cap keeps its largest
//! tensors resident until the rest fits; then the units that cannot be split are made
//! resident while they fit, largest first (streamed, they are many small tensors per read;
//! every trunk byte is read by every token, so any resident byte saves one byte from disk).
//! The matrices read in row blocks are resident whole where all of them fit; else each keeps
//! the same share of its leading rows, so the streamed rows are spread over the pass (each
//! part's blocks are read while the parts before it and its own resident rows compute).
//! [`Layout::best`] tries the caps that matter and keeps the one that leaves the most resident.

use std::collections::HashSet;
use std::ops::Range;

use expert_store::io::IO_ALIGN;

use super::sizes::{Part, StoredTensor, WeightSizes, read_bytes};

/// Row blocks hold a multiple of this many rows (every kernel's row block divides it).
pub const BLOCK_ROWS: usize = 64;

/// The smallest cap tried: reads below it lose disk rate, and every block is one more
/// dispatch of the pool.
pub const MIN_CAP: u64 = 64 << 20;

/// One buffer's worth of the stream: a unit's streamed tensors, or one row block of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamStep {
    /// The layer (the layer count for the head).
    pub layer: usize,
    /// The part of the forward pass that reads it.
    pub part: Part,
    /// For a part read in row blocks, the rows of this block (of each of its tensors).
    pub rows: Option<Range<usize>>,
    /// What is read, in file order (for a row block: those rows of each tensor).
    pub tensors: Vec<StoredTensor>,
}

/// Where the trunk's bytes are under a plan that does not fit the mapping.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TrunkPlan {
    /// Stored names copied into resident memory.
    pub resident: HashSet<String>,
    /// Leading row blocks (rows `0..n`) of matrices read in row blocks, copied into resident
    /// memory where a whole matrix does not fit what is left; the rest of their rows stream.
    pub resident_rows: Vec<StoredTensor>,
    /// What is read from disk every token, in the order a forward pass reads it (empty: all
    /// resident).
    pub steps: Vec<StreamStep>,
    /// Buffers the stream cycles through (2: a step is read while the one before is
    /// computed; 1 where the budget allows no more).
    pub slots: usize,
}

impl TrunkPlan {
    /// Bytes read from disk per token for the streamed trunk.
    pub fn streamed_read_bytes(&self) -> u64 {
        self.steps.iter().map(|s| read_bytes(&s.tensors)).sum()
    }

    /// Bytes of one stream buffer: the largest step's read.
    pub fn buffer_bytes(&self) -> u64 {
        self.steps
            .iter()
            .map(|s| read_bytes(&s.tensors))
            .max()
            .unwrap_or(0)
    }

    /// Whether any trunk bytes are read from disk per token (some step is left).
    pub fn streams(&self) -> bool {
        !self.steps.is_empty()
    }

    /// The steps counted by part, e.g. " (attention 3, gate 4, lm_head 12)"; empty without
    /// steps.
    pub fn describe_steps(&self) -> String {
        let mut counts: Vec<(Part, usize)> = Vec::new();
        for s in &self.steps {
            match counts.iter_mut().find(|(p, _)| *p == s.part) {
                Some((_, n)) => *n += 1,
                None => counts.push((s.part, 1)),
            }
        }
        counts.sort();
        let words: Vec<String> = counts
            .iter()
            .map(|(p, n)| format!("{} {n}", p.name()))
            .collect();
        match words.is_empty() {
            true => String::new(),
            false => format!(" ({})", words.join(", ")),
        }
    }
}

/// A unit of the stream before it is cut: a layer's part and its tensors in file order.
struct Unit<'s> {
    layer: usize,
    part: Part,
    tensors: Vec<&'s StoredTensor>,
}

/// The units of `sizes` in forward order.
fn units(sizes: &WeightSizes) -> Vec<Unit<'_>> {
    let mut units: Vec<Unit<'_>> = Vec::new();
    let mut all: Vec<(usize, &StoredTensor)> = sizes.read_tensors().collect();
    // Stable: file order within a part.
    all.sort_by_key(|&(layer, t)| (layer, t.part));
    for (layer, t) in all {
        match units.last_mut() {
            Some(u) if u.layer == layer && u.part == t.part => u.tensors.push(t),
            _ => units.push(Unit {
                layer,
                part: t.part,
                tensors: vec![t],
            }),
        }
    }
    units
}

/// A layout of the trunk for one cap and slot count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// What is resident and what streams.
    pub trunk: TrunkPlan,
    /// Bytes of the resident copy.
    pub resident: u64,
    /// Bytes of the stream's buffers (`slots` × the largest step).
    pub buffers: u64,
}

/// Rows of a row block of `tensors` (of `rows` rows each) that fit `cap` with each read
/// rounded out to pages; `None` where not even [`BLOCK_ROWS`] rows fit.
fn block_rows(tensors: &[&StoredTensor], rows: usize, cap: u64) -> Option<usize> {
    let per_row: u64 = tensors
        .iter()
        .map(|t| t.read_range().1.len() as u64 / t.rows.max(1) as u64)
        .sum();
    let slack = 2 * IO_ALIGN as u64 * tensors.len() as u64;
    let fit = cap.saturating_sub(slack) / per_row.max(1);
    let fit = fit as usize / BLOCK_ROWS * BLOCK_ROWS;
    (fit >= BLOCK_ROWS.min(rows)).then_some(fit.min(rows))
}

impl Layout {
    /// The layout for buffers of at most `cap` bytes, `slots` of them, within `room` bytes
    /// (resident copy and buffers together); `None` where it cannot fit.
    pub fn new(sizes: &WeightSizes, room: u64, cap: u64, slots: u64) -> Option<Self> {
        // The pack cache's exception blocks and row indexes are held whatever streams.
        let mut left = room.checked_sub(slots * cap + sizes.packed_side)?;
        let mut resident = HashSet::new();
        let mut resident_bytes = sizes.packed_side;
        let units = units(sizes);
        let mut wanted: Vec<&StoredTensor> = Vec::new();
        // Units that must shrink to the cap: their largest tensors resident first.
        for unit in &units {
            let mut streamed = unit.tensors.clone();
            let mut by_size = unit.tensors.clone();
            by_size.sort_by_key(|t| std::cmp::Reverse(t.resident_bytes()));
            for t in by_size {
                if fits(unit.part, &streamed, cap) {
                    break;
                }
                wanted.push(t);
                streamed.retain(|s| s.name != t.name);
            }
        }
        // Then the rest where it fits: the units that cannot be split first (streamed, each is
        // one read of many small tensors), then the matrices read in row blocks; largest
        // first within each.
        let mut rest: Vec<&StoredTensor> = units.iter().flat_map(|u| u.tensors.clone()).collect();
        rest.sort_by_key(|t| (t.part.splits(), std::cmp::Reverse(t.resident_bytes())));
        let forced = wanted.len();
        wanted.extend(rest);
        let mut splittable_left: Vec<&StoredTensor> = Vec::new();
        for (i, t) in wanted.into_iter().enumerate() {
            if resident.contains(&t.name) {
                continue;
            }
            if i >= forced && t.part.splits() {
                // After every unit that cannot be split: whole only if all of them fit.
                splittable_left.push(t);
                continue;
            }
            if t.resident_bytes() <= left {
                left -= t.resident_bytes();
                resident_bytes += t.resident_bytes();
                resident.insert(t.name.clone());
            } else if i < forced {
                return None;
            }
        }
        let splittable_bytes: u64 = splittable_left.iter().map(|t| t.resident_bytes()).sum();
        if splittable_bytes <= left {
            for t in splittable_left {
                left -= t.resident_bytes();
                resident_bytes += t.resident_bytes();
                resident.insert(t.name.clone());
            }
        }
        // What is left goes to the leading rows of the matrices read in row blocks (a trunk
        // byte saves a byte from disk every token, more than an expert byte does), the same
        // share of each: the streamed rows are spread over the pass, so each part's reads
        // overlap the compute of its resident rows and of the parts before it, instead of
        // one matrix streaming whole while the disk idles through the rest.
        let streamed_of: Vec<Vec<&StoredTensor>> = units
            .iter()
            .map(|unit| {
                unit.tensors
                    .iter()
                    .copied()
                    .filter(|t| !resident.contains(&t.name))
                    .collect()
            })
            .collect();
        let mut resident_rows = Vec::new();
        let split: Vec<usize> = (0..units.len())
            .filter(|&u| units[u].part.splits() && !streamed_of[u].is_empty())
            .collect();
        // Rows of unit `u` kept for a share `f` of its rows: whole blocks, never all of them.
        let kept_rows = |u: usize, f: f64| {
            let rows = streamed_of[u][0].rows;
            let kept = (f * rows as f64) as usize / BLOCK_ROWS * BLOCK_ROWS;
            kept.min(rows.saturating_sub(1) / BLOCK_ROWS * BLOCK_ROWS)
        };
        let cost = |f: f64| -> u64 {
            split
                .iter()
                .map(|&u| {
                    let kept = kept_rows(u, f);
                    streamed_of[u]
                        .iter()
                        .map(|t| match kept {
                            0 => 0,
                            k => t.row_block(0..k).resident_bytes(),
                        })
                        .sum::<u64>()
                })
                .sum()
        };
        // The largest share that fits (bisection: the cost grows with the share).
        let (mut lo, mut hi) = (0.0f64, 1.0f64);
        for _ in 0..48 {
            let mid = (lo + hi) / 2.0;
            if cost(mid) <= left {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let mut first_streamed = vec![0usize; units.len()];
        for &u in &split {
            let kept = kept_rows(u, lo);
            if kept == 0 {
                continue;
            }
            for t in &streamed_of[u] {
                let block = t.row_block(0..kept);
                resident_bytes += block.resident_bytes();
                resident_rows.push(block);
            }
            first_streamed[u] = kept;
        }
        let mut steps = Vec::new();
        for (u, (unit, streamed)) in units.iter().zip(streamed_of).enumerate() {
            if streamed.is_empty() {
                continue;
            }
            let step = |rows: Option<Range<usize>>, tensors| StreamStep {
                layer: unit.layer,
                part: unit.part,
                rows,
                tensors,
            };
            if unit.part.splits() {
                let rows = streamed[0].rows;
                let block = block_rows(&streamed, rows, cap).expect("fits the cap (checked)");
                for start in (first_streamed[u]..rows).step_by(block) {
                    let r = start..(start + block).min(rows);
                    let tensors = streamed.iter().map(|t| t.row_block(r.clone())).collect();
                    steps.push(step(Some(r), tensors));
                }
            } else {
                steps.push(step(None, streamed.into_iter().cloned().collect()));
            }
        }
        let trunk = TrunkPlan {
            resident,
            resident_rows,
            steps,
            slots: slots as usize,
        };
        Some(Self {
            buffers: slots * trunk.buffer_bytes(),
            resident: resident_bytes,
            trunk,
        })
    }

    /// The caps worth trying: [`MIN_CAP`] (or the largest unsplittable unit, if smaller: the
    /// floor), `share` (the largest that affords a second buffer), the powers of two between
    /// them, and each unsplittable unit's whole read; none below the floor.
    pub(super) fn caps(sizes: &WeightSizes, share: u64) -> Vec<u64> {
        let whole: Vec<u64> = units(sizes)
            .iter()
            .filter(|u| !u.part.splits())
            .map(|u| read_bytes(&u.tensors.iter().map(|&t| t.clone()).collect::<Vec<_>>()))
            .collect();
        // A model whose units are all smaller than MIN_CAP goes down to its largest one.
        let floor = whole.iter().copied().max().unwrap_or(0).clamp(1, MIN_CAP);
        // And every power of two from the floor up to `share`: smaller buffers leave more
        // room, larger ones force fewer units resident, and the best lies anywhere between.
        let powers = std::iter::successors(Some(floor.next_power_of_two()), |&c| c.checked_mul(2))
            .take_while(move |&c| c < share);
        let mut caps: Vec<u64> = whole
            .into_iter()
            .chain([floor, share])
            .chain(powers)
            .filter(|&c| c >= floor)
            .collect();
        caps.sort_unstable();
        caps.dedup();
        caps
    }

    /// The layout within `room` that keeps the most resident with two buffers (a step's read
    /// overlapping the previous step's compute), the second taking at most `share` bytes;
    /// with one where no such layout fits. Ties go to the smaller buffers. `None`: nothing
    /// fits.
    pub fn best(sizes: &WeightSizes, room: u64, share: u64) -> Option<Self> {
        let mut best: Option<Self> = None;
        for cap in Self::caps(sizes, share) {
            for slots in [2, 1] {
                if slots == 2 && cap > share {
                    continue;
                }
                let Some(layout) = Self::new(sizes, room, cap, slots) else {
                    continue;
                };
                let key = |l: &Self| {
                    (
                        l.trunk.slots,
                        std::cmp::Reverse(l.trunk.streamed_read_bytes()),
                        l.resident,
                        std::cmp::Reverse(l.buffers),
                    )
                };
                if best.as_ref().is_none_or(|b| key(&layout) > key(b)) {
                    best = Some(layout);
                }
            }
        }
        best
    }

    /// The least memory any layout needs (one buffer and what must be resident for it).
    pub fn minimum(sizes: &WeightSizes) -> Self {
        Self::caps(sizes, 0)
            .into_iter()
            .filter_map(|cap| {
                Self::new(
                    sizes,
                    forced_bytes(sizes, cap) + cap + sizes.packed_side,
                    cap,
                    1,
                )
            })
            .min_by_key(|l| (l.resident + l.buffers, l.buffers))
            .expect("the largest unit's cap always fits")
    }
}

/// Whether the streamed `tensors` of a unit of `part` fit buffers of `cap`: whole, or for a
/// splittable part in row blocks.
fn fits(part: Part, tensors: &[&StoredTensor], cap: u64) -> bool {
    if tensors.is_empty() {
        return true;
    }
    if part.splits() {
        block_rows(tensors, tensors[0].rows, cap).is_some()
    } else {
        let owned: Vec<StoredTensor> = tensors.iter().map(|&t| t.clone()).collect();
        read_bytes(&owned) <= cap
    }
}

/// Bytes that must be resident for every unit to fit buffers of `cap`.
pub fn forced_bytes(sizes: &WeightSizes, cap: u64) -> u64 {
    let mut forced = 0;
    for unit in units(sizes) {
        let mut streamed = unit.tensors.clone();
        let mut by_size = unit.tensors.clone();
        by_size.sort_by_key(|t| std::cmp::Reverse(t.resident_bytes()));
        for t in by_size {
            if fits(unit.part, &streamed, cap) {
                break;
            }
            forced += t.resident_bytes();
            streamed.retain(|s| s.name != t.name);
        }
    }
    forced
}
