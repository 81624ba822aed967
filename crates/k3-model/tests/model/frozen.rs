//! Frozen reference data: `tests/data/<set>/<file>` checked against its `<file>.sha256`
//! sidecar (sha256sum's `HEX  NAME` line) before any test trusts it.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// `tests/data/<set>`.
pub(crate) fn data_dir(set: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(set)
}

/// The bytes of `file` in `set`, after checking them against the sidecar; the failure names
/// the `cargo xtask` command that regenerates them.
pub(crate) fn read_frozen(set: &str, file: &str, command: &str) -> Vec<u8> {
    let dir = data_dir(set);
    let sidecar = std::fs::read_to_string(dir.join(format!("{file}.sha256"))).unwrap();
    let (want, name) = sidecar
        .trim_end()
        .split_once("  ")
        .unwrap_or_else(|| panic!("{file}.sha256 is not a sha256sum line: {sidecar:?}"));
    assert_eq!(name, file, "{file}.sha256 names another file");
    let bytes = std::fs::read(dir.join(file)).unwrap();
    let got: String = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(got, want, "{set}/{file} changed since `{command}` froze it");
    bytes
}
