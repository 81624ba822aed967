//! NUMA placement: each expert's home domain, and binding its buffer's pages to nodes.

use super::open::ExpertStore;
use super::shared::{Located, Placement, Shared};

impl ExpertStore {
    /// Gives every expert a home among `nodes.len()` domains (`nodes[d]`: the NUMA node of
    /// domain `d`, or `None` for a synthetic one) and binds the buffers of experts loaded from
    /// now on: with `split_rows`, each tensor's rows evenly over the domains' nodes (where the
    /// forward pass reads them with split placement), else the whole buffer on the home's
    /// node. Homes balance the expected load per layer: experts in
    /// order of their earlier-run use counts (most used first, ties by id) each go to the
    /// domain with the least load so far, counting a never-seen expert as one use; with no
    /// counts that is round-robin by id. Call once, before the first request or preload;
    /// later calls change nothing (returns false).
    pub fn place(&self, nodes: Vec<Option<usize>>, split_rows: bool) -> bool {
        let shared = &self.shared;
        let domains = nodes.len().max(1);
        let homes = shared
            .layer_pos
            .iter()
            .map(|(&layer, &pos)| {
                let n = shared.experts_per_layer[pos];
                let weight = |e: usize| shared.history.count(layer, e).max(1);
                let mut order: Vec<usize> = (0..n).collect();
                order.sort_by_key(|&e| (std::cmp::Reverse(weight(e)), e));
                let mut load = vec![0u64; domains];
                let mut homes = vec![0u16; n];
                for e in order {
                    let d = (0..domains)
                        .min_by_key(|&d| (load[d], d))
                        .expect("at least one domain");
                    load[d] = load[d].saturating_add(weight(e));
                    homes[e] = d as u16;
                }
                homes
            })
            .collect();
        shared
            .placement
            .set(Placement {
                homes,
                nodes,
                split_rows,
            })
            .is_ok()
    }
}

impl Shared {
    pub(super) fn home(&self, layer: usize, expert: usize) -> usize {
        let (Some(placement), Some(&pos)) = (self.placement.get(), self.layer_pos.get(&layer))
        else {
            return 0;
        };
        placement.homes[pos]
            .get(expert)
            .map_or(0, |&d| usize::from(d))
    }

    /// Binds a new buffer of `key` (segments starting at `starts`) to its nodes, before the
    /// read faults its pages in. A refusal (no NUMA support) leaves first touch to place them.
    pub(super) fn bind(
        &self,
        key: (usize, usize),
        located: &Located,
        buf: &mut [u8],
        starts: &[usize],
    ) {
        let Some(placement) = self.placement.get() else {
            return;
        };
        if placement.nodes.iter().all(Option::is_none) {
            return;
        }
        if !placement.split_rows {
            if let Some(node) = placement
                .nodes
                .get(self.home(key.0, key.1))
                .copied()
                .flatten()
            {
                numa_sched::memory::bind_whole_pages(buf, node);
            }
            return;
        }
        for (m, matrix) in self.layout.matrices().iter().enumerate() {
            // Codes and scales both split by the matrix's rows.
            let rows = matrix.rows;
            for i in [2 * m, 2 * m + 1] {
                let (segment, offset, len) = located.tensors[i];
                let at = starts[segment] + offset;
                numa_sched::memory::bind_row_split(&mut buf[at..at + len], rows, &placement.nodes);
            }
        }
    }
}
