//! Reading a checkpoint directory's `config.json`: a regular file only, up to a cap, so a FIFO
//! or a link to a device in its place is refused at once instead of blocking or being read
//! for ever.

use std::path::Path;

use expert_store::file::{ReadFileError, read_regular_text};

/// The config's file name in a checkpoint directory.
pub const CONFIG_FILE: &str = "config.json";

/// The most bytes `config.json` may hold: the release's is a few KB, so 16 MiB is generous,
/// and a file that is no config is not read whole.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// The text of `dir`'s `config.json` (parse it with [`K3Config::from_json`]).
///
/// [`K3Config::from_json`]: super::K3Config::from_json
pub fn read_config_text(dir: &Path) -> Result<String, ReadFileError> {
    read_regular_text(&dir.join(CONFIG_FILE), MAX_CONFIG_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A FIFO or a link to `/dev/zero` as `config.json`: refused at once, naming it.
    #[test]
    fn a_fifo_or_a_device_as_the_config_is_refused_at_once() {
        for special in ["fifo", "/dev/zero"] {
            let dir = k3_testkit::Scratch::new("config-specials");
            let path = dir.path().join(CONFIG_FILE);
            let kind = k3_testkit::replace_with_special(&path, special);
            let from = dir.path().to_owned();
            let read =
                k3_testkit::promptly(special, std::time::Duration::from_secs(5), move || {
                    read_config_text(&from).map(|_| ())
                });
            assert_eq!(
                read.expect_err(special).to_string(),
                format!("{} is {kind}, not a regular file", path.display())
            );
        }
        let dir = k3_testkit::Scratch::new("config-regular");
        std::fs::write(dir.path().join(CONFIG_FILE), "{}").unwrap();
        assert_eq!(read_config_text(dir.path()).unwrap(), "{}");
    }
}
