//! Workloads shared by the criterion benches (`benches/kernels.rs`) and `cargo xtask
//! bench-kernels`: K3-shaped weights and a STREAM-like read-bandwidth probe, run on the
//! engine's pinned pool (`numa_sched::Pool`), splitting rows (or experts) across its workers
//! the way a caller of the kernels does.

#![warn(missing_docs)]

pub mod cases;

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use k3_testkit::Rng;
use mxfp4_kernels::codes::{Q8_0_BLOCK_BYTES, bf16_to_f32, f32_to_bf16, quantize_q8_0};
use mxfp4_kernels::{
    Activations, Bf16Matrix, ExpertScratch, Kernels, MxFp4Matrix, Q8_0Matrix, Situ,
};

/// K3's routed expert: gate/up `[3072, 3584]`, down `[3584, 3072]` (docs/MODEL.md §3.3).
pub const EXPERT_INTER: usize = 3072;
/// The latent width routed experts read and write (K3's `moe_latent_size`).
pub const EXPERT_LATENT: usize = 3584;
/// KDA q/k/v/g projections `[12288, 7168]`.
pub const KDA_ROWS: usize = 12288;
/// K3's hidden size.
pub const HIDDEN: usize = 7168;
/// The lm_head is `[163840, 7168]` (2.35 GB); benches use a 16384-row slice (235 MB), which is
/// already 7x the L3, so every pass streams from DRAM exactly as the full head would.
pub const LM_HEAD_SLICE_ROWS: usize = 16384;
/// k3-0.40b's hidden size and vocabulary: its lm_head is 163840 x 1024.
pub const HIDDEN_040B: usize = 1024;
/// k3-0.40b's vocabulary: the rows of its lm_head.
pub const LM_HEAD_040B_ROWS: usize = 163_840;

/// A zeroed, 2 MiB-aligned byte buffer. On Linux it is advised into transparent huge pages
/// (`MADV_HUGEPAGE`; this machine's THP mode is `madvise`), as the expert store's owned expert
/// buffers are: with 4 KiB pages every row stream of a GEMV restarts the hardware prefetcher
/// at each page boundary and the kernels lose a third of the bandwidth (PERFORMANCE.md).
#[derive(Debug)]
pub struct HugeBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

const HUGE_ALIGN: usize = 2 << 20;

impl HugeBuf {
    /// `len` zero bytes, advised into huge pages first when `huge_pages`.
    pub fn zeroed(len: usize, huge_pages: bool) -> Self {
        let layout = std::alloc::Layout::from_size_align(len.max(1), HUGE_ALIGN).expect("layout");
        // SAFETY: the layout has non-zero size.
        let raw = unsafe { std::alloc::alloc(layout) };
        let ptr =
            std::ptr::NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        // Advise before the first touch: pages faulted in earlier stay 4 KiB.
        #[cfg(target_os = "linux")]
        if huge_pages {
            // SAFETY: the range is one live allocation; madvise only changes paging policy.
            unsafe { libc::madvise(raw.cast(), len.max(1), libc::MADV_HUGEPAGE) };
        }
        let _ = huge_pages;
        // SAFETY: `raw` is valid for `len` bytes; zeroing initialises them.
        unsafe { std::ptr::write_bytes(raw, 0, len) };
        Self { ptr, len }
    }
    /// A copy of `bytes` in a new buffer.
    pub fn from_slice(bytes: &[u8], huge_pages: bool) -> Self {
        let mut buf = Self::zeroed(bytes.len(), huge_pages);
        buf.copy_from_slice(bytes);
        buf
    }
}

