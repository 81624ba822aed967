//! Tests of `queue.rs`.

use super::*;
use crate::engine::job::Event;
use crate::engine::state::StateFiles;

fn job() -> (Job, tokio::sync::mpsc::UnboundedReceiver<Event>) {
    let (events, rx) = tokio::sync::mpsc::unbounded_channel();
    let request =
        crate::api::completion::CompletionRequest::from_json(&serde_json::json!({"prompt": "x"}))
            .unwrap()
            .validate(&crate::api::limits::Limits {
                model_names: vec!["m".into()],
                max_tokens_default: 4,
                context: 64,
                thinking_effort: Default::default(),
                thinking: true,
                vocab_size: 16,
                max_compile: std::time::Duration::from_secs(2),
                max_mask: std::time::Duration::from_millis(200),
                created: 0,
            })
            .unwrap();
    let job = Job {
        request,
        prompt_ids: vec![1],
        system_tokens: 0,
        cache_namespace: Default::default(),
        events,
        log_id: None,
        submitted: std::time::Instant::now(),
        state: StateFiles::default(),
        grammar: None,
    };
    (job, rx)
}

/// Jobs whose receivers are dropped leave the queue at once: the depth falls, their
/// slots are free for new submits, and the engine pops only the live one.
#[test]
fn abandoned_jobs_leave_at_once() {
    let depth = Arc::new(AtomicI64::new(0));
    let queue = JobQueue::new(3, Arc::clone(&depth));
    let (a, rx_a) = job();
    let (b, rx_b) = job();
    let (c, rx_c) = job();
    for j in [a, b, c] {
        queue.submit(j).unwrap();
    }
    let (d, _rx_d) = job();
    assert_eq!(queue.submit(d), Err(SubmitError::Full));
    assert_eq!(depth.load(Ordering::Relaxed), 3);
    drop(rx_a);
    drop(rx_c);
    assert_eq!(queue.depth(), 1);
    assert_eq!(depth.load(Ordering::Relaxed), 1);
    let (e, rx_e) = job();
    let (f, _rx_f) = job();
    queue.submit(e).unwrap();
    queue.submit(f).unwrap();
    let Pop::Job(first) = queue.pop(false) else {
        panic!("a live job waits")
    };
    drop(rx_b);
    assert!(first.events.is_closed(), "the first popped is b");
    // e went away while waiting: the next pop skips it and gives f.
    drop(rx_e);
    let mut live = 0;
    while let Pop::Job(job) = queue.pop(false) {
        assert!(!job.events.is_closed());
        live += 1;
    }
    assert_eq!(live, 1);
    assert_eq!(depth.load(Ordering::Relaxed), 0);
}

#[test]
fn closing_drains_then_stops() {
    let queue = JobQueue::new(2, Arc::new(AtomicI64::new(0)));
    let sender = Sender(Arc::clone(&queue));
    let (a, _rx) = job();
    queue.submit(a).unwrap();
    drop(sender);
    let (b, _rx_b) = job();
    assert_eq!(queue.submit(b), Err(SubmitError::Stopped));
    assert!(matches!(queue.pop(true), Pop::Job(_)));
    assert!(matches!(queue.pop(true), Pop::Closed));
}
