//! The machine a run measured, as `/proc/cpuinfo` names it: the first CPU's model name,
//! family and model, and whether it has AVX-512F.

/// The first CPU's identity, one line (`unknown CPU` where `/proc/cpuinfo` cannot be read).
pub(crate) fn describe() -> String {
    match std::fs::read_to_string("/proc/cpuinfo") {
        Ok(text) => describe_cpuinfo(&text),
        Err(e) => format!("unknown CPU (/proc/cpuinfo: {e})"),
    }
}

/// [`describe`] of a `/proc/cpuinfo` text: the fields of its first processor.
fn describe_cpuinfo(text: &str) -> String {
    let first = text.split("\n\n").next().unwrap_or("");
    let field = |name: &str| {
        first.lines().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            (key.trim() == name).then(|| value.trim().to_owned())
        })
    };
    let unknown = || "?".to_owned();
    let avx512f =
        field("flags").is_some_and(|flags| flags.split_whitespace().any(|f| f == "avx512f"));
    format!(
        "{} (family {}, model {}), avx512f {}",
        field("model name").unwrap_or_else(unknown),
        field("cpu family").unwrap_or_else(unknown),
        field("model").unwrap_or_else(unknown),
        if avx512f { "yes" } else { "no" },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_processor_is_described() {
        let text = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n\
                    model name\t: AMD EPYC 9R14\nflags\t\t: fpu avx2 avx512f avx512bw\n\n\
                    processor\t: 1\nmodel name\t: other\n";
        assert_eq!(
            describe_cpuinfo(text),
            "AMD EPYC 9R14 (family 25, model 17), avx512f yes"
        );
        assert_eq!(
            describe_cpuinfo("model name\t: X\nflags\t: avx512fx avx2\n"),
            "X (family ?, model ?), avx512f no"
        );
    }
}
