//! The command line as a user meets it: `--help` is the flag table, `--version`, usage errors
//! as one line with exit 2 (whatever `RUST_BACKTRACE` says), the llama-server / vLLM spellings
//! (`-m`, `-t`, `--ctx-size`, `--port=N`), `--served-model-name` aliases, `--api-key`, the
//! per-request log line, unseeded sampling, `--scan`, and the one-shot run's output.

use std::ffi::{OsStr, OsString};
use std::os::unix::fs::FileExt;
use std::time::Duration;

use k3_serve::cli::{k3_serve_flags, render_help};
use serde_json::{Value, json};

use crate::e2e::{free_port, post_chat, request, request_with, run_captured, start, start_exactly};

const VERSION: &str = env!("CARGO_PKG_VERSION");

fn os(args: &[&str]) -> Vec<OsString> {
    args.iter().map(OsString::from).collect()
}

/// Runs the binary to its exit (at most 120 s: a one-shot run on the tiny model takes a
/// few seconds): status code, stdout, stderr.
fn run(args: &[OsString], env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let args: Vec<&OsStr> = args.iter().map(OsString::as_os_str).collect();
    let (status, stdout, stderr) = run_captured(&args, env, Duration::from_secs(120));
    (status.code(), stdout, stderr)
}

/// `-m TINY -t 2` and `args`.
fn on_tiny(args: &[&str]) -> Vec<OsString> {
    let mut all = vec![
        OsString::from("-m"),
        crate::tiny().into(),
        "-t".into(),
        "2".into(),
    ];
    all.extend(os(args));
    all
}

#[test]
fn help_is_the_flag_table_and_lists_every_flag() {
    let table = k3_serve_flags();
    let expected = render_help(&table, "k3-serve", VERSION);
    for spelling in ["--help", "-h"] {
        let (code, stdout, stderr) = run(&os(&[spelling]), &[]);
        assert_eq!(code, Some(0), "{stderr}");
        assert_eq!(stdout, expected);
        // Read back, the help lists exactly the table's flags, in its order.
        let names: Vec<String> = table.iter().map(|f| f.long()).collect();
        assert_eq!(k3_cli::flags_in_help(&stdout), names);
    }
    for flag in &table {
        // The line whose first column (`-m, --model DIR`) names the flag.
        let line = expected
            .lines()
            .find(|l| {
                l.starts_with("  ")
                    && l.trim_start()
                        .split("  ")
                        .next()
                        .is_some_and(|c| c.split([',', ' ']).any(|w| w == flag.long()))
            })
            .unwrap_or_else(|| panic!("{} is not in --help", flag.long()));
        assert!(
            line.contains(&format!("[default: {}]", flag.default)),
            "{line}"
        );
    }
}

#[test]
fn version_prints_the_name_and_version() {
    for spelling in ["--version", "-V"] {
        let (code, stdout, _) = run(&os(&[spelling]), &[]);
        assert_eq!(code, Some(0));
        assert_eq!(stdout, format!("k3-serve {VERSION}\n"));
    }
}

