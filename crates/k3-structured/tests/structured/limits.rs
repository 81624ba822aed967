//! The work limits, rejected tokens, and the mask time measured on the tiny tokenizer.

use std::time::Duration;

use k3_structured::{Error, Grammar, Limits, Matcher, Options, Spec};

use crate::generate::generate;
use crate::json::nested_schema;
use crate::{special, vocab};

#[test]
fn a_compile_limit_of_about_zero_fails_cleanly() {
    let options = Options {
        limits: Limits {
            compile: Duration::from_nanos(1),
            ..Limits::default()
        },
        ..Options::default()
    };
    let spec = Spec::JsonSchema(nested_schema());
    match Grammar::compile(&vocab(), &spec, &options) {
        Err(Error::CompileTime { limit, took }) => {
            assert_eq!(limit, Duration::from_nanos(1));
            assert!(took > limit);
        }
        other => panic!("{other:?}"),
    }
    // Nothing is left broken: the same spec compiles with the default limits.
    Grammar::compile(&vocab(), &spec, &Options::default()).unwrap();
}

#[test]
fn a_mask_limit_of_about_zero_fails_the_sequence() {
    let options = Options {
        limits: Limits {
            mask: Duration::from_nanos(1),
            ..Limits::default()
        },
        ..Options::default()
    };
    let grammar = Grammar::compile(&vocab(), &Spec::JsonObject, &options).unwrap();
    let mut matcher = Matcher::new(&grammar);
    // The first mask comes with the grammar; the second is computed, and too slow.
    let first = matcher.mask().unwrap().clone();
    let open = (0..first.n_vocab() as u32)
        .find(|&t| first.allows(t) && crate::tokenizer().decode(&[t]) == "{")
        .unwrap();
    matcher.commit(open).unwrap();
    assert!(matches!(matcher.mask(), Err(Error::MaskTime { .. })));
    assert!(matches!(matcher.commit(open), Err(Error::MaskTime { .. })));
}

#[test]
fn a_disallowed_token_is_rejected_and_changes_nothing() {
    let grammar = Grammar::compile(&vocab(), &Spec::JsonObject, &Options::default()).unwrap();
    let mut matcher = Matcher::new(&grammar);
    let end = special("<|end_of_msg|>");
    let before = matcher.mask().unwrap().clone();
    assert!(!before.allows(end), "an empty output is no object");
    assert_eq!(matcher.commit(end), Err(Error::Rejected { token: end }));
    let past = crate::TOKENIZER_IDS as u32;
    assert_eq!(matcher.commit(past), Err(Error::Rejected { token: past }));
    assert_eq!(matcher.mask().unwrap(), &before);
    // Logits of disallowed tokens become -inf.
    let mut logits = vec![0.0f32; crate::N_VOCAB];
    before.apply(&mut logits);
    assert_eq!(
        logits.iter().filter(|l| l.is_finite()).count(),
        before.count()
    );
}

/// Prints the mask time per token for the nested schema on the tiny tokenizer (the number in
/// the crate's README; k3-0.40b's tokenizer is measured by `examples/mask_time.rs`).
#[test]
fn mask_time_per_token_on_the_tiny_tokenizer() {
    let spec = Spec::JsonSchema(nested_schema());
    let grammar = Grammar::compile(&vocab(), &spec, &Options::default()).unwrap();
    let mut tokens = 0;
    let mut total = Duration::ZERO;
    for seed in 0..20 {
        let mut matcher = Matcher::new(&grammar);
        let out = generate(&grammar, 1.0, 1000 + seed, false);
        // Replay the sequence to time its masks.
        for &token in &out.tokens {
            matcher.mask().unwrap();
            matcher.commit(token).unwrap();
        }
        let end = special("<|end_of_msg|>");
        matcher.commit(end).unwrap();
        tokens += out.tokens.len() + 1;
        total += matcher.mask_time();
    }
    println!(
        "nested schema, tiny tokenizer ({} ids): compile {:?}, {} tokens, mask {:?} per token",
        crate::N_VOCAB,
        grammar.compile_time(),
        tokens,
        total / tokens as u32
    );
}

/// A schema whose `$ref`s chain 3,000 definitions deep, and a Lark grammar of 5,000 chained
/// rules, compiled from a thread with a 256 KB stack: llguidance recurses per level (the
/// grammar used to overflow the 8 MB main thread and abort the process; the schema, at 400
/// levels, a server's 2 MB worker), so the compile runs on a thread of its own with a large
/// stack and answers (a grammar, or a clean error), whatever the caller's stack.
#[test]
fn deeply_chained_constraints_compile_on_a_stack_of_their_own() {
    let n = 3000;
    let mut defs = serde_json::Map::new();
    for i in 0..n {
        let next = format!("#/$defs/d{}", i + 1);
        defs.insert(
            format!("d{i}"),
            serde_json::json!({"anyOf": [{"$ref": next}, {"type": "null"}]}),
        );
    }
    defs.insert(format!("d{n}"), serde_json::json!({"type": "integer"}));
    let schema = Spec::JsonSchema(serde_json::json!({"$ref": "#/$defs/d0", "$defs": defs}));
    let mut rules = vec!["start: r0".to_owned()];
    rules.extend((0..5000).map(|i| format!("r{i}: r{} | \"x{i}\"", i + 1)));
    rules.push("r5000: \"z\"".into());
    let lark = Spec::Lark(rules.join("\n"));
    let options = Options {
        limits: Limits {
            compile: Duration::from_secs(120),
            ..Limits::default()
        },
        ..Options::default()
    };
    for spec in [schema, lark] {
        let outcome = std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn({
                let options = options.clone();
                move || Grammar::compile(&vocab(), &spec, &options).map(|_| ())
            })
            .unwrap()
            .join()
            .expect("the compile returns, it does not take the caller's thread down");
        // Compiled; or refused by llguidance's own limits, with its words.
        if let Err(e) = outcome {
            assert!(matches!(e, Error::Invalid(_)), "{e:?}");
        }
    }
}