impl std::ops::Deref for HugeBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` owns `len` initialised (zeroed) bytes until drop.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for HugeBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HugeBuf {
    fn drop(&mut self) {
        let layout =
            std::alloc::Layout::from_size_align(self.len.max(1), HUGE_ALIGN).expect("layout");
        // SAFETY: allocated in `zeroed` with this very layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
    }
}

// SAFETY: HugeBuf owns its bytes like a Vec<u8>.
unsafe impl Send for HugeBuf {}
// SAFETY: shared access is read-only (`&[u8]`).
unsafe impl Sync for HugeBuf {}

/// An owned MXFP4 matrix with random codes and realistic scales (2^-9 .. 2^-3, as QAT experts).
#[derive(Debug)]
pub struct MxOwned {
    /// Two E2M1 codes per byte, row-major.
    pub packed: HugeBuf,
    /// One E8M0 scale per 32 codes.
    pub scales: HugeBuf,
    /// Output rows.
    pub rows: usize,
    /// Input columns.
    pub cols: usize,
}

impl MxOwned {
    /// Random codes and scales from `rng`.
    pub fn random(rng: &mut Rng, rows: usize, cols: usize) -> Self {
        let mut packed = HugeBuf::zeroed(rows * cols / 2, true);
        rng.fill(&mut packed);
        let mut scales = HugeBuf::zeroed(rows * cols / 32, true);
        rng.fill(&mut scales);
        scales.iter_mut().for_each(|s| *s = 118 + *s % 7);
        Self {
            packed,
            scales,
            rows,
            cols,
        }
    }
    /// The validated kernel view.
    pub fn view(&self) -> MxFp4Matrix<'_> {
        MxFp4Matrix::new(&self.packed, &self.scales, self.rows, self.cols)
            .expect("valid by construction")
    }
    /// Codes and scales, in bytes.
    pub fn bytes(&self) -> usize {
        self.packed.len() + self.scales.len()
    }
}

/// One routed expert's three matrices.
#[derive(Debug)]
pub struct Expert {
    /// The gate projection `[3072, 3584]`.
    pub gate: MxOwned,
    /// The up projection `[3072, 3584]`.
    pub up: MxOwned,
    /// The down projection `[3584, 3072]`.
    pub down: MxOwned,
}

impl Expert {
    /// Three random matrices of K3's expert shapes.
    pub fn random(rng: &mut Rng) -> Self {
        Self {
            gate: MxOwned::random(rng, EXPERT_INTER, EXPERT_LATENT),
            up: MxOwned::random(rng, EXPERT_INTER, EXPERT_LATENT),
            down: MxOwned::random(rng, EXPERT_LATENT, EXPERT_INTER),
        }
    }
    /// 17,547,264 bytes, as docs/MODEL.md §3.4.
    pub fn bytes(&self) -> usize {
        self.gate.bytes() + self.up.bytes() + self.down.bytes()
    }
    /// Validated views of the three matrices. Build them once, outside timed loops: the
    /// constructor scans every scale byte for 0xFF (what a loader does once per expert).
    pub fn views(&self) -> ExpertViews<'_> {
        ExpertViews {
            gate: self.gate.view(),
            up: self.up.view(),
            down: self.down.view(),
        }
    }
}

/// One expert's validated views.
#[derive(Debug, Clone, Copy)]
pub struct ExpertViews<'a> {
    /// The gate projection.
    pub gate: MxFp4Matrix<'a>,
    /// The up projection.
    pub up: MxFp4Matrix<'a>,
    /// The down projection.
    pub down: MxFp4Matrix<'a>,
}

impl ExpertViews<'_> {
    /// Runs the fused FFN.
    pub fn run(&self, k: &Kernels, z: &Activations, scratch: &mut ExpertScratch, out: &mut [f32]) {
        k.expert_ffn(&self.gate, &self.up, &self.down, &Situ::K3, z, scratch, out)
            .expect("shapes fixed by construction");
    }
}

/// `n` random experts (`n * 17.5 MB`).
pub fn experts(n: usize, seed: u64) -> Vec<Expert> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| Expert::random(&mut rng)).collect()
}

/// Random BF16 weights around 1e-2.
pub fn bf16_bytes(rows: usize, cols: usize, seed: u64) -> HugeBuf {
    let mut rng = Rng::new(seed);
    let mut bytes = HugeBuf::zeroed(rows * cols * 2, true);
    for pair in bytes.chunks_exact_mut(2) {
        pair.copy_from_slice(&f32_to_bf16(rng.unit() * 0.02).to_le_bytes());
    }
    bytes
}

/// BF16 bytes (a whole number of 32-value blocks) quantised to Q8_0 (`quantize_q8_0`).
pub fn q8_0_bytes(bf16: &[u8]) -> HugeBuf {
    let mut bytes = HugeBuf::zeroed(bf16.len() / 64 * Q8_0_BLOCK_BYTES, true);
    for (src, dst) in bf16
        .chunks_exact(64)
        .zip(bytes.chunks_exact_mut(Q8_0_BLOCK_BYTES))
    {
        let values: [f32; 32] =
            core::array::from_fn(|i| bf16_to_f32(u16::from_le_bytes([src[2 * i], src[2 * i + 1]])));
        dst.copy_from_slice(&quantize_q8_0(&values));
    }
    bytes
}

/// The kernel view of Q8_0 bytes of the given shape.
pub fn q8_0_view(bytes: &[u8], rows: usize, cols: usize) -> Q8_0Matrix<'_> {
    Q8_0Matrix::new(bytes, rows, cols).expect("valid by construction")
}

/// `n` activations uniform in [-1, 1).
pub fn activations(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.unit()).collect()
}

/// The kernel view of BF16 bytes of the given shape.
pub fn bf16_view(bytes: &[u8], rows: usize, cols: usize) -> Bf16Matrix<'_> {
    Bf16Matrix::new(bytes, rows, cols).expect("valid by construction")
}

/// Splits `0..n` into `parts` contiguous ranges of near-equal size, rounded to multiples of 8
/// rows (the kernels' row block) so no part runs the slow single-row tail unnecessarily.
pub fn split_rows(n: usize, parts: usize, part: usize) -> Range<usize> {
    let blocks = n.div_ceil(8);
    let start = (blocks * part / parts * 8).min(n);
    let end = (blocks * (part + 1) / parts * 8).min(n);
    start..end
}

/// The engine's pool type: `Pool::new(threads)` pins worker `i` to the `i`-th CPU the process
/// may run on, so two-thread figures do not depend on the scheduler moving threads, and
/// [`Pool::broadcast`] gives each pinned worker one share, as the kernels' callers split rows.
pub use numa_sched::Pool;

/// A buffer far larger than the L3 (32 MiB here) for the read-bandwidth probe, in huge pages
/// like the weights.
pub fn bandwidth_buffer(bytes: usize) -> HugeBuf {
    let mut buf = HugeBuf::zeroed(bytes, true);
    Rng::new(1).fill(&mut buf);
    buf
}

/// Reads every byte of `buf` once, split across the pool's workers (a STREAM-like sum);
/// returns the sum so the reads cannot be optimised away.
pub fn read_all(pool: &Pool, buf: &[u8]) -> u64 {
    let buf: &[u64] = bytemuck::cast_slice(&buf[..buf.len() / 8 * 8]);
    let total = Arc::new(AtomicU64::new(0));
    let parts = pool.threads();
    pool.broadcast(|w| {
        let range = split_rows(buf.len(), parts, w);
        total.fetch_add(sum_words(&buf[range]), Ordering::Relaxed);
    });
    total.load(Ordering::Relaxed)
}

/// One timed [`read_all`] of `buf`: the read bandwidth in bytes per second.
pub fn read_rate(pool: &Pool, buf: &[u8]) -> f64 {
    let start = std::time::Instant::now();
    std::hint::black_box(read_all(pool, buf));
    buf.len() as f64 / start.elapsed().as_secs_f64()
}

/// Wrapping sum of the words, with AVX-512 loads where available (the widest loads this CPU
/// issues, the same the kernels use), else portable code.
pub fn sum_words(words: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: avx512f was just detected.
        return unsafe { sum_words_avx512(words) };
    }
    words.iter().fold(0u64, |a, &w| a.wrapping_add(w))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_words_avx512(words: &[u64]) -> u64 {
    use core::arch::x86_64::*;
    let mut acc = [_mm512_setzero_si512(); 4];
    let chunks = words.chunks_exact(32);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: each chunk holds 32 words; j < 4 picks 8 of them.
            let v = unsafe { _mm512_loadu_si512(chunk.as_ptr().add(8 * j).cast()) };
            *a = _mm512_add_epi64(*a, v);
        }
    }
    let v = _mm512_add_epi64(
        _mm512_add_epi64(acc[0], acc[1]),
        _mm512_add_epi64(acc[2], acc[3]),
    );
    let mut lanes = [0u64; 8];
    // SAFETY: `lanes` is 64 writable bytes.
    unsafe { _mm512_storeu_si512(lanes.as_mut_ptr().cast(), v) };
    lanes
        .iter()
        .chain(tail)
        .fold(0u64, |a, &w| a.wrapping_add(w))
}

/// Checks a kernel's first rows against the scalar oracle once, outside any timed loop:
/// relative deviation at most 1e-4 (exact tiers) or 5e-2 (approximate tiers) of Σ|y|/n.
pub fn check_against_scalar(tier_exact: bool, got: &[f32], want: &[f32]) {
    let scale = want.iter().map(|v| v.abs()).sum::<f32>() / want.len() as f32;
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let allowed = if tier_exact { 1e-4 } else { 5e-2 } * scale.max(f32::MIN_POSITIVE);
    assert!(
        worst <= allowed,
        "kernel disagrees with scalar: max |Δ| {worst} > {allowed}"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The probe reads every word exactly once, one share per pinned worker: its sum is the
    /// serial sum whatever the thread count.
    #[test]
    fn read_all_reads_every_word_once() {
        let buf = bandwidth_buffer(1 << 20);
        let words: &[u64] = bytemuck::cast_slice(&buf[..]);
        let serial = words.iter().fold(0u64, |a, &w| a.wrapping_add(w));
        for threads in [1, 2, 3] {
            let pool = Pool::new(threads).unwrap();
            assert_eq!(read_all(&pool, &buf), serial, "{threads} threads");
        }
    }
}
