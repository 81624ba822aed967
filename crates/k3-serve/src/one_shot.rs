//! The one-shot run (`--prompt`): one request through the same validation and engine as the
//! server's, the answer on stdout and the rest on stderr.

use std::io::{IsTerminal, Write};
use std::sync::atomic::Ordering;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use k3_serve::api::{ChatRequest, CompletionRequest, Limits, OutputConstraint, Prompt};
use k3_serve::engine::{EngineHandle, Event, Job, prompt_ids};
use serde_json::json;

use crate::args::{Args, usage_exit};

/// The one-shot run: `--prompt` as a user message, validated as the server validates a chat
/// request (the same `ChatRequest::validate`), or with `--raw` as plain text (a completion
/// request), checked against `--ctx`, then generated; from `--load-state`'s state when given,
/// and with `--save-state` writing the state after the answer. The
/// answer goes to stdout; the reasoning (marked `[reasoning]`, dimmed on a terminal), the
/// `[answer]` mark and the timing line go to stderr, so `k3-serve --prompt ... > out.txt`
/// keeps the answer alone.
pub(crate) fn one_shot(engine: &EngineHandle, limits: &Limits, args: &Args) -> Result<()> {
    let body = json!({
        "messages": [{"role": "user", "content": args.prompt.clone().unwrap_or_default()}],
        "max_tokens": limits.max_tokens_default,
        "temperature": args.temperature,
        "seed": args.seed,
        "stream": true,
    });
    let request = if args.raw {
        let mut body = body;
        let object = body.as_object_mut().expect("a JSON object");
        object.remove("messages");
        object.insert(
            "prompt".into(),
            json!(args.prompt.clone().unwrap_or_default()),
        );
        let request: CompletionRequest =
            serde_json::from_value(body).context("building the request")?;
        request.validate(limits)
    } else {
        let request: ChatRequest = serde_json::from_value(body).context("building the request")?;
        request.validate(limits)
    };
    let request = request.unwrap_or_else(|e| {
        let flag = match e.param.as_deref() {
            Some("max_tokens") => "--max-tokens",
            Some("temperature") => "--temperature",
            Some("seed") => "--seed",
            _ => "--prompt",
        };
        usage_exit(format!("{flag}: {}", e.message))
    });
    // --json-schema / --grammar: the answer after any reasoning is constrained.
    let request = match &args.constraint {
        Some((spec, flag)) => {
            let thinking = matches!(request.prompt, Prompt::Chat { thinking: true, .. });
            request.constrained(Some(OutputConstraint {
                spec: spec.clone(),
                thinking,
                field: flag,
            }))
        }
        None => request,
    };
    // Compiled before waiting for the model: a schema the library refuses is told at once.
    let grammar = match &request.constraint {
        Some(constraint) => match engine.compile_constraint(constraint, limits) {
            Ok(grammar) => Some(grammar),
            Err(e) if e.status.is_client_error() => usage_exit(e.message),
            Err(e) => bail!("{}", e.message),
        },
        None => None,
    };
    if let Err(why) = engine.wait_loaded(None) {
        bail!("the model did not load: {why}");
    }
    let ids = prompt_ids(&engine.tokenizer, &request.prompt);
    if ids.len() + request.max_tokens > limits.context {
        usage_exit(format!(
            "the prompt ({} tokens, chat template included) plus --max-tokens {} exceeds --ctx {}",
            ids.len(),
            request.max_tokens,
            limits.context
        ));
    }
    let max_tokens = request.max_tokens;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let start = Instant::now();
    engine
        .submit(Job {
            request,
            prompt_ids: ids,
            system_tokens: 0,
            cache_namespace: Default::default(),
            events: tx,
            log_id: None,
            submitted: start,
            state: args.state.clone(),
            grammar,
        })
        .map_err(|e| anyhow::anyhow!("could not queue the prompt: {e:?}"))?;
    let mut out = std::io::stdout();
    let mut err = std::io::stderr();
    let (dim, undim) = if err.is_terminal() {
        ("\x1b[2m", "\x1b[0m")
    } else {
        ("", "")
    };
    let (mut in_reasoning, mut reasoned, mut answered) = (false, false, false);
    let mut tokens = 0;
    while let Some(event) = rx.blocking_recv() {
        match event {
            Event::Delta {
                reasoning, content, ..
            } => {
                if !reasoning.is_empty() {
                    if !in_reasoning {
                        write!(err, "[reasoning]\n{dim}")?;
                        in_reasoning = true;
                        reasoned = true;
                    }
                    write!(err, "{reasoning}")?;
                    err.flush()?;
                }
                if !content.is_empty() {
                    if in_reasoning {
                        writeln!(err, "{undim}")?;
                        in_reasoning = false;
                    }
                    if reasoned && !answered {
                        writeln!(err, "[answer]")?;
                    }
                    answered = true;
                    write!(out, "{content}")?;
                    out.flush()?;
                }
            }
            Event::Done {
                finish_reason,
                completion_tokens,
                prompt_tokens,
                cached_tokens,
                prefill,
                decode,
                passes,
            } => {
                tokens = completion_tokens;
                if in_reasoning {
                    writeln!(err, "{undim}")?;
                }
                if answered {
                    writeln!(out)?;
                } else if reasoned && finish_reason == "length" {
                    writeln!(
                        err,
                        "[no answer: the {max_tokens} tokens ran out while thinking; raise --max-tokens or give --no-think]"
                    )?;
                }
                let total = start.elapsed().as_secs_f64();
                // Output constraints: each token's mask time (on its own thread, beside the
                // step's forward pass).
                let masks = engine.metrics.masks.load(Ordering::Relaxed);
                if masks > 0 {
                    let mask_ns = engine.metrics.mask_ns.load(Ordering::Relaxed);
                    writeln!(
                        err,
                        "constrained: {masks} masks, {:.3} ms per token",
                        mask_ns as f64 / 1e6 / masks as f64
                    )?;
                }
                let prefill = prefill.as_secs_f64();
                // Tokens restored from --load-state instead of prefilled.
                let prompt_tokens = if cached_tokens > 0 {
                    format!("{prompt_tokens} ({cached_tokens} restored from --load-state)")
                } else {
                    prompt_tokens.to_string()
                };
                // The first token comes with the prefill; the rest are decode steps, so one
                // token has no decode rate.
                if completion_tokens <= 1 {
                    let unit = if completion_tokens == 1 {
                        "token"
                    } else {
                        "tokens"
                    };
                    writeln!(
                        err,
                        "{completion_tokens} {unit} ({finish_reason}); prefill of {prompt_tokens} tokens {prefill:.3} s ({total:.2} s in all)"
                    )?;
                } else {
                    // Tokens per pass: above 1 when speculation verified drafts.
                    writeln!(
                        err,
                        "{completion_tokens} tokens ({finish_reason}); prefill of {prompt_tokens} tokens {prefill:.3} s, then {:.2} tokens/s decoding, {:.2} tokens per pass ({total:.2} s in all)",
                        (completion_tokens - 1) as f64 / decode.as_secs_f64().max(1e-9),
                        (completion_tokens - 1) as f64 / passes.max(1) as f64,
                    )?;
                }
            }
            Event::Error(message) => bail!("generation failed: {message}"),
        }
    }
    if tokens == 0 {
        bail!("no tokens were generated");
    }
    Ok(())
}
