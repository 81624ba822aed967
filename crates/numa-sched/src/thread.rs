//! Threads outside the worker pools: the I/O threads.

/// Starts an I/O thread named `k3-io-{index}` on domain 0's CPUs (all of them, with one
/// domain). I/O threads mostly sleep in `pread`, so they are not pinned to one core: the
/// domain is their placement.
pub fn spawn_io_thread(
    index: usize,
    f: impl FnOnce() + Send + 'static,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("k3-io-{index}"))
        .spawn(f)
}
