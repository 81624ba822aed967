//! The routed experts' two-phase tasks (gate/up, then down, by row blocks) and their domains.

use mxfp4_kernels::{ExpertScratch, MAX_TOKENS, MxFp4Matrix};

use super::dispatch::own_blocks;
use super::error::Result;
use super::forward::{ExpertPlacement, Model};

impl Model<'_> {
    /// The domain that runs routed expert `expert` of checkpoint layer `layer`: its home in
    /// its source (in an expert store, where the store placed it; mapped, round-robin).
    pub(super) fn expert_domain(&self, layer: usize, expert: usize) -> usize {
        let domains = self.pool.domains();
        self.experts.home(layer, expert) % domains
    }

    /// Runs `experts` (id and matrices) for the tokens that chose them, writing each output to
    /// `outputs[token][pick]`.
    pub(super) fn run_experts(
        &self,
        layer: usize,
        experts: &[(usize, [MxFp4Matrix<'_>; 3])],
        routes: &[(Vec<usize>, Vec<f32>)],
        zs: &[Vec<f32>],
        outputs: &mut [Vec<Vec<f32>>],
    ) -> Result<()> {
        let c = &self.config;
        let io = zs.first().map_or(0, Vec::len);
        // Work items: (expert, block of up to MAX_TOKENS of its tokens). Each is split into row
        // blocks twice — gate/up rows of the hidden vector, then down rows of the output — so
        // that more workers than experts still share the work. Every row is computed by one
        // task with the arithmetic of the fused kernel, so the schedule cannot change a bit.
        let mut items: Vec<(usize, Vec<(usize, usize)>)> = Vec::new();
        for (slot, (e, _)) in experts.iter().enumerate() {
            let users: Vec<(usize, usize)> = routes
                .iter()
                .enumerate()
                .filter_map(|(t, (ids, _))| ids.iter().position(|id| id == e).map(|k| (t, k)))
                .collect();
            items.extend(users.chunks(MAX_TOKENS).map(|block| (slot, block.to_vec())));
        }
        let expert_bytes: usize = experts.first().map_or(0, |(_, [g, u, d])| {
            g.weight_bytes() + u.weight_bytes() + d.weight_bytes()
        });
        let threads = if items.len() * expert_bytes < self.parallel_min_bytes {
            1
        } else {
            self.pool.threads()
        };
        let inter = c.moe.expert_intermediate;
        // With split placement each expert's rows are spread over every domain (at least one
        // block each); with home placement an expert's blocks all run on its home domain.
        let domains = self.pool.domains();
        let split = self.expert_placement == ExpertPlacement::Split && domains > 1;
        let per_expert = threads.div_ceil(items.len().max(1));
        // Under several ranks, each runs its share of every expert's rows (then all-gathers).
        let ranks = self.pool.ranks();
        let splits = |rows: usize| {
            own_blocks(
                ranks.share(rows),
                if split {
                    per_expert.max(domains)
                } else {
                    per_expert
                },
                domains,
            )
        };
        let acts: Vec<mxfp4_kernels::Activations> = items
            .iter()
            .map(|(_, block)| {
                let flat: Vec<f32> = block
                    .iter()
                    .flat_map(|&(t, _)| zs[t].iter().copied())
                    .collect();
                self.kernels.prepare(&flat, io)
            })
            .collect::<std::result::Result<_, _>>()?;
        // Phase 1: SiTU(gate · z, up · z) by row blocks of the hidden vector.
        let phase1: Vec<(usize, std::ops::Range<usize>, usize)> = (0..items.len())
            .flat_map(|i| splits(inter).into_iter().map(move |(r, d)| (i, r, d)))
            .collect();
        let gate_up = |task: usize| -> Result<Vec<f32>> {
            let (i, range, _) = &phase1[task];
            let [gate, up, _] = &experts[items[*i].0].1;
            let mut hidden = vec![0.0; range.len() * items[*i].1.len()];
            let mut scratch = ExpertScratch::default();
            self.kernels.expert_gate_up(
                gate,
                up,
                &self.situ,
                &acts[*i],
                range.clone(),
                &mut scratch,
                &mut hidden,
            )?;
            Ok(hidden)
        };
        let domain = |i: usize, block_domain: usize| {
            if split {
                block_domain
            } else {
                self.expert_domain(layer, experts[items[i].0].0)
            }
        };
        let parts = self.run_tasks(
            threads > 1,
            phase1.len(),
            |t| domain(phase1[t].0, phase1[t].2),
            gate_up,
        )?;
        let mut hidden: Vec<Vec<f32>> = items
            .iter()
            .map(|(_, b)| vec![0.0; inter * b.len()])
            .collect();
        for ((i, range, _), part) in phase1.iter().zip(parts) {
            let part = part?;
            let tokens = items[*i].1.len();
            for t in 0..tokens {
                hidden[*i][t * inter + range.start..t * inter + range.end]
                    .copy_from_slice(&part[t * range.len()..(t + 1) * range.len()]);
            }
        }
        if ranks.size() > 1 {
            let mut rows: Vec<Vec<&mut [f32]>> = hidden
                .iter_mut()
                .map(|h| h.chunks_mut(inter).collect())
                .collect();
            self.gather_rows(&mut rows);
        }
        let hidden_acts: Vec<mxfp4_kernels::Activations> = hidden
            .iter()
            .map(|h| self.kernels.prepare(h, inter))
            .collect::<std::result::Result<_, _>>()?;
        // Phase 2: down · hidden by row blocks of the output.
        let phase2: Vec<(usize, std::ops::Range<usize>, usize)> = (0..items.len())
            .flat_map(|i| splits(io).into_iter().map(move |(r, d)| (i, r, d)))
            .collect();
        let down_rows = |task: usize| -> Result<Vec<f32>> {
            let (i, range, _) = &phase2[task];
            let [_, _, down] = &experts[items[*i].0].1;
            let mut y = vec![0.0; range.len() * items[*i].1.len()];
            self.kernels
                .matmul_mxfp4(down, &hidden_acts[*i], range.clone(), &mut y)?;
            Ok(y)
        };
        let parts = self.run_tasks(
            threads > 1,
            phase2.len(),
            |t| domain(phase2[t].0, phase2[t].2),
            down_rows,
        )?;
        let mut down: Vec<Vec<f32>> = items.iter().map(|(_, b)| vec![0.0; io * b.len()]).collect();
        for ((i, range, _), part) in phase2.iter().zip(parts) {
            let part = part?;
            for n in 0..items[*i].1.len() {
                down[*i][n * io + range.start..n * io + range.end]
                    .copy_from_slice(&part[n * range.len()..(n + 1) * range.len()]);
            }
        }
        if ranks.size() > 1 {
            let mut rows: Vec<Vec<&mut [f32]>> = down
                .iter_mut()
                .map(|d| d.chunks_mut(io.max(1)).collect())
                .collect();
            self.gather_rows(&mut rows);
        }
        for ((_, block), y) in items.iter().zip(&down) {
            for (n, &(t, k)) in block.iter().enumerate() {
                outputs[t][k].copy_from_slice(&y[n * io..(n + 1) * io]);
            }
        }
        Ok(())
    }
}