/// Each mistake is one line on stderr, `k3-serve: ...`, and exit 2, with `RUST_BACKTRACE=1`
/// set (it would add a stack trace to an `anyhow` report); a real failure (no such model)
/// keeps the report and exits 1.
#[test]
fn usage_errors_are_one_line_and_exit_2_under_rust_backtrace() {
    let backtrace = [("RUST_BACKTRACE", "1"), ("RUST_LIB_BACKTRACE", "1")];
    // `--model` naming a GGUF file, and a directory of a partial download.
    let scratch = std::env::temp_dir().join(format!("k3-serve-cli-model-{}", std::process::id()));
    let partial = scratch.join("partial");
    std::fs::create_dir_all(&partial).unwrap();
    for name in [
        "tiktoken.model",
        "tokenizer_config.json",
        "model.safetensors.index.json",
    ] {
        std::fs::write(partial.join(name), b"").unwrap();
    }
    let gguf = scratch.join("Kimi-K3-Q4_K_M.gguf");
    std::fs::write(&gguf, b"GGUF\x03\0\0\0").unwrap();
    let model = |path: &std::path::Path| {
        let mut args = os(&["--prompt", "hi", "--model"]);
        args.push(path.into());
        args
    };
    let gguf_error = format!("--model {}: a GGUF file", gguf.display());
    let partial_error = format!(
        "--model {}: no config.json in the directory",
        partial.display()
    );
    let cases: Vec<(Vec<OsString>, &str)> = vec![
        // A model directory that is not there, a GGUF file, one without config.json: named
        // as such before anything reads them.
        (
            os(&["--model", "/nonexistent/k3", "--prompt", "hi"]),
            "--model /nonexistent/k3: no such directory",
        ),
        (model(&gguf), &gguf_error),
        (model(&partial), &partial_error),
        (os(&["--thread", "4"]), "did you mean --threads?"),
        (
            os(&["--prompt", "hi", "--temperature", "-1"]),
            "--temperature",
        ),
        (os(&["--serve", "--port=0"]), "--port"),
        (os(&["--model"]), "--model needs a value"),
        (os(&["serve"]), "unexpected argument"),
        (os(&[]), "give --prompt"),
        (os(&["--serve", "--prompt", "x"]), "give one of them"),
        (
            os(&["--serve", "--seed", "3"]),
            "--seed is for a one-shot run",
        ),
        (os(&["--no-think=1"]), "is a switch"),
        (
            os(&["--idle-timeout-s", "0", "--serve"]),
            "--idle-timeout-s",
        ),
        // After the flags parse: max_tokens against the context.
        (on_tiny(&["--prompt", "hi", "--ctx", "16"]), "--ctx 16"),
    ];
    for (args, expected) in cases {
        let (code, stdout, stderr) = run(&args, &backtrace);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.starts_with("[INFO")).collect();
        assert_eq!(lines.len(), 1, "{args:?}: {stderr}");
        assert!(lines[0].starts_with("k3-serve: "), "{}", lines[0]);
        assert!(lines[0].contains(expected), "{args:?}: {}", lines[0]);
        assert!(stdout.is_empty());
    }
    let _ = std::fs::remove_dir_all(&scratch);
}

/// `-m`, `-t`, `--ctx-size`, `--port=N`, `-n`, `--no-think` and two `--served-model-name`s:
/// the server listens on N, `/v1/models` lists every name with the context and a real
/// `created`, a request naming an alias or the default name is served (reporting the first
/// alias), another name is a 404; a request without `max_tokens` gets `-n`'s, and a chat
/// without `chat_template_kwargs` does not think; the log says how many compute threads, and
/// one line per request without its prompt.
#[test]
fn llama_server_and_vllm_spellings_and_aliases() {
    let port = free_port();
    let log = std::env::temp_dir().join(format!("k3-serve-cli-log-{}", std::process::id()));
    let args = on_tiny(&[
        "--ctx-size",
        "512",
        "--serve",
        &format!("--port={port}"),
        "--served-model-name",
        "kimi-k3",
        "--served-model-name=moonshotai/Kimi-K3",
        "-n",
        "3",
        "--no-think",
    ]);
    let server = start_exactly(&args, &[], port, Some(&log));
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let (status, text) = request(server.port, "GET", "/v1/models", None).unwrap();
    assert_eq!(status, 200, "{text}");
    let models: Value = serde_json::from_str(&text).unwrap();
    let default = crate::tiny()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["kimi-k3", "moonshotai/Kimi-K3", default.as_str()]);
    for model in models["data"].as_array().unwrap() {
        assert_eq!(model["max_model_len"], 512, "--ctx-size: {model}");
        // The process started within the last minute (it loaded the model meanwhile).
        let created = model["created"].as_u64().unwrap();
        assert!(created <= started && created + 60 > started, "{model}");
    }
    for name in ["kimi-k3", "moonshotai/Kimi-K3", default.as_str()] {
        let body = json!({"model": name, "messages": [{"role": "user", "content": "zebra-secret"}],
                          "max_tokens": 4, "temperature": 0});
        let text = post_chat(server.port, &body, name);
        let answer: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(answer["model"], "kimi-k3");
        assert!(
            answer["choices"][0]["message"]
                .get("reasoning_content")
                .is_none(),
            "--no-think: {text}"
        );
    }
    // No max_tokens: the server's -n 3 (the end tokens banned, so it runs to its length).
    let banned = end_tokens_banned();
    let body = json!({"prompt": "Once", "logit_bias": banned});
    let (status, text) = request(
        server.port,
        "POST",
        "/v1/completions",
        Some(&body.to_string()),
    )
    .unwrap();
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(answer["usage"]["completion_tokens"], 3, "{text}");
    let body = json!({"model": "gpt-4o", "prompt": "x", "max_tokens": 2});
    let (status, text) = request(
        server.port,
        "POST",
        "/v1/completions",
        Some(&body.to_string()),
    )
    .unwrap();
    assert_eq!(status, 404, "{text}");
    assert!(
        text.contains("kimi-k3"),
        "the error names what is served: {text}"
    );
    drop(server);
    let log_text = std::fs::read_to_string(&log).unwrap();
    let _ = std::fs::remove_file(&log);
    assert!(log_text.contains("2 compute threads"), "-t 2: {log_text}");
    assert!(log_text.contains("no --api-key"), "{log_text}");
    let finished: Vec<&str> = log_text
        .lines()
        .filter(|l| l.contains("cmpl-") && l.contains("output tokens"))
        .collect();
    assert_eq!(finished.len(), 4, "one line per request:\n{log_text}");
    for line in finished {
        assert!(
            line.contains("prompt tokens")
                && line.contains("time to first token")
                && (line.contains(": length;") || line.contains(": stop;")),
            "{line}"
        );
    }
    assert!(!log_text.contains("zebra-secret"), "a prompt was logged");
}

