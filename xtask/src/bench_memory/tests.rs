//! The memory sweep's helpers: budgets, lists, the direct-read probe, output parsing.

use super::*;

#[test]
fn budgets_in_gb_and_as_fractions_of_the_model() {
    let gb = budgets(Some("1.5,0.25"), None, 1_000_000_000).unwrap();
    assert_eq!(
        gb.iter().map(|b| b.0).collect::<Vec<_>>(),
        [1_500_000_000, 250_000_000]
    );
    assert!(gb[0].1.contains("1.50x the model"), "{}", gb[0].1);
    let f = budgets(None, Some("1.2,0.5"), 3_000_000_000).unwrap();
    assert_eq!(
        f.iter().map(|b| b.0).collect::<Vec<_>>(),
        [3_600_000_000, 1_500_000_000]
    );
}

#[test]
fn bad_budgets_are_refused_with_the_value() {
    let e = budgets(Some("2,x"), None, 1).unwrap_err().to_string();
    assert!(e.contains("\"x\""), "{e}");
    assert!(budgets(None, Some("0"), 1).is_err());
    assert!(budgets(Some("1"), Some("1"), 1).is_err());
    assert!(budgets(None, None, 1).is_err());
}

#[test]
fn decode_times_from_both_engines_output() {
    let ours = "step 1 ...\n8 steps: median 12.000 ms/token, mean after the first 20.000 ms/token; 5 weight bytes per token; combined fingerprint 00ff\n";
    assert_eq!(seconds_per_token(true, ours).unwrap(), 0.02);
    let peer = r#"[{"avg_ts": 4.0, "n_gen": 32}]"#;
    assert_eq!(seconds_per_token(false, peer).unwrap(), 0.25);
    assert!(seconds_per_token(true, "no such line").is_err());
}

#[test]
fn the_peer_mark_is_the_timed_run_not_the_warm_up() {
    // The two lines llama-bench 0.3.36 prints with --progress, in this order.
    let warm_up = "llama-bench: benchmark 1/1: warmup generation run";
    let timed = "llama-bench: benchmark 1/1: generation run 1/1";
    assert!(!warm_up.contains(LLAMA_TIMED_MARK));
    assert!(timed.contains(LLAMA_TIMED_MARK));
}

#[test]
fn a_file_just_read_is_resident_and_dropped_is_not() {
    let exe = std::env::current_exe().unwrap();
    let path = exe.with_file_name(format!("{}.resident", group_name("file")));
    std::fs::write(&path, vec![1u8; 1 << 20]).unwrap();
    std::fs::File::open(&path).unwrap().sync_all().unwrap();
    let _ = std::fs::read(&path).unwrap();
    let before = resident_bytes(&path).unwrap();
    crate::runs::drop_page_cache(&path).unwrap();
    let after = resident_bytes(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(before, 1 << 20);
    assert_eq!(after, 0);
}

#[test]
fn the_plans_prediction_is_read_from_the_plan_line() {
    let stderr = "loading\nmemory plan: budget 3.62 GB (cgroup): resident trunk 2.10 GB; \
                  trunk streamed 4.01 GB per token through 2 buffer(s), experts cached 0% \
                  with 4 reads in flight; predicted from disk 4.57 GB per token\nstep 0\n";
    assert_eq!(predicted_disk_per_token(stderr), Some(4.57e9));
    // Everything fits: the line predicts nothing.
    let fits = "memory plan: budget 9.48 GB (cgroup): everything fits, weights read through \
                the file mapping; resident trunk 0 GB\n";
    assert_eq!(predicted_disk_per_token(fits), None);
    assert_eq!(predicted_disk_per_token("no plan here"), None);
}

#[test]
fn the_direct_read_reads_every_request_once_at_any_depth() {
    let exe = std::env::current_exe().unwrap();
    let path = exe.with_file_name(format!("{}.direct", group_name("file")));
    // Three whole requests and a tail that a whole request cannot cover.
    std::fs::write(&path, vec![3u8; (24 << 20) + 4096]).unwrap();
    let reads: Vec<_> = [1, 2, 3, 8]
        .into_iter()
        .map(|depth| (depth, direct_read(&path, u64::MAX, depth)))
        .collect();
    let capped = direct_read(&path, 16 << 20, 2);
    std::fs::remove_file(&path).unwrap();
    for (depth, read) in reads {
        match read {
            // Each 8 MiB request read once, whatever the depth; the tail is left out.
            Ok((bytes, seconds)) => {
                assert_eq!(bytes, 24 << 20, "depth {depth}");
                assert!(seconds > 0.0, "depth {depth}");
            }
            // Some filesystems (tmpfs) refuse O_DIRECT: that is an error naming the file.
            Err(e) => assert!(format!("{e:#}").contains("O_DIRECT"), "{e:#}"),
        }
    }
    if let Ok((bytes, _)) = capped {
        assert_eq!(bytes, 16 << 20);
    }
}
