//! Threads outside the worker pools: the I/O threads, placed on a set of CPUs.

/// Starts an I/O thread named `k3-io-{index}`, allowed to run on `cpus` only (the caller's
/// domain for I/O; engines pass their pool's domain 0) from before `f` runs, so the buffers it
/// first touches are that domain's. I/O threads mostly sleep in `pread`, so they get the
/// domain's whole CPU set rather than one core of it. With `cpus` empty the thread is not
/// placed (tools and tests that have no pool). A CPU set the kernel refuses (none of them
/// allowed to this process) leaves the thread unplaced, as a worker whose pinning fails.
pub fn spawn_io_thread<T: Send + 'static>(
    index: usize,
    cpus: &[usize],
    f: impl FnOnce() -> T + Send + 'static,
) -> std::io::Result<std::thread::JoinHandle<T>> {
    let cpus = cpus.to_vec();
    std::thread::Builder::new()
        .name(format!("k3-io-{index}"))
        .spawn(move || {
            if !cpus.is_empty() {
                let _ = set_current_cpus(&cpus);
            }
            f()
        })
}

/// Restricts the calling thread to `cpus` (`sched_setaffinity`); CPUs past the mask's size
/// (1024) are left out.
#[cfg(target_os = "linux")]
pub(crate) fn set_current_cpus(cpus: &[usize]) -> std::io::Result<()> {
    // SAFETY: an all-zero `cpu_set_t` is a valid empty set (it is a plain bit array).
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let max = 8 * std::mem::size_of::<libc::cpu_set_t>();
    for &cpu in cpus.iter().filter(|&&cpu| cpu < max) {
        // SAFETY: `cpu` is below the set's size in bits, checked just above.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: `set` is a live, initialised `cpu_set_t` and the size passed is its own; pid 0
    // is the calling thread.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Thread placement is Linux-only: elsewhere threads are left where the OS puts them.
#[cfg(not(target_os = "linux"))]
pub(crate) fn set_current_cpus(_cpus: &[usize]) -> std::io::Result<()> {
    Ok(())
}

/// The CPUs the calling thread may run on (Linux; elsewhere empty).
#[cfg(all(test, target_os = "linux"))]
fn current_cpus() -> Vec<usize> {
    // SAFETY: as in `set_current_cpus`: an all-zero `cpu_set_t` is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is writable and the size passed is its own; pid 0 is the calling thread.
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    assert_eq!(
        rc,
        0,
        "sched_getaffinity: {}",
        std::io::Error::last_os_error()
    );
    (0..8 * std::mem::size_of::<libc::cpu_set_t>())
        // SAFETY: `cpu` is below the set's size in bits.
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect()
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn an_io_thread_runs_on_the_cpus_it_is_given() {
        let allowed = current_cpus();
        assert!(!allowed.is_empty());
        // One CPU of those this process may use: a set strictly smaller than the inherited one
        // whenever there are two, so an unplaced thread could not pass by inheritance.
        let one = vec![allowed[allowed.len() - 1]];
        let (name, cpus) = spawn_io_thread(3, &one, || {
            (
                std::thread::current().name().map(str::to_owned),
                current_cpus(),
            )
        })
        .unwrap()
        .join()
        .unwrap_or_else(|_| panic!("the I/O thread panicked"));
        assert_eq!(name.as_deref(), Some("k3-io-3"));
        assert_eq!(cpus, one);
        // No set: the thread keeps the spawner's CPUs.
        let inherited = spawn_io_thread(0, &[], current_cpus)
            .unwrap()
            .join()
            .unwrap();
        assert_eq!(inherited, allowed);
    }
}