/// `--api-key` (and `K3_API_KEY`): `/v1` answers 401 with OpenAI's error object without the
/// key or with a wrong one, 200 with it; `/health` and `/metrics` stay open.
#[test]
fn api_key_guards_v1_and_leaves_health_open() {
    for (flag, env) in [(true, &[][..]), (false, &[("K3_API_KEY", "sk-test")][..])] {
        let port = free_port();
        let mut args = on_tiny(&["--serve", "--port", &port.to_string()]);
        if flag {
            args.extend(os(&["--api-key", "sk-test"]));
        }
        let _server = start_exactly(&args, env, port, None);
        let chat =
            json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).to_string();
        for headers in [&[][..], &["Authorization: Bearer sk-wrong"][..]] {
            for (method, path, body) in [
                ("GET", "/v1/models", None),
                ("POST", "/v1/chat/completions", Some(chat.as_str())),
            ] {
                let (status, text) = request_with(port, method, path, body, headers).unwrap();
                assert_eq!(status, 401, "{path} {headers:?}: {text}");
                let error: Value = serde_json::from_str(&text).unwrap();
                assert_eq!(error["error"]["code"], "invalid_api_key", "{text}");
                assert!(!text.contains("sk-test"));
            }
        }
        let right = ["Authorization: Bearer sk-test"];
        let (status, text) = request_with(port, "GET", "/v1/models", None, &right).unwrap();
        assert_eq!(status, 200, "{text}");
        let (status, text) =
            request_with(port, "POST", "/v1/chat/completions", Some(&chat), &right).unwrap();
        assert_eq!(status, 200, "{text}");
        for path in ["/health", "/metrics"] {
            let (status, text) = request(port, "GET", path, None).unwrap();
            assert_eq!(status, 200, "{path}: {text}");
        }
    }
}

