//! Special files for the tests that check a reader refuses them ([`mkfifo`]), and a bound on
//! how long such a test may wait ([`promptly`]): a reader that opened a FIFO would wait for a
//! writer for ever, and the test must fail, not hang the suite.

use std::ffi::{CString, c_char, c_int};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Duration;

// Declared here rather than through the `libc` crate: this crate depends on nothing.
unsafe extern "C" {
    fn mkfifo(path: *const c_char, mode: u32) -> c_int;
}

/// Makes a FIFO (named pipe) at `path`, readable and writable by its owner; panics when it
/// cannot (a test has nothing to check without it).
pub fn make_fifo(path: &Path) {
    let c = CString::new(path.as_os_str().as_bytes()).expect("a path without NUL");
    // SAFETY: mkfifo(3) reads a NUL-terminated path that outlives the call; `mode_t` is a
    // 32-bit unsigned integer on every Linux target.
    let rc = unsafe { mkfifo(c.as_ptr(), 0o600) };
    assert_eq!(
        rc,
        0,
        "mkfifo {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
}

/// Puts `special` where the file at `path` was (removed first): `"fifo"` makes a FIFO, any
/// other value is what a symlink there points at (`/dev/zero`, say). Returns how the readers
/// name what is there: `"a FIFO"` or `"a character device"`.
pub fn replace_with_special(path: &Path, special: &str) -> &'static str {
    let _ = std::fs::remove_file(path);
    if special == "fifo" {
        make_fifo(path);
        "a FIFO"
    } else {
        std::os::unix::fs::symlink(special, path).expect("a symlink in the test's directory");
        "a character device"
    }
}

/// `f`'s result, computed on a thread of its own; panics, naming `what`, when it takes over
/// `within` (the thread is then left behind, blocked where it was: a test process ends
/// anyway).
pub fn promptly<T: Send + 'static>(
    what: &str,
    within: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(within)
        .unwrap_or_else(|_| panic!("{what}: still blocked after {within:?}"))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileTypeExt;

    use super::*;
    use crate::Scratch;

    #[test]
    fn a_fifo_is_made_and_a_blocked_call_is_caught() {
        let dir = Scratch::new("testkit-fifo");
        let fifo = dir.path().join("fifo");
        make_fifo(&fifo);
        assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
        assert_eq!(promptly("quick", Duration::from_secs(5), || 7), 7);
        let blocked = std::panic::catch_unwind(|| {
            promptly("slow", Duration::from_millis(50), || {
                std::thread::sleep(Duration::from_secs(2))
            })
        });
        assert!(blocked.is_err());
    }
}
