//! Criterion benchmarks of the kernels on K3 shapes: `cargo bench --bench kernels [-- FILTER]`.
//!
//! Ids are `{op}/{shape}.{cache}.t{threads}/{tier}`; throughput is bytes of weights read, so
//! criterion's figures compare directly with `read_bw/1GiB.out-of-cache.t{threads}/sum`,
//! the STREAM-like read measured by the same harness. Cases are shared with
//! `cargo xtask bench-kernels` (`benches::cases`), which prints the ratios in one table.

use std::time::Duration;

use benches::Pool;
use benches::cases::{Case, Workloads, cases, read_case};
use criterion::{BenchmarkId, Criterion, Throughput};
use mxfp4_kernels::Kernels;

fn bench(c: &mut Criterion, case: &mut Case<'_>) {
    let mut group = c.benchmark_group(case.op);
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    group.throughput(Throughput::Bytes(case.bytes as u64));
    group.bench_function(BenchmarkId::new(case.function(), case.variant), |b| {
        b.iter(|| (case.run)())
    });
    group.finish();
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    eprintln!("generating ~2.2 GB of K3-shaped weights and the read probe ...");
    let w = Workloads::generate();
    for threads in [1, 2] {
        let pool = Pool::new(threads).expect("a pinned pool");
        bench(&mut c, &mut read_case(&w, &pool));
        for k in Kernels::available() {
            for mut case in cases(&w, &pool, k) {
                bench(&mut c, &mut case);
            }
        }
    }
    c.final_summary();
}