/// Several keys: `--api-key` repeated and `--api-key-file` (one per line) each let their
/// requests in; another key is refused; an unreadable or keyless file is a usage error.
#[test]
fn several_api_keys_from_flags_and_a_file() {
    let dir = std::env::temp_dir().join(format!("k3-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("keys.txt");
    std::fs::write(&file, "sk-file-1\n\n  sk-file-2  \n").unwrap();
    let port = free_port();
    let mut args = on_tiny(&["--serve", "--port", &port.to_string()]);
    args.extend(os(&[
        "--api-key",
        "sk-flag-1",
        "--api-key",
        "sk-flag-2",
        "--api-key-file",
    ]));
    args.push(file.clone().into());
    let server = start_exactly(&args, &[], port, None);
    for key in ["sk-flag-1", "sk-flag-2", "sk-file-1", "sk-file-2"] {
        let header = format!("Authorization: Bearer {key}");
        let (status, text) = request_with(port, "GET", "/v1/models", None, &[&header]).unwrap();
        assert_eq!(status, 200, "{key}: {text}");
    }
    let (status, _) = request_with(
        port,
        "GET",
        "/v1/models",
        None,
        &["Authorization: Bearer sk-other"],
    )
    .unwrap();
    assert_eq!(status, 401);
    drop(server);
    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "\n  \n").unwrap();
    for (path, says) in [
        (dir.join("missing.txt"), "No such file"),
        (empty, "holds no key"),
    ] {
        let mut args = on_tiny(&["--serve", "--port", &free_port().to_string()]);
        args.extend(os(&["--api-key-file"]));
        args.push(path.into());
        let (code, _, stderr) = run(&args, &[]);
        assert_eq!(code, Some(2), "{stderr}");
        assert!(
            stderr.contains(says) && stderr.lines().count() == 1,
            "{stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `logit_bias` that bans the tiny model's end tokens, so an answer runs to its length.
fn end_tokens_banned() -> serde_json::Map<String, Value> {
    let tokenizer = k3_model::tokenizer::Tokenizer::from_dir(&crate::tiny()).unwrap();
    ["[EOS]", "<|end_of_msg|>"]
        .iter()
        .filter_map(|s| tokenizer.special(s))
        .map(|id| (id.to_string(), json!(-100)))
        .collect()
}

/// The completion text of one `/v1/completions` request.
fn complete(port: u16, body: Value) -> String {
    let (status, text) = request(port, "POST", "/v1/completions", Some(&body.to_string())).unwrap();
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 64, "{text}");
    v["choices"][0]["text"].as_str().unwrap().to_owned()
}

/// Without a seed each request samples with a fresh one, so two identical requests at
/// temperature 1 differ; with a seed they are equal. Why a chance collision is negligible: 64
/// tokens each, the end tokens banned so none stops early, and the tiny model's random weights
/// give broad next-token distributions (checked below: the sampled tokens' mean log-probability
/// is under ln 0.5, so a step's token is typically a coin flip or worse to repeat); 64 such
/// steps all agreeing has a probability of the order of 0.5^64 ~ 5e-20.
#[test]
fn unseeded_requests_differ_and_seeded_ones_repeat() {
    let server = start();
    let port = server.port;
    // The end tokens banned, so every answer has its 64 tokens (two answers that both ended
    // at once would be equal).
    let banned = end_tokens_banned();
    assert!(!banned.is_empty());
    let body = json!({"prompt": "Once upon a time", "max_tokens": 64, "temperature": 1.0,
                      "logit_bias": banned});
    // Compared as tokens (logprobs' token texts, specials by name): the text drops special
    // tokens, so two different samples can both read as "" on the random tiny model.
    let tokens = |body: &Value| {
        let mut body = body.clone();
        body["logprobs"] = json!(0);
        let (status, text) =
            request(port, "POST", "/v1/completions", Some(&body.to_string())).unwrap();
        assert_eq!(status, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        let tokens = v["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .unwrap()
            .clone();
        assert_eq!(tokens.len(), 64, "{text}");
        tokens
            .iter()
            .map(|t| t.as_str().unwrap().to_owned())
            .collect::<Vec<_>>()
    };
    let (a, b) = (tokens(&body), tokens(&body));
    assert_ne!(a, b, "two unseeded requests gave the same 64 tokens");
    let mut seeded = body.clone();
    seeded["seed"] = json!(7);
    assert_eq!(
        complete(port, seeded.clone()),
        complete(port, seeded.clone())
    );
    // The premise of the bound above.
    seeded["logprobs"] = json!(0);
    let (_, text) = request(port, "POST", "/v1/completions", Some(&seeded.to_string())).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let lps: Vec<f64> = v["choices"][0]["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_f64().unwrap())
        .collect();
    let mean = lps.iter().sum::<f64>() / lps.len() as f64;
    assert!(mean < 0.5f64.ln(), "mean chosen-token logprob {mean}");
}

/// The one-shot run: the answer alone on stdout; the reasoning marked `[reasoning]` and the
/// timing on stderr; one token is reported without a decode rate; `--ctx` bounds prompt plus
/// `--max-tokens`.
#[test]
fn one_shot_marks_reasoning_and_honours_ctx() {
    let (code, stdout, stderr) = run(&on_tiny(&["--prompt", "Hello", "--max-tokens", "8"]), &[]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("[reasoning]\n"), "{stderr}");
    assert!(!stdout.contains("[reasoning]"), "{stdout}");
    assert!(
        stderr.contains("8 tokens (") && stderr.contains("tokens/s decoding"),
        "{stderr}"
    );

    let (code, _, stderr) = run(
        &on_tiny(&["--prompt", "Hello", "--max-tokens", "1", "--no-think"]),
        &[],
    );
    assert_eq!(code, Some(0), "{stderr}");
    assert!(!stderr.contains("[reasoning]"), "{stderr}");
    assert!(stderr.contains("1 token ("), "{stderr}");
    assert!(
        !stderr.contains("tokens/s"),
        "a rate for one token: {stderr}"
    );

    // The chat template alone is over 40 tokens: prompt + 8 > 48.
    let (code, _, stderr) = run(
        &on_tiny(&[
            "--prompt",
            "Hello",
            "--max-tokens",
            "8",
            "--ctx",
            "48",
            "--no-think",
        ]),
        &[],
    );
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("exceeds --ctx 48"), "{stderr}");
}

/// `--resident-trunk` copies the trunk into memory at startup (the log says how much), and
/// the greedy answer is the same text as from the file mapping; so is one with two synthetic
/// NUMA domains, each binding its rows, and one where the startup measurement chose (the
/// packed trunk or the mapping).
#[test]
fn resident_trunk_answers_the_same() {
    let args = ["--prompt", "Hello", "--max-tokens", "8", "--no-think"];
    // `--no-pack-trunk`: the mapping, whatever the startup measurement would choose.
    let mut plain = args.to_vec();
    plain.push("--no-pack-trunk");
    let (code, mapped, stderr) = run(&on_tiny(&plain), &[]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(!stderr.contains("resident trunk: "), "{stderr}");
    assert!(!stderr.contains("packed trunk: per core"), "{stderr}");
    // The measured choice (packed or not) answers the same.
    let (code, measured, stderr) = run(&on_tiny(&args), &[]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("packed trunk: per core"), "{stderr}");
    assert_eq!(measured, mapped);
    for extra in [
        &["--resident-trunk"][..],
        &["--resident-trunk", "--numa-fake", "2"],
    ] {
        let mut with = args.to_vec();
        with.extend(extra);
        let (code, resident, stderr) = run(&on_tiny(&with), &[]);
        assert_eq!(code, Some(0), "{stderr}");
        assert!(stderr.contains("resident trunk: "), "{extra:?}: {stderr}");
        assert!(!mapped.is_empty());
        assert_eq!(resident, mapped, "{extra:?}");
    }
}

/// `--scan` reads every weight at startup: a clean checkpoint loads (and says so), an
/// infinity in a norm weight fails the load, naming the tensor.
#[test]
fn scan_refuses_a_checkpoint_with_an_infinity() {
    let (code, _, stderr) = run(
        &on_tiny(&["--prompt", "Hi", "--max-tokens", "1", "--scan"]),
        &[],
    );
    assert_eq!(code, Some(0), "{stderr}");
    // The library says what it did; the binary names the flag that asked for it.
    assert!(
        stderr.contains("weight scan: ") && stderr.contains("(--scan)"),
        "{stderr}"
    );

    // BF16 +Inf, little-endian.
    let dir = tiny_with_first_norm_value("scan", [0x80, 0x7f]);
    let mut args = vec![OsString::from("--model"), dir.clone().into()];
    args.extend(os(&[
        "--prompt",
        "Hi",
        "--max-tokens",
        "1",
        "--scan",
        "-t",
        "2",
    ]));
    let (code, _, stderr) = run(&args, &[]);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("Inf") && stderr.contains("norm.weight"),
        "{stderr}"
    );
    assert!(stderr.contains("(flags: --scan)"), "{stderr}");
}

/// `--save-state` writes the session's state after a one-shot answer; `--load-state` resumes
/// a prompt that extends the saved tokens and answers as a cold run of that prompt does
/// (greedy, so the same bits give the same tokens), and refuses a prompt that does not extend
/// them or a damaged file, each with an error naming the file.
#[test]
fn a_saved_state_resumes_a_longer_prompt_as_a_cold_run() {
    let dir = std::env::temp_dir().join(format!("k3-serve-state-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let state = dir.join("once.k3state");
    let state_arg = state.to_str().unwrap();
    let greedy = ["--raw", "--temperature", "0"];
    let one_shot = |prompt: &str, tokens: &str, extra: &[&str]| {
        let mut args = vec!["--prompt", prompt, "--max-tokens", tokens];
        args.extend(greedy);
        args.extend(extra);
        run(&on_tiny(&args), &[])
    };
    // One token: the state saved covers exactly the prompt (the last output is not fed).
    let (code, _, stderr) = one_shot("Once upon a time", "1", &["--save-state", state_arg]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("saved to"), "{stderr}");
    let long = "Once upon a time there was a";
    let (code, cold, stderr) = one_shot(long, "8", &[]);
    assert_eq!(code, Some(0), "{stderr}");
    let (code, warm, stderr) = one_shot(long, "8", &["--load-state", state_arg]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("restored from --load-state"), "{stderr}");
    assert!(!cold.is_empty());
    assert_eq!(warm, cold, "resumed and cold runs answer differently");
    // A state the user names through a link is followed; a FIFO is refused at once.
    let link = dir.join("link.k3state");
    std::os::unix::fs::symlink(&state, &link).unwrap();
    let (code, linked, stderr) = one_shot(long, "8", &["--load-state", link.to_str().unwrap()]);
    assert_eq!((code, linked), (Some(0), cold.clone()), "{stderr}");
    let fifo = dir.join("fifo.k3state");
    k3_testkit::make_fifo(&fifo);
    let (code, _, stderr) = one_shot(long, "2", &["--load-state", fifo.to_str().unwrap()]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("a FIFO"), "{stderr}");

    let (code, _, stderr) = one_shot("Twice upon a time", "2", &["--load-state", state_arg]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("does not extend the saved tokens") && stderr.contains(state_arg),
        "{stderr}"
    );
    // A state of the exact trunk under a requantised one is another model's state: resumed,
    // it would not answer as the q8_0 run's cold start does, so it is refused, naming both.
    let q8 = ["--load-state", state_arg, "--trunk-format", "q8_0"];
    let (code, _, stderr) = one_shot(long, "2", &q8);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("q8_0 trunk") && stderr.contains(state_arg),
        "{stderr}"
    );

    let mut bytes = std::fs::read(&state).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x10;
    std::fs::write(&state, &bytes).unwrap();
    let (code, _, stderr) = one_shot(long, "2", &["--load-state", state_arg]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains(state_arg), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--json-schema FILE` holds the one-shot answer to the schema (stdout is the JSON alone, and
/// stderr says the mask time per token); `--grammar FILE` to a Lark grammar. A schema the
/// library refuses, a file that is not JSON, both flags, or either with `--serve` exit 2
/// naming the flag.
#[test]
fn one_shot_json_schema_and_grammar() {
    let dir = std::env::temp_dir().join(format!("k3-one-shot-schema-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 50}},
        "required": ["answer", "n"], "additionalProperties": false
    });
    let schema_file = dir.join("schema.json");
    std::fs::write(&schema_file, schema.to_string()).unwrap();
    let path = schema_file.to_str().unwrap();
    let (code, stdout, stderr) = run(
        &on_tiny(&[
            "--prompt",
            "Yes or no?",
            "--max-tokens",
            "40",
            "--no-think",
            "--json-schema",
            path,
        ]),
        &[],
    );
    assert_eq!(code, Some(0), "{stderr}");
    let answer: Value =
        serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    assert!(
        jsonschema::validator_for(&schema)
            .unwrap()
            .is_valid(&answer),
        "{answer}"
    );
    assert!(
        stderr.contains("constrained: ") && stderr.contains("ms per token"),
        "{stderr}"
    );

    let grammar_file = dir.join("answer.lark");
    std::fs::write(&grammar_file, "start: (\"ab\" | \"cd\") \"!\"\n").unwrap();
    let (code, stdout, stderr) = run(
        &on_tiny(&[
            "--prompt",
            "Hi",
            "--max-tokens",
            "20",
            "--no-think",
            "--grammar",
            grammar_file.to_str().unwrap(),
        ]),
        &[],
    );
    assert_eq!(code, Some(0), "{stderr}");
    assert!(matches!(stdout.trim(), "ab!" | "cd!"), "{stdout}");

    let unique = dir.join("unique.json");
    std::fs::write(&unique, r#"{"type": "array", "uniqueItems": true}"#).unwrap();
    let not_json = dir.join("not.json");
    std::fs::write(&not_json, "{oops").unwrap();
    for (args, says) in [
        (
            on_tiny(&["--prompt", "Hi", "--json-schema", unique.to_str().unwrap()]),
            "uniqueItems",
        ),
        (
            on_tiny(&[
                "--prompt",
                "Hi",
                "--json-schema",
                not_json.to_str().unwrap(),
            ]),
            "not JSON",
        ),
        (
            on_tiny(&[
                "--prompt",
                "Hi",
                "--json-schema",
                path,
                "--grammar",
                grammar_file.to_str().unwrap(),
            ]),
            "give one of them",
        ),
        (
            on_tiny(&["--serve", "--json-schema", path]),
            "--json-schema is for a one-shot run",
        ),
    ] {
        let (code, _, stderr) = run(&args, &[]);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains(says) && stderr.lines().count() == 1,
            "{args:?}: {stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A one-shot run with an expert cache saves the expert usage counts (the next start's
/// preload order) before it exits: it used to end while the engine thread was still writing
/// them, leaving no file or a partial `.tmp` most of the time.
#[test]
fn one_shot_saves_the_expert_usage_before_it_exits() {
    let dir = std::env::temp_dir().join(format!("k3-usage-one-shot-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for round in 0..3 {
        let usage = dir.join(format!("usage-{round}.json"));
        let args = [
            "--prompt",
            "Hello",
            "--max-tokens",
            "4",
            "--expert-cache",
            "2",
            "--usage-file",
            usage.to_str().unwrap(),
        ];
        let (code, _, stderr) = run(&on_tiny(&args), &[]);
        assert_eq!(code, Some(0), "{stderr}");
        let text = std::fs::read_to_string(&usage)
            .unwrap_or_else(|e| panic!("round {round}: no usage file ({e}): {stderr}"));
        serde_json::from_str::<Value>(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(stderr.contains("expert usage saved to"), "{stderr}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A NaN in a weight (here the final norm's first value) turns every logit NaN: without
/// `--scan` the run used to print token 0 after token 0 and exit 0. The request now fails,
/// saying the logits are NaN and pointing at `--scan`.
#[test]
fn nan_logits_fail_the_request_instead_of_sampling_token_0() {
    // BF16 quiet NaN, little-endian.
    let dir = tiny_with_first_norm_value("nan", [0xc0, 0x7f]);
    let mut args = vec![OsString::from("--model"), dir.clone().into()];
    args.extend(os(&[
        "--prompt",
        "Hi",
        "--max-tokens",
        "4",
        "--raw",
        "-t",
        "2",
    ]));
    let (code, stdout, stderr) = run(&args, &[]);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(code, Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("logits are NaN") && stderr.contains("--scan"),
        "{stderr}"
    );
    assert!(!stdout.contains('\0'), "{stdout:?}");
}

/// A fresh `tiny` checkpoint (in a directory of its own, named by `what`) whose final norm's
/// first value is the BF16 `bits` (little-endian).
fn tiny_with_first_norm_value(what: &str, bits: [u8; 2]) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("k3-serve-{what}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let options = k3_model::synth::SynthOptions::new(k3_model::synth::Preset::Tiny);
    k3_model::synth::generate(&dir, &options).unwrap();
    let (path, offset) = {
        let ckpt = expert_store::Checkpoint::open(&dir).unwrap();
        let t = ckpt.require("model.norm.weight").unwrap();
        (t.path.to_owned(), t.offset)
    };
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .write_all_at(&bits, offset as u64)
        .unwrap();
    dir
}
